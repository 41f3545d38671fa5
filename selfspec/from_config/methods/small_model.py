"""The small draft model (`SmallModelDrafter`): a separate, smaller model with the target's
tokenizer (model.draft), or one cut from the target and trained by train/draft.py.

Rows: small_model[/V{K}][/top{W}][/stop{t}][/pard] for each K in small_model.draft_vocab (its K
most frequent training tokens; null: the whole vocabulary), W in small_model.first_candidates
(the first token's candidates; 1: a chain), t in small_model.confidence_threshold (end a draft
below that top-1 probability; null: never) and small_model.parallel (true: PARD, all k tokens
from one forward with k - 1 mask tokens, for a draft train/draft.py trained so; its rows are
chains without a confidence stop, so they come only with W = 1 and t = null).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from selfspec.checks import is_count
from selfspec.drafters import SmallModelDrafter
from selfspec.drafters.confidence import check_confidence_threshold
from selfspec.from_config.common import as_list, device
from selfspec.from_config.methods.entry import Loaded, MethodEntry, always
from selfspec.from_config.models import (
    compile_steps,
    draft_model_config,
    load_model,
    resolve_model_path,
)
from selfspec.heads.draft_vocab import DraftVocab, load_draft_vocab
from selfspec.measure.grid import Variant
from selfspec.model import Transformer


@dataclass(frozen=True)
class SmallModelVariant(Variant):
    method: str = "small_model"
    draft_vocab: int | None = None
    first_candidates: int = 1
    confidence_threshold: float | None = None
    parallel: bool = False

    def label(self) -> str:
        return (self.method + ("" if self.draft_vocab is None else f"/V{self.draft_vocab}")
                + ("" if self.first_candidates == 1 else f"/top{self.first_candidates}")
                + ("" if self.confidence_threshold is None
                   else f"/stop{self.confidence_threshold:g}")
                + ("/pard" if self.parallel else ""))


def variants(cfg: DictConfig, with_comparisons: bool = True) -> tuple[SmallModelVariant, ...]:
    group = cfg.get("small_model", {})
    sizes = as_list(group.get("draft_vocab")) or [None]
    widths = as_list(group.get("first_candidates")) or [1]
    stops = as_list(group.get("confidence_threshold")) or [None]
    if not all(is_count(k) for k in sizes if k is not None):
        raise ValueError(f"small_model.draft_vocab: give token counts >= 1 (or null for the "
                         f"whole vocabulary), got {sizes}")
    if not all(map(is_count, widths)):
        raise ValueError(f"small_model.first_candidates: give candidate counts >= 1 (1: a "
                         f"chain), got {widths}")
    stops = [check_confidence_threshold("small_model", t) for t in stops]
    parallel = as_list(group.get("parallel")) or [False]
    if not all(isinstance(p, bool) for p in parallel):
        raise ValueError(f"small_model.parallel: give true (PARD) or false, got {parallel}")
    return tuple(SmallModelVariant(draft_vocab=k, first_candidates=w, confidence_threshold=t,
                                   parallel=p)
                 for k in sizes for w in widths for t in stops for p in parallel
                 if not p or (w == 1 and t is None))


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    resolve_model_path(draft_model_config(cfg), "model.draft")


def draft_model(loaded: Loaded) -> Transformer:
    """model.draft, loaded once (hf_assisted reads the same folder)."""
    cfg = loaded.cfg
    return loaded.once("draft_model", lambda: load_model(
        draft_model_config(cfg), "model.draft", cfg.model.dtype, device(cfg),
        compile_steps(cfg)))


def _vocab(loaded: Loaded, size: int | None) -> DraftVocab | None:
    if size is None:
        return None
    return loaded.once(f"draft_vocab/{size}",
                       lambda: load_draft_vocab(draft_model(loaded).source, size))


def load(loaded: Loaded, chosen: tuple[SmallModelVariant, ...]) -> None:
    draft_model(loaded)
    for variant in chosen:
        _vocab(loaded, variant.draft_vocab)
        if variant.parallel:
            read_pard(draft_model(loaded).source)


def drafter(loaded: Loaded, variant: SmallModelVariant, k: int) -> SmallModelDrafter:
    model = draft_model(loaded)
    mask = read_pard(model.source)["mask_token_id"] if variant.parallel else None
    return SmallModelDrafter(model, num_draft_tokens=k,
                             draft_vocab=_vocab(loaded, variant.draft_vocab),
                             confidence_threshold=variant.confidence_threshold,
                             first_candidates=variant.first_candidates, mask_token_id=mask)


PARD_FILE = "pard.json"  # beside a draft trained to fill masks: its mask token, its K


def write_pard(folder: str | Path, mask_token_id: int, parallel: int) -> None:
    """Record, beside a draft model train/draft.py trained for PARD, what drafting needs."""
    (Path(folder) / PARD_FILE).write_text(json.dumps({"mask_token_id": int(mask_token_id),
                                                      "parallel": int(parallel)}) + "\n")


def read_pard(folder: str | Path | None) -> dict:
    """The PARD settings recorded beside a draft model, or an error naming the fix."""
    path = Path(str(folder)) / PARD_FILE
    if folder is None or not path.is_file():
        raise FileNotFoundError(f"small_model.parallel=true needs a draft trained to fill mask "
                                f"tokens (train/draft.py draft_model.parallel=K): no {PARD_FILE} "
                                f"in {folder}")
    return json.loads(path.read_text())


ENTRIES = (MethodEntry(
    name="small_model", summary="a separate small draft model with the target's tokenizer",
    variants=variants, load=load, drafter=drafter, check=check, default_when=always,
    color="tab:blue", order=0),)
