"""Schedules as data: compile, validate (with the failing step marked), print."""

from __future__ import annotations

import itertools

import pytest

from memory.spec import BlockPlan, MemoryPlan
from partition import schedule as sched
from partition.schedule import Action, Schedule, ScheduleError, compile_plan, validate


def _plan(specs: str, m: int = 1) -> MemoryPlan:
    """'k r o K' letters: keep/recompute/offload; capitals are streamed."""
    modes = {"k": "keep", "r": "recompute", "o": "offload"}
    return MemoryPlan(
        tuple(
            BlockPlan(
                f"b{i}", modes[c.lower()], "stream" if c.isupper() else "resident"
            )
            for i, c in enumerate(specs)
        ),
        num_microbatches=m,
    )


def _strs(s: Schedule) -> list[str]:
    return [str(a) for a in s.ranks[0]]


@pytest.mark.parametrize(
    "text", ["F3.0", "B12.7", "R0.1", "LOAD3", "OFFLOAD0", "WRITE9", "UPDATE2", "STEP"]
)
def test_action_round_trips_through_its_string(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", ["F3", "LOAD3.0", "X1", "STEP1", "B.1", ""])
def test_malformed_action_strings_are_rejected(text):
    with pytest.raises(ValueError):
        Action.parse(text)


def test_plain_plan_is_forward_backward_step():
    assert _strs(compile_plan(_plan("kkk"))) == [
        "F0.0",
        "F1.0",
        "F2.0",
        "B2.0",
        "B1.0",
        "B0.0",
        "STEP",
    ]


def test_streamed_blocks_load_recompute_update_write():
    assert _strs(compile_plan(_plan("kRK"))) == [
        "F0.0",
        "LOAD1",
        "F1.0",
        "OFFLOAD1",
        "LOAD2",
        "F2.0",
        "B2.0",
        "UPDATE2",
        "WRITE2",
        "LOAD1",
        "R1.0",
        "B1.0",
        "UPDATE1",
        "WRITE1",
        "B0.0",
        "STEP",
    ]


def test_all_streamed_has_no_resident_step():
    s = _strs(compile_plan(_plan("KK", m=2)))
    assert "STEP" not in s
    assert s.count("UPDATE0") == 1 and s.index("UPDATE0") > s.index("B0.1")
    assert s.count("WRITE0") == 2  # gradient after micro-batch 0, update after 1


@pytest.mark.parametrize(
    "specs,m",
    [("".join(p), m) for p in itertools.product("krKR", repeat=3) for m in (1, 3)],
)
def test_every_compiled_plan_validates(specs, m):
    validate(compile_plan(_plan(specs, m)))


def _broken(s: Schedule, actions: list[str]) -> Schedule:
    return Schedule(
        [[Action.parse(a) for a in actions]],
        s.num_blocks,
        s.num_microbatches,
        s.streamed,
        s.names,
        s.activations,
    )


@pytest.mark.parametrize(
    "edit,why,step",
    [
        (lambda a: [x for x in a if x != "R1.0"], "without its recompute R1.0", 10),
        (lambda a: [x for x in a if x != "LOAD1"], "not loaded", 1),
        (lambda a: a[:4] + ["B0.0"] + a[4:], "before B1.0", 4),
        (lambda a: [x for x in a if x != "UPDATE2"], "before UPDATE2", 7),
        (lambda a: [x for x in a if x != "STEP"], "never updated (STEP)", 15),
        (
            lambda a: [x.replace("WRITE1", "OFFLOAD1") for x in a],
            "drop block 1's grad",
            13,
        ),
        (lambda a: ["STEP"] + a, "STEP before the backward", 0),
        (lambda a: a + ["F0.0"], "runs twice", 16),
        (lambda a: [x for x in a if x != "WRITE2"], "still loaded at the end", 15),
    ],
)
def test_validate_marks_the_failing_step(edit, why, step):
    good = compile_plan(_plan("kRK"))
    bad = _broken(good, edit(_strs(good)))
    with pytest.raises(ScheduleError) as e:
        validate(bad)
    msg = str(e.value)
    assert why in msg
    marked = [line for line in msg.splitlines() if "<--" in line]
    assert len(marked) == 1 and marked[0].split()[0] == str(step), msg


def test_format_lists_every_action_and_the_block_modes():
    s = compile_plan(_plan("kRo", m=2))
    text = sched.format(s)
    assert "1=b1:recompute+stream" in text and "2=b2:offload" in text
    rows = text.splitlines()[2:]
    assert [r.split()[1] for r in rows] == _strs(s)


def test_compile_rejects_empty_and_bad_counts():
    with pytest.raises(ValueError):
        compile_plan(MemoryPlan(()))
    with pytest.raises(ValueError):
        compile_plan(_plan("kk", m=0))
