"""Held-out tau against training data and epochs: each method trained on nested subsets of the
answers (the first N of a fixed shuffled order) for several epochs, tau with its standard
error over the held-out prompts after every epoch.

    python train/data_curves.py                                   # tiny target, a few minutes
    python train/data_curves.py --config-name data_curves_smollm2   # SmolLM2: hours

Builds one feature store over the largest subset first (`train/store.py`, in <run_dir>/store),
which every run reads instead of running the target; then runs each trainer
(`train/<trainer>.py`, its run in <run_dir>/<method>/N<answers>), and writes curves.json and
data_curves.png into the run folder and prints a table. Run it again to resume: the store
resumes at its first missing shard, a finished run is kept and an interrupted one resumes
from its last epoch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from learning_curves import check_kept, model_overrides
from omegaconf import DictConfig, OmegaConf

from selfspec.checks import is_count
from selfspec.cli import hydra_entry_point
from selfspec.errors import SelfspecError
from selfspec.from_config.methods import CurveVariant, curve_variants
from selfspec.measure.curves import tau_curve
from selfspec.measure.plots import data_curves_figure

TRAIN = Path(__file__).resolve().parent


@hydra_entry_point("data_curves")
def main(cfg: DictConfig) -> None:
    methods, sizes = checked(cfg)
    folder = Path(cfg.run_dir)
    results = finished_runs(cfg, methods, sizes) if cfg.draw_only else train_all(cfg, methods,
                                                                                 sizes)
    results = with_earlier(results, cfg.earlier)
    (folder / "curves.json").write_text(json.dumps(results, indent=1))
    data_curves_figure(results, f"held-out tau against answers and epochs, {cfg.model.name} "
                       f"({cfg.tau_prompts} prompts)").savefig(folder / "data_curves.png",
                                                               dpi=110)
    print(table(results))
    print(f"figures in {folder.resolve()}")


def train_all(cfg: DictConfig, methods: dict[str, CurveVariant], sizes: list[int]
              ) -> dict[str, dict[int, list]]:
    """Every method on every answer set, the smaller sets first (a finished run is kept)."""
    folder = Path(cfg.run_dir)
    store = build_store(cfg, folder / "store", max(sizes)) if cfg.store.enabled else None
    results: dict[str, dict[int, list]] = {name: {} for name in methods}
    for answers in sizes:
        for name, variant in methods.items():
            run_dir = folder / name / f"N{answers}"
            command = [*trainer_overrides(cfg, run_dir, answers, store), *variant.overrides,
                       *(cfg.method_overrides.get(name) or [])]
            if finished(run_dir, float(cfg.epochs)):
                check_kept(variant.trainer, command, run_dir)
            else:
                print(f"== {name}, {answers:,} answers: train/{variant.trainer}.py, "
                      f"{cfg.epochs} epochs", flush=True)
                run([TRAIN / f"{variant.trainer}.py", *command], f"{name} N={answers}")
            results[name][answers] = tau_curve(run_dir)
    return results


def finished_runs(cfg: DictConfig, methods: dict[str, CurveVariant], sizes: list[int]
                  ) -> dict[str, dict[int, list]]:
    """draw_only: the curves of the runs that finished so far, training nothing (a long run
    can be drawn while it goes on)."""
    folder = Path(cfg.run_dir)
    return {name: {n: tau_curve(folder / name / f"N{n}") for n in sizes
                   if finished(folder / name / f"N{n}", float(cfg.epochs))} for name in methods}


def with_earlier(results: dict[str, dict[int, list]], earlier: list[str] | None
                 ) -> dict[str, dict[int, list]]:
    """This run's curves and, where it has no run of its own, the points of earlier curves.json
    files (runs made elsewhere whose folders are gone), so that one figure holds them all."""
    merged: dict[str, dict[int, list]] = {}
    for path in earlier or []:
        if not Path(path).is_file():
            raise SelfspecError(f"earlier: no curves.json at {path}; give the curves.json "
                                f"files of earlier runs")
        for name, by_size in json.loads(Path(path).read_text()).items():
            merged.setdefault(name, {}).update({int(n): curve for n, curve in by_size.items()})
    for name, by_size in results.items():
        merged.setdefault(name, {}).update(by_size)
    return {name: dict(sorted(by_size.items())) for name, by_size in merged.items()}


def checked(cfg: DictConfig) -> tuple[dict[str, CurveVariant], list[int]]:
    known = curve_variants()
    methods = OmegaConf.to_container(cfg.methods)
    if not isinstance(methods, list) or not methods or not set(methods) <= set(known):
        raise SelfspecError(f"methods: give a list of {', '.join(known)}, got {methods}")
    sizes = OmegaConf.to_container(cfg.answers)
    if not isinstance(sizes, list) or not sizes or not all(map(is_count, sizes)):
        raise SelfspecError(f"answers: give a list of training set sizes >= 1, got {sizes}")
    if not cfg.epochs > 0 or not int(cfg.tau_prompts) >= 2:
        raise SelfspecError(f"epochs must be > 0 and tau_prompts >= 2 (a standard error needs "
                            f"two prompts), got {cfg.epochs} and {cfg.tau_prompts}")
    unknown = set(cfg.method_overrides or {}) - set(known)
    if unknown:
        raise SelfspecError(f"method_overrides: unknown methods {sorted(unknown)}")
    return {name: known[name] for name in methods}, sorted(set(sizes))


def build_store(cfg: DictConfig, out: Path, answers: int) -> Path:
    """One feature store over the largest subset (the smaller ones are its prefixes)."""
    print(f"== feature store over {answers:,} answers: train/store.py", flush=True)
    run([TRAIN / "store.py", *model_overrides(), f"device={cfg.device}", *threads(cfg),
         *cfg.rows, f"train_data.max_answers={answers}", f"store.out={out}",
         f"store.dtype={cfg.store.dtype}",
         f"store.layers={json.dumps(OmegaConf.to_container(cfg.store.layers))}",
         f"hydra.run.dir={out}"], "the feature store")
    return out


def trainer_overrides(cfg: DictConfig, run_dir: Path, answers: int, store: Path | None
                      ) -> list[str]:
    """What every trainer is given alike: the target, the rows (the first `answers`), the
    epochs, held-out tau on tau_prompts prompts after each epoch, and the store."""
    overrides = [*model_overrides(), f"device={cfg.device}", *threads(cfg), *cfg.rows,
                 f"train_data.max_answers={answers}", f"trainer.epochs={cfg.epochs}",
                 "trainer.keep_best=tau", f"trainer.tau_prompts={cfg.tau_prompts}",
                 "trainer.resume=true", f"hydra.run.dir={run_dir}"]
    if store is not None:
        overrides.append(f"trainer.features={store}")
    return overrides + list(cfg.train_overrides)


def threads(cfg: DictConfig) -> list[str]:
    return [] if cfg.threads is None else [f"trainer.threads={cfg.threads}"]


def finished(run_dir: Path, epochs: float) -> bool:
    """Whether a run folder holds the evaluation after its last epoch."""
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    return any((p["epochs"] or 0) >= epochs - 1e-9 for p in tau_curve(run_dir))


def run(command: list, what: str) -> None:
    done = subprocess.run([sys.executable, *map(str, command)])
    if done.returncode != 0:
        raise SelfspecError(f"{what}: {Path(command[0]).name} failed (exit {done.returncode})")


def table(results: dict[str, dict[int, list]]) -> str:
    """A line per method and set size: tau +- its standard error after each epoch."""
    lines = ["method       answers  tau after each epoch (+- standard error over prompts)"]
    for name, by_size in results.items():
        for answers, curve in sorted(by_size.items()):
            taus = "  ".join(f"{p['tau']:.3f}+-{p['tau_se'] or 0:.3f}" for p in curve)
            lines.append(f"{name:<12} {answers:>7,}  {taus}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
