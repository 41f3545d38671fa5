"""The one training loop: resume, tracking, non-finite loss, DeepSpeed ZeRO on 2 processes."""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import distributed_fit
import pytest
import torch
from accelerate.state import AcceleratorState
from helpers import (
    HAS_DEEPSPEED,
    HAS_WANDB,
    assert_same_adam_training,
    suite_threads,
    tiny_llama,
)
from safetensors import safe_open
from safetensors.torch import load_file

from selfspec.errors import SelfspecError
from selfspec.from_config.methods.medusa import MedusaObjective
from selfspec.heads.base import LossOutput
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.model import Transformer
from selfspec.tracking import Tracker, read_metrics
from selfspec.training.checkpoints import RUN_CONFIG, checkpoint_problem, record_run_config
from selfspec.training.loop import (
    NonFiniteLoss,
    TokenRows,
    TrainSettings,
    _optimizer_and_schedule,
    fit,
    make_accelerator,
)

TESTS = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(True)  # each test builds its own Accelerator


def objective(seed: int = 1) -> MedusaObjective:
    target = Transformer.from_hf(tiny_llama(0))
    torch.manual_seed(seed)
    return MedusaObjective(target, MedusaHeads(MedusaConfig(32, 64, num_heads=2)))


def rows(n: int = 32, length: int = 24) -> TokenRows:
    tokens = torch.randint(64, (n, length), generator=torch.Generator().manual_seed(2))
    return TokenRows(tokens, torch.ones_like(tokens))


def run(run_dir: Path, judge=None, **overrides) -> tuple:
    settings = TrainSettings(**{"run_dir": str(run_dir), "max_steps": 6, "micro_batch_size": 4,
                                "lr": 3e-3, "log_every": 1, "save_every": 2, **overrides})
    accelerator = make_accelerator(settings)
    tracker = Tracker(run_dir, use_wandb=False)
    exported = []

    def export(state, folder):
        folder.mkdir(parents=True)
        torch.save(state, folder / "state.pt")
        exported.append(folder)

    result = fit(objective(), rows(), rows(8), settings, accelerator=accelerator,
                 tracker=tracker, export=export, judge=judge)
    AcceleratorState._reset_state(True)
    return result, exported


def scripted_judge(taus: dict[int, float]):
    """A judge that gives step s's export the held-out tau taus[s] (read from the step the
    export's state reached: each export is judged as it is written), and records its calls."""
    calls = []

    def judge(folder: Path) -> dict[str, float]:
        calls.append(folder)
        return {"eval/tau": taus[len(calls) * 2]}  # evaluations at steps 2, 4, 6, ...

    return judge, calls


def test_keep_best_tau_ends_with_the_export_of_the_best_judged_step(tmp_path):
    judge, calls = scripted_judge({2: 1.4, 4: 1.9, 6: 1.7})
    result, _ = run(tmp_path, judge=judge, eval_every=2, keep_best="tau")
    assert len(calls) == 3 and result.best.step == 4 and result.best.value == 1.9
    assert result.export == tmp_path / "checkpoints" / "best" / "export"
    kept = torch.load(result.export / "state.pt")
    judged_at_4 = torch.load(tmp_path / "checkpoints" / "step_0000004" / "export" / "state.pt")
    assert all(torch.equal(kept[k], judged_at_4[k]) for k in kept)  # step 4's weights
    assert [(r["step"], r["eval/tau"]) for r in read_metrics(tmp_path) if "eval/tau" in r] == [
        (2, 1.4), (4, 1.9), (6, 1.7)]


def test_keep_best_loss_and_last(tmp_path):
    result, _ = run(tmp_path / "loss", eval_every=2, keep_best="loss")
    losses = {r["step"]: r["eval/loss"] for r in read_metrics(tmp_path / "loss")
              if "eval/loss" in r}
    assert result.best.step == min(losses, key=losses.get)
    last, _ = run(tmp_path / "last", eval_every=2)
    assert last.best is None and last.export == last.checkpoint / "export"


def test_a_resumed_run_keeps_the_best_it_had(tmp_path):
    judge, _ = scripted_judge({2: 2.5, 4: 1.1, 6: 1.2})
    stopped, _ = run(tmp_path, judge=judge, eval_every=2, keep_best="tau", stop_after=4)
    assert stopped.best.step == 2 and not stopped.finished
    judge, calls = scripted_judge({2: 0.0, 4: 0.0, 6: 1.2})  # resumed: only step 6 is judged
    resumed, _ = run(tmp_path, judge=judge, eval_every=2, keep_best="tau", resume=True)
    assert resumed.finished and len(calls) == 1
    assert (resumed.best.step, resumed.best.value) == (2, 2.5)
    assert [step for step, _ in resumed.best.history] == [2, 4, 6]


