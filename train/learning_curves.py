"""Every method's held-out tau against training minutes and tokens seen, on the same target,
rows and budget: which method gives the most tau per training minute, and whether each curve is
still rising (more data or steps would help).

    python train/learning_curves.py                              # tiny target, CPU
    python train/learning_curves.py minutes=10 'methods=[medusa,draft]'
    python train/learning_curves.py --config-name learning_curves_smollm2   # SmolLM2, one core

Runs each trainer in turn (`train/<trainer>.py`, its run in <run_dir>/<method>), then writes
curves.json and learning_curves.png into the run folder and prints a table. Run again in the
same folder (hydra.run.dir=<run_dir>) after an interruption or a failed method, it keeps the
methods whose runs finished with today's settings (another setting is refused, naming it) and
trains the rest, a run that was cut short resumed from its last checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from selfspec.cli import hydra_entry_point
from selfspec.errors import SelfspecError
from selfspec.from_config.methods import CurveVariant, curve_variants, resumable_changes
from selfspec.from_config.training import check_kept_run
from selfspec.measure.curves import final_report, judge_share, rising, tau_curve
from selfspec.measure.plots import learning_curves_figure

TRAIN = Path(__file__).resolve().parent


@hydra_entry_point("learning_curves")
def main(cfg: DictConfig) -> None:
    methods = checked_methods(cfg)
    folder = Path(cfg.run_dir)
    results = {}
    for name, variant in methods.items():
        run_dir = folder / name
        command = [*trainer_overrides(cfg, run_dir), *variant.overrides,
                   *method_overrides(cfg, name)]
        if (run_dir / "summary.json").exists():  # written last: the run finished before
            check_kept(variant.trainer, command, run_dir)
            print(f"== {name}: kept, its run in {run_dir} finished", flush=True)
        else:
            # resumed: an interrupted run goes on from its last checkpoint (none: from step 0)
            train_one(name, variant.trainer, [*command, "trainer.resume=true"], run_dir)
        results[name] = {"curve": tau_curve(run_dir), **final_report(run_dir)}
    (folder / "curves.json").write_text(json.dumps(results, indent=1))
    labels = {f"{name} ({r['speedup']:.2f}x)": r["curve"] for name, r in results.items()}
    learning_curves_figure(labels, f"held-out tau while training, {cfg.model.name}, "
                           f"{cfg.minutes} min each").savefig(folder / "learning_curves.png",
                                                              dpi=110)
    print(table(results))
    print(f"figures in {folder.resolve()}")


def train_one(name: str, trainer: str, command: list[str], run_dir: Path) -> None:
    print(f"== {name}: train/{trainer}.py", flush=True)
    done = subprocess.run([sys.executable, str(TRAIN / f"{trainer}.py"), *command])
    if done.returncode != 0:
        raise SelfspecError(f"{name}: train/{trainer}.py failed (exit {done.returncode}); "
                            f"its log is in {run_dir}")


def check_kept(trainer: str, command: list[str], run_dir: Path) -> None:
    """A finished run is kept only if its trainer was given what `command` gives it now
    (the check of a resume): a curve never mixes runs of two configs."""
    cfg = compose(f"train_{trainer}", [o for o in command if not o.startswith("hydra.")])
    check_kept_run(cfg, run_dir, resumable_changes())


def checked_methods(cfg: DictConfig) -> dict[str, CurveVariant]:
    """The chosen variants (each trainer's `curve_variants`), the budget and the overrides
    checked."""
    known = curve_variants()
    methods = OmegaConf.to_container(cfg.methods)
    if not isinstance(methods, list) or not methods or not set(methods) <= set(known):
        raise SelfspecError(f"methods: give a list of {', '.join(known)}, got {methods}")
    if not cfg.minutes > 0 or not int(cfg.eval_every) >= 1:
        raise SelfspecError(f"minutes must be > 0 and eval_every >= 1, got {cfg.minutes} and "
                            f"{cfg.eval_every}")
    unknown = set(cfg.method_overrides or {}) - set(known)
    if unknown:
        raise SelfspecError(f"method_overrides: unknown methods {sorted(unknown)}; give some of "
                            f"{', '.join(known)}")
    return {name: known[name] for name in methods}


def trainer_overrides(cfg: DictConfig, run_dir: Path) -> list[str]:
    """What every trainer is given alike: the target, the budget, the evaluation cadence and
    the rows."""
    overrides = [*model_overrides(), f"device={cfg.device}",
                 f"trainer.max_minutes={cfg.minutes}", f"trainer.max_steps={cfg.max_steps}",
                 f"trainer.eval_every={cfg.eval_every}", f"trainer.save_every={cfg.eval_every}",
                 "trainer.keep_best=tau", f"trainer.tau_prompts={cfg.tau_prompts}",
                 f"train_data.self_distill_prompt_tokens={cfg.self_distill_prompt_tokens}",
                 f"hydra.run.dir={run_dir}"]
    if cfg.threads is not None:
        overrides.append(f"trainer.threads={cfg.threads}")
    return overrides + list(cfg.train_overrides)


def method_overrides(cfg: DictConfig, name: str) -> list[str]:
    """The overrides of one method alone (its own keys: a draft vocabulary, exit layers)."""
    return list(cfg.method_overrides.get(name) or [])


def model_overrides() -> list[str]:
    """The model this command was given (its option and model.* overrides), for a trainer."""
    hydra = HydraConfig.get()
    return [f"model={hydra.runtime.choices['model']}",
            *(o for o in hydra.overrides.task if o.startswith("model."))]


def table(results: dict[str, dict]) -> str:
    lines = ["method       evaluations  minutes  tokens seen  best tau  last tau  rising  "
             "judging  final tau  speedup"]
    for name, r in results.items():
        curve = r["curve"]
        best = max((p["tau"] for p in curve), default=float("nan"))
        last = curve[-1] if curve else {"minutes": 0, "tokens_seen": 0, "tau": float("nan")}
        lines.append(f"{name:<12} {len(curve):>11}  {last['minutes']:>7.1f}  "
                     f"{last['tokens_seen']:>11,}  {best:>8.2f}  {last['tau']:>8.2f}  "
                     f"{'yes' if rising(curve) else 'no':>6}  {judge_share(curve):>7.0%}  "
                     f"{r['tau']:>9.2f}  "
                     f"{r['speedup']:>6.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
