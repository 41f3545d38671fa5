"""FastMTP's objective (`MtpObjective`): only the target's MTP module trains (a NextN module's
LM head and the whole rest of the target stay put), a few steps lower its loss against the
target's law, trainer.objective chooses the divergence, and the trainer's export round trips
through the checkpoint layout."""

import pytest
import torch
from helpers import adam_fit
from mtp_reference import mtp_target
from omegaconf import OmegaConf
from safetensors import safe_open

from selfspec.divergences import divergence
from selfspec.drafters.mtp import MtpHead
from selfspec.from_config.methods import mtp as method
from selfspec.from_config.methods.mtp import MtpObjective
from selfspec.from_config.training import TrainingRun
from selfspec.training.rows import TokenRows

ROWS = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))


def objective_over(layout: str, **options) -> MtpObjective:
    target = mtp_target(layout, seed=3)
    return MtpObjective(target, MtpHead(target), **options)


def trainable_names(objective: MtpObjective) -> set[str]:
    return {n for n, p in objective.target.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", ["nextn", "mtp"])
def test_only_the_module_changes_and_its_loss_falls(layout):
    objective = objective_over(layout)
    before = {n: p.detach().clone() for n, p in objective.target.named_parameters()}
    mask = torch.ones_like(ROWS, dtype=torch.bool)
    first = objective(ROWS, mask)
    params = [p for p in objective.parameters() if p.requires_grad]
    last = adam_fit(lambda: objective(ROWS, mask), params, steps=15, lr=3e-3)
    assert float(last.loss.detach()) < 0.8 * float(first.loss.detach())
    changed = {n for n, p in objective.target.named_parameters()
               if not torch.equal(p, before[n])}
    assert changed == trainable_names(objective)
    assert changed and all(n.startswith("mtp.0.") and not n.startswith("mtp.0.head.")
                           for n in changed)
    assert any(n.startswith("mtp.0.block.") for n in changed)


def test_its_loss_is_the_chosen_divergence_to_the_targets_next_next_law():
    objective = objective_over("mtp", objective="tv")
    target = objective.target
    mask = torch.ones_like(ROWS, dtype=torch.bool)
    with torch.no_grad():
        out = target(ROWS, torch.arange(ROWS.shape[1]))
        states = target.mtp_forward(0, target.embed_tokens(ROWS[:, 1:]), out.last_hidden[:, :-1],
                                    torch.arange(ROWS.shape[1] - 1))
        mine = target.mtp_logits(0, states[:, :-1])  # [B, T-2, V] token t+2's law at row t
        teacher = torch.log_softmax(out.logits[:, 1:-1].float(), -1)  # the target's at t+1
        expected = divergence("tv")(mine, teacher).mean()
        assert torch.allclose(objective(ROWS, mask).loss, expected, atol=1e-5)


@pytest.mark.parametrize(("layout", "key"), [
    ("nextn", "model.layers.2.eh_proj.weight"),  # NextN's place: layer L
    ("mtp", "mtp.fc.weight"), ("mimo", "model.mtp_layers.0.input_proj.weight")])
def test_the_export_holds_the_trained_module_in_the_checkpoint_layout(tmp_path, layout, key):
    target = mtp_target(layout, seed=4)
    cfg = OmegaConf.create({"seed": 0, "mtp": {"add_module": None, "depth": 2},
                            "trainer": {"objective": "kl"}})
    run = TrainingRun(cfg, target, None, TokenRows(ROWS, torch.ones_like(ROWS)),
                      method.trainable_module(cfg, target, None))
    objective = method.objective(run, None)
    trained = {n: torch.full_like(p, 0.5) for n, p in objective.named_parameters()
               if p.requires_grad}
    method.exporter(run, objective)(trained, tmp_path)
    fresh = mtp_target(layout, seed=9)  # other MTP weights: the export's replace them
    method.load_module(fresh, tmp_path)
    for name, param in fresh.mtp.named_parameters(prefix="mtp"):
        kept = target.state_dict()[name] if name.startswith("mtp.0.head.") else 0.5
        assert torch.allclose(param, torch.as_tensor(kept)), name
    assert (tmp_path / "config.json").is_file()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert key in handle.keys()


def test_a_target_without_modules_is_refused_unless_one_is_added():
    target = mtp_target("nextn", modules=0)
    with pytest.raises(ValueError, match="mtp.add_module"):
        method.with_module(OmegaConf.create({"seed": 0, "mtp": {}}), target)
    added = method.with_module(OmegaConf.create({"seed": 0, "mtp": {"add_module": "nextn"}}),
                               target)
    assert added.config.mtp_layout == "nextn"
    assert torch.equal(added.mtp[0].head.weight, added.lm_head.weight)
    with pytest.raises(ValueError, match="mtp.add_module must be"):
        method.added_layout(OmegaConf.create({"mtp": {"add_module": "medusa"}}))


def test_its_recursive_steps_read_their_own_outputs_and_weigh_by_decay():
    once, twice = objective_over("mtp"), objective_over("mtp", steps=2, decay=0.5)
    target, mask = twice.target, torch.ones_like(ROWS, dtype=torch.bool)
    mask[0, :6] = False  # a prompt's tokens do not count
    with torch.no_grad():
        first, out = once(ROWS, mask), twice(ROWS, mask)
        assert out.metrics["mtp/step1_loss"] == pytest.approx(float(first.loss), abs=1e-5)
        full = target(ROWS, torch.arange(ROWS.shape[1]))
        states = target.mtp_forward(0, target.embed_tokens(ROWS[:, 1:]),
                                    full.last_hidden[:, :-1], torch.arange(ROWS.shape[1] - 1))
        deeper = target.mtp_forward(0, target.embed_tokens(ROWS[:, 2:]), states[:, :-1],
                                    torch.arange(ROWS.shape[1] - 2))
        mine = target.mtp_logits(0, deeper[:, :-1])  # [B, T-3, V] token t+3's law at row t
        teacher = torch.log_softmax(full.logits[:, 2:-1].float(), -1)  # the target's at t+2
        counted = mask[:, 3:]
        second = divergence("kl")(mine, teacher)[counted].mean()
        assert out.metrics["mtp/step2_loss"] == pytest.approx(float(second), abs=1e-5)
        assert float(out.loss) == pytest.approx((float(first.loss) + 0.5 * float(second)) / 1.5,
                                                abs=1e-5)
    with pytest.raises(ValueError, match="steps"):
        objective_over("mtp", steps=0)


@pytest.mark.parametrize("steps", [1, 2])
def test_cached_target_states_give_the_same_loss(steps):
    online = objective_over("nextn", steps=steps)
    cached = objective_over("nextn", steps=steps, cache_features=True)
    mask = torch.ones_like(ROWS, dtype=torch.bool)
    with torch.no_grad():
        expected = online(ROWS, mask).loss
        for _ in range(2):  # the second reads the cache
            assert torch.allclose(cached(ROWS, mask).loss, expected, atol=1e-6)