def test_training_stops_after_evaluations_without_a_gain(tmp_path):
    judge, calls = scripted_judge({2: 1.5, 4: 1.4, 6: 1.3, 8: 1.9, 10: 2.0, 12: 2.1})
    result, _ = run(tmp_path, judge=judge, eval_every=2, keep_best="tau", max_steps=12,
                    stop_after_no_gain=2)
    assert len(calls) == 3 and result.step == 6 and result.finished  # no gain at 4 and 6
    assert result.best.step == 2 and result.checkpoint.name == "step_0000006"


def test_judging_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="trainer.keep_best must be one of last, loss, tau"):
        TrainSettings(run_dir=str(tmp_path), max_steps=2, keep_best="accuracy")
    with pytest.raises(ValueError, match="stop_after_no_gain .* needs trainer.keep_best"):
        TrainSettings(run_dir=str(tmp_path), max_steps=2, stop_after_no_gain=2)
    with pytest.raises(ValueError, match="keep_best=tau needs held-out tau"):
        run(tmp_path, eval_every=2, keep_best="tau")


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    whole, _ = run(tmp_path / "whole")
    stopped, _ = run(tmp_path / "split", stop_after=3)  # step 3 ran after the last save: lost
    assert stopped.step == 3 and stopped.checkpoint.name == "step_0000002"
    resumed, _ = run(tmp_path / "split", resume=True)
    assert resumed.step == 6
    a = torch.load(whole.checkpoint / "export" / "state.pt")
    b = torch.load(resumed.checkpoint / "export" / "state.pt")
    assert a.keys() == b.keys() and all(k.startswith("heads.") for k in a)
    # Exact: one process and thread count, so the resumed run repeats the same float operations
    # on bit-identical restored state (a tolerance would mean little: Adam turns any rounding
    # difference into steps of ~lr).
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2, 3, 4, 5, 6]
    losses = [r["loss"] for r in read_metrics(tmp_path / "whole")]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "split")]


def test_a_fresh_run_refuses_a_folder_that_holds_another_runs_checkpoints(tmp_path):
    run(tmp_path, max_steps=2)
    with pytest.raises(SelfspecError, match="holds an earlier run's checkpoints: resume it "
                                            "with trainer.resume=true, or train into an empty"):
        run(tmp_path, max_steps=4)
    AcceleratorState._reset_state(True)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # its record kept, unmixed
    with pytest.raises(SelfspecError, match="holds an earlier run's checkpoints"):
        record_run_config(tmp_path, {"trainer": {"max_steps": 4}}, resume=False)
    assert not (tmp_path / RUN_CONFIG).exists()  # refused before any config is written
    assert run(tmp_path, max_steps=4, resume=True)[0].step == 4


def test_checkpoints_hold_the_head_not_the_frozen_target(tmp_path):
    result, _ = run(tmp_path, max_steps=2)
    weights = load_file(result.checkpoint / "model.safetensors")
    assert weights and all(name.startswith("heads.") for name in weights)


def counting_rows(n: int, seed: int, length: int = 24) -> TokenRows:
    """Rows that count up (mod 64) from a random start: what follows a token is learnable."""
    starts = torch.randint(64, (n, 1), generator=torch.Generator().manual_seed(seed))
    tokens = (starts + torch.arange(length)) % 64
    return TokenRows(tokens, torch.ones_like(tokens))


def test_training_lowers_the_training_and_the_heldout_loss(tmp_path):
    settings = TrainSettings(run_dir=str(tmp_path), max_steps=24, micro_batch_size=4, lr=3e-2,
                             log_every=1, eval_every=8, save_every=24)
    fit(objective(), counting_rows(32, seed=2), counting_rows(8, seed=3), settings,
        accelerator=make_accelerator(settings), tracker=Tracker(tmp_path, use_wandb=False))
    records = read_metrics(tmp_path)
    train = [r["loss"] for r in records if "loss" in r]
    heldout = [r["eval/loss"] for r in records if "eval/loss" in r]
    # measured: training 7.57 to 1.86, held-out 4.57 (step 8) to 3.43 (step 24)
    assert len(train) == 24 and train[-1] < 0.5 * train[0], train
    assert len(heldout) == 3 and heldout[-1] < 0.9 * heldout[0], heldout


