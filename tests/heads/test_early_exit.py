"""Early-exit heads (heads/early_exit.py): the norm exit, the adapter, exit layers refused."""

import pytest
import torch
from helpers import tiny_llama

from selfspec import Transformer
from selfspec.heads import ExitConfig, ExitHead

LAYERS = 4


@pytest.fixture(scope="module")
def target() -> Transformer:
    """A 4-layer toy target, so that E can be 1, 2 or 3."""
    return Transformer.from_hf(tiny_llama(0, layers=LAYERS))


def test_the_norm_exit_is_the_targets_own_early_exit(target):
    head = ExitHead(ExitConfig.for_target(target.config, 2, "norm"))
    assert dict(head.named_parameters()) == {}
    tokens, positions = torch.tensor([[3, 9, 4, 7]]), torch.arange(4)
    with torch.no_grad():
        early = target(tokens, positions, exit_layer=2, return_hidden=(2,))
        logits = head.logits(early.hidden[0], positions, target)
    torch.testing.assert_close(logits, early.logits)


def test_an_adapter_starts_as_the_norm_exit_and_has_no_mlp(target):
    head = ExitHead(ExitConfig.for_target(target.config, 2)).init_from_target(target)
    names = {name.split(".")[0] for name, _ in head.named_parameters()}
    assert names == {"input_layernorm", "self_attn", "norm"}
    hidden = torch.randn(1, 5, 32)
    norm = ExitHead(ExitConfig.for_target(target.config, 2, "norm"))
    with torch.no_grad():
        torch.testing.assert_close(head.logits(hidden, torch.arange(5), target),
                                   norm.logits(hidden, torch.arange(5), target))


@pytest.mark.parametrize("exit_layer", [0, LAYERS, -1, 2.5])
def test_an_exit_layer_outside_1_to_l_is_refused(target, exit_layer):
    with pytest.raises(ValueError, match=r"exit layer E must be an integer in \[1, 4\)"):
        ExitConfig.for_target(target.config, exit_layer)
