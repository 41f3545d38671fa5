"""The DFlash head (heads/dflash.py): the references' layer spacing, the block mask of training
(a block sees the context before its anchor and itself, nothing else), training blocks that
equal drafting blocks, its checkpoint, and clear errors."""

import pytest
import torch
from helpers import dflash_head_config, random_dflash_head

from selfspec.from_config.methods.dflash import DFlashObjective, anchor_blocks
from selfspec.heads import DFlashConfig, DFlashHead, describe_target, load_head, save_head
from selfspec.heads.dflash import default_target_layers
from selfspec.model.kv_cache import KVCache


def test_default_target_layers_follow_the_references_spacing():
    # The references fuse the outputs of layers 1 .. L-3 (36 layers, 5 streams: 1, 9, 17, 25,
    # 33); ours count layers run, one more.
    assert default_target_layers(36, 5) == (2, 10, 18, 26, 34)
    assert default_target_layers(8, 3) == (2, 4, 6)
    assert default_target_layers(28, 1) == (15,)  # one stream: the middle layer's output
    assert default_target_layers(2, 3) == (2, 2, 2)  # never past the last layer


@pytest.fixture(scope="module")
def objective(target):
    head = random_dflash_head(dflash_head_config(target, block_size=4, num_layers=2), seed=5,
                              std=0.3)
    return DFlashObjective(target, head, anchors=5).eval()


def rows(seed: int, length: int = 24) -> torch.Tensor:
    return torch.randint(2, 63, (2, length), generator=torch.Generator().manual_seed(seed))


def block_logits(objective, tokens, blocks) -> torch.Tensor:
    with torch.no_grad():
        return objective.block_logits(objective.block_features(tokens), blocks)  # [B, A, K, V]


def test_a_block_sees_the_context_before_its_anchor_and_itself_alone(objective):
    tokens, mask = rows(0), torch.ones(2, 24, dtype=torch.bool)
    blocks = anchor_blocks(tokens, mask, objective.head.config, 5,
                           torch.Generator().manual_seed(1))
    anchors = blocks.positions.view(2, 5, -1)[..., 0]  # [B, A]
    base = block_logits(objective, tokens, blocks)
    first = int(anchors[0].argmin())
    a = int(anchors[0, first])
    later = anchors[0] > a + 1
    assert later.any()
    # Every token after the anchor (they change the target's streams there, and any other
    # block's anchor token) leaves the block as it is, and moves the blocks after them.
    after = tokens.clone()
    after[0, a + 1:] = (after[0, a + 1:] + 7) % 60 + 2
    moved = block_logits(objective, after, anchor_blocks(after, mask, objective.head.config, 5,
                                                         torch.Generator().manual_seed(1)))
    torch.testing.assert_close(moved[0, first], base[0, first], atol=1e-5, rtol=1e-5)
    assert all((moved[0, j] - base[0, j]).abs().max() > 1e-3 for j in later.nonzero().flatten())
    torch.testing.assert_close(moved[1], base[1], atol=1e-5, rtol=1e-5)  # another row
    # A token before the anchor, or the anchor's own, does move it: the test can fail.
    for position in (a - 1, a):
        changed = tokens.clone()
        changed[0, position] = (changed[0, position] + 7) % 60 + 2
        again = anchor_blocks(changed, mask, objective.head.config, 5,
                              torch.Generator().manual_seed(1))
        assert (block_logits(objective, changed, again)[0, first] - base[0, first]).abs().max() \
            > 1e-3
    # Another block's slots: its anchor token swapped in place leaves every other block alone.
    other = int((first + 1) % 5)
    swapped = blocks.tokens.clone()
    swapped[0, other * 4] = (swapped[0, other * 4] + 7) % 60 + 2
    moved = block_logits(objective, tokens, type(blocks)(**{**blocks.__dict__, "tokens": swapped}))
    for j in range(5):
        if j == other:
            assert (moved[0, j] - base[0, j]).abs().max() > 1e-3
        else:
            torch.testing.assert_close(moved[0, j], base[0, j], atol=1e-5, rtol=1e-5)


def test_a_training_block_equals_the_block_a_drafter_runs(objective, target):
    """The training forward (all positions' context keys ahead, the block mask) gives the
    logits of drafting's forward (the committed context written into a cache, then the block
    over every slot), at the anchor the drafter stands at."""
    tokens = rows(3)[:1]
    anchor = 13
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[0, anchor + 1] = True  # the one anchor allowed
    blocks = anchor_blocks(tokens, mask, objective.head.config, 1, None)
    assert int(blocks.positions[0, 0]) == anchor
    training = block_logits(objective, tokens, blocks)[0, 0]  # [K, V]
    head, config = objective.head, objective.head.config
    cache = KVCache(config.num_layers, 1, config.num_kv_heads, 64, config.head_dim)
    with torch.no_grad():
        streams = target(tokens[:, :anchor], torch.arange(anchor),
                         return_hidden=config.target_layers).hidden
        head.write_context(head.context(streams), torch.arange(anchor), cache)
        block = blocks.tokens[:, :config.block_size]
        hidden = head(target.embed_tokens(block), anchor + torch.arange(config.block_size), cache)
        drafting = head.logits(hidden[0, 1:], target.lm_head)
    torch.testing.assert_close(training, drafting, atol=1e-5, rtol=1e-5)


def test_the_head_saves_and_loads_bit_for_bit(tmp_path, target):
    config = dflash_head_config(target, num_layers=2, draft_vocab_size=40)
    head = random_dflash_head(config, seed=2)
    folder = save_head(tmp_path / "head", head, config, describe_target(target))
    loaded = load_head(folder, DFlashHead, DFlashConfig, target=target)
    assert loaded.config == config
    assert loaded.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    assert {"layers.1.self_attn.q_norm.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(head.state_dict())


@pytest.mark.parametrize("change, message", [
    ({"block_size": 1}, "block_size must be an integer >= 2"),
    ({"mask_token_id": 64}, r"mask_token_id must be a token id in \[0, 64\)"),
    ({"target_layers": (1, -1)}, r"target_layers must be one or more layer ids >= 0"),
    ({"draft_vocab_size": 65}, "draft_vocab_size 65 exceeds the target's vocab_size 64"),
    ({"num_layers": 0}, "num_layers must be an integer >= 1"),
])
def test_impossible_configs_are_refused(target, change, message):
    with pytest.raises(ValueError, match=message):
        dflash_head_config(target, **change)


def test_the_context_needs_every_fused_stream(target):
    head = DFlashHead(dflash_head_config(target))
    with pytest.raises(ValueError, match=r"it fuses 3 target states \(layers \(0, 1, 2\)\), "
                                         r"got 2"):
        head.context((torch.zeros(1, 2, 32), torch.zeros(1, 2, 32)))
