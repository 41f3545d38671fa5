"""MTP: the target's own multi-token-prediction modules (DeepSeek-V3's NextN layers,
Qwen3-Next's and Qwen3.5's `mtp.*`), drafted by `MtpDrafter`; nothing to train or load beside
the target (a checkpoint that ships them, or a model config whose arch names them:
model=random-mtp).

Rows: mtp (a chain of k tokens, each step reading the last one's output and token) and
mtp/tree{N} for each N in mtp.total_tokens beside null (an EAGLE-2 dynamic tree k deep of N
nodes, mtp.top_k children per frontier node), at each draft length k.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from selfspec.checks import is_count
from selfspec.drafters.mtp import MtpDrafter
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import CostRow
from selfspec.tree import Tree


@dataclass(frozen=True)
class MtpVariant(Variant):
    method: str = "mtp"
    total_tokens: int | None = None  # None: a chain

    def label(self) -> str:
        return self.method + ("" if self.total_tokens is None else f"/tree{self.total_tokens}")


def settings(cfg: DictConfig) -> DictConfig:
    return cfg.get("mtp") or OmegaConf.create({})


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[MtpVariant, ...]:
    nodes = as_list(settings(cfg).get("total_tokens")) or [None]
    if not all(n is None or is_count(n) for n in nodes):
        raise ValueError(f"mtp.total_tokens: give null (a chain) or node counts >= 1, got "
                         f"{nodes}")
    return tuple(MtpVariant(total_tokens=n) for n in nodes)


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """Every tree holds its deepest draft (total_tokens >= k), top_k a count."""
    top_k = settings(cfg).get("top_k", 3)
    if not is_count(top_k):
        raise ValueError(f"mtp.top_k must be an integer >= 1, got {top_k!r}")
    short = [v.total_tokens for v in variants(cfg) if v.total_tokens is not None
             and v.total_tokens < max(lengths)]
    if short:
        raise ValueError(f"mtp.total_tokens {short} < the longest draft length ({max(lengths)}): "
                         f"a tree that deep needs that many nodes; raise mtp.total_tokens or "
                         f"lower num_draft_tokens")


def drafter(loaded: Loaded, variant: MtpVariant, k: int) -> MtpDrafter:
    s = settings(loaded.cfg)
    sampled = bool(s.get("sampled_children", True))
    if variant.total_tokens is None:
        return MtpDrafter(loaded.target, Tree.chain(k), sampled_children=sampled)
    return MtpDrafter(loaded.target, total_tokens=variant.total_tokens, depth=k,
                      top_k=s.get("top_k", 3), sampled_children=sampled)


def has_modules(cfg: DictConfig) -> bool:
    """A sweep with methods=null runs mtp when the model config's arch names MTP modules."""
    return bool(OmegaConf.select(cfg, "model.arch.mtp_modules", default=0))


ENTRIES = (MethodEntry(
    name="mtp", summary="the target's own MTP modules (DeepSeek-V3 NextN, Qwen3-Next mtp): a "
                        "chain of k tokens or a dynamic tree from their top tokens",
    variants=variants, drafter=drafter, check=check, default_when=has_modules,
    color="tab:brown", order=42, cost_rows={"mtp": CostRow(
        "the target's own MTP module, EAGLE-2 tree: 60 nodes, depth 6, top-10",
        lambda target, tree, seed: MtpDrafter(target, total_tokens=60, depth=6, top_k=10),
        lambda drafter: drafter.shape.depth)}),)
