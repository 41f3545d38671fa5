"""How the decode loop's target forward over T new tokens runs: eagerly, or as a static-shape
step replayed from a CUDA graph.

On a GPU an eager forward is launch-bound: its cost hardly depends on T and sits far above
what reading the weights costs. A CUDA graph replays the whole forward as one launch, but only
with fixed shapes and fixed memory. So `StaticSteps` keeps, per target:

- one persistent `KVCache` that every generation reuses (graphs read its tensors in place);
- per bucket of T (1, 2, 4, ..., 128) static input buffers, and a forward over them that
  writes K/V at slot tensors (`index_copy_`) and attends over every slot of the cache with a
  mask built on the device from the cache length: nothing in it depends on a host value;
- a draft of N nodes runs in the bucket >= N + 1, its extra rows attending only to themselves;
  they write K/V past the cache's valid length, where the next step writes again.

Graphs are captured on CUDA; on another device the same static forward runs eagerly, which
is how the CPU tests check it against the eager path. Prefill and forwards of more than the
largest bucket stay eager.

A compiled step (`Transformer.compile_steps = True`, off by default) fuses each layer's q/k/v and
gate/up products into one product each and runs the work around attention through inductor
(`selfspec.model.compiled_stages`), inside the same graphs. A bucket compiles on its first use,
so a run compiles only the buckets it uses; `StaticSteps.setup_seconds` holds the time that
compiling and capturing took, which no timed figure should hold.
"""

from __future__ import annotations

import gc
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from selfspec.model import ModelOutput, Transformer
from selfspec.model.kv_cache import KVCache, rows_mask, slot_positions
from selfspec.model.transformer import EAGER_STAGES, compiled_stages, fuse_projections

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_SLOT_GRANULE = 256  # caches are sized in steps of this, so most generations reuse one


def bucket_of(n: int) -> int | None:
    """The smallest bucket that holds n rows (None: more than the largest, run eagerly)."""
    return next((b for b in BUCKETS if b >= n), None)


def padded_slots(max_length: int) -> int:
    """Cache slots for generations of up to max_length tokens: room for a bucket's padding,
    rounded up so that most generations fit one cache."""
    return -(-(max_length + max(BUCKETS)) // _SLOT_GRANULE) * _SLOT_GRANULE


def use_cuda_graphs(setting: bool | None, target: Transformer) -> bool:
    """cuda_graphs: None = auto (on for a CUDA target), True or False. A target placed over
    several devices (`selfspec.model.placement`) decodes eagerly: one graph cannot span devices,
    and a graph per device segment is not built; so does a recurrent target (Qwen3-Next)."""
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"cuda_graphs must be None (on for CUDA), True or False, got {setting!r}")
    placed = target.placement is not None and target.placement.spans_devices
    if placed and setting:
        raise ValueError("cuda_graphs=True: a target placed over several devices decodes "
                         "eagerly (model.device_map); leave cuda_graphs unset or False")
    # A recurrent target's state is kept per forward row by the eager forward only
    # (`selfspec.model.recurrent_cache`): it has no static step yet.
    recurrent = bool(target.config.linear_layers)
    if recurrent and setting:
        raise ValueError("cuda_graphs=True: a recurrent target (Gated DeltaNet layers) decodes "
                         "eagerly, its static steps are not built yet; leave cuda_graphs unset "
                         "or False")
    device = target.embed_tokens.weight.device
    eager = placed or recurrent
    return device.type == "cuda" and not eager if setting is None else setting


