#!/usr/bin/env bash
# One evaluator for every trainer's head: selfspec's replay of the target's recorded greedy
# answers to 24 MT-bench prompts (128 tokens), held out from every trainer's rows.
set -ex
R="model=smollm2-135m data=mt_bench num_prompts=24 max_new_tokens=128 record=runs/peers/mt_bench_greedy24.json"
for head in runs/peers/selfspec-eagle3/checkpoints/step_0000080/export runs/peers/speculators-eagle3/export; do
  python eval/replay.py $R 'methods=[eagle]' eagle_head=$head eagle.total_tokens=8 eagle.top_k=2 'num_draft_tokens=[3]' hydra.run.dir=$head/../replay
done
for head in runs/peers/selfspec-dflash/checkpoints/step_0000080/export runs/peers/speculators-dflash/export runs/peers/specforge-dflash/export; do
  python eval/replay.py $R 'methods=[dflash]' dflash_head=$head hydra.run.dir=$head/../replay
done
