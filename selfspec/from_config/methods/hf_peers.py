"""The Hugging Face peers: transformers' own `generate` on the same weights, as our rows' peers
(each row compared with plain `generate`, and with our method that does the same thing).

hf_assisted: assisted generation with the small draft model (`assistant_model=`), the peer of
small_model; hf_prompt_lookup: prompt lookup (`prompt_lookup_num_tokens=k`), the peer of ngram.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from selfspec.from_config.common import device
from selfspec.from_config.methods import draft_model_settings
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.from_config.models import (
    load_hf_model,
    resolve_model_path,
    target_quantization,
)
from selfspec.measure.grid import Variant
from selfspec.measure.passes import Method
from selfspec.measure.peers import HFDecoder, OurDecoder


@dataclass(frozen=True)
class PeerVariant(Variant):
    peer: str = ""  # our method that does what this one does

    @property
    def peer_of(self) -> str | None:
        return self.peer or None


def _hf_model(loaded: Loaded, key: str, folder) -> Any:
    cfg = loaded.cfg
    return loaded.once(key, lambda: load_hf_model(folder, cfg.model.dtype, device(cfg)))


def hf_target(loaded: Loaded) -> Any:
    return _hf_model(loaded, "hf_target", resolve_model_path(loaded.cfg.model))


def hf_draft(loaded: Loaded) -> Any:
    folder = resolve_model_path(draft_model_settings(loaded.cfg), "model.draft")
    return _hf_model(loaded, "hf_draft", folder)


def _peer(name: str, peer: str | None, summary: str, kind: str, order: int) -> MethodEntry:
    """kind: assisted (with the draft model), lookup (prompt lookup) or plain (no drafts: a
    peer of our plain decoding, which is its baseline)."""
    assisted = kind == "assisted"

    def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[PeerVariant, ...]:
        return (PeerVariant(name, peer or ""),)

    def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
        if target_quantization(cfg.model) is not None:
            raise ValueError(f"{name} runs transformers' full-precision copy of the target, not "
                             f"the model.quantize={cfg.model.quantize} one: leave it out of "
                             f"methods, or set model.quantize=null")
        if assisted:
            resolve_model_path(draft_model_settings(cfg), "model.draft")

    def load(loaded: Loaded, chosen: tuple[Variant, ...]) -> None:
        hf_target(loaded)
        if assisted:
            hf_draft(loaded)

    def method(loaded: Loaded, variant: Variant, k: int) -> Method:
        target = hf_target(loaded)
        if kind == "plain":
            return Method(name, k, HFDecoder(target), OurDecoder(loaded.target), "plain", 0)
        decoder = HFDecoder(target, hf_draft(loaded) if assisted else None, num_draft_tokens=k,
                            prompt_lookup=kind == "lookup")
        return Method(name, k, decoder, HFDecoder(target), "hf_plain", k)

    def lengths(cfg: DictConfig, variant: Variant, lengths: tuple[int, ...]) -> tuple[int, ...]:
        return lengths[:1] if kind == "plain" else lengths  # plain decoding drafts nothing

    colors = {"assisted": "tab:purple", "lookup": "tab:brown", "plain": "tab:gray"}
    return MethodEntry(name=name, summary=summary, variants=variants, load=load, method=method,
                       check=check, lengths=lengths, color=colors[kind], order=order,
                       runs_draft_model=assisted)


ENTRIES = (
    _peer("hf_assisted", "small_model", "transformers' assisted generation with the draft model",
          "assisted", 90),
    _peer("hf_prompt_lookup", "ngram", "transformers' prompt lookup decoding", "lookup", 91),
    _peer("hf_plain", None, "transformers' plain generate (a batch left-padded), against our "
          "plain decoding", "plain", 92),
)
ONE_PROMPT = ("hf_assisted", "hf_prompt_lookup")  # transformers decodes them one at a time