@pytest.mark.parametrize("damage", ["cut_short", "file_missing", "never_marked"])
def test_a_damaged_newest_checkpoint_is_skipped_and_resume_stays_exact(tmp_path, caplog, damage):
    whole, _ = run(tmp_path / "whole")
    run(tmp_path / "split", stop_after=4)  # checkpoints at steps 2 and 4
    newest = tmp_path / "split/checkpoints/step_0000004"
    weights = newest / "model.safetensors"
    if damage == "cut_short":  # e.g. a copy of the run folder that stopped half-way
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "file_missing":
        weights.unlink()
    else:  # the process died while saving: no COMPLETE marker yet
        (newest / "COMPLETE").unlink()
    assert checkpoint_problem(newest) is not None
    with caplog.at_level(logging.WARNING, logger="selfspec.training.checkpoints"):
        resumed, _ = run(tmp_path / "split", resume=True)
    assert f"skipping checkpoint {newest}" in caplog.text
    assert resumed.step == 6
    a = torch.load(whole.checkpoint / "export" / "state.pt")
    b = torch.load(resumed.checkpoint / "export" / "state.pt")
    for key in a:  # resumed from step 2: steps 3 and 4 ran again, the same way
        assert torch.equal(a[key], b[key]), key


def test_a_complete_checkpoint_lists_its_files_and_sizes(tmp_path):
    result, _ = run(tmp_path, max_steps=2)
    manifest = json.loads((result.checkpoint / "COMPLETE").read_text())
    assert manifest["step"] == 2 and "model.safetensors" in manifest["files"]
    assert manifest["files"]["model.safetensors"] == (
        result.checkpoint / "model.safetensors").stat().st_size
    assert checkpoint_problem(result.checkpoint) is None


class BlowsUpAtStep(torch.nn.Module):
    """Wraps an objective; its loss turns NaN from the given step on."""

    def __init__(self, inner, step: int):
        super().__init__()
        self.inner, self.step, self.calls = inner, step, 0

    def forward(self, tokens, loss_mask) -> LossOutput:
        self.calls += 1
        out = self.inner(tokens, loss_mask)
        return LossOutput(out.loss * float("nan"), out.metrics) if self.calls >= self.step else out


def test_a_non_finite_loss_stops_training_and_names_the_step(tmp_path):
    settings = TrainSettings(run_dir=str(tmp_path), max_steps=6, micro_batch_size=4, save_every=2)
    with pytest.raises(NonFiniteLoss, match="step 4.*step_0000002"):
        fit(BlowsUpAtStep(objective(), 4), rows(), None, settings,
            accelerator=make_accelerator(settings))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002"]


LOG_THREE_STEPS = """
import sys
from selfspec.tracking import Tracker
tracker = Tracker(sys.argv[1], project="selfspec-test", config={"lr": 0.1})
for step in range(1, 4):
    tracker.log({"loss": 1.0 / step, "medusa/head0_top1": 0.25 * step}, step=step)
tracker.finish()
"""


@pytest.mark.skipif(not HAS_WANDB, reason="needs wandb")
def test_offline_wandb_and_the_json_lines_file_hold_the_same_numbers(tmp_path):
    # A process of its own, as a training run is: W&B's service finishes writing at exit.
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-c", LOG_THREE_STEPS, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    raw = runs[0].read_bytes()  # W&B's record log: the scalars are stored as JSON text
    for record in records:
        for key, value in record.items():
            assert key.encode() in raw and json.dumps(value).encode() in raw


