"""Hostile replies, one known case each (issue 13): the real round loop with two
honest nodes and one hostile node (two for the federated evaluation), one round.

Each test states the behaviour the server should have; what they share: the round
completes, the hostile node's reply (or its query reply) is refused with a reason in
the round record (its assignment's status, or an entry of ``errors`` naming it), the
global model is the honest update ``S``, the run folder's files name the round and
hold strict JSON. ``test_reply_fuzz.py`` finds such cases; the fuzzer's own finds are
at the end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Array

from server import persist
from server.fedopt import ServerOptConfig
from server.loop import Federation
from tests.reliability.hostile import (
    HostileTransport,
    RoundTimeout,
    assignment,
    honest_state,
    make_config,
    model_keys,
    query_answer,
    refusal,
    role_budgets,
    round_problems,
    time_limit,
    train_answer,
)
from wire import keys
from wire.reply import MAX_TEXT

pytestmark = pytest.mark.timeout(120)

HONEST = {1000: 0, 1001: 1}
NODE = 2000  # the hostile node (partition 2)
INF, NAN = math.inf, math.nan
ROUND_LIMIT_S = 10  # a round takes about 0.05 s


def run_case(
    tmp_path: Path,
    train: dict[int, tuple[Any, ...]] | list[tuple[Any, ...]] = (),
    query: dict[int, tuple[Any, ...]] | tuple[Any, ...] = ("reply", "full", []),
    honest: dict[int, int] = HONEST,
    **config: Any,
) -> tuple[Federation, dict[str, Any]]:
    """One round; ``train`` and ``query``: a node's answers as the fuzzer draws
    them (a list of changes for ``NODE`` alone, or by node); ``config``: run
    settings beside ``make_config``'s."""
    if not isinstance(train, dict):
        train = {NODE: ("reply", list(train))}
    if not isinstance(query, dict):
        query = {NODE: query}
    hostile = sorted({*train, *query})
    pid = {n: len(honest) + i for i, n in enumerate(hostile)}

    def on_query(node: int) -> tuple[Any, ...]:
        return query_answer(query.get(node, ("reply", "full", [])), pid[node])

    def on_train(node: int, ins: Any) -> tuple[Any, ...]:
        return train_answer(train.get(node, ("reply", [])), ins.kind, pid[node])

    role_budgets()  # profiles the model once per process, outside the time limit
    transport = HostileTransport(honest, hostile, on_query, on_train)
    fed = Federation(make_config(tmp_path / "run", rounds=1, **config), transport)
    try:
        with time_limit(ROUND_LIMIT_S):
            record = fed.run_round(1)
    except RoundTimeout as e:
        pytest.fail(f"the round hangs ({e})")
    return fed, record


def assert_refused(
    fed: Federation, record: dict[str, Any], node: int = NODE, *words: str
) -> None:
    """The round's files are sound and ``node``'s reply is refused with a reason
    naming ``words``."""
    assert round_problems(fed, 1, record) == []
    reason = refusal(record, node)
    assert reason is not None, (
        f"node {node}'s reply counts, with no reason recorded: "
        f"{[a for a in record['assignments'] if a['node_id'] == node]}"
    )
    for word in words:
        assert word in reason, reason


# ---------------------------------------------------------------- train replies
def test_num_examples_inf(tmp_path):
    fed, record = run_case(tmp_path, [("set", "metrics", keys.NUM_EXAMPLES, INF)])
    assert_refused(fed, record, NODE, keys.NUM_EXAMPLES)


def test_measured_peak_inf(tmp_path):
    fed, record = run_case(tmp_path, [("set", "metrics", keys.PEAK_BYTES, INF)])
    assert_refused(fed, record, NODE, keys.PEAK_BYTES)


def test_partition_id_inf(tmp_path):
    fed, record = run_case(tmp_path, [("set", "metrics", keys.PARTITION_ID, INF)])
    assert_refused(fed, record, NODE, keys.PARTITION_ID)


@pytest.mark.parametrize("bad", ["empty", "zip-header"])
def test_array_data_that_is_no_npy(tmp_path, bad):
    change = ("arrays", ("S", ("bytes", "2.bias", bad)))
    fed, record = run_case(tmp_path, [change])
    assert_refused(fed, record, NODE, "2.bias")


@pytest.mark.parametrize("kind", ["full", "none"])
def test_report_holding_bytes(tmp_path, kind):
    report_keys = (
        keys.KIND,
        keys.WINDOW,
        keys.PEAK_METHOD,
        keys.REASON,
        keys.EVAL_RUNTIME,
        keys.EVAL_ERROR,
    )
    changes = [("set", "report", k, b"\x00\xff") for k in report_keys]
    fed, record = run_case(tmp_path, changes, query=("reply", kind, []))
    assert_refused(fed, record, NODE, "report")


