"""Training data: assistant-only loss masks, packing, self-distillation, and the split of the
stdlib corpus."""

import json

import pytest
import torch
from helpers import tiny_llama
from transformers import AutoTokenizer

from selfspec.corpus import stdlib_files, stdlib_manifest_sha256
from selfspec.decode import generate
from selfspec.model import Transformer
from selfspec.training.data import (
    document_rows,
    first_answers,
    load_jsonl_documents,
    load_sharegpt,
    pack_token_stream,
    packed_chat_dataset,
    render_conversation,
    reply_prompt,
    rows_from_dataset,
    self_distill,
    self_distill_rows,
)
from selfspec.training.features import (
    FeatureStore,
    StoreWriter,
    build_store,
    store_spec,
)
from selfspec.training.rows import TokenRows

CHAT = [{"role": "user", "content": "add one"},
        {"role": "assistant", "content": "def f(x):\n    return x + 1\n"}]


@pytest.fixture(scope="module")
def tokenizer(quick_build):
    return AutoTokenizer.from_pretrained(quick_build / "tokenizer")


def test_loss_mask_covers_the_assistant_reply_only(tokenizer):
    ids, mask = render_conversation(tokenizer, CHAT)
    assert len(ids) == len(mask)
    reply = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tokenizer.decode(reply).startswith("def f(x):") and reply[-1] == tokenizer.eos_token_id
    assert "add one" in tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])


