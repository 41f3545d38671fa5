#!/usr/bin/env bash
# The trainers side by side at a small scale (docs/peers.md): one fp32 store of SmolLM2's
# instruction rows (120 + 400 answers, rows of 256 tokens: 343 rows), 80 steps of 4 rows each,
# two threads; EAGLE-3 by selfspec and speculators, DFlash by selfspec, speculators and SpecForge.
set -ex
# Each trainer starts in an empty folder (selfspec refuses another run's checkpoints, and
# speculators would resume from them).
rm -rf runs/peers/{selfspec,speculators}-eagle3 runs/peers/{selfspec,speculators,specforge}-dflash
P="model=smollm2-135m train_data.source=instructions train_data.num_prompts=120 train_data.general_prompts=400 train_data.self_distill_max_new_tokens=128 trainer.seq_len=256"
S="trainer.micro_batch_size=4 trainer.max_steps=80 trainer.keep_best=last trainer.threads=2 trainer.eval_every=1000 final_eval.num_prompts=1 final_eval.max_new_tokens=16"
STORE=features/smollm2-peers-small
T="--target $HOME/.cache/selfspec/models/smollm2-135m --store $STORE --steps 80 --batch 4 --threads 2"
python train/eagle.py $P $S data=mt_bench eagle.version=3 eagle.draft_vocab_size=8192 eagle.ttt_steps=4 \
       optim.lr=5e-4 trainer.features=$STORE hydra.run.dir=runs/peers/selfspec-eagle3
python scripts/peer_train.py eagle3 $T --lr 5e-4 --ttt-steps 4 --draft-vocab-size 8192 --out runs/peers/speculators-eagle3
python train/dflash.py $P $S data=mt_bench trainer.features=$STORE hydra.run.dir=runs/peers/selfspec-dflash
python scripts/peer_train.py dflash $T --out runs/peers/speculators-dflash
python scripts/peer_train.py dflash --peer specforge $T --out runs/peers/specforge-dflash
