import importlib
from pathlib import Path

import pytest
import torch

# The test models are tiny: one thread is as fast as two, and it keeps timings sane when the
# other core is busy (a second OpenMP thread spin-waits on a loaded core).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def quick_build(tmp_path_factory) -> Path:
    """The tiny-model recipe at toy size (scripts/build_tiny.py --quick): tokenizer, target,
    draft folders, built once per test session."""
    out = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
        build_tiny = importlib.import_module("build_tiny")
        assert build_tiny.main(["--quick", "--out", str(out)]) == 0
    return out
