"""Figures of a sweep (`SweepRow`s as dicts, e.g. results.json's "rows"), as PNG files.

Built on matplotlib's object API (`Figure`), not pyplot: no global state, no GUI backend, so
plotting works in threads, tests and headless machines. Each figure has one panel per
sampling setting, since acceptance and speed differ between greedy and sampled decoding.
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import rcParams
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import text_to_path
from matplotlib.ticker import MaxNLocator

from selfspec.metrics import POSITION_SPAN

Row = Mapping[str, Any]
Colors = Mapping[str, str]  # a method's colour by its name, the same in every figure
PANEL_WIDTH = 4.6  # inches per sampling setting
TITLE_MARGIN = 0.4  # inches of a figure's width its suptitle leaves free
# A panel's title is centred on its axes, which share the panel with the y label and ticks.
PANEL_TITLE_WIDTH = PANEL_WIDTH - 1.2


def plot_sweep(rows: Sequence[Row], folder: str | Path, colors: Colors | None = None
               ) -> dict[str, Path]:
    """Every sweep figure as a PNG in folder; returns {name: path}. speedup_vs_bound only when
    some row has a bound (the sweep measured a cost profile); with several batch sizes, the
    figures against draft length show the smallest batch and speedup_vs_batch_size all.
    colors: each method's colour (the registry's, `from_config.sweeps.method_colors()`); others get
    one of matplotlib's."""
    if not rows:
        raise ValueError("plot_sweep: no rows to plot (the sweep measured nothing)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    batches = sorted({r.get("batch_size", 1) for r in rows})
    every_batch, rows = rows, [r for r in rows if r.get("batch_size", 1) == batches[0]]
    makers = {
        "acceptance_vs_draft_length": acceptance_vs_draft_length,
        "tokens_per_s_vs_draft_length": tokens_per_s_vs_draft_length,
        "speedup_at_best_draft_length": speedup_at_best_draft_length,
        "acceptance_by_position": acceptance_by_position,
    }
    if any(r.get("bound") is not None for r in rows):
        makers["speedup_vs_bound"] = speedup_vs_bound
    if any(len(r.get("tau_by_position") or ()) > 1 for r in rows):  # answers past one span
        makers["tau_by_position"] = tau_by_position
    paths = {}
    for name, make in makers.items():
        paths[name] = folder / f"{name}.png"
        make(rows, colors or {}).savefig(paths[name], dpi=110)
    if len(batches) > 1:
        paths["speedup_vs_batch_size"] = folder / "speedup_vs_batch_size.png"
        speedup_vs_batch_size(every_batch, colors or {}).savefig(
            paths["speedup_vs_batch_size"], dpi=110)
    return paths


def speedup_vs_batch_size(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """Each method's speedup over plain decoding of the same batch against the batch size, at
    its best draft length for each size, a line per method."""
    fig, panels = _panels(rows, "Speedup over plain decoding of the same batch vs batch size "
                                "(each method at its best draft length)")
    for sampling, ax in panels.items():
        best: dict[str, dict[int, float]] = {}
        for r in rows:
            if r["sampling"] == sampling:
                line = best.setdefault(r["method"], {})
                line[r["batch_size"]] = max(line.get(r["batch_size"], 0.0), r["speedup"])
        for method, line in best.items():
            sizes = sorted(line)
            ax.plot(sizes, [line[b] for b in sizes], marker="o", color=_color(method, colors),
                    label=method)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        sizes = sorted({b for line in best.values() for b in line})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set(xlabel="batch size", ylabel="speedup (x)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return fig


def acceptance_vs_draft_length(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """Acceptance rate (accepted / drafted depth) against draft length, a line per method."""
    fig, panels = _panels(rows, "Acceptance rate vs draft length")
    for sampling, ax in panels.items():
        for method, line in _lines(rows, sampling).items():
            ax.plot([r["draft_length"] for r in line], [r["acceptance_rate"] for r in line],
                    marker="o", color=_color(method, colors), label=method)
        ax.set(xlabel="draft length k", ylabel="acceptance rate", ylim=(0, 1.05))
    return _finish(fig, panels)


def tokens_per_s_vs_draft_length(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """Median tokens/s against draft length (bars: min..max over repeats), with each
    baseline's median as a dashed line."""
    fig, panels = _panels(rows, "Tokens/s vs draft length (median; bars: min-max over repeats)")
    for sampling, ax in panels.items():
        lines = _lines(rows, sampling)
        for method, line in lines.items():
            y = [r["tokens_per_s"] for r in line]
            spread = [[v - r["tokens_per_s_min"] for v, r in zip(y, line, strict=True)],
                      [r["tokens_per_s_max"] - v for v, r in zip(y, line, strict=True)]]
            ax.errorbar([r["draft_length"] for r in line], y, yerr=spread, marker="o",
                        capsize=3, color=_color(method, colors), label=method)
        for baseline, style in (("plain", "--"), ("hf_plain", ":")):
            speeds = [r["baseline_tokens_per_s"] for line in lines.values() for r in line
                      if r["baseline"] == baseline]
            if speeds:
                ax.axhline(statistics.median(speeds), color="black", linestyle=style,
                           label=f"{baseline} (baseline, median of its runs)")
        ax.set(xlabel="draft length k", ylabel="tokens / s")
        ax.set_ylim(bottom=0)
    return _finish(fig, panels)


def speedup_at_best_draft_length(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """Each method's speedup over its baseline at its best draft length, per sampling setting,
    labelled with that k and the share of repeated 4-grams in its outputs."""
    fig, panels = _panels(rows, "Speedup over plain decoding at each method's best draft length")
    for sampling, ax in panels.items():
        best = [max(line, key=lambda r: r["speedup"])
                for line in _lines(rows, sampling).values()]
        x = range(len(best))
        heights = [r["speedup"] for r in best]
        spread = [[h - r["speedup_min"] for h, r in zip(heights, best, strict=True)],
                  [r["speedup_max"] - h for h, r in zip(heights, best, strict=True)]]
        bars = ax.bar(x, heights, yerr=spread, capsize=3,
                      color=[_color(r["method"], colors) for r in best])
        labels = [f"k={r['draft_length']}\nrep4 {r['repeated_4gram_share']:.2f}" for r in best]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(list(x), [r["method"] for r in best], rotation=20, fontsize=8)
        ax.set(ylabel="speedup (x)")
        ax.set_ylim(0, max([*heights, 1.0]) * 1.35)
    return _finish(fig, panels, line_plot=False)


def acceptance_by_position(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """Share of drafts accepted at each draft position, per method at its longest draft."""
    fig, panels = _panels(rows, "Acceptance by draft position (each method at its longest draft)")
    for sampling, ax in panels.items():
        for method, line in _lines(rows, sampling).items():
            rates = line[-1]["acceptance_by_position"]
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", color=_color(method, colors),
                        label=f"{method} (k={line[-1]['draft_length']})")
        ax.set(xlabel="draft position", ylabel="accepted share", ylim=(0, 1.05))
    return _finish(fig, panels)


def tau_by_position(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """tau of the steps starting in each span of POSITION_SPAN new tokens, per method at its
    longest draft: whether acceptance holds up deep into long answers."""
    fig, panels = _panels(rows, "tau by position in the answer (each method at its longest "
                                "draft)")
    for sampling, ax in panels.items():
        for method, line in _lines(rows, sampling).items():
            spans = line[-1].get("tau_by_position") or []
            points = [(POSITION_SPAN * i, tau) for i, tau in enumerate(spans) if tau is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", color=_color(method, colors),
                        label=f"{method} (k={line[-1]['draft_length']})")
        ax.set(xlabel=f"new tokens before the step (spans of {POSITION_SPAN})", ylabel="tau")
    return _finish(fig, panels)


def speedup_vs_bound(rows: Sequence[Row], colors: Colors | None = None) -> Figure:
    """Measured speedup against the bound tau / (c(N + 1) + draft cost), a point per row,
    coloured by method and labelled with its draft length, with y = x: how much of what
    acceptance allows the loop delivers."""
    fig, panels = _panels(rows, "Measured speedup vs the bound tau / (c(N+1) + draft cost)")
    for sampling, ax in panels.items():
        points = [r for line in _lines(rows, sampling).values() for r in line
                  if r.get("bound") is not None]
        for method in dict.fromkeys(r["method"] for r in points):
            mine = [r for r in points if r["method"] == method]
            ax.scatter([r["bound"] for r in mine], [r["speedup"] for r in mine], s=22,
                       color=_color(method, colors), label=method)
            for r in mine:
                ax.annotate(f"k={r['draft_length']}", (r["bound"], r["speedup"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        top = max([1.0, *(max(r["bound"], r["speedup"]) for r in points)]) * 1.1
        ax.plot([0, top], [0, top], color="black", linestyle="--", linewidth=1, label="y = x")
        ax.set(xlabel="bound (x)", ylabel="measured speedup (x)", xlim=(0, top), ylim=(0, top))
        ax.legend(fontsize=7)
    return fig


# ---- helpers ------------------------------------------------------------------------------


def _panels(rows: Sequence[Row], title: str) -> tuple[Figure, dict[str, Any]]:
    """A figure with one panel per sampling setting, in the rows' order."""
    samplings = list(dict.fromkeys(r["sampling"] for r in rows))
    width = PANEL_WIDTH * len(samplings)
    fig = Figure(figsize=(width, 3.8), layout="constrained")
    axes = fig.subplots(1, len(samplings), squeeze=False)[0]
    fig.suptitle(_wrap(title, rcParams["figure.titlesize"], width - TITLE_MARGIN))
    for sampling, ax in zip(samplings, axes, strict=True):
        ax.set_title(_wrap(f"sampling: {sampling}", 10, PANEL_TITLE_WIDTH), fontsize=10)
        ax.grid(alpha=0.3)
    return fig, dict(zip(samplings, axes, strict=True))


def _lines(rows: Sequence[Row], sampling: str) -> dict[str, list[Row]]:
    """The rows of one sampling setting, grouped by method, by increasing draft length."""
    lines: dict[str, list[Row]] = {}
    for row in rows:
        if row["sampling"] == sampling:
            lines.setdefault(row["method"], []).append(row)
    return {m: sorted(line, key=lambda r: r["draft_length"]) for m, line in lines.items()}


def _finish(fig: Figure, panels: dict[str, Any], line_plot: bool = True) -> Figure:
    """Legends and integer x ticks (draft lengths, positions) on line plots."""
    if line_plot:
        for ax in panels.values():
            _integer_x(ax)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return fig


def _integer_x(ax: Any) -> None:
    """Integer ticks over the panel's data, half a step beyond it: left to matplotlib, a lone
    x (k=1) gets a +-5% view with ticks 0.945..1.05, as no two integers fall in it."""
    low, high = ax.dataLim.intervalx  # data x only: axhline spans the axes, not the data
    if low > high:  # nothing plotted (e.g. no acceptance by position recorded)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return
    ax.set_xlim(low - 0.5, high + 0.5)
    if high - low <= 10:
        ax.set_xticks(range(round(low), round(high) + 1))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _wrap(text: str, fontsize: float | str, width: float) -> str:
    """text broken at spaces into lines at most width inches wide at fontsize: constrained
    layout makes room for a title's height but not its width, so a long title over one panel
    would run past both edges of the canvas."""
    font = FontProperties(size=fontsize)
    lines: list[str] = []
    for word in text.split(" "):
        if lines and _inches(f"{lines[-1]} {word}", font) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return "\n".join(lines)


def _inches(text: str, font: FontProperties) -> float:
    """text's width in inches when drawn in font (measured without a renderer)."""
    points = text_to_path.get_text_width_height_descent(text, font, ismath=False)[0]
    return points / 72


def _color(method: str, colors: Colors | None) -> str:
    """The method's own color; a method without one (e.g. an early_exit/E4/norm/stop0.6 row)
    gets one of matplotlib's ten cycle colors, the same in every figure."""
    return (colors or {}).get(method) or f"C{zlib.crc32(method.encode()) % 10}"


def plot_cost_profile(c_of_n: Mapping[int, float], title: str, path: str | Path) -> Path:
    """c(N), the cost of a forward over N new tokens in one-token forwards, as a PNG."""
    cost_profile_figure(c_of_n, title).savefig(path, dpi=110)
    return Path(path)


def cost_profile_figure(c_of_n: Mapping[int, float], title: str) -> Figure:
    """c(N) against N on a log2 axis, a tick at each measured N."""
    width = 6.0
    figure = Figure(figsize=(width, 4), layout="constrained")
    axes = figure.subplots()
    lengths = sorted(int(n) for n in c_of_n)
    axes.plot(lengths, [c_of_n[n] for n in lengths], marker="o", color="tab:blue")
    axes.set_xscale("log", base=2)
    # Ticks at the measured N, written as integers: the log locator's own would add
    # fractions (0.5 around a lone N=1) and write 2^k.
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.minorticks_off()
    axes.set_xlabel("new tokens N in one forward")
    axes.set_ylabel("c(N): time / time of one token")
    # A suptitle, centred on the figure (not on the axes, which the y label pushes right).
    figure.suptitle(_wrap(title, rcParams["figure.titlesize"], width - TITLE_MARGIN))
    axes.grid(True, alpha=0.3)
    return figure


def moe_costs_figure(c_by_target: Mapping[str, Mapping[int, float]],
                     experts_touched: Mapping[int, float], experts: int, top_k: int,
                     title: str) -> Figure:
    """A MoE target's verification cost: c(N) of each target (`c_by_target`: {label: {N: c}})
    against N, and the distinct experts a forward of N tokens touches per layer, between one
    token's top_k and all `experts`."""
    width = 2 * PANEL_WIDTH
    figure = Figure(figsize=(width, 3.8), layout="constrained")
    cost, touched = figure.subplots(1, 2)
    figure.suptitle(_wrap(title, rcParams["figure.titlesize"], width - TITLE_MARGIN))
    for i, (label, c_of_n) in enumerate(c_by_target.items()):
        lengths = sorted(int(n) for n in c_of_n)
        by_n = {int(n): c for n, c in c_of_n.items()}
        cost.plot(lengths, [by_n[n] for n in lengths], marker="o", markersize=3,
                  color=f"C{i}", label=label)
    cost.set(xlabel="new tokens N in one forward", ylabel="c(N): time / time of one token")
    cost.legend(fontsize=7)
    by_n = {int(n): e for n, e in experts_touched.items()}
    lengths = sorted(by_n)
    touched.plot(lengths, [by_n[n] for n in lengths], marker="o", markersize=3, color="C0")
    for level, text in ((experts, "every expert"), (top_k, "one token's top-k")):
        touched.axhline(level, color="grey", linestyle=":", linewidth=1)
        touched.annotate(text, (lengths[-1], level), fontsize=7, ha="right", va="bottom")
    touched.set(xlabel="new tokens N in one forward", ylabel="distinct experts touched a layer")
    ticks = [2**i for i in range(lengths[-1].bit_length()) if 2**i <= lengths[-1]]
    for axes in (cost, touched):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(n) for n in ticks])
        axes.minorticks_off()
        axes.grid(alpha=0.3)
    return figure


def learning_curves_figure(curves: Mapping[str, Sequence[Row]], title: str,
                           colors: Colors | None = None) -> Figure:
    """Held-out tau against training minutes and against tokens seen, a line per method.
    curves: {label: [{"minutes", "tokens_seen", "tau"}, ...]} in step order."""
    width = 2 * PANEL_WIDTH
    figure = Figure(figsize=(width, 3.8), layout="constrained")
    panels = figure.subplots(1, 2)
    figure.suptitle(_wrap(title, rcParams["figure.titlesize"], width - TITLE_MARGIN))
    for axes, x, label in ((panels[0], "minutes", "training minutes"),
                           (panels[1], "tokens_seen", "training tokens seen")):
        for i, (name, points) in enumerate(curves.items()):
            color = (colors or {}).get(name.split(" ")[0]) or f"C{i}"  # distinct, in order
            axes.plot([p[x] for p in points], [p["tau"] for p in points], marker="o",
                      markersize=3, color=color, label=name)
        axes.set(xlabel=label, ylabel="held-out tau (greedy)")
        axes.grid(alpha=0.3)
    panels[0].legend(fontsize=7)
    return figure


def data_curves_figure(curves: Mapping[str, Mapping[int, Sequence[Row]]], title: str,
                       colors: Colors | None = None) -> Figure:
    """Held-out tau against data and epochs: a panel per method with tau after each epoch, a
    line per training set size (answers), and a last panel with each method's tau after its
    last epoch against the answers it trained on. Error bars: the standard error over the
    held-out prompts. curves: {method: {answers: [{"epochs", "tau", "tau_se"}, ...]}}."""
    panels_count = len(curves) + 1
    width = PANEL_WIDTH * panels_count
    figure = Figure(figsize=(width, 3.8), layout="constrained")
    panels = figure.subplots(1, panels_count, squeeze=False)[0]
    figure.suptitle(_wrap(title, rcParams["figure.titlesize"], width - TITLE_MARGIN))
    for axes, (method, by_size) in zip(panels, curves.items(), strict=False):
        for i, (answers, points) in enumerate(sorted(by_size.items())):
            axes.errorbar([p["epochs"] for p in points], [p["tau"] for p in points],
                          yerr=[p.get("tau_se") or 0.0 for p in points], marker="o",
                          markersize=3, capsize=2, color=f"C{i}", label=f"{answers:,} answers")
        axes.set(title=method, xlabel="epochs", ylabel="held-out tau (greedy)")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        if by_size:  # a method none of whose runs finished yet (draw_only) has no lines
            axes.legend(fontsize=7)
    last = panels[-1]
    for i, (method, by_size) in enumerate(curves.items()):
        sizes = sorted(size for size, points in by_size.items() if points)
        ends = [by_size[size][-1] for size in sizes]
        last.errorbar(sizes, [p["tau"] for p in ends], yerr=[p.get("tau_se") or 0.0 for p in ends],
                      marker="o", markersize=3, capsize=2, label=method,
                      color=(colors or {}).get(method) or f"C{i}")
    sizes = sorted({size for by_size in curves.values() for size in by_size})
    if len(sizes) > 1:
        last.set_xscale("log")
        last.minorticks_off()
    last.set_xticks(sizes, [f"{size:,}" for size in sizes])
    last.set(title="after the last epoch", xlabel="training answers",
             ylabel="held-out tau (greedy)")
    last.grid(alpha=0.3)
    last.legend(fontsize=7)
    return figure
