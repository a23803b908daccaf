"""The GPU layout cost model: shapes, memory, a proposed layout, infeasibility."""

from __future__ import annotations

from pathlib import Path

import pytest

from partition.cluster import Cluster, load_cluster
from partition.gpu import MEMORY_RESERVE, MODELS, evaluate, plan_layout

CLUSTERS = Path(__file__).resolve().parents[2] / "partition" / "clusters"


def test_parameter_counts_match_the_papers():
    assert MODELS["llama2-7b"].num_params == pytest.approx(6.74e9, rel=0.01)
    assert MODELS["llama2-70b"].num_params == pytest.approx(68.98e9, rel=0.01)


@pytest.mark.parametrize("model", ["llama2-7b", "llama2-70b"])
def test_64_h100s_get_a_layout_that_fits(model):
    cluster = load_cluster(CLUSTERS / "h100-64.toml")
    lay = plan_layout(model, cluster)
    assert lay.dp * lay.pp * lay.tp == 64 and lay.tp <= 8
    assert lay.memory_bytes <= MEMORY_RESERVE * 80e9
    dev = cluster.devices[0]
    assert 0.2 < lay.mfu < dev.flops_per_s / dev.peak_flops_per_s
    assert lay.tokens_per_s == pytest.approx(4 * 2**20 / lay.step_s)


def test_70b_needs_sharding_or_model_parallelism():
    cluster = load_cluster(CLUSTERS / "h100-64.toml")
    plain = evaluate(
        MODELS["llama2-70b"],
        cluster,
        4 * 2**20,
        dp=64,
        pp=1,
        tp=1,
        microbatch_size=1,
        recompute="full",
        sharding="ddp",
    )
    assert plain is None  # 16 bytes x 69B parameters on every GPU: far over 80 GB
    lay = plan_layout("llama2-70b", cluster)
    assert lay.sharding == "fsdp" or lay.tp * lay.pp > 1


def test_more_pipeline_stages_mean_more_bubble():
    cluster = load_cluster(CLUSTERS / "h100-64.toml")
    kw = dict(microbatch_size=1, recompute="selective", sharding="zero1")
    a = evaluate(MODELS["llama2-70b"], cluster, 4 * 2**20, dp=4, pp=2, tp=8, **kw)
    b = evaluate(MODELS["llama2-70b"], cluster, 4 * 2**20, dp=2, pp=4, tp=8, **kw)
    assert a is not None and b is not None
    assert b.breakdown["bubble_s"] > a.breakdown["bubble_s"]


def test_too_small_gpus_state_the_least_memory():
    tiny = Cluster.uniform(1, devices_per_host=8, memory="4GB", compute="100TFLOP/s")
    with pytest.raises(ValueError, match="the least any layout needs is"):
        plan_layout("llama2-70b", tiny)
    with pytest.raises(ValueError, match="unknown model"):
        plan_layout("llama9", tiny)
