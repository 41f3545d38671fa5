"""Training rows from every source, packed into windows of token ids and loss masks.

The stdlib corpus (`selfspec.corpus`) tokenised and joined with eos; ShareGPT conversations and
JSON lines of token ids or chat turns, the loss on the answers; the target's own greedy answers
(self-distillation), written to the feature store as they are generated. Tokenised and
generated rows are cached under a key of what made them (`cache_key`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.checks import is_count
from selfspec.corpus import Split, read_source, stdlib_files, stdlib_manifest_sha256
from selfspec.model.fingerprint import cache_key, weights_fingerprint
from selfspec.training.rows import TokenRows

if TYPE_CHECKING:
    from selfspec.training.features import StoreWriter, TargetStates

EOS_TOKEN = "<|endoftext|>"


def token_stream(tokenizer, paths: Iterable[Path], max_tokens: int | None = None) -> list[int]:
    """Documents joined with eos, one leading eos so every document follows the same token.

    ``tokenizer`` is a ``transformers`` tokenizer with an eos token; no special tokens are
    added inside documents. Stops early once ``max_tokens`` are collected.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token: documents cannot be joined")
    ids = [eos]
    for path in paths:
        # split_special_tokens: a literal "<|endoftext|>" in a source file stays plain text
        text = read_source(path)
        ids += tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids


def pack_token_stream(ids: Sequence[int], seq_len: int) -> torch.Tensor:
    """Cut a token stream into full windows of ``seq_len``: LongTensor [N, seq_len].

    The tail shorter than a window is dropped, so every row is a complete training example.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"{len(ids)} tokens do not fill one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


# ---- training rows through Hugging Face `datasets` (tokenise, pack, cache) -------------------


def packed_stdlib_dataset(tokenizer, split: Split, seq_len: int, cache_dir: str | Path | None):
    """The stdlib split tokenised and packed into windows: a `datasets.Dataset` with columns
    `tokens` and `loss_mask` (all ones: every token is a target), cached in cache_dir."""
    import datasets

    paths = [str(p) for p in stdlib_files(split)]
    manifest = stdlib_manifest_sha256(split)
    key = cache_key("stdlib", split, manifest, seq_len, _vocab_hash(tokenizer))
    docs = datasets.Dataset.from_dict({"path": paths})
    docs = docs.map(
        lambda batch: {"ids": [_document_ids(tokenizer, Path(p)) for p in batch["path"]]},
        batched=True, remove_columns=["path"], desc="tokenize",
        cache_file_name=_cache_file(cache_dir, key, "ids"),
    )
    return docs.map(
        lambda batch: _pack_batch(batch["ids"], None, seq_len), batched=True, batch_size=None,
        remove_columns=["ids"], desc="pack", cache_file_name=_cache_file(cache_dir, key, "packed"),
    )


def packed_chat_dataset(tokenizer, conversations: list[list[dict]], seq_len: int):
    """ShareGPT-style conversations packed into windows with assistant-only loss masks."""
    return packed_documents([render_conversation(tokenizer, c) for c in conversations], seq_len)


Document = tuple[list[int], list[int]]  # a document's token ids and loss mask (1 = learned)


def packed_documents(documents: Sequence[Document], seq_len: int):
    """Documents concatenated in order and cut into windows of seq_len: a `datasets.Dataset`
    with columns `tokens` and `loss_mask` (the short tail is dropped)."""
    import datasets

    return datasets.Dataset.from_dict(_pack_batch([d[0] for d in documents],
                                                  [d[1] for d in documents], seq_len))


def document_rows(documents: Sequence[Document], seq_len: int, max_answers: int | None = None):
    """(train, held-out) `TokenRows` of documents: the first twentieth (at least one) is held
    out, the rest packed for training. max_answers: train on the first max_answers of them in
    a fixed shuffled order (`first_answers`), so that smaller sets are prefixes of larger
    ones, rows included."""
    cut = max(1, len(documents) // 20)
    train = list(documents[cut:])
    if max_answers is not None:
        train = first_answers(train, max_answers)
    return tuple(rows_from_dataset(packed_documents(part, seq_len))
                 for part in (train, documents[:cut]))


def first_answers(items: Sequence, count: int) -> list:
    """The first `count` items (all, if fewer) in a fixed shuffled order that does not depend
    on count: the sets of several counts are nested, each a prefix of the next."""
    import random

    if not is_count(count):
        raise ValueError(f"train_data.max_answers must be an integer >= 1 (or null), got "
                         f"{count!r}")
    order = list(range(len(items)))
    random.Random(0).shuffle(order)
    return [items[i] for i in order[:count]]


def load_jsonl_documents(path: str | Path, tokenizer) -> list[Document]:
    """Training documents from a JSON-lines file, one a line, in any of these forms (what a
    serving engine's batch run, or selfspec's own self-distillation, writes):

        {"tokens": [ids], "loss_mask": [0/1, ...]}     token ids (no mask: every token learned)
        {"prompt_ids": [ids], "answer_ids": [ids]}     token ids, the answer learned
        {"messages": [{"role", "content"}, ...]}       chat turns (or ShareGPT's
                                                       "conversations" of {"from", "value"})
        {"prompt": "...", "answer": "..."}             one exchange (a self-distillation cache)

    Chat turns go through the tokenizer's chat template, the assistant's turns learned."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"train_data.path: no JSON-lines file at {path}")
    documents = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                documents.append(_document(line, tokenizer, f"{path}, line {number}"))
    if not documents:
        raise ValueError(f"{path} holds no documents (it is empty)")
    return documents


