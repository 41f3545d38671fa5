"""vLLM's CPU build as this CPU's throughput anchor: selfspec and vLLM decode SmolLM2 on the
same prompts, in fp32, on the same threads, in one run: plain decoding, then each one's
speculative methods, at each batch size.

    python scripts/vllm_anchor.py --out docs/results/vllm_anchor       # about 15 minutes

Needs `scripts/peers.sh vllm` and SmolLM2's package (README, "Install"). selfspec's side is one
eval/sweep.py run (plain decoding re-measured beside each method, prompt by prompt: n-gram
lookup in the context and in the shipped answers, the shipped EAGLE head's chain);
vLLM's is scripts/vllm_anchor_side.py, one engine a configuration and batch size, on the
prompt ids the sweep recorded (plain decoding, its n-gram proposer, the shipped EAGLE head
exported with scripts/export_heads.py). Every generation runs --max-new-tokens tokens (EOS
ignored on both sides). Writes anchor.json: every figure, the commands, and the ratios
selfspec / vLLM for plain decoding and for each one's best method at each batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".peers/vllm/venv/bin/python"
TARGET = Path.home() / ".cache/selfspec/models/smollm2-135m"  # the converted folder
SHIPPED_EAGLE = ROOT / "selfspec/assets/heads/smollm2-135m/eagle_head"


def sweep_command(args, folder: Path) -> list[str]:
    """selfspec's side: the README's lookup rows and the shipped EAGLE head's chain."""
    batches = ",".join(map(str, args.batch_sizes))
    return [sys.executable, str(ROOT / "eval/sweep.py"), "model=smollm2-135m", "data=mt_bench",
            f"bench.num_prompts={args.prompts}", f"bench.max_new_tokens={args.max_new_tokens}",
            f"bench.batch_sizes=[{batches}]", "samplings=[greedy]", "stop_at_eos=false",
            f"threads={args.threads}", "wandb.enabled=false", "progress=false",
            "methods=[ngram,eagle]", "ngram.corpus=shipped", "eagle_head=shipped",
            "num_draft_tokens=[1,3]", "baseline=shared", f"hydra.run.dir={folder}"]


def prompt_ids(args) -> list[list[int]]:
    """The token ids of the prompts the sweep decodes (its texts, its encoding)."""
    from hydra import compose, initialize_config_dir

    from selfspec.from_config.models import load_tokenizer
    from selfspec.from_config.prompts import encode_prompt_texts, sweep_prompt_texts

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("sweep", overrides=["model=smollm2-135m", "data=mt_bench"])
    texts = sweep_prompt_texts(cfg.data, args.prompts)
    return [p.ids for p in encode_prompt_texts(cfg.data, texts, load_tokenizer(TARGET))]


def vllm_configs(eagle_folder: Path | None) -> dict[str, dict | None]:
    """vLLM's side: plain decoding, its n-gram proposer (the context's latest-to-earliest
    match of 1-3 tokens, its defaults) at chains of 1 and 3, the shipped EAGLE head's chain."""
    configs: dict[str, dict | None] = {"plain": None}
    for k in (1, 3):
        configs[f"ngram/{k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if eagle_folder is not None:
        for k in (1, 3):
            configs[f"eagle/{k}"] = {"method": "eagle", "model": str(eagle_folder),
                                     "num_speculative_tokens": k}
    return configs


def export_eagle(folder: Path) -> tuple[Path | None, str]:
    """The shipped EAGLE head in vLLM's layout under folder (a scratch folder: the weights are
    not results), or None and the exporter's refusal."""
    out = folder / "eagle_vllm"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/export_heads.py"),
                           str(SHIPPED_EAGLE), "--to", "vllm", str(out)],
                          capture_output=True, text=True)
    if done.returncode:
        return None, (done.stderr or done.stdout).strip().splitlines()[-1]
    return out, "exported"


def serve(job: dict, folder: Path, name: str, threads: int) -> dict:
    """One vLLM engine over the prompts at one batch size; its cores pinned to `threads`."""
    stem = folder / name.replace("/", "_")
    stem.with_suffix(".job.json").write_text(json.dumps(job))
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts/vllm_anchor_side.py"),
                           str(stem.with_suffix(".job.json")), str(stem.with_suffix(".json"))],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(stem.with_suffix(".json").read_text())


