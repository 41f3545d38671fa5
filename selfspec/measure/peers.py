"""The decoders a benchmark times: selfspec's own loop and Hugging Face `generate` peers.

Every decoder is timed the same way, around the whole call, whichever library runs it. The
Hugging Face peers run on the same weights, and their acceptance counters are read off the
target's forward calls so that their figures read like ours.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from selfspec.decode import GenerationResult, generate
from selfspec.devices import synchronize
from selfspec.drafters.base import Drafter, LearningDrafter
from selfspec.metrics import GenerationStats
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams


class Decoder(Protocol):
    """One way to generate a continuation; wall_time_s is measured around the whole call.
    `batch` decodes several prompts together: their results (each one's wall_time_s: its
    latency, until its last token) and the seconds the whole call took.

    measures_draft_time: whether stats.draft_time_s holds the drafting time (False: unknown).
    """

    measures_draft_time: bool

    def __call__(
        self, prompt: Sequence[int], sampling: SamplingParams, max_new_tokens: int, seed: int,
        stop_ids: Sequence[int],
    ) -> GenerationResult: ...

    def batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, max_new_tokens: int,
        seed: int, stop_ids: Sequence[int],
    ) -> tuple[list[GenerationResult], float]: ...

    def forget_learnt(self) -> None:
        """Forget what earlier calls taught it (run after a warmup on the measured prompts)."""


@dataclass
class OurDecoder:
    """selfspec's decode loop: plain decoding when drafter is None. split_time, cuda_graphs:
    as `generate`'s (None: the per-phase time split where it is free, on the CPU; CUDA graphs
    on a CUDA target)."""

    target: Transformer
    drafter: Drafter | None = None
    measures_draft_time: bool = True
    split_time: bool | None = None
    cuda_graphs: bool | None = None  # as `generate`'s: None = on for a CUDA target

    def __call__(
        self, prompt: Sequence[int], sampling: SamplingParams, max_new_tokens: int, seed: int,
        stop_ids: Sequence[int],
    ) -> GenerationResult:
        [result], seconds = self._generate(list(prompt), sampling, max_new_tokens, seed,
                                           stop_ids)
        result.stats.wall_time_s = seconds  # timed like every decoder
        return result

    def batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, max_new_tokens: int,
        seed: int, stop_ids: Sequence[int],
    ) -> tuple[list[GenerationResult], float]:
        return self._generate([list(p) for p in prompts], sampling, max_new_tokens, seed,
                              stop_ids)

    def forget_learnt(self) -> None:
        if isinstance(self.drafter, LearningDrafter):
            self.drafter.forget()

    def _generate(self, prompts, sampling: SamplingParams, max_new_tokens: int, seed: int,
                  stop_ids: Sequence[int]) -> tuple[list[GenerationResult], float]:
        device = self.target.embed_tokens.weight.device
        generator = torch.Generator(device=device).manual_seed(seed)
        start = time.perf_counter()
        results = generate(self.target, prompts, drafter=self.drafter, sampling=sampling,
                           max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids) or None,
                           generator=generator, split_time=self.split_time,
                           cuda_graphs=self.cuda_graphs)
        synchronize(device)
        seconds = time.perf_counter() - start
        return (results if isinstance(results, list) else [results]), seconds

    @torch.inference_mode()
    def next_token_logits(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.dtype]:
        """The target's logits [V] for the token after ids (one full forward), and the dtype
        its products round to: its weights', or a quantized target's `products_dtype`."""
        weight = self.target.embed_tokens.weight
        tokens = torch.tensor([list(ids)], device=weight.device)
        positions = torch.arange(len(ids), device=weight.device)
        rounds_to = getattr(self.target, "products_dtype", weight.dtype)
        return self.target(tokens, positions).logits[0, -1], rounds_to


@dataclass
class HFDecoder:
    """Hugging Face `generate` on the same weights: plain (no assistant, no lookup), assisted
    generation with a draft model (`assistant`), or prompt lookup (`prompt_lookup=True`).

    Drafts have a fixed length `num_draft_tokens` (constant schedule, no confidence cut-off).
    Acceptance is read from the target's forward calls: each call's input length gives the
    tokens drafted and the next call's cache length the tokens kept. Draft time is measured
    only for assisted generation (time inside the assistant's forwards: a lower bound).
    """

    model: Any  # a transformers PreTrainedModel (causal LM)
    assistant: Any | None = None
    num_draft_tokens: int = 0
    prompt_lookup: bool = False
    max_ngram: int = 3  # prompt lookup's longest n-gram, as NgramDrafter's default

    @property
    def measures_draft_time(self) -> bool:
        return self.assistant is not None

    def forget_learnt(self) -> None:
        """Nothing to forget: transformers' `generate` keeps nothing between calls."""

    def __call__(
        self, prompt: Sequence[int], sampling: SamplingParams, max_new_tokens: int, seed: int,
        stop_ids: Sequence[int],
    ) -> GenerationResult:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.model.device)
        kwargs = {**self._mode_kwargs(), **_hf_sampling_kwargs(sampling)}
        torch.manual_seed(seed)  # HF samples from the global RNG
        with _ForwardLog(self.model, self.assistant) as log:
            start = time.perf_counter()
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                eos_token_id=list(stop_ids) or None, pad_token_id=_pad_id(self.model), **kwargs,
            )
            synchronize(ids.device)
            seconds = time.perf_counter() - start
        tokens = out[0, ids.shape[1]:].tolist()
        stats = log.stats(len(prompt), len(tokens))
        stats.wall_time_s = seconds
        return GenerationResult(tokens, stats)

    def batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, max_new_tokens: int,
        seed: int, stop_ids: Sequence[int],
    ) -> tuple[list[GenerationResult], float]:
        """Plain `generate` over the prompts left-padded to one length (its attention mask
        hides the padding); every row's latency is the whole call's. Assisted generation and
        prompt lookup take one prompt in transformers: refused."""
        if self.assistant is not None or self.prompt_lookup:
            raise ValueError("transformers' assisted generation and prompt lookup decode one "
                             "prompt at a time; sweep hf_assisted and hf_prompt_lookup at "
                             "bench.batch_sizes=[1]")
        width, pad = max(len(p) for p in prompts), _pad_id(self.model)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts],
                           dtype=torch.long, device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            dtype=torch.long, device=self.model.device)
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  eos_token_id=list(stop_ids) or None, pad_token_id=pad,
                                  **_hf_sampling_kwargs(sampling))
        synchronize(ids.device)
        seconds = time.perf_counter() - start
        results = []
        for row in out[:, width:].tolist():
            tokens = _until_stop(row, set(stop_ids))
            stats = GenerationStats(new_tokens=len(tokens), wall_time_s=seconds)
            for _ in tokens:
                stats.record_step(0, 0, 0)
            results.append(GenerationResult(tokens, stats))
        return results, seconds

    @torch.inference_mode()
    def next_token_logits(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.dtype]:
        """The model's logits [V] for the token after ids (one full forward), its dtype."""
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        return self.model(tokens).logits[0, -1], self.model.dtype

    def _mode_kwargs(self) -> dict[str, Any]:
        if self.assistant is not None:
            # transformers reads these from the assistant's own generation config.
            config = self.assistant.generation_config
            config.num_assistant_tokens = self.num_draft_tokens
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0  # 0 disables the early cut-off
            return {"assistant_model": self.assistant}
        if self.prompt_lookup:
            return {"prompt_lookup_num_tokens": self.num_draft_tokens,
                    "max_matching_ngram_size": self.max_ngram}
        return {}


