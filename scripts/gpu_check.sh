#!/bin/bash
# The checks and figures of docs/gpu.md, on the machine this runs on (one CUDA device).
#   bash scripts/gpu_check.sh bench   # the Llama-2-7B-shaped floor (random weights, bf16):
#                                     # CUDA graphs as written (the oracle chains and trees,
#                                     # every method's draft cost), then compiled
#   bash scripts/gpu_check.sh tests   # the CUDA tests: every drafter on CUDA, graphs and the
#                                     # compiled step against eager, CUDA logits against CPU,
#                                     # every trainer a few steps in bf16
#   bash scripts/gpu_check.sh         # both
# Figures land in outputs/gpu_check/<run>/bench_decode.json.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
what=${1:-all}

if [[ $what == bench || $what == all ]]; then
    # As written: c(N) to 128, the oracle chains and trees (EAGLE-2's 60 nodes, Medusa's 63),
    # and every method's draft cost with random heads, its drafts captured.
    python eval/bench_decode.py model=random-7b device=cuda num_prompts=1 repeats=2 \
        compile=false 'oracle_trees=[eagle2,medusa_63]' \
        'methods=[eagle2,eagle3,eagle1,medusa,early_exit]' \
        hydra.run.dir=outputs/gpu_check/random7b_graphs_compiled_false || status=1
    # Compiled: only the buckets the oracle chains use (k <= 8 verifies at most 16 rows).
    python eval/bench_decode.py model=random-7b device=cuda num_prompts=1 repeats=2 \
        compile=true 'cost_lengths=[1,2,4,8,16]' \
        hydra.run.dir=outputs/gpu_check/random7b_graphs_compiled_true || status=1
fi

if [[ $what == tests || $what == all ]]; then
    python -m pytest tests/test_step.py tests/model/test_placement.py tests/test_batch.py \
        tests/drafters/test_static_drafting.py \
        tests/features/test_every_device.py \
        tests/features/test_train_on_cuda.py tests/measure/test_costs.py \
        tests/measure/test_oracle.py tests/measure/test_floor.py \
        tests/measure/test_passes.py::test_a_training_report_line_says_where_the_drafters_time_went \
        tests/from_config/test_sweeps.py::test_a_random_weights_target_shares_its_weights_with_its_transformers_twin \
        --all -q -rfEs -W ignore::UserWarning || status=1
fi
exit ${status:-0}
