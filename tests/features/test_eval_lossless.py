"""eval/lossless.py on the toy target: every method's greedy rows equal plain decoding's."""

import json
import shutil

import pytest
import torch
from helpers import load_entry, sweep_variant, toy

from selfspec import generate
from selfspec.from_config.sweeps import build_method, load_sweep_models, plan_sweep, verified_target
from selfspec.heads.draft_vocab import save_token_counts
from selfspec.measure.grid import GridPoint
from selfspec.measure.lossless import greedy_outputs
from selfspec.measure.passes import BenchSettings, Method, measure_row
from selfspec.measure.peers import OurDecoder
from selfspec.metrics import GenerationStats
from selfspec.sampling import SamplingParams


def test_lossless_passes_on_the_toy_target(quick_build, cfg_of, heads_dir, capsys):
    cfg = cfg_of("lossless", *toy(quick_build)[:3], f"medusa_heads={heads_dir}",
                 "methods=[small_model,ngram,medusa,hf_assisted,hf_prompt_lookup]",
                 "num_draft_tokens=[1,3]", "num_prompts=3", "max_new_tokens=16")
    assert load_entry("lossless").run(cfg) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "medusa k=1: 3/3 prompts equal plain" in out
    assert "hf_assisted k=3: 3/3 prompts equal hf_plain" in out


def test_an_eagle1_draft_vocabulary_is_lossless_and_eagle3_heads_refuse_one(
        quick_build, cfg_of, eagle_dir, capsys, tmp_path):
    head = tmp_path / "export"
    shutil.copytree(eagle_dir, head)
    counts = torch.arange(384).flip(0)  # the toy vocabulary; the draft vocabulary: ids 0..K-1
    save_token_counts(head, counts)
    cfg = cfg_of("lossless", *toy(quick_build)[:3], f"eagle_head={head}", "methods=[eagle]",
                 "num_draft_tokens=[3]", "num_prompts=3", "max_new_tokens=16",
                 "eagle.total_tokens=6", "eagle.top_k=2", "eagle.draft_vocab=64")
    version = json.loads((head / "head_config.json").read_text())["config"]["version"]
    if version == 3:
        with pytest.raises(ValueError, match="EAGLE-3 head scores its own draft vocabulary"):
            load_entry("lossless").run(cfg)
        return
    assert load_entry("lossless").run(cfg) == 0
    assert "eagle k=3: 3/3 prompts equal plain" in capsys.readouterr().out
    models = load_sweep_models(cfg, (sweep_variant(cfg, "eagle"),))
    drafter = build_method(models, sweep_variant(cfg, "eagle"), 3).decoder.drafter
    assert drafter.draft_vocab.t2d.sum() == 64 and drafter.draft_vocab.t2d[:64].all()


def test_eagle_rows_are_lossless_and_measured(quick_build, cfg_of, eagle_dir, capsys, tmp_path):
    cfg = cfg_of("lossless", *toy(quick_build)[:3], f"eagle_head={eagle_dir}",
                 "methods=[eagle,ngram]", "num_draft_tokens=[1,3]", "num_prompts=3",
                 "max_new_tokens=16", "eagle.total_tokens=6", "eagle.top_k=2")
    assert load_entry("lossless").run(cfg) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "eagle k=3: 3/3 prompts equal plain" in out
    eagle = sweep_variant(cfg, "eagle")
    models = load_sweep_models(cfg, (eagle,))
    method = build_method(models, eagle, 3)
    assert method.decoder.drafter.shape.depth == 3 and method.draft_nodes == 6
    point = GridPoint(eagle, 3, "t1", SamplingParams(1.0))
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    row, _ = measure_row(method, point, prompts, BenchSettings(max_new_tokens=8))
    assert row.method == "eagle" and row.draft_time_share is not None
    # The row's tau is generate's over the same draws (prompt i seeded i): every step counted.
    live = GenerationStats()
    for i, prompt in enumerate(prompts):
        live.merge(generate(method.decoder.target, prompt, drafter=method.decoder.drafter,
                            sampling=point.sampling, max_new_tokens=8,
                            generator=torch.Generator().manual_seed(i)).stats)
    assert live.steps < 16 and row.tau == pytest.approx(live.tau)


def test_medusa2_rows_verify_against_the_adapted_target(quick_build, cfg_of, medusa2_dir,
                                                       capsys):
    cfg = cfg_of("lossless", *toy(quick_build)[:3], f"medusa_heads={medusa2_dir}",
                 "methods=[medusa,ngram]", "tree=top_k_products", "tree.top_k=4",
                 "tree.max_nodes=16", "num_draft_tokens=[1,2]",
                 "num_prompts=3", "max_new_tokens=16")
    medusa = sweep_variant(cfg, "medusa")
    models = load_sweep_models(cfg, (medusa, sweep_variant(cfg, "ngram")))
    method = build_method(models, medusa, 2)
    medusa_target, _ = verified_target(models, medusa)
    assert method.decoder.target is medusa_target is method.baseline.target
    assert medusa_target is not models.target
    assert method.baseline_name == "plain_adapted"
    assert method.draft_nodes == 16  # max_nodes of the 4 + 4 * 4 product paths, 2 deep
    prompts = [[5, 6, 7], [40, 41, 42, 43], [9]]
    adapted, original = (greedy_outputs(OurDecoder(t), prompts, 16)
                         for t in (medusa_target, models.target))
    assert adapted != original  # so comparing with the wrong target would be caught
    assert load_entry("lossless").run(cfg) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "medusa k=2: 3/3 prompts equal plain_adapted" in out
    assert "ngram k=2: 3/3 prompts equal plain\n" in out


