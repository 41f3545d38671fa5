"""The real target Gemma 3 270M (base): its GGUF file, joined from four chunk packages and
converted once, loads into our Transformer with the logits of `transformers` on the same
weights, over a prompt longer than its 512-token window; greedy decoding follows the full
forward's argmax chain on held-out code and text; the entry points a benchmark needs run on
it. Slow: the conversion takes a minute or more and ~1.1 GB of memory."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import load_entry
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from selfspec import generate
from selfspec.drafters import NgramDrafter
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.models import load_tokenizer, model_config
from selfspec.measure.prompts import encode_prompts, humaneval_prompts, stdlib_heldout_prompts
from selfspec.model import Transformer, converted
from selfspec.model.converted import GGUFSource, SourceNotInstalled, gguf_model_folder

pytestmark = pytest.mark.slow

MODEL_CFG = OmegaConf.load(CONF_DIR / "model" / "gemma3-270m.yaml")
SOURCE = GGUFSource(**{**MODEL_CFG.gguf, "parts": tuple(MODEL_CFG.gguf.parts)})


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory) -> Iterator[Path]:
    """The converted folder, made once per session in a fresh cache and deleted after it;
    skipped where the packages are not installed (CI installs them)."""
    try:
        converted.check_installed(SOURCE)
    except SourceNotInstalled as exc:
        pytest.skip(f"Gemma 3 conversion not tested: {exc}")
    cache = tmp_path_factory.mktemp("cache")
    yield gguf_model_folder("gemma3-270m", SOURCE, cache=cache)
    shutil.rmtree(cache, ignore_errors=True)  # ~1.1 GB


@pytest.fixture(scope="module")
def tokenizer(gemma3):
    return load_tokenizer(gemma3)


@pytest.fixture(scope="module")
def both_models(gemma3):
    from transformers import AutoModelForCausalLM

    ours = Transformer.from_pretrained(gemma3).eval()
    hf = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    return ours, hf


def test_the_converted_folder_holds_the_configs_facts(gemma3):
    loaded = Transformer.from_pretrained(gemma3).config
    assert loaded == model_config(MODEL_CFG)  # the arch block, family filled in
    assert loaded.model_type == "gemma3_text" and loaded.norm_scale == "one_plus_weight"
    assert loaded.sliding_window == 512 and len(loaded.sliding_layers) == 15
    assert (loaded.local_rope_theta, loaded.rope_theta) == (1e4, 1e6)
    record = json.loads((gemma3 / converted.RECORD).read_text())
    assert record["parts"] == list(SOURCE.parts) and len(record["sha256"]) == 64
    assert not list(gemma3.rglob("*.gguf"))  # the joined file is gone with the private folder


@torch.no_grad()
def test_logits_equal_transformers_on_the_same_weights(both_models, tokenizer):
    """Past the window: 700 tokens of stdlib source. The same fp32 weights and operations;
    kernels sum in other orders (our few-row products, SDPA against transformers' eager
    attention), a few ulps per product through 18 layers and a 262k-row LM head."""
    ours, hf = both_models
    text = "\n\n".join(p.text for p in stdlib_heldout_prompts(8, 60))
    ids = tokenizer(text)["input_ids"][:700]
    tokens = torch.tensor([ids])
    logits = ours(tokens, torch.arange(len(ids))).logits
    expected = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
    assert len(ids) == 700 > ours.config.sliding_window
    assert expected.abs().max() > 10
    assert (logits - expected).abs().max() < 1e-4 * expected.abs().max()


def teacher_forced_chain(hf, ids: list[int], n: int) -> list[int]:
    """transformers' argmax chain: a full forward per token, no cache (not `generate` on the
    GGUF-loaded model, which left its own chain)."""
    sequence, chain = list(ids), []
    for _ in range(n):
        tokens = torch.tensor([sequence])
        logits = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0, -1]
        chain.append(int(logits.argmax()))
        sequence.append(chain[-1])
    return chain


@torch.no_grad()
def test_greedy_follows_the_full_forwards_argmax_chain_on_held_out_prompts(both_models,
                                                                          tokenizer):
    ours, hf = both_models
    prompts = [humaneval_prompts()[23], stdlib_heldout_prompts(1, 20)[0]]
    for encoded in encode_prompts(prompts, tokenizer, 1024):
        out = generate(ours, encoded.ids, max_new_tokens=12)
        assert out.tokens == teacher_forced_chain(hf, encoded.ids, 12)
        drafted = generate(ours, encoded.ids, drafter=NgramDrafter(3), max_new_tokens=12)
        assert drafted.tokens == out.tokens
    assert "return" in tokenizer.decode(generate(ours, encode_prompts(
        [humaneval_prompts()[23]], tokenizer, 1024)[0].ids, max_new_tokens=24).tokens)


@pytest.fixture(scope="module")
def compose_cfg(gemma3):
    cache = str(gemma3.parents[1])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), \
            pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_CACHE", cache)  # the session's conversion
        yield lambda config, *overrides: compose(config, overrides=[
            "model=gemma3-270m", *overrides])


def test_the_entry_points_run_on_it(compose_cfg, tmp_path, capsys):
    """What a benchmark needs: eval/generate.py, eval/lossless.py, eval/replay.py and
    eval/sweep.py with model=gemma3-270m, on code and on the text set."""
    cfg = compose_cfg("generate", "drafter=ngram", "max_new_tokens=8", "data.num_prompts=1")
    load_entry("generate").main.__wrapped__(cfg)
    assert "over plain decoding" in capsys.readouterr().out
    cfg = compose_cfg("lossless", "methods=[ngram]", "num_draft_tokens=[2]", "num_prompts=1",
                      "max_new_tokens=8", "data=spec_bench_text")
    assert load_entry("lossless").run(cfg) == 0
    cfg = compose_cfg("replay", "methods=[ngram]", "num_draft_tokens=[2]", "num_prompts=1",
                      "max_new_tokens=8", f"run_dir={tmp_path}")
    (row,) = load_entry("replay").run(cfg)
    assert (row["method"], row["draft_length"]) == ("ngram", 2)
    assert json.loads((tmp_path / "replay.json").read_text())["rows"] == [row]  # what it wrote
    cfg = compose_cfg("sweep", "methods=[ngram]", "num_draft_tokens=[1]", "samplings=[greedy]",
                      "bench.num_prompts=1", "bench.max_new_tokens=8", "cost_profile=false",
                      "wandb.enabled=false", f"run_dir={tmp_path / 'sweep'}")
    load_entry("sweep").run(cfg)
    assert (tmp_path / "sweep" / "results.json").is_file()