def _document(line: str, tokenizer, where: str) -> Document:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "tokens" in record:
        ids = _ids(record["tokens"], where)
        mask = _ids(record.get("loss_mask", [1] * len(ids)), where)
        if len(mask) != len(ids) or not set(mask) <= {0, 1}:
            raise ValueError(f"{where}: loss_mask must be 0s and 1s, one per token")
        return ids, mask
    if "prompt_ids" in record and "answer_ids" in record:
        prompt, answer = _ids(record["prompt_ids"], where), _ids(record["answer_ids"], where)
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    if "prompt" in record and "answer" in record:
        turns = [{"role": "user", "content": record["prompt"]},
                 {"role": "assistant", "content": record["answer"]}]
        return render_conversation(tokenizer, turns)
    turns = record.get("messages") or record.get("conversations")
    if isinstance(turns, list) and all(isinstance(t, dict) for t in turns):
        return render_conversation(tokenizer, chat_messages(turns))
    raise ValueError(f"{where}: expected tokens, prompt_ids and answer_ids, messages (chat "
                     f"turns) or prompt and answer")


def _ids(values, where: str) -> list[int]:
    if not isinstance(values, list) or not all(is_count(v, 0) for v in values):
        raise ValueError(f"{where}: token ids must be a list of integers >= 0")
    return values


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "system": "system"}


def chat_messages(turns: list[dict]) -> list[dict]:
    """Chat turns as {"role", "content"} messages, from either form: {"role", "content"} or
    ShareGPT's {"from", "value"} (human/user become "user", gpt/assistant/chatgpt
    "assistant")."""
    return [{"role": ROLES.get(t.get("from", t.get("role")), "user"),
             "content": t.get("value", t.get("content", ""))} for t in turns]


def load_sharegpt(path: str | Path) -> list[list[dict]]:
    """Conversations from a ShareGPT JSON file: a list of {"conversations": [{"from", "value"}]}.

    Roles human/user become "user", gpt/assistant/chatgpt become "assistant".
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path}")
    try:
        records = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"ShareGPT file {path} is not JSON ({exc}); give a JSON list of "
                         f'{{"conversations": [{{"from": ..., "value": ...}}]}} records') from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"ShareGPT file {path} must hold a JSON list of records "
                         f'({{"conversations": [...]}} each)')
    conversations = []
    for record in records:
        messages = chat_messages(record.get("conversations") or record.get("messages") or [])
        if any(m["role"] == "assistant" for m in messages):
            conversations.append(messages)
    if not conversations:
        raise ValueError(f"{path} holds no conversation with an assistant turn")
    return conversations


def render_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask that is 1 on the assistant replies only (their closing
    end-of-turn token included, the role header excluded).

    With a chat template the conversation is rendered by it; without one a plain
    "### role:" layout is used. A reply spans from where `reply_prompt` of the conversation
    before it ends to where the rendering through it ends.
    """
    ids = _render(tokenizer, messages)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(reply_prompt(tokenizer, messages[:i]))
            end = len(_render(tokenizer, messages[: i + 1]))
            mask[start:end] = [1] * (end - start)
    return ids, mask


