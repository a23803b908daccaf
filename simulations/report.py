"""Reports of a strategy comparison: a terminal table, CSVs, PNG plots and Markdown.

``fleetfit simulate --compare`` hands its ``OUT/summary.json`` dict here; the same
dict can be reread later and reported again:

    >>> import json
    >>> from pathlib import Path
    >>> from simulations.report import format_table, write_report
    >>> compare = json.loads(Path("runs/phones/summary.json").read_text())
    >>> print(format_table(compare))
    >>> write_report(Path("runs/phones"), compare)  # compare.csv ... report.md

The files are described in docs/simulations.md ("Reports"). Everything is computed
from the dict: no model, no Ray, no network. Optional numbers (a null peak, a strategy
without per-class entries, rounds without ``assignments``) leave gaps, not errors.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

METRICS = ("accuracy", "perplexity")
HIGHER_IS_BETTER = {"accuracy": True, "perplexity": False}
# keys the issue fixes for every entry of compare["strategies"]
REQUIRED_KEYS = ("participation", "data_share", "final_metric", "metric_name", "rounds")

COMPARE_CSV = "compare.csv"
ROUNDS_CSV = "rounds.csv"
METRIC_PNG = "metric.png"
PARTICIPATION_PNG = "participation.png"
PEAKS_PNG = "peaks.png"
CLASS_METRIC_PNG = "class_metric.png"
METRIC_TIME_PNG = "metric_time.png"
CLASS_ROUNDS_PNG = "class_rounds.png"
REPORT_MD = "report.md"

_MISSING = "-"
_PEAK = "worst_peak_over_budget_"  # + class name: a column of compare.csv
# columns of the table aligned left (strategy, workload, peaks); numbers align right
_TEXT_COLUMNS = {0, 1, 7}


# ------------------------------------------------------------------ input
def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (null, NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def validate(compare: dict[str, Any]) -> str:
    """Check a comparison dict; return its metric name.

    Raises:
        ValueError: no strategies, an unknown or inconsistent ``metric_name``, a
            strategy entry without one of the issue's keys, or a share outside [0, 1].
    """
    if not isinstance(compare, dict):
        raise ValueError(f"compare must be a dict, got {type(compare).__name__}")
    strategies = compare.get("strategies")
    if not isinstance(strategies, dict) or not strategies:
        raise ValueError(
            f"compare['strategies'] is {strategies!r}: nothing to report; it must map "
            "each strategy's name to its results, e.g. {'fleetfit': {...}}"
        )
    names = {s.get("metric_name") for s in strategies.values() if isinstance(s, dict)}
    metric = compare.get("metric_name")
    if metric is None and len(names) == 1:
        metric = next(iter(names))
    if metric not in METRICS:
        raise ValueError(
            f"metric_name {metric!r} is not one of {', '.join(METRICS)}; "
            "set compare['metric_name'] to the metric the strategies report"
        )
    for name, s in strategies.items():
        if not isinstance(s, dict):
            raise ValueError(f"strategy {name!r}: entry must be a dict, got {s!r}")
        missing = [k for k in REQUIRED_KEYS if k not in s]
        if missing:
            raise ValueError(
                f"strategy {name!r} lacks {', '.join(missing)}; each strategy needs "
                f"{', '.join(REQUIRED_KEYS)}"
            )
        if s["metric_name"] != metric:
            raise ValueError(
                f"strategy {name!r} reports metric_name {s['metric_name']!r} but the "
                f"comparison's metric_name is {metric!r}; compare one metric at a time"
            )
        if not isinstance(s["rounds"], list):
            raise ValueError(f"strategy {name!r}: rounds must be a list of rounds")
        for key in ("participation", "data_share"):
            v = s[key]
            if v is not None and not (_number(v) is not None and 0 <= v <= 1):
                raise ValueError(
                    f"strategy {name!r}: {key}={v!r} must be a fraction in [0, 1]"
                )
    return str(metric)


def _fleet(compare: dict[str, Any]) -> dict[str, Any]:
    fleet = compare.get("fleet")
    return fleet if isinstance(fleet, dict) else {}


def class_names(compare: dict[str, Any]) -> list[str]:
    """Device classes in the fleet's order, then any only the strategies mention."""
    names: list[str] = []
    for c in _fleet(compare).get("classes") or []:
        if isinstance(c, dict) and c.get("name") is not None:
            names.append(str(c["name"]))
    for s in compare["strategies"].values():
        for name in s.get("classes") or {}:
            if str(name) not in names:
                names.append(str(name))
    return names


