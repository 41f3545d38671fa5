"""Interop with speculators 0.9.0, proven with its own classes in its own venv: selfspec's
`--to speculators` EAGLE-3, P-EAGLE and DFlash exports load in its
`SpeculatorModel.from_pretrained`,
and the heads its `save_pretrained` writes load in `selfspec.heads.load_head`; in both
directions the two sides' logits agree on the same inputs (fp32, within 1e-4).

speculators' side runs in a subprocess (tests/peers/speculators_side.py) with the python of
the venv `scripts/peers.sh speculators` builds; without it these tests skip.
"""

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dflash_interop import streams_block_logits
from eagle_interop import eagle3_logits, peagle_logits, peagle_rows
from helpers import random_dflash_head, random_eagle_head, tiny_llama
from safetensors.torch import load_file, save_file

from selfspec import Transformer
from selfspec.heads import DFlashConfig, DFlashHead, EagleConfig, EagleHead, load_head
from selfspec.heads.export import export_head

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".peers" / "speculators" / "venv" / "bin" / "python"
SIDE = Path(__file__).with_name("speculators_side.py")
V, H, LAYERS, T = 64, 32, 8, 12
DRAFT_V, BLOCK, MASK = 24, 4, V - 1
EAGLE3_LAYERS, DFLASH_LAYERS = (2, 4, 5), (2, 4, 6)  # HF hidden_states[l]: ours too
ANCHORS = [3, 5, 7]  # DFlash block roots (speculators takes anchors below T - BLOCK)
PARALLEL = 4  # P-EAGLE's tokens a forward; its mask pairs hang off ANCHORS
KINDS = ["eagle3", "peagle", "dflash"]
ROPE_THETA = 500000.0  # not transformers v4's default: a lost key shows
TOLERANCE = 1e-4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason="speculators' venv is absent: build it "
                                                     "with scripts/peers.sh speculators"),
]


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    """The target as a transformers folder: speculators reads its verifier from one."""
    folder = tmp_path_factory.mktemp("target")
    tiny_llama(0, vocab=V, layers=LAYERS, hidden=H).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(target_folder) -> Transformer:
    return Transformer.from_pretrained(target_folder).eval()


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {"input_ids": torch.randint(0, V - 1, (T,)), "positions": torch.arange(T),
            "eagle3_hidden": torch.randn(T, 3 * H), "dflash_hidden": torch.randn(T, 3 * H),
            "anchors": torch.tensor(ANCHORS), **peagle_rows(T, ANCHORS, PARALLEL)}