def reply_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids that ask for the assistant's next reply after `messages`."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        ))
    return _render(tokenizer, messages) + _plain_ids(tokenizer, _plain_header("assistant"))


def _render(tokenizer, messages: list[dict]) -> list[int]:
    if not messages:
        return []
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    ids = []
    for message in messages:  # header and body tokenised apart, so prefixes stay prefixes
        ids += _plain_ids(tokenizer, _plain_header(message["role"]))
        ids += _plain_ids(tokenizer, message["content"] + "\n")
        if message["role"] == "assistant":
            ids.append(tokenizer.eos_token_id)
    return ids


def _plain_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _plain_header(role: str) -> str:
    return f"### {role}:\n"


def rows_from_dataset(dataset):
    """A packed `datasets.Dataset` as `TokenRows` tensors."""
    columns = dataset.with_format("torch")[:]  # every row, as tensors
    return TokenRows(columns["tokens"].long(), columns["loss_mask"].long())


def _document_ids(tokenizer, path: Path) -> list[int]:
    text = read_source(path)
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [tokenizer.eos_token_id, *ids]


def _pack_batch(ids: list[list[int]], masks: list[list[int]] | None, seq_len: int) -> dict:
    """Concatenate documents and cut full windows of seq_len (the short tail is dropped)."""
    flat = [t for doc in ids for t in doc]
    flat_mask = [m for doc in masks for m in doc] if masks is not None else [1] * len(flat)
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"{len(flat)} tokens do not fill one window of {seq_len}")
    cut = lambda xs: [xs[i * seq_len : (i + 1) * seq_len] for i in range(n)]  # noqa: E731
    return {"tokens": cut(flat), "loss_mask": cut(flat_mask)}


def _vocab_hash(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _cache_file(cache_dir: str | Path | None, key: str, stage: str) -> str | None:
    if cache_dir is None:
        return None
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(cache_dir) / f"{key}-{stage}.arrow")


def self_distill(conversations: list[list[dict]], target, tokenizer, *, max_new_tokens: int = 256,
                 sampling=None, seed: int = 0) -> list[list[dict]]:
    """Replace every assistant turn by the target's own reply to the conversation so far.

    Heads trained on the target's outputs learn what they will be asked to predict (Medusa-2
    and EAGLE-3 train this way); the user turns are kept.
    """
    from tqdm.auto import tqdm

    from selfspec.decode import generate
    from selfspec.sampling import SamplingParams

    sampling = sampling or SamplingParams()
    generator = torch.Generator(device=target.embed_tokens.weight.device).manual_seed(seed)
    eos = tokenizer.eos_token_id
    distilled = []
    for messages in tqdm(conversations, desc="self-distill"):
        rewritten: list[dict] = []
        for message in messages:
            if message["role"] == "assistant":
                ids = reply_prompt(tokenizer, rewritten)
                reply = generate(target, ids, sampling=sampling, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, generator=generator).tokens
                text = tokenizer.decode([t for t in reply if t != eos])
                message = {**message, "content": text}
            rewritten.append(message)
        distilled.append(rewritten)
    return distilled


