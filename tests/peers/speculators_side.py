"""speculators' side of tests/peers/test_speculators.py: run with the python of speculators' own
venv (scripts/peers.sh speculators), never imported by the suite (selfspec is not installed
there). Every tensor travels in safetensors files; the draft models are speculators' own
classes, loaded and saved with their own from_pretrained / save_pretrained.

    python speculators_side.py save INPUTS OUT_DIR   # random eagle3, peagle, dflash heads, saved
    python speculators_side.py load INPUTS OUT_DIR   # OUT_DIR/{eagle3,peagle,dflash} loaded, scored

INPUTS (safetensors): `input_ids` [T], `positions` [T], `eagle3_hidden` [T, 3h] (the fused
streams), `dflash_hidden` [T, n h], `anchors` [A] (DFlash block roots), `peagle_anchor` and
`peagle_depth` [R] (P-EAGLE's sampled rows: every position at depth 0, then some anchors
at depths 1..K-1, in speculators' order); for `save` its metadata
holds the sizes (JSON) and `verifier`, the target's transformers folder, from which speculators
takes the embedding, the LM head of a full-vocabulary draft and its checks. Each run writes
OUT_DIR/logits.safetensors: `eagle3` [T, draft V] (one pass, no drafted token fed back),
`peagle` [R, draft V] (its sampled rows) and `dflash` [A * block, V] (each block's slots).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ATTN = "eager"  # flex attention (speculators' default) is for GPUs; eager runs on the CPU


def read_inputs(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def speculators_config(algorithm: str, steps: int, verifier: str):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return SpeculatorsConfig(
        algorithm=algorithm, default_proposal_method="greedy",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
        verifier=VerifierConfig.from_pretrained(verifier))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every trained weight random (norms around 1); the verifier's (the embedding, the
    verifier's norm and LM head) stay uninitialised for load_verifier_weights to fill."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)


def new_eagle3(sizes: dict, parallel: int | None = None):
    """A random EAGLE-3 head, or (parallel: its tokens a forward) a random P-EAGLE head."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**sizes["layer"], num_hidden_layers=1)
    layer._attn_implementation = ATTN
    shared = {"transformer_layer_config": layer, "draft_vocab_size": sizes["draft_vocab_size"],
              "eagle_aux_hidden_state_layer_ids": sizes["eagle3_layers"]}
    if parallel is None:
        model = Eagle3DraftModel(Eagle3SpeculatorConfig(
            **shared, speculators_config=speculators_config("eagle3", 3, sizes["verifier"])))
    else:
        model = PEagleDraftModel(PEagleSpeculatorConfig(
            **shared, mask_token_id=sizes["mask_token_id"],
            speculators_config=speculators_config("peagle", parallel, sizes["verifier"])))
    randomize(model, 1 if parallel is None else 3)
    vocab, draft = layer.vocab_size, sizes["draft_vocab_size"]
    if draft < vocab:  # every other id first, as selfspec's tests choose
        ids = torch.cat([torch.arange(0, vocab, 2), torch.arange(1, vocab, 2)])[:draft]
        ids = ids.sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft))
    model.load_verifier_weights()  # the target's embedding (from_training_args does this)
    return model


def new_dflash(sizes: dict):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(**sizes["layer"], num_hidden_layers=sizes["dflash_layers_count"])
    layer._attn_implementation = ATTN
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=layer.vocab_size,
        block_size=sizes["block_size"], mask_token_id=sizes["mask_token_id"],
        aux_hidden_state_layer_ids=sizes["dflash_layers"],
        speculators_config=speculators_config("dflash", sizes["block_size"] - 1,
                                              sizes["verifier"]))
    model = DFlashDraftModel(config)
    randomize(model, 2)
    model.load_verifier_weights()  # the target's embedding and LM head
    return model


def load(folder: Path):
    """speculators' own loader (which takes the verifier's embedding, and a full-vocabulary
    DFlash draft's LM head, from the verifier the config names), the attention switched to
    one that runs on a CPU."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = ATTN
    return SpeculatorModel.from_pretrained(folder, config=config).float().eval()


def eagle3_logits(model, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One pass of speculators' own forward (ttt_steps=1), the LM head's output captured."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        model(hidden_states=t["eagle3_hidden"][None], input_ids=t["input_ids"][None],
              document_ids=torch.zeros_like(t["input_ids"])[None],
              position_ids=t["positions"][None], ttt_steps=1)
    hook.remove()
    return seen[0][0]


def peagle_logits(model, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """speculators' own P-EAGLE training forward, its sampled (anchor, depth) rows fixed to
    the inputs' `peagle_anchor` and `peagle_depth` in place of its random draw, the LM head's
    output captured: [rows, draft V]."""
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import core

    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    drawn, core.generate_cod_sample_indices = core.generate_cod_sample_indices, \
        lambda **_: (t["peagle_anchor"], t["peagle_depth"])
    ids = t["input_ids"][None]
    try:
        with torch.no_grad():
            model(hidden_states=t["eagle3_hidden"][None], input_ids=ids,
                  document_ids=torch.zeros_like(ids),
                  verifier_last_hidden_states=torch.zeros(1, ids.shape[1], model.hidden_size),
                  loss_config=resolve_loss_config("kl_div", "eager"))  # fused: Triton only
    finally:
        core.generate_cod_sample_indices = drawn
        hook.remove()
    return seen[0][0]


def dflash_logits(model, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """speculators' own training forward up to the logits, the anchors chosen by a loss mask
    that allows only them (all are taken, in order)."""
    ids = t["input_ids"][None]
    mask = torch.zeros_like(ids)
    mask[0, t["anchors"]] = 1
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            t["dflash_hidden"][None], ids, mask,
            torch.zeros(1, ids.shape[1], model.config.transformer_layer_config.hidden_size),
            torch.zeros_like(ids), t["positions"][None], max_anchors=len(t["anchors"]))
    return logits[0]


def main(mode: str, inputs: str, out: str) -> None:
    torch.set_num_threads(1)
    t, meta = read_inputs(inputs)
    out_dir = Path(out)
    if mode == "save":
        sizes = json.loads(meta["sizes"])
        new_eagle3(sizes).save_pretrained(out_dir / "eagle3")
        new_eagle3(sizes, sizes["parallel"]).save_pretrained(out_dir / "peagle")
        new_dflash(sizes).save_pretrained(out_dir / "dflash")
    results = {}
    for kind, score in (("eagle3", eagle3_logits), ("peagle", peagle_logits),
                        ("dflash", dflash_logits)):
        model = load(out_dir / kind)
        results[kind] = score(model, t).contiguous()
    save_file(results, str(out_dir / "logits.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