def test_lossless_reports_a_mismatch_with_its_prompt_id_and_fails(
    quick_build, cfg_of, monkeypatch, capsys
):
    class Wrong:
        """Plain decoding that then swaps one token: what a broken drafter would do."""

        measures_draft_time = True

        def __init__(self, decoder):
            self.decoder = decoder

        def forget_learnt(self):
            self.decoder.forget_learnt()

        def __call__(self, prompt, sampling, max_new_tokens, seed, stop_ids):
            result = self.decoder(prompt, sampling, max_new_tokens, seed, stop_ids)
            result.tokens[2] = (result.tokens[2] + 1) % 100
            return result

    entry = load_entry("lossless")
    real = build_method

    def broken(models, variant, k):
        method = real(models, variant, k)
        return Method(method.name, k, Wrong(method.decoder), method.baseline)

    monkeypatch.setattr(entry, "build_method", broken)
    cfg = cfg_of("lossless", *toy(quick_build)[:3], "methods=[ngram]", "num_draft_tokens=[2]",
                 "num_prompts=2", "max_new_tokens=8", "stop_at_eos=false")
    assert entry.run(cfg) == 2  # both prompts differ
    out = capsys.readouterr().out
    assert "MISMATCH ngram k=2: 0/2 prompts" in out
    assert "on prompt HumanEval/0: first difference at new token 2" in out


def test_ngram_rows_with_a_corpus_are_lossless(tmp_path, quick_build, cfg_of):
    """ngram.corpus adds an ngram/corpus row beside ngram: lookup in the target's earlier
    answers (a self-distillation cache file) as well as in the context."""
    answers = tmp_path / "answers.jsonl"
    lines = ["    def __init__(self, name):\n        self.name = name\n",
             "        return self._data[key]\n", "import os\nimport sys\n"]
    answers.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": a}) + "\n"
                               for i, a in enumerate(lines)))
    cfg = cfg_of("lossless", *toy(quick_build)[:3], "methods=[ngram]", f"ngram.corpus={answers}",
                 "num_draft_tokens=[1,3]", "num_prompts=3", "max_new_tokens=16")
    assert load_entry("lossless").run(cfg) == 0
    ngram, corpus = (sweep_variant(cfg, label) for label in ("ngram", "ngram/corpus"))
    models = load_sweep_models(cfg, (ngram, corpus))
    drafter = build_method(models, corpus, 3).decoder.drafter
    assert drafter.corpus is not None and drafter.corpus.num_tokens > 20
    assert drafter.max_nodes == 3  # a chain: ngram.tree_nodes is null
    assert build_method(models, ngram, 3).decoder.drafter.corpus is None
    cfg = cfg_of("lossless", *toy(quick_build)[:3], "methods=[ngram]", f"ngram.corpus={answers}",
                 "ngram.tree_nodes=[null,5]", "num_draft_tokens=[1,3]", "num_prompts=3",
                 "max_new_tokens=16")
    methods = plan_sweep(cfg, 3, greedy_only=True).grid.methods
    assert methods == ("ngram", "ngram/corpus", "ngram/corpus/tree5")
    assert load_entry("lossless").run(cfg) == 0  # and trees of 5 nodes, 1 and 3 deep
    tree5 = sweep_variant(cfg, "ngram/corpus/tree5")
    models = load_sweep_models(cfg, (tree5,))
    assert build_method(models, tree5, 1).decoder.drafter.max_nodes == 5
    answers.write_text("not json\n")
    with pytest.raises(ValueError, match="holds no answers"):
        load_entry("lossless").run(cfg)


def test_merged_ngram_and_medusa_rows_are_lossless(tmp_path, quick_build, cfg_of, heads_dir):
    """ngram+medusa merges Medusa's candidates (ngram.medusa_choices) and lookup's draft into
    one tree of ngram.merged_nodes nodes, a row per ngram.tree_nodes entry with a corpus."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "p", "answer": "        return self._data[key]\n"})
                       + "\n")
    common = [*toy(quick_build)[:3], f"medusa_heads={heads_dir}", "num_draft_tokens=[1,3]",
              "num_prompts=3", "max_new_tokens=16"]
    cfg = cfg_of("lossless", *common, "methods=[ngram+medusa,ngram]", f"ngram.corpus={answers}",
                 "ngram.tree_nodes=[null,4]", "ngram.merged_nodes=5")
    assert plan_sweep(cfg, 3, greedy_only=True).grid.methods == (
        "ngram+medusa", "ngram+medusa/tree4", "ngram", "ngram/corpus", "ngram/corpus/tree4")
    assert load_entry("lossless").run(cfg) == 0
    tree4 = sweep_variant(cfg, "ngram+medusa/tree4")
    models = load_sweep_models(cfg, (tree4,))
    method = build_method(models, tree4, 3)
    medusa, lookup = method.decoder.drafter.drafters
    assert medusa.tree.choices == ((0,), (1,)) and lookup.max_nodes == 4
    corpus = models.once("lookup_corpus", lambda: None)  # loaded once, shared by the rows
    assert lookup.corpus is corpus is not None and method.draft_nodes == 5
    cfg = cfg_of("lossless", *common, "methods=[ngram+medusa]",
                 "ngram.medusa_choices=[[0],[0,0],[0,0,0]]")
    with pytest.raises(ValueError, match="are 3 deep but the heads .* are 2"):
        load_entry("lossless").run(cfg)
