"""Head checkpoints (heads/io.py): Medusa, EAGLE and exit heads round-trip; wrong ones refused."""

import json

import pytest
import torch
from helpers import (
    EAGLE3_LAYERS,
    eagle_head_config,
    random_eagle_head,
    random_exit,
    random_medusa_heads,
    reduced_medusa_heads,
    tiny_llama,
)

from selfspec import Transformer
from selfspec.heads import (
    EagleConfig,
    EagleHead,
    ExitConfig,
    ExitHead,
    MedusaConfig,
    MedusaHeads,
    describe_target,
    load_head,
    save_head,
)

# ---- Medusa ----------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, target):
    config = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2)
    heads = random_medusa_heads(config, 5)
    save_head(tmp_path / "medusa", heads, heads.config, describe_target(target))
    return tmp_path / "medusa", heads


def test_a_medusa_checkpoint_round_trips(saved, target):
    folder, heads = saved
    meta = json.loads((folder / "head_config.json").read_text())
    assert meta["head_type"] == "MedusaHeads"
    assert meta["config"] == {"hidden_size": 32, "vocab_size": 64, "num_heads": 3, "num_layers": 2,
                              "draft_vocab_size": None, "shared_lm_head": False}
    assert meta["target"]["hidden_size"] == 32 and meta["target"]["num_layers"] == 2
    loaded = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    assert loaded.config == heads.config
    assert loaded.state_dict().keys() == heads.state_dict().keys()
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(3, 32)
    assert torch.equal(loaded(hidden), heads(hidden))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden": 48}, r"hidden_size 32 \(checkpoint target\) vs 48 \(this target\)"),
        ({"vocab": 80}, r"vocab_size 64 \(checkpoint target\) vs 80 \(this target\)"),
    ],
)
def test_a_medusa_checkpoint_for_another_target_is_refused(saved, kwargs, message):
    other = Transformer.from_hf(tiny_llama(6, layers=2, **kwargs))
    with pytest.raises(ValueError, match=f"trained for another target.*{message}.*Load the head"):
        load_head(saved[0], MedusaHeads, MedusaConfig, target=other)


def test_missing_checkpoint_files_are_clear_errors(saved, tmp_path, target):
    with pytest.raises(FileNotFoundError, match="head checkpoint folder not found"):
        load_head(tmp_path / "nowhere", MedusaHeads, MedusaConfig, target=target)
    (saved[0] / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_head(saved[0], MedusaHeads, MedusaConfig, target=target)


def test_a_checkpoint_of_another_head_type_is_refused(saved, target):
    class OtherHeads(MedusaHeads):
        pass

    with pytest.raises(ValueError, match="holds a 'MedusaHeads' head, not 'OtherHeads'"):
        load_head(saved[0], OtherHeads, MedusaConfig, target=target)


def test_a_reduced_checkpoint_round_trips_with_its_vocabulary(tmp_path, target):
    heads = reduced_medusa_heads(target, [3, 5, 40, 41])
    save_head(tmp_path / "m", heads, heads.config, describe_target(target))
    loaded = load_head(tmp_path / "m", MedusaHeads, MedusaConfig, target=target)
    assert loaded.config.draft_vocab_size == 4
    assert loaded.draft_vocab.target_ids.tolist() == [3, 5, 40, 41]
    hidden = torch.randn(2, target.config.hidden_size)
    assert torch.equal(loaded(hidden), heads(hidden))


# ---- EAGLE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 3])
def test_an_eagle_checkpoint_round_trips(tmp_path, target, version):
    head = random_eagle_head(eagle_head_config(target, version), seed=5)
    save_head(tmp_path / "eagle", head, head.config, describe_target(target))
    meta = json.loads((tmp_path / "eagle" / "head_config.json").read_text())
    assert meta["head_type"] == "EagleHead" and meta["config"]["version"] == version
    if version == 3:
        assert meta["config"]["draft_vocab_size"] == 48
        assert meta["config"]["target_hidden_size"] == 32
        assert meta["config"]["target_layers"] == list(EAGLE3_LAYERS)
    loaded = load_head(tmp_path / "eagle", EagleHead, EagleConfig, target=target)
    assert loaded.config == head.config
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    embeds, feature = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    positions = torch.arange(4)
    assert torch.equal(loaded(embeds, feature, positions), head(embeds, feature, positions))


@pytest.mark.parametrize("kwargs, message", [
    ({"hidden": 48}, r"hidden_size 32 \(checkpoint target\) vs 48 \(this target\)"),
    ({"layers": 1}, r"need layers \[2\], which a 1-layer target does not have"),
])
def test_an_eagle_checkpoint_for_another_target_is_refused(tmp_path, target, kwargs, message):
    head = random_eagle_head(eagle_head_config(target, 3), seed=5)
    info = describe_target(target)
    info.pop("num_layers")  # so that the fused layers alone tell the targets apart
    save_head(tmp_path / "eagle", head, head.config, info)
    other = Transformer.from_hf(tiny_llama(6, **kwargs))
    with pytest.raises(ValueError, match=f"trained for another target.*{message}"):
        load_head(tmp_path / "eagle", EagleHead, EagleConfig, target=other)


# ---- early exit ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target4() -> Transformer:
    """A 4-layer toy target, so that an exit E can be 1, 2 or 3."""
    return Transformer.from_hf(tiny_llama(0, layers=4))


@pytest.mark.parametrize("kind", ["norm", "adapter"])
def test_an_exit_checkpoint_round_trips(tmp_path, target4, kind):
    head = random_exit(target4, 2, kind)
    save_head(tmp_path / "exit", head, head.config, describe_target(target4))
    meta = json.loads((tmp_path / "exit" / "head_config.json").read_text())
    assert meta["head_type"] == "ExitHead" and meta["config"]["exit_layer"] == 2
    loaded = load_head(tmp_path / "exit", ExitHead, ExitConfig, target=target4)
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(1, 3, 32)
    with torch.no_grad():
        assert torch.equal(loaded.logits(hidden, torch.arange(3), target4),
                           head.logits(hidden, torch.arange(3), target4))


def test_an_exit_checkpoint_for_another_target_or_another_e_is_refused(tmp_path, target4):
    from selfspec.from_config.methods.early_exit import load_early_exit

    head = random_exit(target4, 2, "adapter")
    save_head(tmp_path / "exit", head, head.config, describe_target(target4))
    other = Transformer.from_hf(tiny_llama(6, layers=2))
    with pytest.raises(ValueError, match=r"trained for another target.*num_layers 4"):
        load_head(tmp_path / "exit", ExitHead, ExitConfig, target=other)
    assert load_early_exit(tmp_path / "exit", target4, exit_layer=2).exit_layer == 2
    with pytest.raises(ValueError, match=r"exits at layer E=2, not E=3"):
        load_early_exit(tmp_path / "exit", target4, exit_layer=3)
