"""Suffix decoding against arctic-inference 0.3.0's own SuffixDecodingCache (the cache vLLM's
`suffix` method calls), in its own venv: the same requests, learnt token by token and
interleaved as a batch's rows would be, give the same speculations (tokens, tree, estimated
probabilities and scores) from selfspec's SuffixDrafter over a shared SuffixStore.

arctic's side runs in a subprocess (tests/peers/arctic_side.py) with the python of the venv
`scripts/peers.sh arctic` builds; without it these tests skip.
"""

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

import selfspec.drafters.suffix as suffix
from selfspec import SamplingParams
from selfspec.drafters.base import DecodeSetup, DraftContext
from selfspec.drafters.suffix import SuffixDrafter, SuffixSettings, SuffixStore

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".peers" / "arctic" / "venv" / "bin" / "python"
SIDE = Path(__file__).with_name("arctic_side.py")
TOLERANCE = 1e-5  # arctic multiplies float32 ratios along a path; selfspec divides two counts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason="arctic-inference's venv is absent: build "
                                                    "it with scripts/peers.sh arctic"),
]

# (max_tree_depth, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
SETTINGS = [(24, 8, 1.0, 0.0, 0.1, False), (16, 6, 0.5, 1.0, 0.0, False),
            (24, 10, 2.0, -1.0, 0.05, True), (8, 5, 1.0, 0.0, 0.2, True)]


def token_streams(seed: int, requests: int = 6) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs over a vocabulary of 8 whose answers copy spans of their prompt
    and of earlier answers, so that both trees have matches, branches and ties."""
    rng = random.Random(seed)
    pairs, answers = [], []
    for _ in range(requests):
        prompt = [rng.randrange(8) for _ in range(rng.randint(12, 30))]
        answer: list[int] = []
        while len(answer) < 40:
            source = rng.choice([prompt] + answers) if rng.random() < 0.7 else None
            if source:
                start = rng.randrange(len(source))
                answer += source[start:start + rng.randint(2, 9)]
            else:
                answer.append(rng.randrange(8))
        pairs.append((prompt, answer))
        answers.append(answer)
    return pairs


def script(pairs, rows: int, seed: int) -> list[list]:
    """Requests `rows` at a time, each learning its answer in steps of 1-4 tokens (what a
    verification commits) and speculating after each but the last (learnt when the request
    stops: the loop's `finish`); the rows' steps interleave."""
    rng = random.Random(seed)
    ops = []
    for first in range(0, len(pairs), rows):
        batch = list(range(first, min(first + rows, len(pairs))))
        done = {r: 0 for r in batch}
        for r in batch:
            ops.append(["start", r, pairs[r][0]])
            ops.append(["speculate", r, pairs[r][0]])
        while any(done[r] < len(pairs[r][1]) for r in batch):
            for r in batch:
                prompt, answer = pairs[r]
                if done[r] < len(answer):
                    step = answer[done[r]:done[r] + rng.randint(1, 4)]
                    done[r] += len(step)
                    ops.append(["add", r, step])
                    if done[r] < len(answer):
                        ops.append(["speculate", r, prompt + answer[:done[r]]])
                    else:  # the row stops: its last step is learnt now (the loop's `finish`)
                        ops.append(["stop", r, prompt + answer])
    return ops


def arctic_drafts(tmp_path: Path, ops, depth: int, settings: dict) -> list[dict]:
    path, out = tmp_path / "script.json", tmp_path / "drafts.json"
    path.write_text(json.dumps({"max_tree_depth": depth, "settings": settings, "ops": ops}))
    done = subprocess.run([str(PYTHON), str(SIDE), str(path), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def selfspec_drafts(ops, depth: int, settings: SuffixSettings) -> list[dict]:
    """The same script through SuffixDrafter: a drafter per request over one store; each
    proposal learns what its context added (arctic's add_active_response), and `finish` the
    last step's tokens."""
    store, drafters, drafts = SuffixStore(depth), {}, []
    for op, req, *args in ops:
        if op == "start":
            drafters[req] = SuffixDrafter(store, settings)
            drafters[req].begin(DecodeSetup(None, torch.tensor(args[0]), SamplingParams(), None,
                                            0))
        elif op == "speculate":
            draft = drafters[req].propose(DraftContext(torch.tensor(args[0]), None))
            last = drafters[req].last
            assert draft.token_paths() == paths_of(last.tokens, last.parents)
            drafts.append({"tokens": last.tokens, "parents": last.parents, "probs": last.probs,
                           "score": last.score, "match_len": last.match})
        elif op == "stop":
            drafters[req].finish(args[0])
    return drafts


def paths_of(tokens, parents) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


@pytest.mark.parametrize("grouping", ["python", "numpy"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"depth{s[0]}-k{s[1]}-"
                         f"f{s[2]}-o{s[3]}-p{s[4]}-{'tree' if s[5] else 'chain'}")
def test_the_same_speculations_as_arctic_inference(tmp_path, monkeypatch, rows, setting,
                                                   grouping):
    """grouping: every node's children grouped in plain Python, or every one with numpy
    (selfspec groups few occurrences one way and many the other)."""
    monkeypatch.setattr(suffix, "SMALL", 10**9 if grouping == "python" else -1)
    depth, k, factor, offset, min_prob, tree = setting
    ops = script(token_streams(seed=depth + k), rows, seed=rows)
    theirs = arctic_drafts(tmp_path, ops, depth, dict(
        max_spec_tokens=k, max_spec_factor=factor, max_spec_offset=offset,
        min_token_prob=min_prob, use_tree_spec=tree))
    ours = selfspec_drafts(ops, depth, SuffixSettings(k, factor, offset, min_prob, tree))
    assert len(ours) == len(theirs) > 60
    drafted = 0
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        where = f"speculation {i}: ours {a}, arctic's {b}"
        assert a["match_len"] == b["match_len"], where
        assert a["score"] == pytest.approx(b["score"], abs=TOLERANCE), where
        if tree:
            assert_same_tree_up_to_ties(a, b, where)
        else:
            assert paths_of(a["tokens"], a["parents"]) == paths_of(b["tokens"], b["parents"]), \
                where
            assert a["probs"] == pytest.approx(b["probs"], abs=TOLERANCE), where
        drafted += len(a["tokens"]) > 0
    assert drafted > len(ours) / 2  # most speculations drafted something


def assert_same_tree_up_to_ties(ours: dict, theirs: dict, where: str) -> None:
    """A best-first tree takes every node likelier than its last one and some of those exactly
    as likely: both sides must hold the same nodes above that cut, with the same
    probabilities, and as many at it. Which tied nodes make the cut, and the order nodes are
    listed in, is arctic's priority queue's (std::priority_queue, whose order between equal
    items is its heap's), where selfspec takes them in the order they were found."""
    ours_by_path = dict(zip(paths_of(ours["tokens"], ours["parents"]), ours["probs"],
                            strict=True))
    theirs_by_path = dict(zip(paths_of(theirs["tokens"], theirs["parents"]), theirs["probs"],
                              strict=True))
    assert sorted(ours["probs"]) == pytest.approx(sorted(theirs["probs"]), abs=TOLERANCE), where
    cut = min(ours["probs"], default=1.0) + TOLERANCE
    above = {path for path, p in ours_by_path.items() if p > cut}
    assert above == {path for path, p in theirs_by_path.items() if p > cut}, where
    for path in ours_by_path.keys() & theirs_by_path.keys():
        assert ours_by_path[path] == pytest.approx(theirs_by_path[path], abs=TOLERANCE), where
