import importlib
import os
from pathlib import Path

import pytest
import torch
from helpers import suite_threads, tiny_llama

from selfspec import Transformer, generate


def pytest_configure(config) -> None:
    """Torch threads for the whole suite: SELFSPEC_TEST_THREADS, default 1. The test models are
    tiny: one thread is as fast as two, and it keeps timings sane when the other core is busy
    (a second OpenMP thread spin-waits on a loaded core). With 2, float sums round in another
    order, which no test may depend on."""
    threads = os.environ.get("SELFSPEC_TEST_THREADS", "1")
    if not threads.isdigit() or int(threads) < 1:
        raise pytest.UsageError(f"SELFSPEC_TEST_THREADS must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(suite_threads())


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