def run_side(mode: str, folder: Path, inputs: dict, metadata: dict | None = None
             ) -> dict[str, torch.Tensor]:
    """speculators' side in its venv; its logits."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(inputs, str(folder / "inputs.safetensors"), metadata=metadata)
    done = subprocess.run([str(PYTHON), str(SIDE), mode, str(folder / "inputs.safetensors"),
                           str(folder)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return load_file(str(folder / "logits.safetensors"))


# ---- selfspec's logits on the same inputs ------------------------------------------------


def eagle_logits(kind: str, head: EagleHead, target: Transformer, inputs: dict
                 ) -> torch.Tensor:
    """EAGLE-3's [T, draft V] or P-EAGLE's [rows, draft V] (eagle_interop's shared scoring)."""
    ids, fused = inputs["input_ids"], inputs["eagle3_hidden"]
    if kind == "peagle":
        return peagle_logits(head, target, ids, fused, ANCHORS)
    return eagle3_logits(head, target, ids, fused)


def dflash_logits(head: DFlashHead, target: Transformer, inputs: dict) -> torch.Tensor:
    """[A * BLOCK, V]: the shared DFlash scoring over the random `dflash_hidden` streams."""
    streams = inputs["dflash_hidden"][None].split(H, dim=-1)
    return streams_block_logits(head, target, inputs["input_ids"], streams, ANCHORS)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert torch.isfinite(theirs).all()
    diff = (ours - theirs).abs().max().item()
    assert diff < TOLERANCE, f"max |logit difference| {diff:.2e}"


# ---- selfspec -> speculators -----------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target, target_folder, inputs):
    """A random EAGLE-3, P-EAGLE and DFlash head, exported --to speculators and scored by
    speculators' from_pretrained models; with selfspec's own logits."""
    out = tmp_path_factory.mktemp("to_speculators")
    eagle = random_eagle_head(replace(EagleConfig.for_target(
        target.config, 3, draft_vocab_size=DRAFT_V, target_layers=EAGLE3_LAYERS),
        rope_theta=ROPE_THETA), seed=4)
    peagle = random_eagle_head(replace(EagleConfig.for_target(
        target.config, 3, draft_vocab_size=DRAFT_V, target_layers=EAGLE3_LAYERS,
        parallel=PARALLEL, mask_token_id=MASK), rope_theta=ROPE_THETA), seed=6)
    dflash = random_dflash_head(replace(DFlashConfig.for_target(
        target.config, mask_token_id=MASK, num_layers=2, block_size=BLOCK,
        target_layers=DFLASH_LAYERS), rope_theta=ROPE_THETA), seed=5)
    for kind, head in (("eagle3", eagle), ("peagle", peagle), ("dflash", dflash)):
        export_head(head, "speculators", out / kind, base_model=str(target_folder),
                    target_embedding=target.embed_tokens.weight,
                    target_lm_head=target.lm_head.weight)
    theirs = run_side("load", out, inputs)
    ours = {"eagle3": eagle_logits("eagle3", eagle, target, inputs),
            "peagle": eagle_logits("peagle", peagle, target, inputs),
            "dflash": dflash_logits(dflash, target, inputs)}
    return out, ours, theirs


@pytest.mark.parametrize("kind", KINDS)
def test_a_speculators_export_loads_in_speculators_with_selfspecs_logits(exported, kind):
    out, ours, theirs = exported
    config = json.loads((out / kind / "config.json").read_text())
    assert config["speculators_model_type"] == kind
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config["aux_hidden_state_layer_ids"]
    assert ids == list(DFLASH_LAYERS if kind == "dflash" else EAGLE3_LAYERS)
    if kind == "peagle":  # the mask feature before fc: [1, 1, 3h]
        assert load_file(str(out / kind / "model.safetensors"))["mask_hidden"].shape == \
            (1, 1, 3 * H)
        assert config["mask_token_id"] == MASK
    assert_close(ours[kind], theirs[kind])


# ---- speculators -> selfspec -----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target, target_folder, inputs):
    """A random EAGLE-3, P-EAGLE and DFlash head made and saved by speculators' own classes,
    with their logits there."""
    out = tmp_path_factory.mktemp("from_speculators")
    c = target.config
    sizes = {"layer": {"vocab_size": V, "hidden_size": H, "intermediate_size": 48,
                       "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                       "head_dim": c.head_dim, "rms_norm_eps": 1e-6, "rope_theta": ROPE_THETA},
             "draft_vocab_size": DRAFT_V, "eagle3_layers": list(EAGLE3_LAYERS),
             "dflash_layers": list(DFLASH_LAYERS), "dflash_layers_count": 2,
             "block_size": BLOCK, "mask_token_id": MASK, "parallel": PARALLEL,
             "verifier": str(target_folder)}
    theirs = run_side("save", out, inputs, {"sizes": json.dumps(sizes)})
    return out, theirs


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_speculators_saves_loads_in_selfspec_with_its_logits(saved, target, inputs,
                                                                    kind):
    out, theirs = saved
    config = json.loads((out / kind / "config.json").read_text())
    assert config["speculators_model_type"] == kind
    head = load_head(out / kind, target=target, allow_other_base=True)
    assert head.config.rope_theta == ROPE_THETA
    if kind == "eagle3":
        assert isinstance(head, EagleHead) and head.config.target_layers == EAGLE3_LAYERS
        assert head.config.draft_vocab_size == DRAFT_V
        ours = eagle_logits("eagle3", head, target, inputs)
    elif kind == "peagle":
        assert isinstance(head, EagleHead) and head.config.target_layers == EAGLE3_LAYERS
        assert (head.config.parallel, head.config.mask_token_id) == (PARALLEL, MASK)
        ours = eagle_logits("peagle", head, target, inputs)
    else:
        assert isinstance(head, DFlashHead) and head.config.target_layers == DFLASH_LAYERS
        assert (head.config.block_size, head.config.mask_token_id) == (BLOCK, MASK)
        ours = dflash_logits(head, target, inputs)
    assert_close(ours, theirs[kind])


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_a_speculators_head_embedding_another_target_is_refused(saved, target, tmp_path, kind):
    """speculators' EAGLE-3 and P-EAGLE embed with the embed_tokens their folder holds (P-EAGLE
    trains it by default); selfspec's with the target's: a folder whose embedding is not this
    target's is refused, not misread."""
    import shutil

    out, _ = saved
    shutil.copytree(out / kind, tmp_path / kind)
    weights = load_file(str(tmp_path / kind / "model.safetensors"))
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"] + 0.5
    save_file(weights, str(tmp_path / kind / "model.safetensors"))
    with pytest.raises(ValueError, match="holds its own embed_tokens"):
        load_head(tmp_path / kind, target=target, allow_other_base=True)