def quiet_transformers() -> None:
    """Silence transformers' warnings (assisted generation warns on every draft call) so a
    sweep's progress bar and report stay readable. For entry points: it is process-wide."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def _hf_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    if sampling.greedy:
        return {"do_sample": False}
    # top_k=0 is passed explicitly: HF's own default would be 50.
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p}


def _until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """A row's tokens up to its first stop token (kept); the padding after it dropped."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i + 1]
    return tokens


def _pad_id(model) -> int:
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0


class _ForwardLog:
    """Records (input length, cached length) of every target forward during one generate,
    and the time spent inside the assistant's forwards."""

    def __init__(self, model, assistant=None):
        self.model, self.assistant = model, assistant
        self.calls: list[tuple[int, int]] = []
        self.draft_seconds, self._tick, self._handles = 0.0, 0.0, []

    def __enter__(self) -> _ForwardLog:
        self._handles.append(self.model.register_forward_pre_hook(self._record, with_kwargs=True))
        if self.assistant is not None:
            self._handles.append(self.assistant.register_forward_pre_hook(self._start))
            self._handles.append(self.assistant.register_forward_hook(self._stop))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _record(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        # transformers 5.24 renamed the forward's `past_key_values` argument to `cache`.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.calls.append((ids.shape[1], cache.get_seq_length() if cache is not None else 0))

    def _start(self, module, args) -> None:
        self._tick = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.draft_seconds += time.perf_counter() - self._tick

    def stats(self, prompt_len: int, new_tokens: int) -> GenerationStats:
        """Counters as our loop keeps them. Before call i the sequence holds c_i committed
        tokens (the prompt, then cache + the root); call i keeps c_{i+1} - c_i - 1 drafts."""
        stats = GenerationStats(new_tokens=new_tokens, draft_time_s=self.draft_seconds)
        committed = [prompt_len if past == 0 else past + 1 for _, past in self.calls]
        committed.append(prompt_len + new_tokens)
        for i, (length, past) in enumerate(self.calls):
            drafted = length - (prompt_len if past == 0 else 1)
            accepted = max(0, min(drafted, committed[i + 1] - committed[i] - 1))
            stats.record_step(drafted, drafted, accepted, position=committed[i] - prompt_len)
        return stats
