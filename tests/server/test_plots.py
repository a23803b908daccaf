"""``accuracy.png`` (``server.persist.plot_rounds``): what it draws, read back from the
matplotlib figure rather than from pixels."""

from __future__ import annotations

import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from server import persist


def _summary(metric: str, num_rounds: int = 7) -> dict:
    rounds = []
    for i in range(1, num_rounds + 1):
        loss = 3.0 / i
        r = {"round": i, "accuracy": 1 - loss / 4, "loss": loss}
        r["train_loss"] = loss + 0.1
        if metric == "perplexity":
            r["accuracy"] = 0.01  # a token accuracy barely moves; not what is drawn
            r["perplexity"] = math.exp(loss)
        rounds.append(r)
    if num_rounds > 2:
        rounds[2]["train_loss"] = None  # a round with no accepted update: a gap
    return {"workload": "w", "metric_name": metric, "rounds": rounds}


def _drawn(fig):
    FigureCanvasAgg(fig).draw()  # ticks and the legend are laid out only when drawn
    ax, ax2 = fig.axes
    legend = fig.legends[0]
    return ax, ax2, [t.get_text() for t in legend.get_texts()]


def test_classifier_plots_accuracy_and_losses_with_one_legend():
    ax, ax2, legend = _drawn(persist.rounds_figure(_summary("accuracy")))
    assert ax.get_ylabel() == "accuracy" and ax.get_yscale() == "linear"
    assert ax.get_ylim() == (0, 1)
    assert legend == ["central accuracy", "central loss", "train loss (clients' mean)"]
    assert [ln.get_label() for ln in ax.lines + ax2.lines] == legend


@pytest.mark.parametrize("num_rounds", [1, 2, 7, 30])
def test_round_ticks_are_whole_numbers(num_rounds):
    ax, _, _ = _drawn(persist.rounds_figure(_summary("accuracy", num_rounds)))
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_language_model_plots_perplexity_on_a_log_axis():
    s = _summary("perplexity")
    ax, ax2, legend = _drawn(persist.rounds_figure(s))
    assert ax.get_ylabel() == "perplexity" and ax.get_yscale() == "log"
    assert list(ax.lines[0].get_ydata()) == [r["perplexity"] for r in s["rounds"]]
    # the central loss is log(perplexity): not drawn twice; no token accuracy
    assert legend == ["central perplexity", "train loss (clients' mean)"]


def test_missing_figures_are_gaps_and_no_train_loss_no_line():
    s = _summary("accuracy", 3)
    for r in s["rounds"]:
        r["train_loss"] = None
    s["rounds"][1]["accuracy"] = None
    ax, ax2, legend = _drawn(persist.rounds_figure(s))
    assert math.isnan(ax.lines[0].get_ydata()[1])
    assert legend == ["central accuracy", "central loss"]


def test_plot_rounds_writes_the_png(tmp_path):
    path = persist.plot_rounds(tmp_path, _summary("perplexity"))
    assert path == tmp_path / persist.PLOT_FILE
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
