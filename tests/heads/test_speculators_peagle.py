"""P-EAGLE in speculators' layout without speculators: its mask feature enters before `fc`
([3h]), ours after it ([h]). The conversion is exact both ways while fc has full row rank and
refused where it has not; an export read back by `load_head` drafts as the head it came from,
in speculators' layout and in SpecForge's (`--to sglang`). (The peers' own classes load these
folders in tests/peers/test_speculators.py and test_specforge.py.)"""

import json

import pytest
import torch
from helpers import random_eagle_head, tiny_llama
from safetensors.torch import load_file

from selfspec import Transformer
from selfspec.heads import EagleConfig, EagleHead, load_head
from selfspec.heads.eagle_layouts import mask_hidden_before_fc, mask_hidden_through_fc
from selfspec.heads.export import export_head
from selfspec.heads.layouts import ExportRefused

V, H, LAYERS, PARALLEL, MASK = 64, 32, 8, 4, 63


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=V, layers=LAYERS, hidden=H)).eval()


def peagle_head(target: Transformer, seed: int = 1) -> EagleHead:
    return random_eagle_head(EagleConfig.for_target(
        target.config, 3, draft_vocab_size=24, target_layers=(2, 4, 5), parallel=PARALLEL,
        mask_token_id=MASK), seed=seed)


def test_the_mask_feature_crosses_fc_both_ways_exactly():
    torch.manual_seed(0)
    fc, ours = torch.randn(H, 3 * H) * 0.2, torch.randn(H)
    before = mask_hidden_before_fc(fc, ours)
    assert before.shape == (3 * H,) and before.dtype == torch.float32
    assert (fc @ before - ours).abs().max() < 1e-5  # fp32 rounding, not an approximation
    assert torch.equal(mask_hidden_through_fc(fc, before.view(1, 1, -1)),
                       (fc.double() @ before.double()).float())


def test_a_mask_feature_outside_a_rank_deficient_fc_is_refused(target, tmp_path):
    """fc with a zero row cannot reach a mask feature whose entry there is not zero."""
    head = peagle_head(target)
    with torch.no_grad():
        head.fc.weight[3] = 0.0
        head.mask_hidden[3] = 0.5
    with pytest.raises(ExportRefused, match=r"rank 31 of 32"):
        export_head(head, "speculators", tmp_path / "out", base_model="target",
                    target_embedding=target.embed_tokens.weight)
    assert not (tmp_path / "out").exists()


def drafted_logits(head: EagleHead, target: Transformer) -> torch.Tensor:
    """[PARALLEL, draft V]: one P-EAGLE forward over 6 real pairs and K - 1 mask pairs, the
    last real pair's row and the mask pairs' (what ParallelEagleDrafter reads)."""
    torch.manual_seed(3)
    ids, streams = torch.randint(0, V - 1, (1, 6)), torch.randn(1, 6, 3 * H).split(H, dim=-1)
    mask_embed, mask_feature = head.mask_pairs(target.embed_tokens.weight[MASK], PARALLEL - 1)
    embeds = torch.cat([target.embed_tokens(ids), mask_embed[None]], dim=1)
    features = torch.cat([head.target_feature(None, streams), mask_feature[None]], dim=1)
    with torch.no_grad():
        return head.logits(head(embeds, features, torch.arange(6 + PARALLEL - 1)))[0, 5:]


@pytest.mark.parametrize("to", ["speculators", "sglang"])  # sglang: SpecForge's PEagleDraftModel
def test_a_peagle_export_reads_back_as_the_same_drafter(target, tmp_path, to):
    head = peagle_head(target)
    export_head(head, to, tmp_path, base_model="target",
                target_embedding=target.embed_tokens.weight)
    assert load_file(str(tmp_path / "model.safetensors"))["mask_hidden"].shape == (1, 1, 3 * H)
    loaded = load_head(tmp_path, target=target, allow_other_base=True)
    assert isinstance(loaded, EagleHead)
    assert (loaded.config.parallel, loaded.config.mask_token_id) == (PARALLEL, MASK)
    assert (loaded.mask_hidden - head.mask_hidden).abs().max() < 1e-5
    assert (drafted_logits(loaded, target) - drafted_logits(head, target)).abs().max() < 1e-4


def test_a_specforge_peagle_folder_without_its_depths_is_refused(target, tmp_path):
    """SpecForge keeps K in its training config: a draft folder that does not name it is
    refused, naming what to add, rather than read with a guessed K."""
    export_head(peagle_head(target), "sglang", tmp_path, base_model="target")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["PEagleDraftModel"] and config["num_depths"] == PARALLEL
    del config["num_depths"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="without mask_token_id, num_depths or mask_hidden"):
        load_head(tmp_path, target=target, allow_other_base=True)