class SlotView:
    """The cache as a static forward sees it: K/V written at a slot tensor and every slot
    returned, so attention spans the whole cache under a [T, S] mask. `length` is what makes
    `Transformer.forward` take that mask whole; advancing is left to the host. slots: [b]
    (one row), or [n, b] for a batch's rows, each at its own length."""

    static_shapes = True  # the forward reads nothing back to the host (`feed_forward`)

    def __init__(self, cache: KVCache, slots: torch.Tensor) -> None:
        self.cache, self.slots = cache, slots
        self.length = cache.max_slots - slots.shape[-1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.write_at(layer, self.slots, k, v)

    def advance(self, t: int) -> None:
        pass  # StaticSteps advances the real cache by the step's true row count

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Every slot's position: its own, but at the new rows' slots (a sliding window)."""
        return slot_positions(self.cache.max_slots, self.slots, positions)


@dataclass
class _Bucket:
    """Static inputs of one bucket and, once captured, its graph and output."""

    tokens: torch.Tensor  # [1, b] (a batch's rows: [n, b])
    positions: torch.Tensor  # [b] ([n, b])
    tree: torch.Tensor  # [b, b] bool: the draft's mask, extra rows attending to themselves
    base: torch.Tensor  # [1]: the cache length the step starts at ([n]: each row's)
    eye: torch.Tensor  # [b, b] bool: every row attending to itself alone
    causal: torch.Tensor  # [b, b] bool: the mask of a chain (no mask given)
    graph: torch.cuda.CUDAGraph | None = None
    out: ModelOutput | None = None
    ready: bool = False  # compiled (and captured) already


class StaticSteps:
    """The decode loop's target forwards over one persistent cache, in static shapes: one
    prompt's (`forward`), or a batch's rows', each at its own length (`forward_rows`)."""

    shared_by_forks = True  # a batch's drafters run eagerly: never copied for a row

    def __init__(self, target: Transformer, max_slots: int, batch_size: int = 1) -> None:
        self.target = target
        self.cache = target.new_cache(batch_size, max_slots=max_slots)
        self.capture = self.cache.k.device.type == "cuda"  # elsewhere: the same step, eagerly
        self.compiled = _compiled_setting(target)
        if self.compiled and not fuse_projections(target):
            raise ValueError("compile: a quantized target's products cannot be fused; "
                             "set compile: false")
        self.stages = compiled_stages() if self.compiled else EAGER_STAGES
        self.setup_seconds = 0.0  # compiling and capturing: never inside a timed figure
        self._weights = weights_of(target)
        self._slots = torch.arange(max_slots, device=self.cache.k.device)
        self._buckets: dict[tuple, _Bucket] = {}

    @property
    def batch_size(self) -> int:
        return self.cache.k.shape[1]

    def fits(self, max_slots: int) -> bool:
        """Whether these steps serve a generation needing max_slots: a cache as large, and the
        target's weights the very tensors the graphs read (weights replaced, moved, cast or
        wrapped since then would be missed by a replay)."""
        return (self.cache.max_slots >= max_slots and weights_of(self.target) == self._weights
                and _compiled_setting(self.target) == self.compiled)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
        layers: tuple[int, ...] = (), with_logits: bool = True,
    ) -> ModelOutput:
        """target(tokens [1, n], positions [n], cache, mask=[n, n], return_hidden=layers,
        with_logits=...) from the bucket's static step; the outputs are copies (the step's
        buffers are reused)."""
        n, base = tokens.shape[1], self.cache.length
        b = bucket_of(n)
        if b is None or base + b > self.cache.max_slots:
            return self.target(tokens, positions, self.cache, mask=mask, return_hidden=layers,
                               with_logits=with_logits)
        key = (b, layers, with_logits)
        bucket = self._load(key, tokens, positions, mask, base)
        out = self._run(bucket, lambda: self._static_forward(bucket, key))
        self.cache.advance(n)
        return ModelOutput(_rows(out.logits, n), tuple(h[:, :n].clone() for h in out.hidden),
                           _rows(out.last_hidden, n))

    def _load(self, key, tokens, positions, mask, base) -> _Bucket:
        device, n, b = self.cache.k.device, tokens.shape[1], key[0]
        bucket = self._buckets.get(key)
        if bucket is None:
            eye = torch.eye(b, dtype=torch.bool, device=device)
            bucket = self._buckets[key] = _Bucket(
                torch.zeros(1, b, dtype=torch.long, device=device),
                torch.zeros(b, dtype=torch.long, device=device), eye.clone(),
                torch.zeros(1, dtype=torch.long, device=device), eye,
                torch.ones(b, b, dtype=torch.bool, device=device).tril())
        bucket.tokens[:, :n].copy_(tokens)
        bucket.positions[:n].copy_(positions)
        bucket.tree.copy_(bucket.eye)
        bucket.tree[:n, :n] = bucket.causal[:n, :n] if mask is None else mask
        bucket.base.fill_(base)  # a kernel, not a host read
        return bucket

    def _static_forward(self, bucket: _Bucket, key: tuple) -> ModelOutput:
        """The forward a graph captures: every shape fixed, every index a device tensor."""
        b, layers, with_logits = key
        slots = bucket.base + self._slots[:b]  # [b]
        mask = (self._slots < bucket.base)[None].repeat(b, 1)  # [b, S]: the valid past
        mask.scatter_(1, slots[None].expand(b, b), bucket.tree)  # the new rows among themselves
        return self.target(bucket.tokens, bucket.positions, SlotView(self.cache, slots),
                           mask=mask, return_hidden=layers, with_logits=with_logits,
                           stages=self.stages)

    def _run(self, bucket: _Bucket, step) -> ModelOutput:
        """The bucket's step: its graph replayed (set up on first use), or run as is."""
        if bucket.graph is None and (self.capture or self.compiled) and not bucket.ready:
            self._set_up(bucket, step)
        if bucket.graph is not None:
            bucket.graph.replay()
            return bucket.out
        return step()

    def _set_up(self, bucket: _Bucket, step) -> None:
        """Compile the bucket's step (a warm-up run) and capture its graph, timed apart."""
        start = time.perf_counter()
        if self.capture:
            self._capture(bucket, step)
            torch.cuda.synchronize(self.cache.k.device)
        else:
            step()  # compiles; writes the K/V the real run rewrites
        bucket.ready = True
        self.setup_seconds += time.perf_counter() - start

    def _capture(self, bucket: _Bucket, step) -> None:
        bucket.graph, bucket.out = capture(step, self.cache.k.device)

    # ---- a batch's rows ----------------------------------------------------------------

    @torch.inference_mode()
    def forward_rows(
        self, tokens: torch.Tensor, positions: torch.Tensor, masks: torch.Tensor,
        lengths: list[int], layers: tuple[int, ...] = (),
    ) -> ModelOutput | None:
        """The forward of the cache's first n rows: row r's T new tokens (tokens, positions
        [n, T]; masks [n, T, T] among them) after its lengths[r] cached slots, each written at
        its own slots; the outputs are copies. None where no bucket holds T tokens or the
        cache lacks room: the caller runs it eagerly. Lengths are advanced by the caller."""
        n, t = tokens.shape
        b = bucket_of(t)
        if b is None or max(lengths) + b > self.cache.max_slots:
            return None
        key = ("rows", n, b, layers)
        bucket = self._load_rows(key, tokens, positions, masks, lengths)
        out = self._run(bucket, lambda: self._static_rows_forward(bucket, key))
        return ModelOutput(_rows(out.logits, t), tuple(h[:, :t].clone() for h in out.hidden),
                           _rows(out.last_hidden, t))

    def _load_rows(self, key, tokens, positions, masks, lengths) -> _Bucket:
        device, (_, n, b, _) = self.cache.k.device, key
        t = tokens.shape[1]
        bucket = self._buckets.get(key)
        if bucket is None:
            eye = torch.eye(b, dtype=torch.bool, device=device)
            bucket = self._buckets[key] = _Bucket(
                torch.zeros(n, b, dtype=torch.long, device=device),
                torch.zeros(n, b, dtype=torch.long, device=device),
                eye.repeat(n, 1, 1), torch.zeros(n, dtype=torch.long, device=device), eye,
                eye)
        bucket.tokens[:, :t].copy_(tokens)
        bucket.positions[:, :t].copy_(positions)
        bucket.tree.copy_(bucket.eye.expand(n, b, b))
        bucket.tree[:, :t, :t] = masks
        bucket.base.copy_(torch.tensor(lengths))
        return bucket

    def _static_rows_forward(self, bucket: _Bucket, key: tuple) -> ModelOutput:
        """`_static_forward` for n rows, each with its own base."""
        _, n, b, layers = key
        slots = bucket.base[:, None] + self._slots[:b]  # [n, b]
        mask = rows_mask(bucket.base, slots, self.cache.max_slots, bucket.tree)  # [n, b, S]
        return self.target(bucket.tokens, bucket.positions,
                           SlotView(self.cache.rows(0, n), slots), mask=mask,
                           return_hidden=layers, stages=self.stages)