def _torchrun(run_dir: Path, micro_batch: int, zero: str, processes: int, version: int = 1):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", str(TESTS / "distributed_fit.py"),
               str(run_dir), str(micro_batch), zero, str(version)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = max(1, suite_threads() // processes)
    for rank in range(processes):  # the processes share the suite's threads
        with safe_open(run_dir / f"rank{rank}.safetensors", "pt") as weights:
            assert weights.metadata()["torch_threads"] == str(threads)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    _torchrun(run_dir, micro_batch=4, zero="none", processes=1)
    return run_dir


def fit_rates(version: int) -> tuple[tuple[float, float], list[list[float]]]:
    """Adam's betas in distributed_fit.py's runs, and each step's learning rate per param
    group (the heads first, then any adapters), as `fit` schedules them."""
    settings = distributed_fit.settings("unused", micro_batch=4)
    optimizer, schedule = _optimizer_and_schedule(distributed_fit.objective(version), settings)
    rates = [[base * rate(step) for base, rate in zip(schedule.base_lrs, schedule.lr_lambdas,
                                                      strict=True)]
             for step in range(settings.max_steps)]
    return optimizer.defaults["betas"], rates


def assert_matches_one_process(run_dir: Path, single: Path, version: int = 1) -> None:
    """Same losses as one process with the same global batch, every rank holds the same trained
    weights, and these are the one process's as far as Adam and float rounding allow."""
    expected = [r["loss"] for r in read_metrics(single)]
    got = [r["loss"] for r in read_metrics(run_dir)]
    # rel=1e-5 holds to first order although a few weights may differ by ~lr: Adam moves an
    # element differently in the two runs only where its gradient was ~0, so the loss barely
    # sees it.
    assert len(got) == 4 and got == pytest.approx(expected, rel=1e-5)
    ranks = [load_file(run_dir / f"rank{r}.safetensors") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    for name, tensor in ranks[0].items():  # the ranks apply one and the same update
        assert torch.equal(ranks[1][name], tensor), name
    betas, rates = fit_rates(version)
    reference = load_file(single / "rank0.safetensors")
    assert_same_adam_training(ranks[0], reference, [max(r) for r in rates], betas)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
@pytest.mark.slow
def test_deepspeed_on_two_processes_matches_one_process(tmp_path, single_process_run, zero):
    _torchrun(tmp_path, micro_batch=2, zero=zero, processes=2)  # same global batch of 4 rows
    assert_matches_one_process(tmp_path, single_process_run)


def exported_adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run_dir / f"checkpoints/step_{step:07d}/export/adapter"
    return load_file(folder / "adapter_model.safetensors")


def first_halves(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an export of one rank's ZeRO-3 shard alone would hold: each tensor's second half
    zero."""
    out = {}
    for name, tensor in weights.items():
        flat = tensor.flatten().clone()
        flat[flat.numel() // 2:] = 0
        out[name] = flat.view_as(tensor)
    return out


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
@pytest.mark.slow
def test_medusa2_under_zero3_on_two_processes_matches_one_process(tmp_path):
    """Partitioned adapters, the adapter-disabled teacher pass and the gathered adapter export."""
    single, double = tmp_path / "single", tmp_path / "double"
    _torchrun(single, micro_batch=4, zero="none", processes=1, version=2)
    _torchrun(double, micro_batch=2, zero="zero3", processes=2, version=2)
    assert_matches_one_process(double, single, version=2)
    expected, got = exported_adapter(single, 4), exported_adapter(double, 4)
    assert len(expected) == 2 * 2 * 7
    assert any("lora_B" in n and t.abs().sum() > 0 for n, t in got.items())
    betas, rates = fit_rates(version=2)
    adapter_rates = [r[1] for r in rates]
    assert_same_adam_training(got, expected, adapter_rates, betas)
    # The same comparison rejects an export one step stale and one of a single rank's shard.
    for fault in (exported_adapter(double, 3), first_halves(got)):
        with pytest.raises(AssertionError):
            assert_same_adam_training(fault, expected, adapter_rates, betas)


def test_a_time_budget_ends_the_run_with_an_evaluation_and_a_checkpoint(tmp_path):
    """trainer.max_minutes: the first step past the budget is evaluated, saved, and the run
    finishes; the minutes count training only (the judge's time is paused out)."""
    naps = []

    def slow_judge(folder: Path) -> dict[str, float]:
        time.sleep(0.2)
        naps.append(0.2)
        return {"eval/tau": 1.0 + len(naps) / 100}

    start = time.monotonic()
    result, _ = run(tmp_path, judge=slow_judge, eval_every=5, keep_best="tau",
                    max_steps=100_000, max_minutes=0.01)
    wall = time.monotonic() - start
    records = read_metrics(tmp_path)
    assert result.finished and result.step < 100_000
    assert records[-1]["step"] == result.step and "eval/tau" in records[-1]
    assert result.checkpoint.name == f"step_{result.step:07d}"
    assert records[-1]["minutes"] >= 0.01 > records[-2]["minutes"]
    assert records[-1]["minutes"] * 60 <= wall - sum(naps) + 0.05


def test_a_time_budget_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.max_minutes must be > 0 \(or null\), got 0"):
        TrainSettings(run_dir=str(tmp_path), max_steps=2, max_minutes=0)


@pytest.mark.slow
def test_trained_medusa_heads_beat_untrained_ones_on_held_out_code(tmp_path):
    """Heads trained by `fit` on the shipped tiny target's own continuations of training files
    (a minute on one core) keep more of its greedy tokens on held-out stdlib files than the
    untrained heads they start from (copies of its LM head) do."""
    from transformers import AutoTokenizer

    from selfspec import generate
    from selfspec.corpus import stdlib_files
    from selfspec.drafters import MedusaDrafter
    from selfspec.measure.prompts import stdlib_heldout_prompts
    from selfspec.metrics import GenerationStats
    from selfspec.training.data import pack_token_stream, self_distill_rows, token_stream

    tiny = TESTS.parent / "selfspec" / "assets" / "tiny" / "target"
    target, tokenizer = Transformer.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    windows = pack_token_stream(token_stream(tokenizer, stdlib_files("train")[:80],
                                             max_tokens=96 * 96), 96)  # [96, 96]
    rows = self_distill_rows(TokenRows(windows, torch.ones_like(windows)), target,
                             prompt_tokens=32)
    config = MedusaConfig(target.config.hidden_size, target.config.vocab_size, num_heads=3)
    heads = MedusaHeads(config).init_from_lm_head(target.lm_head.weight.detach())
    untrained = MedusaHeads(config).init_from_lm_head(target.lm_head.weight.detach())
    settings = TrainSettings(run_dir=str(tmp_path), max_steps=80, micro_batch_size=8, lr=1e-2,
                             log_every=1, save_every=80, eval_every=40, eval_rows=16)
    fit(MedusaObjective(target, heads), rows.select(torch.arange(80)),
        rows.select(torch.arange(80, 96)), settings, accelerator=make_accelerator(settings),
        tracker=Tracker(tmp_path, use_wandb=False))
    heldout = [r["eval/loss"] for r in read_metrics(tmp_path) if "eval/loss" in r]

    def tau(trained: MedusaHeads) -> float:
        stats = GenerationStats()
        for prompt in stdlib_heldout_prompts(6, 12):
            ids = tokenizer(prompt.text)["input_ids"][-64:]
            drafter = MedusaDrafter(trained.eval(), [[0], [0, 0], [0, 0, 0]])
            stats.merge(generate(target, ids, drafter=drafter, max_new_tokens=48).stats)
        return stats.tau

    trained_tau, untrained_tau = tau(heads), tau(untrained)
    # measured: held-out loss 6.42 to 6.04, tau 2.10 against 1.02
    assert heldout[-1] < 0.97 * heldout[0], heldout
    assert trained_tau > untrained_tau + 0.5, (trained_tau, untrained_tau)


def test_epochs_set_the_steps_and_evaluate_at_the_end_of_each_pass(tmp_path):
    """trainer.epochs: 32 rows in steps of 4 are 8 steps a pass; 2.5 passes are 20 steps, each
    pass ends with an evaluation and a checkpoint, and every step logs its passes."""
    result, exported = run(tmp_path, epochs=2.5, max_steps=1, eval_every=1, save_every=1)
    records = read_metrics(tmp_path)
    assert result.step == 20 and result.finished
    assert [r["step"] for r in records if "eval/loss" in r] == [8, 16, 20]
    assert [r["epochs"] for r in records if "eval/loss" in r] == [1.0, 2.0, 2.5]
    assert [folder.parent.name for folder in exported] == [
        "step_0000008", "step_0000016", "step_0000020"]
    with pytest.raises(ValueError, match=r"trainer.epochs must be > 0 \(or null\), got 0"):
        TrainSettings(run_dir=str(tmp_path), max_steps=2, epochs=0)


def test_fit_steps_with_the_fused_adamw_that_moves_weights_as_the_plain_one(tmp_path):
    """The one-kernel AdamW `fit` takes (not under DeepSpeed) makes the plain AdamW's update:
    one step from the same gradients gives the same weights to float rounding."""
    settings = distributed_fit.settings("unused", micro_batch=4)
    twins = [objective(), objective()]
    optimizers = [_optimizer_and_schedule(twin, settings, fused=fused)[0]
                  for twin, fused in zip(twins, (False, True), strict=True)]
    assert [o.defaults["fused"] for o in optimizers] == [None, True]
    batch = rows(4)
    for twin, optimizer in zip(twins, optimizers, strict=True):
        twin(batch.tokens, batch.loss_mask).loss.backward()
        optimizer.step()
    moved = [dict(twin.named_parameters()) for twin in twins]
    start = dict(objective().named_parameters())
    for name, param in moved[1].items():
        if param.requires_grad:
            assert not torch.equal(param, start[name]), name
            torch.testing.assert_close(param, moved[0][name], rtol=1e-6, atol=1e-7)
