#!/usr/bin/env bash
# Training objectives on SmolLM2 (docs/training.md#objectives): the store and settings of
# peers_trainers_small/compare.sh (343 rows of 256 tokens, 80 steps of 4 rows, two threads),
# one head per trainer.objective, each judged at its last step by held-out greedy tau over 24
# MT-bench prompts (trainer.tau_prompts, 64 new tokens).
set -ex
rm -rf outputs/objectives-smollm2
P="model=smollm2-135m train_data.source=instructions train_data.num_prompts=120 train_data.general_prompts=400 train_data.self_distill_max_new_tokens=128 trainer.seq_len=256"
S="trainer.micro_batch_size=4 trainer.max_steps=80 trainer.keep_best=last trainer.threads=2 trainer.eval_every=1000 final_eval.num_prompts=1 final_eval.max_new_tokens=16 trainer.tau_prompts=24 wandb.enabled=false"
STORE=features/smollm2-peers-small
O="trainer.objective=kl,tv,reverse_kl,jsd,lk"
python train/eagle.py -m $P $S data=mt_bench eagle.version=3 eagle.draft_vocab_size=8192 eagle.ttt_steps=4 \
       optim.lr=5e-4 trainer.features=$STORE $O hydra.sweep.dir=outputs/objectives-smollm2/eagle3
python train/dflash.py -m $P $S data=mt_bench dflash.loss=kl trainer.features=$STORE $O \
       hydra.sweep.dir=outputs/objectives-smollm2/dflash
python scripts/objectives_table.py outputs/objectives-smollm2/eagle3 outputs/objectives-smollm2/dflash \
       --out docs/results/smollm2_objectives/objectives.json
