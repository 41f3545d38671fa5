"""Gemma 4's assistant (`Gemma4AssistantDrafter`): the small drafter published beside each
Gemma 4 model, reading the target's K/V and last hidden state; nothing to train here.

Settings: `gemma4_assistant.path`, an assistant folder transformers wrote (e.g. a published
`google/gemma-4-*-assistant`, downloaded); where unset, the model config's `assistant` block
(`model=random-gemma4`: `random: true` and its shape, a random assistant for timings). Rows:
gemma4_assistant, a chain of k tokens; in a sweep also gemma4_assistant/tree, the tree config's
choices (`tree=`) cut to depth k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.drafters.gemma4_assistant import Gemma4AssistantDrafter
from selfspec.from_config.common import checked_settings
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.heads.gemma4_assistant import AssistantShape, Gemma4Assistant, random_assistant
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import CostRow
from selfspec.model import Transformer
from selfspec.tree import Tree

NAME = "gemma4_assistant"


@dataclass(frozen=True)
class AssistantVariant(Variant):
    method: str = NAME
    tree: bool = False  # the tree config's choices cut to depth k; False: a chain of k

    def label(self) -> str:
        return self.method + ("/tree" if self.tree else "")


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[AssistantVariant, ...]:
    """A chain; in a sweep, where the tree config lists choices, that tree too."""
    chain = (AssistantVariant(),)
    if not for_sweep or not OmegaConf.select(cfg, "tree.choices"):
        return chain
    return (*chain, AssistantVariant(tree=True))


def settings(cfg: DictConfig) -> DictConfig:
    """The method's own settings, else the model config's `assistant` block."""
    own = cfg.get(NAME)
    if own and own.get("path"):
        return own
    return OmegaConf.select(cfg, "model.assistant") or OmegaConf.create({})


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    s = settings(cfg)
    if s.get("random"):
        return
    if not s.get("path"):
        raise ValueError(f"method {NAME} needs an assistant: set {NAME}.path=/path/to/"
                         f"gemma-4-assistant (a folder transformers wrote), or use "
                         f"model=random-gemma4 (a random assistant beside a random target)")
    if not (Path(str(s.path)).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"{NAME}.path={s.path}: no config.json there; point it at a "
                                f"Gemma 4 assistant folder")


def load_assistant(cfg: DictConfig, target: Transformer) -> Gemma4Assistant:
    s, weight = settings(cfg), target.embed_tokens.weight
    if s.get("random"):
        given = {k: v for k, v in s.items() if k != "random"}
        unknown = sorted(set(given) - set(AssistantShape.__dataclass_fields__))
        if unknown:
            raise ValueError(f"model.assistant: unknown settings {unknown}; a random "
                             f"assistant takes {', '.join(AssistantShape.__dataclass_fields__)}")
        shape = checked_settings(AssistantShape, "model.assistant", **given)
        model = random_assistant(target.config, shape, seed=int(cfg.get("seed", 0)))
        return model.to(device=weight.device, dtype=weight.dtype)
    return Gemma4Assistant.from_pretrained(Path(str(s.path)).expanduser(), dtype=weight.dtype,
                                           device=weight.device)


def load(loaded: Loaded, chosen: tuple[Variant, ...]) -> Gemma4Assistant:
    return loaded.once(NAME, lambda: load_assistant(loaded.cfg, loaded.target))


@torch.inference_mode()
def drafter(loaded: Loaded, variant: AssistantVariant, k: int) -> Gemma4AssistantDrafter:
    assistant = load(loaded, (variant,))
    if not variant.tree:
        return Gemma4AssistantDrafter(assistant, k)
    choices = [list(path) for path in OmegaConf.to_container(loaded.cfg.tree.choices)
               if len(path) <= k]
    return Gemma4AssistantDrafter(assistant, tree=choices)


def random_drafter(target: Transformer, tree, seed: int) -> Gemma4AssistantDrafter:
    """bench_decode's row: a random assistant of the default shape over its static tree."""
    weight = target.embed_tokens.weight
    assistant = random_assistant(target.config, AssistantShape(), seed)
    return Gemma4AssistantDrafter(assistant.to(device=weight.device, dtype=weight.dtype),
                                  tree=Tree.from_paths(tree))


def has_assistant(cfg: DictConfig) -> bool:
    """A sweep with methods=null runs it when the model config ships an assistant."""
    return bool(OmegaConf.select(cfg, "model.assistant", default=None))


ENTRIES = (MethodEntry(
    name=NAME, summary="Gemma 4's published assistant: a chain of k tokens over the target's "
                       "K/V and last hidden state",
    variants=variants, load=load, drafter=drafter, check=check,
    default_when=has_assistant, color="darkorchid", order=44,
    cost_rows={NAME: CostRow(
        "Gemma 4's assistant (random, 4 layers of width 256) over the static tree, each level "
        "one forward over the target's K/V", random_drafter,
        levels=lambda drafter: drafter.tree.max_depth)}),)
