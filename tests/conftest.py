import importlib
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import SMALL_ARCH, suite_threads, tiny_llama
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file

from selfspec import Transformer, generate
from selfspec.from_config.common import CONF_DIR
from selfspec.heads import (
    DFlashConfig,
    DFlashHead,
    EagleConfig,
    EagleHead,
    MedusaConfig,
    MedusaHeads,
    describe_target,
    save_head,
)
from selfspec.model import ModelConfig
from selfspec.model.lora import ADAPTER_DIR, LoraSettings, add_lora, save_adapter


def pytest_addoption(parser) -> None:
    parser.addoption("--all", action="store_true", dest="all_tests",
                     help="run every test, the slow ones included (pyproject's addopts "
                          "leave out those marked slow)")


def pytest_configure(config) -> None:
    """--all: every test, whatever -m says. Torch threads for the whole suite:
    SELFSPEC_TEST_THREADS, default 1. The test models are tiny: one thread is as fast as two,
    and it keeps timings sane when the other core is busy (a second OpenMP thread spin-waits
    on a loaded core). With 2, float sums round in another order, which no test may depend
    on."""
    threads = os.environ.get("SELFSPEC_TEST_THREADS", "1")
    if not threads.isdigit() or int(threads) < 1:
        raise pytest.UsageError(f"SELFSPEC_TEST_THREADS must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(suite_threads())
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # Workers that compile the same kernel at once into one cache can load a file another
        # is still writing ("file too short", seen with 8 workers): a cache of each worker's own.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
            Path(tempfile.gettempdir()) / f"selfspec-inductor-{os.getuid()}-{worker}")
    if config.getoption("all_tests"):
        config.option.markexpr = ""


@pytest.fixture(autouse=True)
def keeps_the_suite_threads():
    yield
    assert torch.get_num_threads() == suite_threads(), "the test changed torch's thread count"


@pytest.fixture(scope="session")
def quick_build(tmp_path_factory) -> Path:
    """The tiny-model recipe at toy size (scripts/build_tiny.py --quick): tokenizer, target,
    draft folders, built once per test session."""
    out = tmp_path_factory.mktemp("tiny")
    threads = str(suite_threads())  # it sets torch's threads for the session
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
        build_tiny = importlib.import_module("build_tiny")
        assert build_tiny.main(["--quick", "--out", str(out), "--threads", threads]) == 0
    return out


@pytest.fixture(scope="module")
def target() -> Transformer:
    """The seeded random toy target of the drafter tests (modules may define their own)."""
    return Transformer.from_hf(tiny_llama(0))


@pytest.fixture(scope="module")
def plain_greedy(request, target) -> dict:
    """Plain greedy continuations of the test module's PROMPTS, NEW_TOKENS long each."""
    module = request.module
    return {tuple(p): generate(target, p, max_new_tokens=module.NEW_TOKENS).tokens
            for p in module.PROMPTS}


def lm_head_copies(target: Transformer, num_heads: int = 2) -> MedusaHeads:
    """Untrained Medusa heads for the target (output layers = its LM head)."""
    config = MedusaConfig(hidden_size=target.config.hidden_size,
                          vocab_size=target.config.vocab_size, num_heads=num_heads, num_layers=1)
    return MedusaHeads(config).init_from_lm_head(target.lm_head.weight.detach())


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, quick_build) -> Path:
    """Untrained 2-head Medusa export for the toy target."""
    target = Transformer.from_pretrained(quick_build / "target")
    heads = lm_head_copies(target)
    return save_head(tmp_path_factory.mktemp("heads") / "export", heads, heads.config,
                     describe_target(target))


@pytest.fixture(scope="module", params=[1, 3])
def eagle_dir(request, tmp_path_factory, quick_build) -> Path:
    """A random EAGLE-1 or EAGLE-3 export for the toy target (one layer: EAGLE-3 fuses the
    streams 0, 1, 1)."""
    target = Transformer.from_pretrained(quick_build / "target")
    extra = {"draft_vocab_size": 64, "target_layers": (0, 1, 1)} if request.param == 3 else {}
    torch.manual_seed(request.param)
    head = EagleHead(EagleConfig.for_target(target.config, request.param, **extra))
    folder = tmp_path_factory.mktemp(f"eagle{request.param}") / "export"
    return save_head(folder, head, head.config, describe_target(target))


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory, quick_build) -> Path:
    """A random DFlash export for the toy target (one layer: it fuses the streams 0, 1, 1)."""
    target = Transformer.from_pretrained(quick_build / "target")
    config = DFlashConfig.for_target(target.config, mask_token_id=target.config.vocab_size - 1,
                                     block_size=5, target_layers=(0, 1, 1))
    torch.manual_seed(0)
    head = DFlashHead(config)
    folder = tmp_path_factory.mktemp("dflash") / "export"
    return save_head(folder, head, head.config, describe_target(target))


@pytest.fixture(scope="module")
def medusa2_dir(tmp_path_factory, quick_build) -> Path:
    """A Medusa-2 export: untrained heads and a random LoRA adapter (fresh ones are the
    identity), so its adapted target is another model than the toy target."""
    target = Transformer.from_pretrained(quick_build / "target")
    heads, info = lm_head_copies(target), describe_target(target)
    adapted = add_lora(target, LoraSettings(rank=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    folder = save_head(tmp_path_factory.mktemp("medusa2") / "export", heads, heads.config, info)
    save_adapter(adapted, folder / ADAPTER_DIR)
    return folder


@pytest.fixture(scope="module")
def cfg_of():
    """cfg_of(config, *overrides): a conf/ config composed with Hydra's compose API."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda config, *overrides: compose(config, overrides=list(overrides))


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama saved the Hugging Face way (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("small")
    config = ModelConfig(**SMALL_ARCH, head_dim=8, max_position_embeddings=128, bos_token_id=0,
                         eos_token_ids=(1,))
    torch.manual_seed(0)
    model = Transformer(config)
    state = {k if k.startswith("lm_head") else f"model.{k}": v.contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    hf_config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 0,
                 "eos_token_id": 1, **{k: SMALL_ARCH[k] for k in
                                       ("vocab_size", "hidden_size", "intermediate_size")}}
    (folder / "config.json").write_text(json.dumps(hf_config))
    return folder