def test_a_chat_template_renders_and_masks_the_reply(quick_build):
    tok = AutoTokenizer.from_pretrained(quick_build / "tokenizer")
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}[end]{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ids, mask = render_conversation(tok, CHAT)
    assert tok.decode(ids) == "[user]add one[end][assistant]" + CHAT[1]["content"] + "[end]"
    reply = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert reply == CHAT[1]["content"] + "[end]"


def test_reply_prompt_is_the_conversation_up_to_the_reply(tokenizer):
    ids, mask = render_conversation(tokenizer, CHAT)
    assert ids[: mask.index(1)] == reply_prompt(tokenizer, CHAT[:1])


def test_sharegpt_file_loads_and_packs_with_masks(tmp_path, tokenizer):
    records = [{"conversations": [{"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "x = 1\n" * 5}]}] * 8
    (tmp_path / "c.json").write_text(json.dumps(records))
    rows = rows_from_dataset(packed_chat_dataset(tokenizer, load_sharegpt(tmp_path / "c.json"), 16))
    assert rows.tokens.shape[1] == 16 and 0 < rows.loss_mask.float().mean() < 1
    (tmp_path / "empty.json").write_text(json.dumps([{"conversations": []}]))
    with pytest.raises(ValueError, match="no conversation with an assistant turn"):
        load_sharegpt(tmp_path / "empty.json")


def test_self_distillation_replaces_replies_with_the_targets_own(tokenizer):
    hf = tiny_llama(0, vocab=len(tokenizer))
    target = Transformer.from_hf(hf)
    [distilled] = self_distill([CHAT], target, tokenizer, max_new_tokens=6)
    assert distilled[0] == CHAT[0]
    expected = generate(target, reply_prompt(tokenizer, CHAT[:1]), max_new_tokens=6,
                        eos_token_id=tokenizer.eos_token_id).tokens
    assert distilled[1]["content"] == tokenizer.decode(
        [t for t in expected if t != tokenizer.eos_token_id])
    assert torch.is_tensor(target.lm_head.weight)


def corpus_rows(n: int = 10, length: int = 20) -> TokenRows:
    tokens = torch.randint(2, 64, (n, length), generator=torch.Generator().manual_seed(3))
    return TokenRows(tokens, torch.ones_like(tokens))


def test_corpus_self_distillation_continues_rows_with_the_targets_greedy_output(tmp_path):
    target = Transformer.from_hf(tiny_llama(0))
    rows = corpus_rows()
    distilled = self_distill_rows(rows, target, prompt_tokens=6, count=4, batch_size=3,
                                  cache_dir=tmp_path)
    picked = [0, 3, 6, 9]  # evenly across the corpus
    assert distilled.tokens.shape == (4, 20)
    assert torch.equal(distilled.tokens[:, :6], rows.tokens[picked, :6])
    for row in distilled.tokens:  # batched generation = one-by-one greedy decoding
        assert row[6:].tolist() == generate(target, row[:6].tolist(), max_new_tokens=14).tokens
    assert distilled.loss_mask[:, :6].sum() == 0 and distilled.loss_mask[:, 6:].all()
    assert rows.tokens[picked, 6:].ne(distilled.tokens[:, 6:]).any()  # really rewritten
    (cached,) = tmp_path.glob("*-distilled.safetensors")
    again = self_distill_rows(rows, target, prompt_tokens=6, count=4, cache_dir=tmp_path)
    assert torch.equal(again.tokens, distilled.tokens) and len(list(tmp_path.iterdir())) == 1
    other = Transformer.from_hf(tiny_llama(1))  # another target: not served from the cache
    fresh = self_distill_rows(rows, other, prompt_tokens=6, count=4, cache_dir=tmp_path)
    assert not torch.equal(fresh.tokens, distilled.tokens)
    with pytest.raises(ValueError, match=r"prompt_tokens must lie in \[1, 20\)"):
        self_distill_rows(rows, target, prompt_tokens=20)


def test_split_is_disjoint_sorted_and_about_five_percent():
    train, heldout = stdlib_files("train"), stdlib_files("heldout")
    assert train == sorted(train) and heldout == sorted(heldout)
    assert not set(train) & set(heldout)
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.08
    assert not any(p in ("test", "tests", "idle_test", "site-packages")
                   for f in train + heldout for p in f.parts[-4:-1])
    assert stdlib_manifest_sha256() == stdlib_manifest_sha256()


def test_pack_token_stream_drops_the_tail():
    windows = pack_token_stream(list(range(10)), 4)
    assert windows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="do not fill"):
        pack_token_stream([1, 2], 4)


def test_a_quantized_targets_weights_have_a_fingerprint_of_their_own():
    """Cached answers are keyed by the weights: a quantized target's (torchao tensors have no
    sum) count as the weights its kernels compute with; a plain model's key is its parameter
    sum, as ever (the shipped answers' keys stay valid)."""
    from helpers import tiny_llama

    from selfspec.model import Transformer
    from selfspec.model.quantized import quantized_copy
    from selfspec.training.data import weights_fingerprint

    full = Transformer.from_hf(tiny_llama(0, hidden=64))
    total = sum(float(p.detach().double().sum()) for p in full.parameters())
    assert weights_fingerprint(full) == f"{full.config}|{total:.12e}"
    int8, int4 = (weights_fingerprint(quantized_copy(full, bits)) for bits in (8, 4))
    assert len({int8, int4, weights_fingerprint(full)}) == 3


def test_corpus_self_distillation_stores_the_states_it_generates_and_resumes(tmp_path,
                                                                           monkeypatch):
    from selfspec.training import data

    target = Transformer.from_hf(tiny_llama(0))
    rows = corpus_rows()
    spec = store_spec(target, (1,), "fp32", "distilled")
    writer = StoreWriter(tmp_path / "generated", spec)
    calls = []
    real = data._greedy_continuations
    monkeypatch.setattr(data, "_greedy_continuations",
                        lambda *args: calls.append(len(args[1])) or real(*args))
    distilled = self_distill_rows(rows, target, prompt_tokens=6, count=5, batch_size=2,
                                  store=writer)
    assert calls == [2, 2, 1]
    forwards = []
    hook = target.register_forward_hook(lambda m, args, out: forwards.append(1))
    names = build_store(target, distilled, writer, prefix="train", rows_per_shard=2,
                        progress=False)  # the shards the generation wrote: nothing to run
    hook.remove()
    assert not forwards and writer.finish(names) is not None
    forced = StoreWriter(tmp_path / "forced", spec)  # one teacher-forced pass afterwards
    forced.finish(build_store(target, distilled, forced, prefix="train", progress=False))
    generated, teacher_forced = (FeatureStore(w.folder).read(distilled.tokens, (1,),
                                                             torch.float32)
                                 for w in (writer, forced))
    torch.testing.assert_close(generated.last, teacher_forced.last)
    torch.testing.assert_close(generated.streams[0], teacher_forced.streams[0])
    writer.path(names[1]).unlink()  # a run killed before its second batch's shard
    calls.clear()
    again = self_distill_rows(rows, target, prompt_tokens=6, count=5, batch_size=2,
                              store=writer)
    assert calls == [2] and torch.equal(again.tokens, distilled.tokens)  # the rest read back


def test_nested_answer_sets_are_prefixes_of_each_other_rows_included():
    documents = [([i] * (3 + i % 5), [0] + [1] * (2 + i % 5)) for i in range(2, 80)]
    assert first_answers(list(range(10)), 4) == first_answers(list(range(10)), 7)[:4]
    assert sorted(first_answers(list(range(10)), 99)) == list(range(10))
    assert first_answers(list(range(10)), 4) != list(range(4))  # shuffled
    small, held = document_rows(documents, 8, max_answers=20)
    large, held_large = document_rows(documents, 8, max_answers=60)
    assert torch.equal(held.tokens, held_large.tokens)  # the held-out set does not move
    assert torch.equal(small.tokens, large.tokens[: len(small)])
    assert torch.equal(small.loss_mask, large.loss_mask[: len(small)])
    with pytest.raises(ValueError, match="max_answers must be an integer >= 1"):
        first_answers(documents, 0)


def test_jsonl_documents_take_token_ids_and_chat_turns(tmp_path, tokenizer):
    lines = [{"tokens": [5, 6, 7]}, {"tokens": [5, 6], "loss_mask": [0, 1]},
             {"prompt_ids": [9, 9], "answer_ids": [4]},
             {"messages": CHAT}, {"conversations": [{"from": "human", "value": "add one"},
                                                    {"from": "gpt", "value": CHAT[1]["content"]}]},
             {"prompt": "add one", "answer": CHAT[1]["content"]}]
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    docs = load_jsonl_documents(path, tokenizer)
    assert docs[:3] == [([5, 6, 7], [1, 1, 1]), ([5, 6], [0, 1]), ([9, 9, 4], [0, 0, 1])]
    chat = render_conversation(tokenizer, CHAT)
    assert docs[3] == docs[4] == docs[5] == chat
    for bad, says in [({"tokens": [1, -2]}, "integers >= 0"),
                      ({"tokens": [1, 2], "loss_mask": [1]}, "one per token"),
                      ({"text": "hi"}, "expected tokens, prompt_ids and answer_ids")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"answers.jsonl, line 1: .*{says}"):
            load_jsonl_documents(path, tokenizer)
