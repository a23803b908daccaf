"""The timeline PNG of ``fleetfit partition simulate``: what its legend says, where it
sits, and where the file goes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

import partition.evaluate
from fleetfit import cmd_partition
from partition.pipeline import build_schedule
from partition.schedule import STAGE_KINDS
from partition.simulate import (
    ACTION_NAMES,
    StageCost,
    simulate,
    timeline_figure,
    timeline_png,
)


def _result(name: str = "InterleavedZeroBubble"):
    s = build_schedule(name, 2, 4, 2 if name.startswith("Interleaved") else 1)
    return simulate(s, [StageCost(1.0, 2.0)] * s.num_stages)


def _legend(fig):
    FigureCanvasAgg(fig).draw()  # lays out ticks and the legend
    (ax,) = fig.axes
    legend = ax.get_legend()
    return ax, legend, [t.get_text() for t in legend.get_texts()]


def test_every_stage_action_kind_has_a_name():
    assert set(ACTION_NAMES) == set(STAGE_KINDS)


def test_legend_names_each_action_drawn_outside_the_plot():
    ax, legend, texts = _legend(timeline_figure(_result(), title="ZB"))
    kinds = {e.kind for e in _result().events}
    assert {"F", "I", "W"} <= kinds
    assert texts == [f"{k}  {ACTION_NAMES[k]}" for k in ACTION_NAMES if k in kinds]
    assert "I  input-gradient backward" in texts
    assert "W  weight-gradient backward" in texts
    # the legend's box starts right of the axes: it covers no rank's row
    renderer = ax.figure.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 (stage 0, 2)",
        "rank 1 (stage 1, 3)",
    ]


def test_full_backward_schedule_shows_f_and_b():
    _, _, texts = _legend(timeline_figure(_result("1F1B")))
    assert texts == ["F  forward", "B  backward (full)"]


def test_timeline_png_writes_a_png(tmp_path):
    out = timeline_png(_result("GPipe"), tmp_path / "t.png", title="GPipe")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "out, where",
    [
        ("", "runs/partition-*/timeline.png"),
        ("res", "res/timeline.png"),
        ("deep/res", "deep/res/timeline.png"),
        ("mine.png", "mine.png"),
    ],
)
def test_partition_simulate_writes_into_its_out_folder(
    tmp_path, monkeypatch, out, where
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        partition.evaluate, "simulate_plan", lambda plan, prof, cluster: _result("1F1B")
    )
    plan = SimpleNamespace(schedule_name="1F1B")
    path = cmd_partition._timeline(plan, None, SimpleNamespace(name="c"), out)
    assert path.is_absolute() and path.read_bytes()[:4] == b"\x89PNG"
    assert [p.resolve() for p in tmp_path.glob(where)] == [path]
    assert not (tmp_path / "timeline.png").exists() or where == "timeline.png"
