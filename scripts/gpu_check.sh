#!/bin/bash
# The checks and figures of README "On a GPU", on the machine this runs on (one CUDA device):
# the CUDA tests (every drafter on CUDA, CUDA graphs against eager, CUDA logits against CPU),
# then the decode loop's floor on the Llama-2-7B shape with random weights (bf16), with CUDA
# graphs and eagerly. Figures land in outputs/gpu_check/.
#   bash scripts/gpu_check.sh
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
python -m pytest tests/test_step.py tests/features/test_every_device.py tests/measure/test_costs.py \
    tests/measure/test_oracle.py tests/measure/test_floor.py \
    tests/measure/test_passes.py::test_a_training_report_line_says_where_the_drafters_time_went \
    tests/from_config/test_sweeps.py::test_a_random_weights_target_shares_its_weights_with_its_transformers_twin \
    -q -rfEs -W ignore::UserWarning || status=1
for graphs in true false; do
    python eval/bench_decode.py model=random-7b device=cuda num_prompts=1 repeats=2 \
        cuda_graphs=$graphs hydra.run.dir=outputs/gpu_check/random7b_graphs_$graphs || status=1
done
exit ${status:-0}