@pytest.mark.parametrize("value", [NAN, INF])
def test_non_finite_train_s_and_train_loss(tmp_path, value):
    """Target: no NaN or Infinity in summary.json (the update itself is S and may
    count). The fuzzer found inf too."""
    changes = [
        ("set", "metrics", keys.TRAIN_S, value),
        ("set", "metrics", keys.TRAIN_LOSS, value),
    ]
    fed, record = run_case(tmp_path, changes)
    assert round_problems(fed, 1, record) == []


def honest_steps(fed: Federation) -> float:
    """How far the global model moved along S's change, in S's changes (1.0: to S;
    negative: backwards)."""
    got = fed.model.state_dict()
    init = fed.workload.make_model(0).state_dict()
    s = honest_state()
    dot = sum(float(((got[k] - init[k]).double() * (s[k] - init[k])).sum()) for k in s)
    return dot / sum(float((s[k] - init[k]).double().square().sum()) for k in s)


def test_a_claim_of_1e15_examples_is_capped(tmp_path):
    """A plausible update (twice S's change) claiming 10**15 examples beside three
    honest nodes: its weight is capped (max-examples, then weight-clip 2 x the
    median: 2/5 of the average) and its change clipped to the median's (S's), so
    the aggregate is S."""
    changes = [
        ("arrays", ("moved", 2.0)),
        ("set", "metrics", keys.NUM_EXAMPLES, 10**15),
    ]
    fed, record = run_case(tmp_path, changes, honest={**HONEST, 1002: 2})
    problems = round_problems(fed, 1, record)
    assert [p for p in problems if not p.startswith("global model")] == []
    assert honest_steps(fed) == pytest.approx(1.0, abs=1e-5)
    claimant = assignment(record, NODE)
    assert claimant["counted_examples"] == 2 * 100  # weight-clip 2 x the median
    assert claimant["clip_scale"] == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize(
    "num_honest, clip, how, steps",
    [
        (3, "median", "mean", 0.2),
        (1, "median", "mean", -1 / 3),
        (3, "off", "mean", -3.36),
        (1, "off", "mean", -6.27),
        (3, "median", "trimmed-mean", 0.5),
        (3, "off", "trimmed-mean", -1.725),
        (3, "median", "median", 1.0),
    ],
)
def test_a_reversed_update_claiming_1e15_examples(
    tmp_path, num_honest, clip, how, steps
):
    """Issue 32, case 4: ``global - 9.9 x S's change`` claiming 10**15 examples
    passes the norm bound (9.9 < 10 x the median) and gets weight 2 x the median.
    With update-clip (the default) its change is clipped to S's: beside three
    honest nodes the model moves 0.2 of S's change forward (before: 3.36
    backwards); beside one it still moves back, by 1/3 (before: 6.27), since
    weight-clip gives it twice the honest node's weight. trimmed-mean (0.2 of 4
    updates: none cut) is a plain mean of the four without the clip; the
    coordinate median is S either way."""
    changes = [
        ("arrays", ("moved", -9.9)),
        ("set", "metrics", keys.NUM_EXAMPLES, 10**15),
    ]
    honest = dict(list({**HONEST, 1002: 2}.items())[:num_honest])
    settings: dict[str, Any] = {}  # the defaults: update-clip median, mean
    if clip != "median":
        settings["update_clip"] = clip
    if how != "mean":
        settings["server_opt"] = ServerOptConfig(aggregation=how)
    fed, record = run_case(tmp_path, changes, honest=honest, **settings)
    assert assignment(record, NODE)["status"] == "ok"  # accepted, and bounded
    assert honest_steps(fed) == pytest.approx(steps, abs=0.005)


# ---------------------------------------------------------------- evaluation only
def test_eval_result_without_loss(tmp_path):
    fed, record = run_case(
        tmp_path,
        [("drop", "metrics", keys.EVAL_LOSS)],
        query=("reply", "none", []),
    )
    assert record["federated_eval"] is None and record["num_evaluated"] == 0
    assert_refused(fed, record, NODE, keys.EVAL_LOSS)


def test_eval_num_examples_inf(tmp_path):
    fed, record = run_case(
        tmp_path,
        [("set", "metrics", keys.EVAL_NUM_EXAMPLES, INF)],
        query=("reply", "none", []),
    )
    assert record["federated_eval"] is None and record["num_evaluated"] == 0
    assert_refused(fed, record, NODE, keys.EVAL_NUM_EXAMPLES)


def test_eval_accuracy_7_is_not_averaged(tmp_path):
    other = NODE + 1  # an honest evaluation-only node: accuracy 0.5
    fed, record = run_case(
        tmp_path,
        {NODE: ("reply", [("set", "metrics", keys.EVAL_ACCURACY, 7.0)])},
        query={NODE: ("reply", "none", []), other: ("reply", "none", [])},
    )
    fe = record["federated_eval"]
    assert fe is not None and fe["num_nodes"] == 1 and fe["accuracy"] == 0.5, fe
    assert_refused(fed, record, NODE, keys.EVAL_ACCURACY)