def _class_value(s: dict[str, Any], cls: str, key: str) -> float | None:
    entry = (s.get("classes") or {}).get(cls)
    return _number(entry.get(key)) if isinstance(entry, dict) else None


def _metrics(s: dict[str, Any], metric: str) -> list[tuple[int, float]]:
    """(round, metric) for the rounds that have the metric."""
    out = []
    for r in s["rounds"]:
        v = _number(r.get(metric)) if isinstance(r, dict) else None
        if v is not None and _number(r.get("round")) is not None:
            out.append((int(r["round"]), v))
    return out


def best_metric(s: dict[str, Any], metric: str) -> float | None:
    """The entry's ``best_metric``, else the best over its rounds."""
    if _number(s.get("best_metric")) is not None:
        return float(s["best_metric"])
    values = [v for _, v in _metrics(s, metric)]
    if not values:
        return None
    return max(values) if HIGHER_IS_BETTER[metric] else min(values)


def rounds_to_target(s: dict[str, Any], metric: str, target: Any) -> int | None:
    """The entry's ``rounds_to_target`` (null: never); computed if the key is absent."""
    if "rounds_to_target" in s:
        v = _number(s["rounds_to_target"])
        return None if v is None else int(v)
    t = _number(target)
    if t is None:
        return None
    for rnd, v in _metrics(s, metric):
        if (v >= t) if HIGHER_IS_BETTER[metric] else (v <= t):
            return rnd
    return None


def peak_points(s: dict[str, Any]) -> list[tuple[int, int, str]]:
    """(budget_bytes, measured_peak_bytes, kind) of every assignment with both."""
    points = []
    for r in s["rounds"]:
        for a in (r.get("assignments") if isinstance(r, dict) else None) or []:
            budget = _number(a.get("budget_bytes"))
            peak = _number(a.get("measured_peak_bytes"))
            if budget is not None and peak is not None:
                points.append((int(budget), int(peak), str(a.get("kind", "?"))))
    return points


# ------------------------------------------------------------------ table
def _fmt_metric(v: float | None, metric: str) -> str:
    if v is None:
        return _MISSING
    return f"{v:.4f}" if metric == "accuracy" else f"{v:.2f}"


def _fmt_pct(v: Any) -> str:
    n = _number(v)
    return _MISSING if n is None else f"{100 * n:.1f}"


def _fmt_number(v: Any, spec: str) -> str:
    return _MISSING if v is None else format(v, spec)


def _fmt_peaks(h: dict[str, Any]) -> str:
    """A :func:`headline` row's peaks per class: "low 0.93, mid 0.71"."""
    parts = [
        f"{k.removeprefix(_PEAK)} {v:.2f}"
        for k, v in h.items()
        if k.startswith(_PEAK) and v is not None
    ]
    return ", ".join(parts) or _MISSING


