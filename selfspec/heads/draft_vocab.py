"""A reduced draft vocabulary, one mechanism for every drafter that scores tokens itself.

On a small real target the LM head is a fifth of the model (SmolLM2-135M: 28M of 135M
parameters), so a drafter that scores the whole vocabulary pays a fifth of a target forward
per drafted token. A draft vocabulary keeps the K target tokens most frequent in the training
data (EAGLE-3's d2t / t2d, FR-Spec's frequency-ranked subset): the drafter scores only those,
its law is zero elsewhere, and verification stays exact because the verifier never assumes
the draft covers the target's support.

Draft id i stands for target id i + d2t[i] (increasing), and t2d [V] marks the target ids the
draft vocabulary holds: the published EAGLE-3 layout, kept for every drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

COUNTS_FILE = "token_counts.safetensors"  # beside a draft model: its training data's counts


@dataclass(frozen=True)
class DraftVocab:
    """d2t [K] int64 (target id = i + d2t[i]) and t2d [V] bool (which target ids are kept)."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def to(self, device: torch.device | str) -> DraftVocab:
        return DraftVocab(self.d2t.to(device), self.t2d.to(device))

    @property
    def target_ids(self) -> torch.Tensor:
        """[K] the target id of each draft id, increasing."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def draft_ids(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids, kept) for target ids `tokens` [...]: a token outside the draft vocabulary
        gets draft id 0 and kept False."""
        kept = self.t2d[tokens]
        ids = torch.cumsum(self.t2d.long(), dim=0) - 1  # [V] draft id of each kept target id
        return ids[tokens].clamp(min=0) * kept, kept

    def scatter(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] scores over the target vocabulary from draft scores [..., K], -inf outside
        the draft vocabulary (probability zero there)."""
        full = logits.new_full((*logits.shape[:-1], len(self.t2d)), float("-inf"))
        return full.scatter(-1, self.target_ids.expand_as(logits), logits)


def token_counts(tokens: torch.Tensor, vocab_size: int,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """[V] int64: how often each token id occurs in `tokens` (where mask is set)."""
    ids = tokens.flatten() if mask is None else tokens.flatten()[mask.flatten().bool()]
    return torch.bincount(ids.cpu(), minlength=vocab_size)[:vocab_size]


def draft_vocabulary(
    tokens: torch.Tensor, vocab_size: int, draft_vocab_size: int,
    mask: torch.Tensor | None = None,
) -> DraftVocab:
    """The draft_vocab_size most frequent token ids of `tokens` (where mask is set), ties and
    ids never seen filled in by lower id first, listed in increasing id order."""
    vocab = most_frequent(token_counts(tokens, vocab_size, mask), draft_vocab_size)
    return DraftVocab(vocab.d2t.to(tokens.device), vocab.t2d.to(tokens.device))


def most_frequent(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """The draft vocabulary of the draft_vocab_size ids with the highest counts [V] (ties:
    lower id first), listed in increasing id order."""
    vocab_size = len(counts)
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocabulary: it must hold 1..{vocab_size} tokens (the target's "
                         f"vocab_size), got {draft_vocab_size}")
    # Stable sort of -count: equal counts keep increasing id order.
    chosen = torch.sort(-counts, stable=True).indices[:draft_vocab_size].sort().values
    d2t = chosen - torch.arange(draft_vocab_size)  # [draft_vocab]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return DraftVocab(d2t, t2d)


def narrowed(vocab: DraftVocab, counts: torch.Tensor, size: int) -> tuple[DraftVocab,
                                                                         torch.Tensor]:
    """The `size` ids of `vocab` most frequent in `counts` [V] (ties: lower id first), and the
    draft ids they held in `vocab`: the rows of a head's projection that score them."""
    if not 1 <= size <= len(vocab.d2t):
        raise ValueError(f"draft vocabulary: it can be narrowed to 1..{len(vocab.d2t)} tokens "
                         f"(the tokens it holds), got {size}")
    check_vocab_covers(vocab, len(counts))
    kept = most_frequent(counts.cpu().masked_fill(~vocab.t2d.cpu(), -1), size)
    return kept, vocab.to("cpu").draft_ids(kept.target_ids)[0]


def rarest_token(counts: torch.Tensor) -> int:
    """The id with the lowest count [V], the highest id among equals: a mask token that
    stands for nothing the counted rows say (DFlash's, PARD's)."""
    return int(len(counts) - 1 - torch.argmin(counts.flip(0)))


def check_vocab_covers(vocab: DraftVocab, vocab_size: int) -> None:
    if len(vocab.t2d) != vocab_size:
        raise ValueError(f"the draft vocabulary maps into {len(vocab.t2d)} token ids, the "
                         f"target has {vocab_size}: it was built for another vocabulary")


def default_vocab(draft_vocab_size: int, vocab_size: int) -> DraftVocab:
    """The first draft_vocab_size target ids: the placeholder a head holds until its real
    vocabulary is set (or loaded with its weights)."""
    return DraftVocab(torch.zeros(draft_vocab_size, dtype=torch.long),
                      torch.arange(vocab_size) < draft_vocab_size)


def save_token_counts(folder: str | Path, counts: torch.Tensor) -> None:
    """Keep a model's training-data token counts beside it, so that any draft vocabulary size
    can be chosen later (`draft_vocab=K`) without training again."""
    save_file({"token_counts": counts.cpu().long()}, str(Path(folder) / COUNTS_FILE))


def load_token_counts(folder: str | Path) -> torch.Tensor:
    """[V] the training-data token counts saved beside a model (`save_token_counts`)."""
    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a draft vocabulary needs the token counts "
                                f"of the drafter's training data (train/draft.py, "
                                f"train/eagle.py and train/medusa.py write them beside their "
                                f"exports); drop draft_vocab to score the whole vocabulary")
    return load_file(str(path))["token_counts"]


def load_draft_vocab(folder: str | Path, draft_vocab_size: int) -> DraftVocab:
    """The draft_vocab_size most frequent ids in the counts saved beside a model."""
    return most_frequent(load_token_counts(folder), draft_vocab_size)


def set_head_vocab(who: str, head: torch.nn.Module, vocab: DraftVocab, size: int | None,
                   full: int) -> None:
    """Copy `vocab` into a head's d2t and t2d buffers; refused unless the head was built for a
    draft vocabulary of `size` of `full` target ids."""
    if size is None or (len(vocab.d2t), len(vocab.t2d)) != (size, full) \
            or int(vocab.t2d.sum()) != size:
        raise ValueError(f"{who}.set_draft_vocab: built for a draft vocabulary of {size} of "
                         f"{full} ids, got {len(vocab.d2t)} of {len(vocab.t2d)}")
    with torch.no_grad():
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d)