# ---------------------------------------------------------------- query replies
@pytest.mark.parametrize(
    "key, value",
    [
        (keys.BUDGET_BYTES, INF),
        (keys.BUDGET_BYTES, NAN),
        (keys.PARTITION_ID, "abc"),
    ],
)
def test_query_reply_with_a_bad_fact(tmp_path, key, value):
    """The node's facts are refused with a reason (it may still train as a plain
    client); here its train reply is honest."""
    fed, record = run_case(
        tmp_path, query=("reply", "full", [("set", "node", key, value)])
    )
    assert_refused(fed, record, NODE, key)


# ---------------------------------------------------------------- found by the fuzzer
def test_query_reply_with_a_huge_budget(tmp_path):
    """budget-bytes 1e308: once the round hung in the assigner (memory.cost.unslack
    steps one byte at a time from a float-rounded guess)."""
    query = ("reply", "full", [("set", "node", keys.BUDGET_BYTES, 1e308)])
    fed, record = run_case(tmp_path, query=query)
    assert round_problems(fed, 1, record) == []


def test_query_reply_with_a_negative_disk_budget(tmp_path):
    """disk-budget-bytes < 0: once MemoryPlanError from the assigner ended the
    round."""
    query = ("reply", "none", [("set", "node", keys.DISK_BUDGET_BYTES, -(2**63))])
    fed, record = run_case(tmp_path, query=query)
    assert_refused(fed, record, NODE, keys.DISK_BUDGET_BYTES)


@pytest.mark.parametrize(
    "key, value",
    [
        (keys.EVAL_LOSS, -721972),
        (keys.EVAL_LOSS, 1e308),
        (keys.EVAL_ACCURACY, -INF),
        (keys.EVAL_ACCURACY, 2**63 - 1),
    ],
)
def test_eval_figures_out_of_range_are_not_averaged(tmp_path, key, value):
    other = NODE + 1  # an honest evaluation-only node: loss 1.5, accuracy 0.5
    fed, record = run_case(
        tmp_path,
        {NODE: ("reply", [("set", "metrics", key, value)])},
        query={NODE: ("reply", "none", []), other: ("reply", "none", [])},
    )
    fe = record["federated_eval"]
    assert fe is not None and fe["num_nodes"] == 1, fe
    assert (fe["accuracy"], fe["loss"]) == (0.5, 1.5), fe
    assert_refused(fed, record, NODE, key)


# ---------------------------------------------------------------- size (issue 32, 5)
@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte length of every array the server decodes (``Array.numpy``)."""
    sizes: list[int] = []
    numpy = Array.numpy

    def counting(self: Array) -> Any:
        sizes.append(len(self.data))
        return numpy(self)

    monkeypatch.setattr(Array, "numpy", counting)
    return sizes


def test_an_oversize_reply_is_refused_before_decoding(tmp_path, decoded):
    """An extra array larger than the whole model (max-reply-bytes "auto": 1.25 x
    the model + 1 MiB) is refused by its size, and none of the reply's arrays is
    decoded: the honest nodes' arrays are the only ones read."""
    model_bytes = sum(v.numel() * v.element_size() for v in honest_state().values())
    big = model_bytes * 5 // 4 + 2**20 + 1
    fed, record = run_case(tmp_path, [("arrays", ("S", ("big", "extra", big)))])
    assert fed.max_reply_bytes < big
    assert_refused(fed, record, NODE, "max-reply-bytes", "not decoded")
    assert max(decoded) < big and len(decoded) == len(HONEST) * len(model_keys())


def test_unexpected_keys_are_refused_before_decoding(tmp_path, decoded):
    fed, record = run_case(tmp_path, [("arrays", ("S", ("extra", "evil")))])
    assert_refused(fed, record, NODE, "unexpected ['evil']", "nothing decoded")
    assert len(decoded) == len(HONEST) * len(model_keys())


@pytest.mark.parametrize("limit", ["auto", "0"])
def test_a_4mb_key_name_makes_no_4mb_summary(tmp_path, limit):
    """A 4 MB array key: refused by size ("auto") or by its keys (no limit), with a
    reason of bounded length in summary.json (it once held the name whole)."""
    name = "k" * 4_000_000
    settings = {} if limit == "auto" else {"max_reply_bytes": limit}  # the default
    fed, record = run_case(tmp_path, [("arrays", ("S", ("extra", name)))], **settings)
    assert_refused(fed, record, NODE)
    assert len(refusal(record, NODE) or "") <= MAX_TEXT
    assert (tmp_path / "run" / persist.SUMMARY_FILE).stat().st_size < 50_000
