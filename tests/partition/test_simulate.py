"""Pipeline schedules as data and their simulation: the textbook bubbles, memory, PNG."""

from __future__ import annotations

import pytest

from partition.pipeline import SCHEDULES, build_schedule
from partition.schedule import Action, Schedule, ScheduleError, format, validate
from partition.simulate import CpuQuota, StageCost, _Paced, simulate, timeline_png


@pytest.mark.parametrize("text", ["2F0", "1B3", "1I3", "0W12", "1SEND_F0", "2RECV_B3"])
def test_stage_actions_round_trip(text):
    a = Action.parse(text)
    assert a.stage is not None and str(a) == text


@pytest.mark.parametrize(
    "name,p,m,v",
    [
        ("GPipe", 1, 1, 1),
        ("GPipe", 4, 3, 1),
        ("1F1B", 4, 4, 1),
        ("1F1B", 3, 7, 1),
        ("Interleaved1F1B", 2, 4, 2),
        ("Interleaved1F1B", 4, 8, 3),
        ("InterleavedZeroBubble", 4, 8, 1),
        ("InterleavedZeroBubble", 2, 6, 2),
    ],
)
def test_built_schedules_validate(name, p, m, v):
    s = build_schedule(name, p, m, v)
    validate(s)
    assert s.num_stages == p * v and len(s.ranks) == p
    assert all(acts[-1] == Action("STEP") for acts in s.ranks)


def test_1f1b_order_matches_torch():
    # torch's Schedule1F1B: stage 0 of 2 warms up with one forward, then alternates
    s = build_schedule("1F1B", 2, 3)
    assert [str(a) for a in s.ranks[0]] == "0F0 0F1 0B0 0F2 0B1 0B2 STEP".split()
    assert [str(a) for a in s.ranks[1]] == "1F0 1B0 1F1 1B1 1F2 1B2 STEP".split()


@pytest.mark.parametrize(
    "name,p,m,why",
    [
        ("1F1B", 4, 2, "at least as many micro-batches"),
        ("Interleaved1F1B", 4, 6, "divisible"),
        ("PipeDream", 2, 2, "unknown schedule"),
    ],
)
def test_schedule_sizes_are_checked(name, p, m, why):
    with pytest.raises(ValueError, match=why):
        build_schedule(name, p, m, 2 if name.startswith("Inter") else 1)


def test_a_deadlock_is_marked_in_the_table():
    s = build_schedule("1F1B", 2, 2)
    bad = [list(s.ranks[0]), [Action.parse(t) for t in "1B0 1F0 1F1 1B1 STEP".split()]]
    with pytest.raises(ScheduleError) as e:
        validate(Schedule(**{**s.__dict__, "ranks": bad}))
    msg = str(e.value)
    assert "rank 1 step 0: 1B0 waits forever for 1F0 (deadlock)" in msg
    assert "<-- rank 1" in msg


@pytest.mark.parametrize(
    "change,why",
    [
        (lambda r: r[0].remove(Action.parse("0B1")), "STEP before the gradient of 0B1"),
        (lambda r: r[0].insert(0, Action.parse("1F0")), "stage 1 is on rank 1"),
        (lambda r: r[1].insert(0, Action.parse("1F0")), "1F0 runs twice"),
        (lambda r: r[0].insert(2, Action("STEP")), "STEP before the gradient of 0B0"),
    ],
)
def test_broken_pipeline_schedules_are_refused(change, why):
    s = build_schedule("GPipe", 2, 2)
    ranks = [list(a) for a in s.ranks]
    change(ranks)
    with pytest.raises(ScheduleError, match=why):
        validate(Schedule(**{**s.__dict__, "ranks": ranks}))