def headline(compare: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``compare.csv``: one per strategy, fractions as in JSON, None where
    a number is missing; one ``worst_peak_over_budget_<class>`` column per class."""
    metric = validate(compare)
    rows = []
    for name, s in compare["strategies"].items():
        row = {
            "strategy": name,
            "workload": s.get("workload") or _fleet(compare).get("workload"),
            "metric_name": metric,
            "participation": _number(s["participation"]),
            "data_share": _number(s["data_share"]),
            "final_metric": _number(s["final_metric"]),
            "best_metric": best_metric(s, metric),
            "rounds_to_target": rounds_to_target(s, metric, compare.get("target")),
            "wall_s": _number(s.get("wall_s")),
            "sim_s": _number(s.get("sim_s")),
        }
        for cls in class_names(compare):
            row[_PEAK + cls] = _class_value(s, cls, "worst_peak_over_budget")
        rows.append(row)
    return rows


def _table(compare: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    metric = validate(compare)
    headers = ["strategy", "workload", "participation (%)", "data share (%)"]
    headers += [f"final {metric}", f"best {metric}", "rounds to target"]
    headers += ["worst peak/budget", "wall s", "simulated s"]
    rows = []
    for h in headline(compare):
        rows.append(
            [
                str(h["strategy"]),
                str(h["workload"] or _MISSING),
                _fmt_pct(h["participation"]),
                _fmt_pct(h["data_share"]),
                _fmt_metric(h["final_metric"], metric),
                _fmt_metric(h["best_metric"], metric),
                _fmt_number(h["rounds_to_target"], "d"),
                _fmt_peaks(h),
                _fmt_number(h["wall_s"], ".1f"),
                _fmt_number(h["sim_s"], ".1f"),
            ]
        )
    return headers, rows


def format_table(compare: dict[str, Any]) -> str:
    """The comparison as a plain-text table, one line per strategy.

    Example:
        >>> print(format_table(compare))  # doctest: +SKIP
        strategy  workload  participation (%)  ...  rounds to target  worst peak/budget
        fleetfit  gpt-byte              100.0  ...                 3  2GB 0.93, 4GB 0.71

    Raises:
        ValueError: as :func:`validate`.
    """
    headers, rows = _table(compare)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in _TEXT_COLUMNS else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


# ------------------------------------------------------------------ CSV
def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # None is written as an empty field
    return buf.getvalue()


def compare_csv(compare: dict[str, Any]) -> str:
    """``compare.csv``: :func:`headline`'s rows."""
    return _csv(headline(compare))


def rounds_csv(compare: dict[str, Any]) -> str:
    """``rounds.csv``: one row per strategy and round; ``metric`` is ``metric_name``."""
    metric = validate(compare)
    keys: tuple[str, ...] = ("round", metric, "loss", "num_clients", "num_sampled")
    keys += ("sim_round_s", "sim_elapsed_s")
    classes = class_names(compare)
    rows = [
        {"strategy": name}
        | {k if k != metric else "metric": r.get(k) for k in keys}
        | {f"metric_{c}": _round_class_metric(r, c) for c in classes}
        for name, s in compare["strategies"].items()
        for r in s["rounds"]
        if isinstance(r, dict)
    ]
    head = ["strategy", "round", "metric", *keys[2:], *(f"metric_{c}" for c in classes)]
    return _csv(rows) if rows else ",".join(head) + "\n"


def _round_class_metric(r: dict[str, Any], cls: str) -> float | None:
    """A round's metric on class ``cls``'s own data (None: not measured)."""
    by_class = r.get("class_metrics")
    return _number(by_class.get(cls)) if isinstance(by_class, dict) else None


def _start(s: dict[str, Any]) -> float | None:
    """The metric of a strategy's model before round 1 (its pretrained model's), at
    simulated time 0; None: not recorded."""
    pre = s.get("pretrain")
    return _number(pre.get("metric")) if isinstance(pre, dict) else None


def _time_points(
    s: dict[str, Any], value: Any, metric: str
) -> list[tuple[float, float]]:
    """(cumulative simulated seconds, value(round)) of a strategy's rounds."""
    points = []
    for r in s["rounds"]:
        t, v = _number(r.get("sim_elapsed_s")), value(r)
        if t is not None and v is not None and (metric == "accuracy" or v > 0):
            points.append((t, v))
    return points


# ------------------------------------------------------------------ plots
def _colours(compare: dict[str, Any]) -> dict[str, str]:
    """One colour per strategy, the same in every plot."""
    palette = [f"C{i}" for i in range(10)]
    return {n: palette[i % 10] for i, n in enumerate(compare["strategies"])}


def _new_figure(width: float = 6.5, height: float = 4.0) -> Any:
    # the object-oriented Figure needs no pyplot and leaves the global backend alone
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _log_y(ax: Any) -> None:
    """A log y axis labelled in plain numbers (20, 30, not 2x10^1)."""
    from matplotlib.ticker import LogFormatter

    ax.set_yscale("log")
    # LogFormatter labels a subset of the minor ticks when the axis spans few decades
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_metric(compare: dict[str, Any], path: Path) -> Path:
    """``metric.png``: the metric per round, a line per strategy (log y: perplexity)."""
    metric = validate(compare)
    colours = _colours(compare)
    fig = _new_figure()
    ax = fig.subplots()
    drawn = False
    for name, s in compare["strategies"].items():
        points = [
            (r, v) for r, v in _metrics(s, metric) if metric == "accuracy" or v > 0
        ]
        if points:
            drawn = True
            ax.plot(*zip(*points), marker="o", color=colours[name], label=name)
    if not drawn:
        _empty(ax, f"no round has a {metric}")
        return _save(fig, path)
    target = _number(compare.get("target"))
    if target is not None and (metric == "accuracy" or target > 0):
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    if metric == "perplexity":
        _log_y(ax)
    else:
        ax.set_ylim(0, 1)
    ax.set_xlabel("round")
    ax.set_ylabel(f"central {metric}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{_title(compare)}: {metric} per round")
    return _save(fig, path)


def _metric_axes(ax: Any, metric: str, ylabel: str) -> None:
    if metric == "perplexity":
        _log_y(ax)
    else:
        ax.set_ylim(0, 1)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_metric_time(compare: dict[str, Any], path: Path) -> Path:
    """``metric_time.png``: the metric against cumulative simulated time (the time
    the fleet's devices would take, server/simtime.py), a line per strategy; a
    pretrained model's metric at 0 s."""
    metric = validate(compare)
    colours = _colours(compare)
    fig = _new_figure()
    ax = fig.subplots()
    drawn = False
    for name, s in compare["strategies"].items():
        points = _time_points(s, lambda r: _number(r.get(metric)), metric)
        start = _start(s)
        if points and start is not None:
            points.insert(0, (0.0, start))
        if points:
            drawn = True
            ax.plot(*zip(*points), marker="o", color=colours[name], label=name)
    if not drawn:
        _empty(ax, "no round has a simulated time")
        return _save(fig, path)
    _metric_axes(ax, metric, f"central {metric}")
    ax.set_xlabel("simulated time (s)")
    ax.legend()
    ax.set_title(f"{_title(compare)}: {metric} against simulated time")
    return _save(fig, path)


def plot_class_rounds(compare: dict[str, Any], path: Path) -> Path:
    """``class_rounds.png``: per device class (a row each), the metric on that
    class's own data against rounds (left) and simulated time (right), a line per
    strategy."""
    metric = validate(compare)
    colours = _colours(compare)
    classes = [
        c
        for c in class_names(compare)
        if any(
            _round_class_metric(r, c) is not None
            for s in compare["strategies"].values()
            for r in s["rounds"]
            if isinstance(r, dict)
        )
    ]
    if not classes:
        fig = _new_figure()
        _empty(fig.subplots(), "no round has per-class metrics (natural split only)")
        return _save(fig, path)
    fig = _new_figure(9.0, 2.4 * len(classes) + 0.6)
    axes = fig.subplots(len(classes), 2, squeeze=False)
    for row, cls in zip(axes, classes, strict=True):
        for name, s in compare["strategies"].items():

            def value(r: dict[str, Any], cls: str = cls) -> float | None:
                return _round_class_metric(r, cls)

            by_round = [
                (int(r["round"]), v)
                for r in s["rounds"]
                if isinstance(r, dict) and (v := value(r)) is not None
            ]
            if by_round:
                row[0].plot(
                    *zip(*by_round), marker="o", color=colours[name], label=name
                )
            by_time = _time_points(s, value, metric)
            if by_time:
                row[1].plot(*zip(*by_time), marker="o", color=colours[name], label=name)
        for ax in row:
            _metric_axes(ax, metric, f"{metric} on {cls}")
        row[0].xaxis.get_major_locator().set_params(integer=True)
    axes[-1][0].set_xlabel("round")
    axes[-1][1].set_xlabel("simulated time (s)")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{_title(compare)}: {metric} on each device class's own data")
    return _save(fig, path)


def _grouped_bars(
    ax: Any,
    compare: dict[str, Any],
    classes: list[str],
    value: Any,
    fmt: str,
) -> bool:
    """Bars of ``value(strategy, class)`` grouped by class; False if none had one.

    Only strategies with at least one value get a slot in each group.
    """
    colours = _colours(compare)
    values = {
        name: [value(s, cls) for cls in classes]
        for name, s in compare["strategies"].items()
    }
    values = {n: vs for n, vs in values.items() if any(v is not None for v in vs)}
    width = 0.8 / max(len(values), 1)
    for i, (name, vs) in enumerate(values.items()):
        xs = [j - 0.4 + width * (i + 0.5) for j, v in enumerate(vs) if v is not None]
        ys = [v for v in vs if v is not None]
        bars = ax.bar(xs, ys, width, color=colours[name], label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(range(len(classes)), classes)
    ax.set_xlabel("device class")
    return bool(values)


def plot_participation(compare: dict[str, Any], path: Path) -> Path:
    """``participation.png``: per class, the share of sampled-and-available devices
    that contributed, grouped bars per strategy."""
    classes = class_names(compare)
    fig = _new_figure()
    ax = fig.subplots()

    def value(s: dict[str, Any], cls: str) -> float | None:
        v = _class_value(s, cls, "participation")
        return None if v is None else 100 * v

    if not _grouped_bars(ax, compare, classes, value, "%.0f"):
        _empty(ax, "no per-class participation")
        return _save(fig, path)
    ax.set_ylim(0, 110)
    ax.set_ylabel("devices that contributed (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{_title(compare)}: participation per device class")
    return _save(fig, path)


def plot_class_metric(compare: dict[str, Any], path: Path) -> Path:
    """``class_metric.png``: final metric on each class's own data, per strategy."""
    metric = validate(compare)
    classes = class_names(compare)
    fig = _new_figure()
    ax = fig.subplots()

    def value(s: dict[str, Any], cls: str) -> float | None:
        v = _class_value(s, cls, "metric")
        return v if v is None or metric == "accuracy" or v > 0 else None

    fmt = "%.2f" if metric == "accuracy" else "%.1f"
    if not _grouped_bars(ax, compare, classes, value, fmt):
        _empty(ax, f"no per-class {metric}")
        return _save(fig, path)
    if metric == "perplexity":
        _log_y(ax)
    else:
        ax.set_ylim(0, 1.1)
    ax.set_ylabel(f"final {metric} on the class's data")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{_title(compare)}: {metric} per device class's data")
    return _save(fig, path)


def plot_peaks(compare: dict[str, Any], path: Path) -> Path:
    """``peaks.png``: measured peak against budget of every client and round, with
    y = x (points above it went over budget)."""
    colours = _colours(compare)
    points = {name: peak_points(s) for name, s in compare["strategies"].items()}
    everything = [v for ps in points.values() for p in ps for v in p[:2]]
    fig = _new_figure(6.0, 5.0)
    ax = fig.subplots()
    if not everything:
        _empty(ax, "no client has both a budget and a measured peak")
        return _save(fig, path)
    scale, unit = (2**30, "GiB") if max(everything) >= 2**30 else (2**20, "MiB")
    markers = {"full": "o", "part": "^", "adapter": "D", "none": "x"}
    for name, ps in points.items():
        for kind in sorted({k for _, _, k in ps}):
            xs = [b / scale for b, _, k in ps if k == kind]
            ys = [p / scale for _, p, k in ps if k == kind]
            style = {"marker": markers.get(kind, "s"), "alpha": 0.6}
            ax.scatter(xs, ys, color=colours[name], label=f"{name} ({kind})", **style)
    top = max(everything) / scale * 1.05
    ax.plot([0, top], [0, top], color="grey", ls="--", lw=1, label="peak = budget")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel(f"budget ({unit})")
    ax.set_ylabel(f"measured peak ({unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{_title(compare)}: measured peak vs budget")
    return _save(fig, path)


# ------------------------------------------------------------------ Markdown
def _title(compare: dict[str, Any]) -> str:
    return str(_fleet(compare).get("name") or "fleet")


def _strategy_line(h: dict[str, Any], s: dict[str, Any], target: Any) -> str:
    """One Markdown line from a :func:`headline` row ``h`` and its entry ``s``."""
    metric = h["metric_name"]
    parts = [
        f"{_fmt_pct(h['participation'])}% of sampled, available devices and "
        f"{_fmt_pct(h['data_share'])}% of the data contributed",
        f"final {metric} {_fmt_metric(h['final_metric'], metric)} "
        f"(best {_fmt_metric(h['best_metric'], metric)})",
    ]
    t, rtt = _number(target), h["rounds_to_target"]
    if t is not None:
        parts.append(
            f"reached {t:g} in round {rtt}"
            if rtt is not None
            else f"never reached {t:g}"
        )
    if _fmt_peaks(h) != _MISSING:
        parts.append(f"worst peak/budget {_fmt_peaks(h)}")
    if h["wall_s"] is not None:
        parts.append(f"{h['wall_s']:.0f} s")
    head = f"**{h['strategy']}**" + (f" (`{h['workload']}`)" if h["workload"] else "")
    folder = s.get("run_folder")
    tail = f" Run folder: [`{folder}/`]({folder}/)." if folder else ""
    return f"- {head}: {'; '.join(parts)}.{tail}"


def _left_out_line(
    name: str, s: dict[str, Any], classes: list[str], metric: str
) -> str:
    """Which classes no device of (``left out``) or only some devices of (``partly``)
    contributed, with the final metric on the class's own data."""
    if not s.get("classes"):
        return f"- **{name}**: no per-class results."
    out, partly = [], []
    for cls in classes:
        p = _class_value(s, cls, "participation")
        m = _class_value(s, cls, "metric")
        on_data = (
            [] if m is None else [f"{metric} on its data {_fmt_metric(m, metric)}"]
        )
        if p == 0:
            out.append(cls + (f" ({on_data[0]})" if on_data else ""))
        elif p is not None and p < 1:
            partly.append(f"{cls} ({', '.join([f'{100 * p:.0f}%', *on_data])})")
    if not out and not partly:
        return f"- **{name}**: left no class out."
    partly_text = f"; partly {', '.join(partly)}" if partly else ""
    return f"- **{name}**: left out {', '.join(out) or 'no class'}{partly_text}."


def _lr_lines(compare: dict[str, Any]) -> list[str]:
    """The learning-rate section: the server optimiser and the sweep's table
    (``simulations.lr_sweep``), when the comparison has them."""
    sweep = compare.get("lr_sweep")
    opt = compare.get("server_opt")
    pretrain_sweeps = _pretrain_sweeps(compare)
    if (
        not isinstance(sweep, dict)
        and not isinstance(opt, dict)
        and not pretrain_sweeps
    ):
        return []
    from simulations.lr_sweep import format_sweep

    lines = ["## Learning rates", ""]
    if isinstance(opt, dict):
        lines += [
            f"Server optimiser `{opt.get('name')}`, server lr {opt.get('lr')}.",
            "",
        ]
    lrs = {n: s.get("lr") for n, s in compare["strategies"].items() if s.get("lr")}
    if lrs:
        lines += [
            "Client lr per strategy: "
            + ", ".join(f"{n} {v:g}" for n, v in lrs.items())
            + ".",
            "",
        ]
    if isinstance(sweep, dict):
        lines += [format_sweep(sweep), ""]
    if pretrain_sweeps:
        rule = compare.get("lr_rule") == "pretrain"
        lines += [
            "Pretraining lr candidates, each model's metric after pretraining at "
            "each (the best one kept"
            + ("; its clients train at it too" if rule else "")
            + "):",
            "",
            *(f"- `{w}`: {text}" for w, text in pretrain_sweeps.items()),
            "",
        ]
    return lines


def _pretrain_sweeps(compare: dict[str, Any]) -> dict[str, str]:
    """Per pretrained model with candidate lrs: ``lr metric, ...`` (kept one
    starred)."""
    out: dict[str, str] = {}
    for entry in compare.get("strategies", {}).values():
        pre = entry.get("pretrain") if isinstance(entry, dict) else None
        if not isinstance(pre, dict) or not isinstance(pre.get("lr_sweep"), list):
            continue
        cells = []
        for row in pre["lr_sweep"]:
            m = row.get("metric") if isinstance(row, dict) else None
            lr = row.get("lr") if isinstance(row, dict) else None
            if not isinstance(lr, int | float):
                continue
            text = f"{m:.4g}" if isinstance(m, int | float) else "-"
            star = "*" if lr == pre.get("lr") else ""
            cells.append(f"lr {lr:g} {text}{star}")
        out[str(pre.get("workload", "?"))] = ", ".join(cells)
    return out


def report_markdown(compare: dict[str, Any]) -> str:
    """``report.md``: title, headline table, the plots, a line per strategy."""
    metric = validate(compare)
    fleet = _fleet(compare)
    facts = [
        f"workload `{fleet['workload']}`" if fleet.get("workload") else None,
        f"{fleet['clients']} clients" if fleet.get("clients") is not None else None,
        f"{fleet['rounds']} rounds" if fleet.get("rounds") is not None else None,
        f"seed {fleet['seed']}" if fleet.get("seed") is not None else None,
        f"{fleet['split']} data split" if fleet.get("split") else None,
    ]
    target = _number(compare.get("target"))
    if target is not None:
        facts.append(f"target {metric} {target:g}")
    headers, rows = _table(compare)
    lines = [
        f"# Fleet comparison: {_title(compare)}",
        "",
        (f"Fleet file `{fleet['file']}`; " if fleet.get("file") else "")
        + ", ".join(f for f in facts if f)
        + ".",
        "",
        "| " + " | ".join(headers) + " |",
        "|"
        + "|".join("---" if i in _TEXT_COLUMNS else "---:" for i in range(len(headers)))
        + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "## Strategies",
        "",
        *(
            _strategy_line(h, s, compare.get("target"))
            for h, s in zip(headline(compare), compare["strategies"].values())
        ),
        "",
        "## Classes left out",
        "",
        *(
            _left_out_line(n, s, class_names(compare), metric)
            for n, s in compare["strategies"].items()
        ),
        "",
        *_lr_lines(compare),
        "## Plots",
        "",
        f"![{metric} per round]({METRIC_PNG})",
        "",
        f"![participation per device class]({PARTICIPATION_PNG})",
        "",
        f"![measured peak vs budget]({PEAKS_PNG})",
        "",
        f"![{metric} per device class's data]({CLASS_METRIC_PNG})",
        "",
        f"![{metric} against simulated time]({METRIC_TIME_PNG})",
        "",
        f"![{metric} per device class against rounds and time]({CLASS_ROUNDS_PNG})",
        "",
        f"Numbers: [`{COMPARE_CSV}`]({COMPARE_CSV}), [`{ROUNDS_CSV}`]({ROUNDS_CSV}).",
        "",
    ]
    return "\n".join(lines)


def write_report(out: Path, compare: dict[str, Any]) -> list[Path]:
    """Write the comparison's report files into ``out``; return their paths.

    Files: ``compare.csv``, ``rounds.csv``, ``metric.png``, ``participation.png``,
    ``peaks.png``, ``class_metric.png``, ``metric_time.png``, ``class_rounds.png``
    and ``report.md`` (see docs/simulations.md).

    Example:
        >>> write_report(Path("runs/phones"), compare)  # doctest: +SKIP
        [PosixPath('runs/phones/compare.csv'), ..., PosixPath('runs/phones/report.md')]

    Raises:
        ValueError: as :func:`validate`, before anything is written.
    """
    validate(compare)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in ((COMPARE_CSV, compare_csv), (ROUNDS_CSV, rounds_csv)):
        (out / name).write_text(text(compare))
        written.append(out / name)
    for name, plot in (
        (METRIC_PNG, plot_metric),
        (PARTICIPATION_PNG, plot_participation),
        (PEAKS_PNG, plot_peaks),
        (CLASS_METRIC_PNG, plot_class_metric),
        (METRIC_TIME_PNG, plot_metric_time),
        (CLASS_ROUNDS_PNG, plot_class_rounds),
    ):
        written.append(plot(compare, out / name))
    (out / REPORT_MD).write_text(report_markdown(compare))
    written.append(out / REPORT_MD)
    return written