def capture(step, device: torch.device, generator: torch.Generator | None = None):
    """(graph, output) of `step` captured on a CUDA device: replaying the graph reruns the
    step's kernels over the same tensors and rewrites the output in place. The step must run
    on static shapes and read no host value. It is first warmed up on a side stream (kernels
    chosen, workspaces allocated, anything compiled), as capture requires; these runs write
    what the replay writes. A step that draws from `generator` draws afresh at every replay:
    the graph advances the generator's state (registered where torch asks for it)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    register = getattr(graph, "register_generator_state", None)  # newer torch: implicit
    if generator is not None and register is not None:
        register(generator)
    with torch.cuda.graph(graph), collector_paused():  # a pool of its own: any replay order
        out = step()
    return graph, out


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside: a collection during a capture can free
    an earlier generation's CUDA graph, whose reset is an operation a capturing stream refuses,
    and the capture is then invalidated (seen on an H200). torch.cuda.graph collects on entry,
    so nothing is left waiting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CapturedSteps:
    """A drafter's steps of static shape, by name: on CUDA each is captured on its first run
    (`capture`) and replayed after (its output tensors rewritten in place); elsewhere each runs
    as it is. A step must read no host value and take its inputs from tensors it holds.

    draws: its steps draw random numbers, from `generator`, one of its own that the graphs
    hold. `run(..., generator=caller's)` carries the caller's generator state in and back out,
    so the draws are the caller's stream, and a new generator per generation keeps the
    graphs."""

    shared_by_forks = True  # graphs cannot be copied; a batch's rows draft eagerly

    def __init__(self, device: torch.device | str, draws: bool = False) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device) if draws else None
        self._graphs: dict[str, tuple] = {}

    def run(self, name: str, step, generator: torch.Generator | None = None):
        if generator is not None:
            self.generator.set_state(generator.get_state())
        out = self._replayed(name, step)
        if generator is not None:
            generator.set_state(self.generator.get_state())
        return out

    def _replayed(self, name: str, step):
        if self.device.type != "cuda":
            return step()
        if name not in self._graphs:
            self._graphs[name] = capture(step, self.device, self.generator)
        graph, out = self._graphs[name]
        graph.replay()
        return out


def _compiled_setting(model: Transformer) -> bool:
    if not isinstance(model.compile_steps, bool):
        raise ValueError(f"compile_steps must be True or False, got {model.compile_steps!r}")
    return model.compile_steps


def weights_of(*modules: torch.nn.Module) -> tuple:
    """Which tensors a forward of the modules reads: where each parameter lives, and as what.
    A captured step replays over these very tensors: one whose weights were replaced, moved,
    cast or wrapped since needs capturing again."""
    return tuple((p.data_ptr(), p.dtype, p.device, p.shape)
                 for module in modules for p in module.parameters())


def _rows(tensor: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[:, :n].clone()


# Each target's static steps, by batch size.
_STEPS: weakref.WeakKeyDictionary[Transformer, dict[int, StaticSteps]] = \
    weakref.WeakKeyDictionary()


def kept_or_new(steps: StaticSteps | None, model: Transformer, max_length: int,
                batch_size: int = 1) -> StaticSteps:
    """`steps` if they serve a generation of up to max_length tokens (+ a bucket's padding)
    of batch_size rows, else new ones for the model; reset to length 0. Kept steps keep their
    captured graphs."""
    slots = padded_slots(max_length)
    if steps is None or not steps.fits(slots) or steps.batch_size != batch_size:
        earlier = steps.setup_seconds if steps is not None else 0.0
        steps = StaticSteps(model, slots, batch_size)
        steps.setup_seconds = earlier  # the model's total, across the steps it had
    steps.cache.reset()
    return steps


def setup_seconds(target: Transformer) -> float:
    """Seconds the target's static steps have spent compiling and capturing so far."""
    return sum(steps.setup_seconds for steps in _STEPS.get(target, {}).values())


def static_steps(target: Transformer, max_length: int, batch_size: int = 1) -> StaticSteps:
    """The target's StaticSteps for a generation of up to max_length tokens of batch_size
    prompts, kept between generations so that graphs are captured once."""
    kept = _STEPS.setdefault(target, {})
    kept[batch_size] = kept_or_new(kept.get(batch_size), target, max_length, batch_size)
    return kept[batch_size]
