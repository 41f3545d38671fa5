"""The decode loop's floor and ceiling on this machine: plain tokens/s (selfspec and Hugging
Face generate on the same weights), the memory floor (what a token reads, at the copy
bandwidth measured in the same run), c(N), and the oracle drafter against its bound, as a
chain, hidden in trees (conf oracle_trees) and against batch size (conf batch_sizes).

    python eval/bench_decode.py                                  # tiny target, CPU
    python eval/bench_decode.py model=random-7b device=cuda      # Llama-2-7B shape, bf16
    python eval/bench_decode.py model=random-moe device=cuda     # Qwen3-30B-A3B's proportions

Prints a table and writes bench_decode.json and c_of_n.png into the run folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.common import set_threads
from selfspec.from_config.methods import cost_rows
from selfspec.from_config.sweeps import floor_settings, timing_models
from selfspec.measure.divergence import describe_difference
from selfspec.measure.floor import measure_floor
from selfspec.measure.plots import plot_cost_profile
from selfspec.measure.results import machine_facts, split_percent


@hydra_entry_point("bench_decode")
def main(cfg: DictConfig) -> None:
    set_threads(cfg)
    settings = floor_settings(cfg)  # checked before any model loads
    target, hf_model = timing_models(cfg)
    figures = measure_floor(target, hf_model, settings, cost_rows())
    figures |= {"model": cfg.model.name, "machine": machine_facts()}
    folder = Path(cfg.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_decode.json").write_text(json.dumps(figures, indent=1))
    profile = figures["cost_profile"]
    plot_cost_profile(profile["c"], f"{cfg.model.name}, {profile['device']}, {profile['dtype']}",
                      folder / "c_of_n.png")
    print(report(figures))
    print(f"figures in {folder.resolve()}")


def report(figures: dict) -> str:
    profile = figures["cost_profile"]
    graphs = "CUDA graphs" if figures["cuda_graphs"] else "eager"
    if figures.get("compiled") and figures["cuda_graphs"]:
        graphs += f", compiled; {figures['setup_seconds']:.0f} s compiling and capturing"
    if figures.get("invariant_rows"):
        graphs += f", the exact mode (products in blocks of {figures['invariant_rows']} rows)"
    lines = [f"{figures['model']} on {profile['device']} ({profile['dtype']}, {graphs}): plain "
             f"{figures['plain_tokens_per_s']:.1f} tokens/s (Hugging Face generate "
             f"{figures['hf_plain_tokens_per_s']:.1f}); one-token forward "
             f"{profile['one_token_ms']:.2f} ms; peak memory of the oracle and plain runs "
             f"{figures['peak_memory_mb']:.0f} MiB ({figures['peak_memory_kind']})",
             _floor_line(figures["memory_floor"]),
             "c(N): " + ", ".join(f"{n}: {c:.2f}" for n, c in profile["c"].items()),
             *_experts_line(profile),
             "oracle  k   tau  speedup  bound  efficiency  lossless  time % "
             "pre/draft/fwd/probs/verify/commit/other"]
    lines += [f"       {r['k']:>2}  {r['tau']:.2f}  {r['speedup']:>6.2f}x  {r['bound']:.2f}x  "
              f"{r['efficiency']:>9.2f}  {str(r['lossless']):<8}  "
              f"{split_percent(r['time_split'])}{_parted(r)}" for r in figures["oracle"]]
    if figures["oracle_trees"]:
        lines.append("oracle tree  nodes  depth   tau  speedup  bound  efficiency  lossless")
        lines += [f"{r['tree']:<11}  {r['nodes']:>5}  {r['depth']:>5}  {r['tau']:.2f}  "
                  f"{r['speedup']:>6.2f}x  {r['bound']:.2f}x  {r['efficiency']:>9.2f}  "
                  f"{r['lossless']}{_parted(r)}" for r in figures["oracle_trees"]]
    if figures["methods"]:
        lines.append("method      nodes  draft cost  a level  c(N+1)  step  projected speedup "
                     "(published tau)  time % pre/draft/fwd/probs/verify/commit/other")
        lines += [f"{r['method']:<10}  {r['nodes']:>5}  {r['draft_cost']:>10.2f}  "
                  f"{r['draft_cost_per_level']:>7.2f}  {r['c_verify']:>6.2f}  "
                  f"{r['step_cost']:>4.2f}  " + (
                      f"{r['projected_speedup']:.2f}x ({r['published_tau']})"
                      if r["projected_speedup"] is not None else "-").ljust(33)
                  + f"  {split_percent(r['time_split'])}{_parted(r)}" for r in figures["methods"]]
        lines.append("draft costs in plain steps, random heads; projections from tau published "
                     "for Vicuna-7B (MT-bench, T=0, EAGLE-2 paper), not measured")
    if figures["batches"]:
        k = figures["batches"][0]["draft_tokens"]
        lines.append(f"batch  plain tokens/s  oracle k={k} tokens/s  speedup   tau  c_B(k+1)  "
                     f"bound  lossless")
        lines += [f"{r['batch_size']:>5}  {r['plain_tokens_per_s']:>14.1f}  "
                  f"{r['oracle_tokens_per_s']:>19.1f}  {r['speedup']:>6.2f}x  {r['tau']:.2f}  "
                  f"{r['c_verify']:>8.2f}  {r['bound']:>4.2f}x  {r['lossless']}{_parted(r)}"
                  for r in figures["batches"]]
    return "\n".join(lines)


def _parted(row: dict) -> str:
    """Where a greedy output parted from plain decoding's, and whether at a near-tie."""
    found = describe_difference(row.get("first_difference"))
    return f"  (parted at {found})" if found else ""


def _experts_line(profile: dict) -> list[str]:
    """A MoE target's distinct experts touched per layer by a forward of N tokens."""
    touched = profile.get("experts_touched")
    if touched is None:
        return []
    return ["distinct experts per MoE layer: " + ", ".join(f"{n}: {e:.1f}"
                                                           for n, e in touched.items())]


def _floor_line(floor: dict) -> str:
    bandwidth = floor["copy_bytes_per_s"] / 1e9
    return (f"memory floor: {floor['weight_bytes'] / 1e9:.2f} GB of weights and "
            f"{floor['kv_bytes'] / 1e9:.2f} GB of K/V a token at {bandwidth:.0f} GB/s (a copy, "
            f"read + written, measured now): {floor['floor_ms']:.2f} ms; the "
            f"one-token forward reaches {floor['share_of_one_token_forward']:.2f} of it, plain "
            f"decoding {floor['share_of_plain_decoding']:.2f}")


if __name__ == "__main__":
    main()
