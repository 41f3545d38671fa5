#!/bin/bash
# The wheels scripts/gpu_check.sh installs on a GPU machine (Python 3.12, x86-64, no registry
# there): what its image lacks (scripts/gpu_wheels.py names them), fetched into .whl/ with
# pip's configured indexes, one version of each; .whl/ is ignored by git and travels as a
# carried path (run: carry [".whl"]). Checks that every wheel's requirements are met by the
# set or by the machine's image, prints the size of what travels, and refuses (one line,
# exit 2) when the tree and the wheels exceed the 64 MiB that travels.
#   bash scripts/gpu_wheels.sh [FOLDER]    # default .whl
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
folder=${1:-.whl}
python=${PYTHON:-python3}
limit=$((64 * 1024 * 1024))
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# Ignored in every checkout (.gitignore), and in this repository's own exclude file, so that
# the wheels never enter a commit and travel only when carried.
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >>"$exclude"

mkdir -p "$folder"
mapfile -t wanted < <("$python" scripts/gpu_wheels.py names) || exit 1
for spec in "${wanted[@]}"; do
    name=${spec%%==*}
    file_name=$(echo "$name" | tr '-' '_')
    rm -f "$folder"/"$file_name"-[0-9]*.whl  # one version of each: two stop the install
    if [[ $name == antlr4-python3-runtime ]]; then  # a source archive only: pure Python
        "$python" -m pip wheel -q --no-deps -w "$folder" "$spec" || exit 1
    else
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platforms[@]}" -d "$folder" "$spec" || exit 1
    fi
done
"$python" scripts/gpu_wheels.py check "$folder" || exit 2

bytes() { xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
tree=$(( $(git ls-files -z | bytes) + $(git ls-files -z -o --exclude-standard | bytes) ))
wheels=$(find "$folder" -name '*.whl' -print0 | bytes)
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
ls -l "$folder"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
echo "wheels $(mib "$wheels") + tree $(mib "$tree") = $(mib $((wheels + tree))) of the $(mib $limit) that travel"
if (( wheels + tree > limit )); then
    echo "error: the tree ($(mib "$tree")) and the wheels in $folder ($(mib "$wheels")) exceed the 64 MiB that travels to a GPU machine; drop the largest wheel (torchao: quantized targets on CUDA then skip) or shrink the tree" >&2
    exit 2
fi