def test_pipeline_table_prints_stages_and_ranks():
    s = build_schedule(
        "GPipe", 2, 2, stage_blocks=((0, 1), (2,)), names=("a", "b", "c")
    )
    text = format(s)
    assert "GPipe: 2 stages (stage 0 on rank 0: blocks 0-1; stage 1 on rank 1" in text
    assert "rank 0" in text and "0F1" in text


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 9)])
def test_equal_stages_have_the_textbook_bubble(name, p, m):
    r = simulate(build_schedule(name, p, m), [StageCost(1.0, 2.0)] * p)
    assert r.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-9)
    assert r.step_s == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)])
def test_interleaved_bubble_is_divided_by_the_chunks(p, m, v):
    costs = [StageCost(1.0 / v, 2.0 / v)] * (p * v)
    r = simulate(build_schedule("Interleaved1F1B", p, m, v), costs)
    assert r.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-9)


def test_zero_bubble_beats_1f1b():
    p, m = 4, 8
    one = simulate(build_schedule("1F1B", p, m), [StageCost(1.0, 2.0)] * p)
    zb = simulate(
        build_schedule("InterleavedZeroBubble", p, m), [StageCost(1.0, 2.0)] * p
    )
    assert zb.step_s < 0.85 * one.step_s


def test_1f1b_holds_p_minus_i_microbatches_and_gpipe_all():
    p, m = 4, 8
    costs = [StageCost(1.0, 2.0, activation_bytes=100, static_bytes=7)] * p
    one = simulate(build_schedule("1F1B", p, m), costs)
    gp = simulate(build_schedule("GPipe", p, m), costs)
    assert one.max_in_flight == [4, 3, 2, 1]
    assert gp.max_in_flight == [m] * p
    assert one.stage_peak_bytes == [7 + 100 * (p - i) for i in range(p)]
    assert gp.stage_peak_bytes == [7 + 100 * m] * p


def test_uneven_stages_follow_sum_plus_m_minus_one_max():
    times = [1.0, 3.0, 2.0]
    m = 6
    costs = [StageCost(t / 3, 2 * t / 3) for t in times]
    r = simulate(build_schedule("GPipe", 3, m), costs)
    approx = sum(times) + (m - 1) * max(times)
    assert r.step_s == pytest.approx(approx, rel=0.05)


def test_links_add_transfer_time():
    costs = [StageCost(1.0, 1.0, output_bytes=10**6)] * 2
    free = simulate(build_schedule("GPipe", 2, 1), costs)
    slow = simulate(
        build_schedule("GPipe", 2, 1), costs, lambda a, b, n: 0.01 + n / 1e6
    )
    assert slow.step_s == pytest.approx(free.step_s + 2 * 1.01)


def test_optimizer_updates_end_each_ranks_step():
    """A rank steps its optimizer after its own last action: in 1F1B the first rank
    finishes last, so its update adds in full; the last rank's fits in its idle tail."""
    p, m = 3, 4
    base = simulate(build_schedule("1F1B", p, m), [StageCost(1.0, 2.0)] * p)
    first = [StageCost(1.0, 2.0, update_s=0.5)] + [StageCost(1.0, 2.0)] * (p - 1)
    last = [StageCost(1.0, 2.0)] * (p - 1) + [StageCost(1.0, 2.0, update_s=0.5)]
    assert simulate(build_schedule("1F1B", p, m), first).step_s == pytest.approx(
        base.step_s + 0.5
    )
    assert simulate(build_schedule("1F1B", p, m), last).step_s == base.step_s
    # a long enough update on the last rank becomes the step's end
    late = [StageCost(1.0, 2.0)] * (p - 1) + [StageCost(1.0, 2.0, update_s=9.0)]
    end_last = max(e.end_s for e in base.events if e.rank == p - 1)
    assert simulate(build_schedule("1F1B", p, m), late).step_s == pytest.approx(
        end_last + 9.0
    )


