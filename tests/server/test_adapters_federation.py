"""A federation whose nodes train LoRA adapters (``adapters=all``): the server sends
the base, gets the factors back, and its new model is the base plus the
example-weighted mean of the devices' ``s B @ A`` (FLoRA's stacked update), each
scaled by the factor ``update-clip`` put on it (``clip_scale``: of two updates, each
is held to the smaller change per key); the result is a plain model file and its
ONNX export."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from memory.lora import factor_keys  # noqa: E402
from server.config import AdapterConfig, FleetConfig, ServerConfig  # noqa: E402
from server.loop import Federation  # noqa: E402
from server.persist import load_model  # noqa: E402
from tests.fakes import DirectTransport  # noqa: E402
from wire.shape import RunShape  # noqa: E402

LORA = AdapterConfig(mode="all", rank=4, alpha=8.0, targets=("qkv", "fc"))


def _cfg(tmp_path, **kw):
    kw = {
        "shape": RunShape(workload="gpt-tiny", local_steps=2, lr=1e-2),
        "adapters": LORA,
        **kw,
    }
    return ServerConfig(
        num_server_rounds=1,
        min_nodes=2,
        out=str(tmp_path / "run"),
        client_measure="inline",
        fleet=FleetConfig(memory_budgets=(2**30, 2**30)),
        eval_windows=8,
        **kw,
    )


def test_adapter_round_merges_the_mean_of_products(tmp_path):
    replies = {}

    def capture(node_id, reply):
        arrays = reply.content.array_records["arrays"]
        replies[node_id] = {k: torch.from_numpy(arrays[k].numpy()) for k in arrays}
        return reply

    cfg = _cfg(tmp_path)
    fed = Federation(cfg, DirectTransport(2, tamper=capture))
    base = {k: v.clone() for k, v in fed.model.state_dict().items()}
    summary = fed.run()
    rec = summary["rounds"][0]
    assert rec["num_clients"] == 2
    counted, clip = {}, {}
    for a in rec["assignments"]:
        assert a["kind"] == "adapter" and a["lora_rank"] == 4, a
        assert a["adapter_start"] == 1  # layers.0: every layer carries adapters
        counted[a["node_id"]] = a["counted_examples"]
        clip[a["node_id"]] = a["clip_scale"]
    assert all(0 < c <= 1.0 for c in clip.values()), clip
    paths = [f"layers.{i}.{m}" for i in (0, 1) for m in ("qkv", "fc")]
    for r in replies.values():  # only the factors travel back
        assert set(r) == {k for p in paths for k in factor_keys(p)}
    for a in rec["assignments"]:  # simulated time prices the factors, not the merge
        sent = replies[a["node_id"]].values()
        assert a["up_bytes"] == sum(v.numel() * v.element_size() for v in sent)
    total = sum(counted.values())
    state, _ = load_model(tmp_path / "run" / "model.safetensors")
    assert set(state) == set(base)  # one plain model: the base's own keys
    for p in paths:
        a_key, b_key = factor_keys(p)
        mean = sum(
            (counted[n] / total)
            * clip[n]
            * 2.0
            * (r[b_key].double() @ r[a_key].double())
            for n, r in replies.items()
        )
        want = base[f"{p}.weight"].double() + mean
        torch.testing.assert_close(
            state[f"{p}.weight"].double(), want, rtol=0, atol=1e-6
        )
        assert not torch.equal(state[f"{p}.weight"], base[f"{p}.weight"])
    for k in base:  # nothing else trained
        if k not in {f"{p}.weight" for p in paths}:
            assert torch.equal(state[k], base[k]), k
    assert (tmp_path / "run" / "model.onnx").stat().st_size > 0


def test_auto_gives_adapters_where_no_whole_model_plan_fits(tmp_path):
    cfg = _cfg(tmp_path, adapters=AdapterConfig(mode="auto", rank=4, alpha=8.0))
    fed = Federation(cfg, DirectTransport(1))
    a = fed.assigner
    from wire.facts import NodeFacts

    roomy = a.assign(NodeFacts(budget_bytes=2**30), 1)
    assert roomy.kind == "full"
    need = a.adapter_min_budget()
    tight = a.assign(NodeFacts(budget_bytes=need, disk_budget_bytes=0), 1)
    assert tight.kind == "adapter" and tight.adapters is not None
    assert tight.predicted_peak_bytes <= need


def test_run_config_checks_adapter_keys():
    with pytest.raises(ValueError, match="adapters"):
        ServerConfig.from_run_config({"adapters": "some"})
    with pytest.raises(ValueError, match="rank"):
        ServerConfig.from_run_config({"adapters": "all", "lora-rank": 0})
    with pytest.raises(ValueError, match="dp-clipping-norm=0"):
        ServerConfig.from_run_config({"adapters": "all", "dp-clipping-norm": 1.0})
    with pytest.raises(ValueError, match="proximal-mu=0"):
        ServerConfig.from_run_config({"adapters": "all", "proximal-mu": 0.1})
    cfg = ServerConfig.from_run_config({"adapters": "auto", "lora-targets": "qkv,fc"})
    assert cfg.adapters.spec().targets == ("qkv", "fc")


def _capture(replies):
    def capture(node_id, reply):
        arrays = reply.content.array_records["arrays"]
        replies[node_id] = {k: torch.from_numpy(arrays[k].numpy()) for k in arrays}
        return reply

    return capture


def _check_merged(tmp_path, rec, replies, base, scaling):
    counted = {a["node_id"]: a["counted_examples"] for a in rec["assignments"]}
    clip = {a["node_id"]: a["clip_scale"] for a in rec["assignments"]}
    total = sum(counted.values())
    state, _ = load_model(tmp_path / "run" / "model.safetensors")
    assert set(state) == set(base)
    paths = sorted({k.rsplit(".", 1)[0] for r in replies.values() for k in r})
    for p in paths:
        a_key, b_key = factor_keys(p)
        mean = sum(
            (counted[n] / total)
            * clip[n]
            * scaling[n]
            * (r[b_key].double() @ r[a_key].double())
            for n, r in replies.items()
        )
        w = base[f"{p}.weight"].double()
        want = w + (mean.T if w.shape != mean.shape else mean)  # Conv1D: (in, out)
        torch.testing.assert_close(
            state[f"{p}.weight"].double(), want, rtol=0, atol=1e-6
        )
    return paths


def test_unequal_ranks_merge_the_mean_of_products(tmp_path):
    """Two devices given ranks 2 and 8: the factors differ in shape and the model
    still moves by the weighted mean of their s B @ A."""
    from dataclasses import replace

    replies = {}
    fed = Federation(_cfg(tmp_path), DirectTransport(2, tamper=_capture(replies)))
    assign = fed.assigner.assign
    ranks = {0: 2, 1: 8}

    def by_partition(facts, server_round):
        a = assign(facts, server_round)
        rank = ranks[facts.partition_id]
        return replace(a, adapters=replace(a.adapters, rank=rank, alpha=2.0 * rank))

    fed.assigner.assign = by_partition  # type: ignore[method-assign]
    base = {k: v.clone() for k, v in fed.model.state_dict().items()}
    rec = fed.run()["rounds"][0]
    assert sorted(a["lora_rank"] for a in rec["assignments"]) == [2, 8]
    shapes = {n: r["layers.0.qkv.lora_A"].shape[0] for n, r in replies.items()}
    assert sorted(shapes.values()) == [2, 8]
    _check_merged(tmp_path, rec, replies, base, {n: 2.0 for n in replies})


def test_transformers_gpt2_adapters_federate_and_export(tmp_path):
    """A transformers GPT-2 (Conv1D modules, weights stored (in, out)) per unit:
    the merged model is plain and exports to ONNX."""
    pytest.importorskip("transformers")
    replies = {}
    cfg = _cfg(
        tmp_path,
        shape=RunShape(
            workload="examples.transformers_gpt2:build", local_steps=2, lr=1e-2
        ),
        adapters=AdapterConfig(mode="all", rank=4, alpha=8.0, targets=("c_attn",)),
    )
    transport = DirectTransport(2, tamper=_capture(replies))
    for node in transport.node_config.values():  # nodes that trust the example
        node["allow-workloads"] = "examples.transformers_gpt2:build"
    fed = Federation(cfg, transport)
    base = {k: v.clone() for k, v in fed.model.state_dict().items()}
    rec = fed.run()["rounds"][0]
    assert all(a["kind"] == "adapter" for a in rec["assignments"]), rec
    paths = _check_merged(tmp_path, rec, replies, base, {n: 2.0 for n in replies})
    assert paths and all(p.endswith("attn.c_attn") for p in paths)
    assert (tmp_path / "run" / "model.onnx").stat().st_size > 0
