#!/bin/bash
# The checks and figures of README "On a GPU", on the machine this runs on (one CUDA device):
# the CUDA tests (every drafter on CUDA, CUDA graphs against eager, CUDA logits against CPU),
# then the decode loop's floor on the Llama-2-7B shape with random weights (bf16), with CUDA
# graphs and eagerly. Figures land in outputs/gpu_check/.
#   bash scripts/gpu_check.sh
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
python -m pytest tests/test_step.py tests/test_devices.py tests/test_costs.py -q -rfEs \
    -W ignore::UserWarning || status=1
for graphs in true false; do
    python eval/bench_decode.py model=random-7b device=cuda num_prompts=1 repeats=2 \
        cuda_graphs=$graphs hydra.run.dir=outputs/gpu_check/random7b_graphs_$graphs || status=1
done
exit ${status:-0}