def test_cpu_quota_runs_bursts_at_full_speed_then_waits():
    """share 0.25, period 10 ms: 2.5 ms of CPU per period. An action of d seconds
    at the sustained rate needs d * 0.25 of CPU."""
    p = _Paced(CpuQuota(0.25, 0.01))
    # 4 ms at the sustained rate = 1 ms of CPU: fits in period 0, full speed
    assert p.finish(0.0, 0.004) == pytest.approx(0.001)
    # 12 ms = 3 ms of CPU: 1.5 ms left in period 0, then 1.5 ms from t = 10 ms
    assert p.finish(0.001, 0.012) == pytest.approx(0.0115)
    # period 1 has 1 ms left; 8 ms = 2 ms of CPU: 1 ms now, 1 ms from t = 20 ms
    assert p.finish(0.0115, 0.008) == pytest.approx(0.021)
    # started at 29.5 ms: the period ends after 0.5 ms of CPU, then period 3
    assert p.finish(0.0295, 0.004) == pytest.approx(0.0305)
    # unused quota is lost; a long action averages to the sustained rate
    q = _Paced(CpuQuota(0.25, 0.01))
    assert q.finish(0.0, 1.0) == pytest.approx(0.9925)  # 100 periods of 2.5 ms
    # a quota of a core or more never holds a one-thread rank
    assert _Paced(CpuQuota(1.5, 0.01)).finish(0.3, 0.2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="share > 0"):
        CpuQuota(0.0)


def test_quotas_pace_the_ranks_they_are_given():
    """Two stages, GPipe, m = 2; rank 1 under a quota of 0.5 per 10 ms. Its forwards
    (10 ms sustained = 5 ms of CPU) each fit one period's burst."""
    costs = [StageCost(0.010, 0.020)] * 2
    sched = build_schedule("GPipe", 2, 2)
    plain = simulate(sched, costs)
    paced = simulate(sched, costs, quotas=[None, CpuQuota(0.5, 0.01)])
    ev = {(e.rank, e.kind, e.microbatch): (e.start_s, e.end_s) for e in paced.events}
    assert ev[(0, "F", 0)] == pytest.approx((0.0, 0.010))  # rank 0 unpaced
    assert ev[(1, "F", 0)] == pytest.approx((0.010, 0.015))  # 5 ms burst
    assert ev[(1, "F", 1)] == pytest.approx((0.020, 0.025))  # next period's
    assert paced.step_s < plain.step_s
    with pytest.raises(ValueError, match="1 CPU quotas for 2 ranks"):
        simulate(sched, costs, quotas=[None])


def test_rendezvous_sends_wait_for_the_receiver():
    """GPipe, 2 stages, m = 2, transfers of 0.5 s. Eager: stage 1's second forward
    input moves as soon as it is made. Rendezvous: stage 1 posts that receive only
    when its first forward ends, so the transfer starts then."""
    costs = [StageCost(1.0, 1.0, output_bytes=1), StageCost(2.0, 1.0)]
    sched = build_schedule("GPipe", 2, 2)

    def link(a, b, n):
        return 0.5

    def starts(sends):
        res = simulate(sched, costs, link, sends=sends)
        return {(e.rank, e.kind, e.microbatch): e.start_s for e in res.events}

    eager, rdv = starts("eager"), starts("rendezvous")
    # F0 on stage 0 ends at 1, arrives at 1.5; F1 ends at 2
    assert eager[(1, "F", 0)] == rdv[(1, "F", 0)] == pytest.approx(1.5)
    assert eager[(1, "F", 1)] == pytest.approx(3.5)  # moved 2-2.5, rank free 3.5
    assert rdv[(1, "F", 1)] == pytest.approx(4.0)  # posted at 3.5, arrives 4.0
    with pytest.raises(ValueError, match="sends must be one of"):
        simulate(sched, costs, sends="lazy")


def test_timeline_png(tmp_path):
    r = simulate(build_schedule("1F1B", 3, 6), [StageCost(1.0, 2.0)] * 3)
    out = timeline_png(r, tmp_path / "t.png", title="1F1B")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_every_schedule_name_is_known_to_torch():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES:
        assert get_schedule_class(name).__name__.lower().endswith(name.lower())
