"""measure/plots.py lays out for one panel as for many: titles and axis labels inside the canvas,
integer ticks on integer axes (draft length, draft position, N), whatever the sweep's size."""

from __future__ import annotations

import pytest
from helpers import covering
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from selfspec.measure import plots
from selfspec.measure.grid import SweepRow

METHODS = ("small_model", "ngram", "hf_assisted")
# (samplings, draft lengths): the reported case (one panel at k=1) first.
SWEEPS = {
    "one_panel_k1": (("greedy",), (1,)),
    "one_panel_many_k": (("greedy",), (1, 2, 4, 8)),
    "many_panels_k1": (("greedy", "t0.7_top_p0.9_top_k50"), (1,)),
    "many_panels_many_k": (("greedy", "t1", "t0.7"), (1, 2, 4)),
}
# Each sweep figure, with whether its x axis counts something (k, a position, a bar's index).
FIGURES = {
    plots.acceptance_vs_draft_length: True,
    plots.tokens_per_s_vs_draft_length: True,
    plots.speedup_at_best_draft_length: True,
    plots.acceptance_by_position: True,
    plots.speedup_vs_bound: False,
    plots.tau_by_position: True,
}


def sweep_row(method: str, k: int, sampling: str) -> dict:
    """A plausible row of the sweep, as `plot_sweep` receives it (`SweepRow.as_dict`)."""
    speed, base = 100.0 + 20 * k, 100.0
    hf = method.startswith("hf_")
    return SweepRow(
        method=method, draft_length=k, draft_nodes=k, sampling=sampling,
        temperature=0.0 if sampling == "greedy" else 1.0, top_k=0, top_p=1.0,
        baseline="hf_plain" if hf else "plain", prompts=8, repeats=3, new_tokens=64,
        tau=1 + 0.6 * k, acceptance_rate=0.6,
        acceptance_by_position=[0.8 * 0.9**i for i in range(k)],
        tokens_per_s=speed, tokens_per_s_min=speed - 5, tokens_per_s_max=speed + 5,
        baseline_tokens_per_s=base, baseline_tokens_per_s_min=base - 3,
        baseline_tokens_per_s_max=base + 3, speedup=speed / base,
        speedup_min=(speed - 5) / base, speedup_max=(speed + 5) / base,
        target_forwards_per_token=1 / (1 + 0.6 * k), draft_time_share=0.2, peak_memory_mb=512.0,
        memory_measure="rss", repeated_4gram_share=0.12, baseline_repeated_4gram_share=0.1,
        lossless=True if sampling == "greedy" else None, draft_cost=0.1 * k,
        bound=1.1 * speed / base, tau_by_position=[1 + 0.6 * k - 0.1 * i for i in range(3)],
    ).as_dict()


def sweep_rows(name: str) -> list[dict]:
    samplings, lengths = SWEEPS[name]
    return [sweep_row(m, k, s) for s in samplings for m in METHODS for k in lengths]


def drawn(fig: Figure):
    """The figure laid out and drawn on Agg (headless), and its renderer."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def assert_titles_inside(fig: Figure) -> None:
    """The suptitle, each panel's title and axis labels lie within the canvas."""
    renderer = drawn(fig)
    texts = [fig._suptitle] if fig._suptitle else []  # Figure keeps its suptitle here only
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
    width, height = fig.bbox.width, fig.bbox.height
    for text in texts:
        if not text.get_text():
            continue
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height, (
            f"{text.get_text()!r} spans x {box.x0:.0f}..{box.x1:.0f}, y {box.y0:.0f}..{box.y1:.0f}"
            f" outside the {width:.0f} x {height:.0f} canvas")


def data_x(ax) -> list[float]:
    """The x of every plotted point and bar centre (not axhline's axes-fraction x)."""
    xs = [x for line in ax.get_lines() if line.get_transform() == ax.transData
          for x in line.get_xdata()]
    return xs + [p.get_x() + p.get_width() / 2 for p in ax.patches]


def assert_integer_x(fig: Figure) -> None:
    """Each panel's ticks within its view are integers, and its data lie within that view."""
    drawn(fig)
    for ax in fig.axes:
        low, high = sorted(ax.get_xlim())
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks, f"no x tick within {low:.3f}..{high:.3f}"
        assert all(float(t).is_integer() for t in ticks), (
            f"fractional x ticks {[round(float(t), 3) for t in ticks]} on an integer axis")
        xs = data_x(ax)
        assert xs and all(low <= x <= high for x in xs), f"data {xs} outside {low}..{high}"


@pytest.mark.parametrize("make, sweep", covering(list(FIGURES), list(SWEEPS)),
                         ids=lambda v: getattr(v, "__name__", v))
def test_sweep_figures_lay_out_for_one_panel_as_for_many(make, sweep):
    rows = sweep_rows(sweep)
    fig = make(rows)
    assert len(fig.axes) == len(SWEEPS[sweep][0])  # one panel per sampling setting
    assert_titles_inside(fig)
    if FIGURES[make]:
        assert_integer_x(fig)


@pytest.mark.parametrize("c_of_n", [{1: 1.0}, {n: 1 + n / 64 for n in (1, 2, 4, 8, 16, 32, 64)}],
                         ids=["one_N", "many_N"])
def test_cost_profile_lays_out_for_one_point_as_for_many(c_of_n):
    title = "HuggingFaceTB/SmolLM2-135M-Instruct, cuda (NVIDIA H100 80GB HBM3), torch.bfloat16"
    fig = plots.cost_profile_figure(c_of_n, title)
    assert_titles_inside(fig)
    assert_integer_x(fig)


def test_plot_sweep_writes_every_figure_for_one_panel(tmp_path):
    paths = plots.plot_sweep(sweep_rows("one_panel_k1"), tmp_path)
    assert set(paths) == {f.__name__ for f in FIGURES}
    assert all(p.stat().st_size > 1000 for p in paths.values())


def curve(epochs: int, start: float) -> list[dict]:
    return [{"epochs": float(e), "tau": start + 0.1 * e, "tau_se": 0.05}
            for e in range(1, 1 + epochs)]


@pytest.mark.parametrize("sizes", [(100,), (100, 400, 1600)], ids=["one_size", "many_sizes"])
def test_data_curves_draw_a_panel_per_method_and_tau_against_answers(sizes):
    curves = {method: {n: curve(3, 1.0 + n / 1000) for n in sizes}
              for method in ("medusa", "eagle2")}
    fig = plots.data_curves_figure(curves, "held-out tau against data and epochs, smollm2-135m")
    assert len(fig.axes) == 3  # two methods, then tau after the last epoch against answers
    assert_titles_inside(fig)
    lines = fig.axes[0].get_lines()
    assert [list(line.get_xdata()) for line in lines if len(line.get_xdata()) == 3][:1] == [
        [1.0, 2.0, 3.0]]
    ends = [line for line in fig.axes[-1].get_lines() if len(line.get_xdata()) == len(sizes)]
    assert [list(line.get_xdata()) for line in ends][0] == list(sizes)
    assert list(ends[0].get_ydata()) == pytest.approx([1.3 + n / 1000 for n in sizes])