def self_distill_rows(rows, target, *, prompt_tokens: int, count: int | None = None,
                      batch_size: int = 64, cache_dir: str | Path | None = None,
                      store: StoreWriter | None = None, store_prefix: str = "train"):
    """Corpus rows rewritten by the target: each keeps its first `prompt_tokens` tokens and
    continues with the target's own greedy output to the row's length; the loss counts only
    that continuation. The corpus counterpart of `self_distill` for chat data.

    rows: `TokenRows` [N, T]; count: how many rows to rewrite, picked evenly across the corpus
    (None = all). Generated `batch_size` rows at a time, and cached in cache_dir, keyed by the
    target's weights and these settings.
    store: also keep the target's states of every row in that feature store as they are
    generated (the generation's forwards compute them: one more one-token forward per batch
    completes a row), a shard per batch named as `features.build_store` names the shards of
    `store_prefix` at batch_size rows a shard; a batch whose shard is written already is read
    back instead of generated, so an interrupted run resumes at the batch it was writing.
    """
    from safetensors.torch import load_file, save_file

    length = rows.tokens.shape[1]
    if not 1 <= prompt_tokens < length:
        raise ValueError(f"self-distillation: prompt_tokens must lie in [1, {length}) (the rows' "
                         f"length), got {prompt_tokens}; set train_data.self_distill_prompt_tokens")
    count = len(rows) if count is None else min(count, len(rows))
    picked = rows.select(torch.linspace(0, len(rows) - 1, count).round().long())
    key = cache_key("distill", weights_fingerprint(target), _rows_hash(picked), prompt_tokens)
    cached = None if cache_dir is None else Path(cache_dir) / f"{key}-distilled.safetensors"
    if cached is not None and cached.is_file():
        return TokenRows(**load_file(str(cached)))
    prompts = picked.tokens[:, :prompt_tokens]  # [count, P]
    mask = torch.zeros(count, length, dtype=torch.long)
    mask[:, prompt_tokens:] = 1
    tokens = torch.cat([
        _distilled_batch(target, batch, length - prompt_tokens, store,
                         f"{store_prefix}-{first:08d}", mask[first : first + len(batch)])
        for first, batch in _batches(prompts, batch_size)])  # [count, T]
    distilled = TokenRows(tokens, mask)
    if cached is not None:  # written whole, then renamed: other ranks never read half a file
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
        save_file({"tokens": tokens, "loss_mask": mask}, str(partial))
        os.replace(partial, cached)
    return distilled


def _distilled_batch(target, prompts: torch.Tensor, new_tokens: int, store: StoreWriter | None,
                     shard: str, mask: torch.Tensor) -> torch.Tensor:
    """One batch's rows [B, P + new_tokens]: generated, or read back from its shard; with a
    store, the shard written with the states the generation computed."""
    if store is None:
        return _greedy_continuations(target, prompts, new_tokens)[0]
    if store.done(shard):
        return store.rows(shard).tokens
    tokens, states = _greedy_continuations(target, prompts, new_tokens, store.spec.layers)
    store.write(shard, TokenRows(tokens, mask), states)
    return tokens


def _batches(prompts: torch.Tensor, batch_size: int) -> Iterable[tuple[int, torch.Tensor]]:
    """(first row, prompts [b, P]) of each batch, with a progress bar."""
    from tqdm.auto import tqdm

    starts = range(0, len(prompts), batch_size)
    return ((s, prompts[s : s + batch_size]) for s in tqdm(starts, desc="self-distill"))


@torch.inference_mode()
def _greedy_continuations(target, prompts: torch.Tensor, new_tokens: int,
                          layers: tuple[int, ...] | None = None
                          ) -> tuple[torch.Tensor, TargetStates | None]:
    """[B, P + new_tokens]: every prompt row [B, P] of equal length and its greedy
    continuation (argmax, lowest id on ties, as greedy decoding), all rows in one batch.
    With `layers`, also the target's states of every position of the rows (`TargetStates`,
    on the CPU), gathered from the generation's own forwards and one more for the last token."""
    from selfspec.training.features import TargetStates

    device = target.embed_tokens.weight.device
    batch, length = prompts.shape
    cache = target.new_cache(batch_size=batch, max_slots=length + new_tokens)
    hidden = () if layers is None else tuple(layers)
    out = target(prompts.to(device), torch.arange(length, device=device), cache,
                 return_hidden=hidden)
    states = [out]
    generated = []
    for i in range(new_tokens):
        token = out.logits[:, -1].argmax(dim=-1)  # [B]
        generated.append(token)
        if i + 1 < new_tokens or layers is not None:  # the last token's states: one more
            position = torch.tensor([length + i], device=device)
            out = target(token[:, None], position, cache, return_hidden=hidden)
            states.append(out)
    tokens = torch.cat([prompts, torch.stack(generated, dim=1).cpu()], dim=1)
    if layers is None:
        return tokens, None
    return tokens, TargetStates(
        torch.cat([s.last_hidden.cpu() for s in states], dim=1),  # [B, P + new, H]
        tuple(torch.cat([s.hidden[i].cpu() for s in states], dim=1) for i in range(len(hidden))))


def _rows_hash(rows) -> str:
    return hashlib.sha256(rows.tokens.numpy().tobytes()).hexdigest()[:16]
