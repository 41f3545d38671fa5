"""The drafters' contract (drafters/base.py): a fork shares what drafting reads and owns what a
row writes; which drafters draft a batch's rows together."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    eagle_head_config,
    first_layers,
    random_eagle_head,
    random_exit,
    random_medusa_heads,
    tiny_llama,
)

from selfspec import Transformer, generate
from selfspec.drafters import (
    EagleDrafter,
    EarlyExitDrafter,
    MedusaDrafter,
    NgramDrafter,
    SmallModelDrafter,
    UnionDrafter,
    base,
)
from selfspec.drafters.base import BatchDrafter, fork
from selfspec.drafters.lookahead import LookaheadDrafter
from selfspec.heads import MedusaConfig
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.model.kv_cache import KVCache

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [3, 9, 4]]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, layers=4))


@pytest.fixture(scope="module")
def drafters(target) -> dict:
    draft = Transformer.from_hf(first_layers(tiny_llama(0, layers=4), 1))
    vocab = draft_vocabulary(torch.arange(40), 64, 40)
    eagle = random_eagle_head(eagle_head_config(target, 3), seed=2)
    return {
        "draft model, draft vocabulary": lambda: SmallModelDrafter(draft, 3, draft_vocab=vocab),
        "medusa": lambda: MedusaDrafter(
            random_medusa_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2), 1),
            [[0], [1], [0, 0]]),
        "eagle-3": lambda: EagleDrafter(eagle, total_tokens=4, depth=2, top_k=2),
        "early exit": lambda: EarlyExitDrafter(random_exit(target, 2, "adapter"), 3, None),
        "lookahead": lambda: LookaheadDrafter(window=3, ngram=3, candidates=2),
        "union": lambda: UnionDrafter([NgramDrafter(3), SmallModelDrafter(draft, 3)]),
    }


def tensors(value: object, caches: list[KVCache], found: dict[int, torch.Tensor],
            seen: set[int]) -> None:
    """Every tensor a drafter holds outside modules (by id), and its KV caches apart."""
    if id(value) in seen or isinstance(value, torch.nn.Module):
        return
    seen.add(id(value))
    if isinstance(value, KVCache):
        caches.append(value)
    elif isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, dict):
        for item in value.values():
            tensors(item, caches, found, seen)
    elif isinstance(value, list | tuple):
        for item in value:
            tensors(item, caches, found, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for item in vars(value).values():
            tensors(item, caches, found, seen)


def held(drafter) -> tuple[dict[int, torch.Tensor], list[KVCache]]:
    found, caches = {}, []
    tensors(drafter, caches, found, set())
    return found, caches


@pytest.mark.parametrize(("kind", "tensors_held", "caches_held"), [
    ("draft model, draft vocabulary", 3, 1),  # the LM head's rows, the vocabulary's d2t, t2d
    ("medusa", 3, 0), ("eagle-3", 0, 1), ("early exit", 0, 2), ("lookahead", 2, 0)])
def test_a_fork_shares_every_tensor_but_its_kv_caches(target, drafters, kind, tensors_held,
                                                      caches_held):
    drafter = drafters[kind]()
    generate(target, PROMPTS[0], drafter=drafter, max_new_tokens=6)  # its caches made
    copy = fork(drafter)
    read_only, caches = held(drafter)
    forked, fork_caches = held(copy)
    assert len(read_only) >= tensors_held and forked.keys() == read_only.keys()  # not copies
    assert len(fork_caches) == len(caches) == caches_held
    storage = {c.k.untyped_storage().data_ptr() for c in caches}
    assert not storage & {c.k.untyped_storage().data_ptr() for c in fork_caches}
    for name, value in vars(drafter).items():
        if isinstance(value, torch.nn.Module | torch.Generator):
            assert getattr(copy, name) is value, name


def rows_alone_and_together(target, make) -> tuple[list, list]:
    """(tokens, steps) of each prompt drafted alone, and in a batch whose second row drafts
    with a fork of a drafter that has drafted before (its caches made)."""
    alone = [generate(target, p, drafter=make(), max_new_tokens=20) for p in PROMPTS]
    drafter = make()
    generate(target, PROMPTS[0], drafter=drafter, max_new_tokens=20)
    together = generate(target, PROMPTS, drafter=drafter, max_new_tokens=20)
    return ([(r.tokens, r.stats.steps) for r in alone],
            [(r.tokens, r.stats.steps) for r in together])


def test_each_row_drafts_in_its_own_caches(target, drafters):
    """Rows draft in turn, a draft model among their parts; each drafts what it drafts
    alone (the same steps)."""
    alone, together = rows_alone_and_together(target, drafters["union"])
    assert together == alone and together[0][1] < 20  # drafts were accepted


def test_a_planted_fork_sharing_its_kv_caches_is_caught(monkeypatch, target, drafters):
    monkeypatch.setattr(base, "KVCache", type("NotACache", (), {}))  # caches shared too
    alone, together = rows_alone_and_together(target, drafters["union"])
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]  # exact
    assert together != alone  # but the rows' drafts were each other's


def test_which_drafters_draft_a_batchs_rows_together(drafters):
    assert isinstance(drafters["draft model, draft vocabulary"](), BatchDrafter)
    for kind in ("medusa", "eagle-3", "early exit", "lookahead"):
        assert not isinstance(drafters[kind](), BatchDrafter), kind
    union = UnionDrafter([NgramDrafter(3), drafters["draft model, draft vocabulary"]()])
    assert not isinstance(union, BatchDrafter)  # its parts draft row by row