def selfspec_rows(results: dict) -> dict[str, dict[int, dict]]:
    """The sweep's rows as {label: {batch: figures}}; plain decoding from its baselines."""
    rows: dict[str, dict[int, dict]] = {"plain": {}}
    for row in results["rows"]:
        batch = row.get("batch_size", 1)
        label = f"{row['method']}/{row['draft_length']}"
        rows.setdefault(label, {})[batch] = {
            "tokens_per_s": row["tokens_per_s"], "tau": row["tau"],
            "speedup": row["speedup"], "lossless": row["lossless"]}
        rows["plain"].setdefault(batch, []).append(row["baseline_tokens_per_s"])
    rows["plain"] = {b: {"tokens_per_s": sum(v) / len(v), "runs": len(v)}
                     for b, v in rows["plain"].items()}
    return rows


def vllm_rows(served: dict[str, dict[int, dict]], plain_tokens: dict[int, list]) -> dict:
    rows = {}
    for label, by_batch in served.items():
        rows[label] = {}
        for batch, got in by_batch.items():
            if "error" in got:
                rows[label][batch] = got
                continue
            drafts = got["drafts"]
            rows[label][batch] = {
                "tokens_per_s": got["tokens_per_s"],
                "mean_acceptance_length": 1 + got["accepted"] / drafts if drafts else None,
                "equals_plain": got["tokens"] == plain_tokens.get(batch, got["tokens"])}
    return rows


def best(rows: dict, batch: int) -> tuple[str, float] | None:
    found = [(label, r[batch]["tokens_per_s"]) for label, r in rows.items()
             if label != "plain" and batch in r and "tokens_per_s" in r[batch]]
    return max(found, key=lambda item: item[1]) if found else None


def ratios(ours: dict, theirs: dict, batches: list[int]) -> dict:
    out = {}
    for batch in batches:
        plain = ours["plain"][batch]["tokens_per_s"] / theirs["plain"][batch]["tokens_per_s"]
        mine, peer = best(ours, batch), best(theirs, batch)
        out[batch] = {"plain": plain, "selfspec_best": mine, "vllm_best": peer,
                      "best": mine[1] / peer[1] if mine and peer else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/vllm_anchor")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit("error: vLLM's venv is missing: build it with `scripts/peers.sh vllm`")
    if not TARGET.exists():
        sys.exit(f"error: {TARGET} is missing: run any SmolLM2 command once (README) to write it")
    (args.out / "vllm").mkdir(parents=True, exist_ok=True)
    command = sweep_command(args, args.out / "selfspec")
    subprocess.run(command, check=True)
    results = json.loads((args.out / "selfspec/results.json").read_text())
    prompts = prompt_ids(args)
    served = {}
    with tempfile.TemporaryDirectory() as scratch:
        eagle_folder, eagle_note = export_eagle(Path(scratch))
        for label, spec in vllm_configs(eagle_folder).items():
            served[label] = {b: serve({"model": str(TARGET), "prompts": prompts,
                                       "max_tokens": args.max_new_tokens, "batch": b,
                                       "speculative_config": spec}, args.out / "vllm",
                                      f"{label}_b{b}", args.threads)
                             for b in args.batch_sizes}
            print(label, {b: round(r.get("tokens_per_s", 0), 2)
                          for b, r in served[label].items()})
    plain_tokens = {b: r.get("tokens") for b, r in served["plain"].items()}
    ours, theirs = selfspec_rows(results), vllm_rows(served, plain_tokens)
    anchor = {"command": " ".join(["python", "scripts/vllm_anchor.py", *sys.argv[1:]]),
              "selfspec_command": " ".join(command[1:]), "eagle_export": eagle_note,
              "settings": vars(args) | {"out": str(args.out)}, "machine": results["machine"],
              "selfspec": ours, "vllm": theirs,
              "ratios": ratios(ours, theirs, args.batch_sizes)}
    (args.out / "anchor.json").write_text(json.dumps(anchor, indent=1))
    for batch, r in anchor["ratios"].items():
        print(f"batch {batch}: plain selfspec/vLLM {r['plain']:.2f}; best {r['selfspec_best']} "
              f"against {r['vllm_best']}: {r['best'] or float('nan'):.2f}")


if __name__ == "__main__":
    main()
