"""The exact mode's attention and activations (`batch_invariant=true`; its products are
`cpu_linear.invariant_linear`'s).

An activation runs over whole vectors (`whole_vectors`): the CPU's elementwise kernels take a
tensor's last few elements on a scalar path whose exp may round otherwise than the vector
path's, so with a row width that is no multiple of the vector, which path an element takes
would depend on how many rows came with it.

In attention each query row's output comes out the same bits whatever rows attend beside it
and wherever its keys sit in the cache.

A row's result is a function of its visible keys in order, and of nothing else:
- its visible keys (the mask's True slots, in slot order, which is position order) are packed
  to the front of the row, so that a tree node's ancestors, scattered over the draft's slots,
  line up as they do when plain decoding writes them one after another;
- the packed keys run in chunks of KEYS_PER_CHUNK, fixed by their rank in the row, and every
  sum runs over one chunk of one shape; chunks add up one after another, and the chunks past a
  row's last key add exact zeros, so a longer cache leaves the row's bits as they were;
- the softmax's maximum is taken over the whole row first (a maximum has no order), so no
  running rescale enters the sums;
- every exponent runs over a whole number of chunks per row, so each element takes the same
  (vectorised) path of the CPU's exp whatever the row count;
- rows are not padded: every sum has at least a chunk's worth of outputs a row (64 keys'
  scores, or the values' width, the softmax's denominator riding along as a value of ones),
  which keeps CUDA's reduction in one layout whatever the rows (PyTorch's reduction spreads a
  sum over more threads only when it has few outputs). The GPU check's diagnosis says whether
  that holds there.

The cost: the keys and values are gathered per row, and the scores and the weighted values
are written out as products and sums rather than run in a fused kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEYS_PER_CHUNK = 64
# Rows x keys gathered and multiplied in one op: few ops for a one-token step, a working set a
# CPU's cache holds for a tree's 64 rows, one chunk (which chunks go together changes no sum)
ROW_KEYS_PER_OP = 64 * KEYS_PER_CHUNK
# A row width every CPU's vector loop divides (two vectors of 16 floats, AVX-512's stride)
WHOLE_VECTOR = 64


def whole_vectors(function, x: torch.Tensor) -> torch.Tensor:
    """function(x) for an elementwise function, its last dimension padded with zeros to a
    multiple of WHOLE_VECTOR, so every element takes the vector path whatever the rows."""
    width = x.shape[-1]
    spare = -width % WHOLE_VECTOR
    if spare == 0:
        return function(x)
    return function(F.pad(x, (0, spare)))[..., :width]


def activated(function, x: torch.Tensor, invariant_rows: int | None) -> torch.Tensor:
    """function(x), over whole vectors in the exact mode (invariant_rows set by
    `cpu_linear.use_invariant_products`)."""
    return function(x) if invariant_rows is None else whole_vectors(function, x)


def invariant_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, H_kv, S, D]
    v: torch.Tensor,  # [B, H_kv, S, D_v]
    attn_mask: torch.Tensor | None,  # [T, S] or [B, 1, T, S] bool; None: causal, no past
    *,
    scale: float | None,
    block_rows: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]: a logit per head in the denominator (gpt-oss)
) -> torch.Tensor:
    """[B, H, T, D_v]: SDPA's attention (with Gemma 2's soft-capping and gpt-oss's sinks where
    given), each row computed as the module docstring says, in float32."""
    batch, heads, t, dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    visible = _visible(attn_mask, batch, t, slots, q.device).reshape(batch * t, slots)
    order, present = _packed_order(visible)  # [B*T, S_pad] each
    order = order + (torch.arange(batch, device=q.device) * slots).repeat_interleave(t)[:, None]
    queries = q.transpose(1, 2).reshape(batch * t, kv_heads, groups, dim).float().contiguous()
    keys = k.transpose(1, 2).reshape(batch * slots, kv_heads, dim).float()
    values = v.transpose(1, 2).reshape(batch * slots, kv_heads, v.shape[-1]).float()
    # a column of ones: the softmax's denominator summed as one more value (`_attended_rows`)
    values = torch.cat((values, values.new_ones(*values.shape[:-1], 1)), dim=-1)
    scale = dim ** -0.5 if scale is None else scale
    sink = None if sinks is None else sinks.float().view(kv_heads, groups)
    blocks = []
    for rows in _blocks(batch * t, block_rows):
        keys_seen = slice(None) if attn_mask is not None else slice(_causal_width(rows, t))
        blocks.append(_attended_rows(queries[rows], order[rows, keys_seen],
                                     present[rows, keys_seen], keys, values, scale, softcap,
                                     sink))
    out = torch.cat(blocks)  # [B*T, H_kv, G, D_v]
    return out.reshape(batch, t, heads, -1).transpose(1, 2).to(q.dtype)


def _visible(attn_mask: torch.Tensor | None, batch: int, t: int, slots: int,
             device: torch.device) -> torch.Tensor:
    """[B, T, S] bool: the slots each row attends to."""
    if attn_mask is None:  # causal without past: T == S
        return torch.ones(t, slots, dtype=torch.bool, device=device).tril().expand(batch, t, slots)
    if attn_mask.dim() == 4:  # [B, 1, T, S]: a batch's rows, each its own
        return attn_mask[:, 0].expand(batch, t, slots)
    return attn_mask.expand(batch, t, slots)


def _packed_order(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows' visible slots [R, S]: [R, S_pad] the slot of each row's i-th visible key
    (slot 0 past its last) and whether there is one, S_pad the slots rounded up to whole
    chunks. Tensor ops only (no host read), so a captured step runs it too."""
    rows, slots = visible.shape
    width = -(-slots // KEYS_PER_CHUNK) * KEYS_PER_CHUNK
    rank = visible.long().cumsum(-1) - 1
    # every hidden slot writes to one spare column past the end, which is then dropped
    column = torch.where(visible, rank, torch.full_like(rank, width))
    slot = torch.arange(slots, device=visible.device).expand(rows, slots)
    order = torch.zeros(rows, width + 1, dtype=torch.long, device=visible.device)
    order.scatter_(1, column, slot)
    present = torch.arange(width, device=visible.device) < visible.sum(-1, keepdim=True)
    return order[:, :width], present


def _blocks(count: int, size: int) -> list[slice]:
    """Rows in blocks of `size` at most: what one block gathers stays bounded (a prefill)."""
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def _causal_width(rows: slice, t: int) -> int:
    """How many packed keys a causal prefill's block of rows (of a batch of T rows each) can
    see, in whole chunks: the chunks past every row's last key would add exact zeros."""
    first, last = rows.start, rows.stop - 1
    seen = t if first // t != last // t else last % t + 1
    return -(-seen // KEYS_PER_CHUNK) * KEYS_PER_CHUNK


def _attended_rows(queries: torch.Tensor, order: torch.Tensor, present: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, scale: float,
                   softcap: float | None, sink: torch.Tensor | None) -> torch.Tensor:
    """[R, H_kv, G, D_v] for queries [R, H_kv, G, D] over their packed keys (`_packed_order`),
    keys [B*S, H_kv, D] and values [B*S, H_kv, D_v + 1] (each batch row's slots in turn; the
    values' last column all ones, which sums the softmax's denominator beside them)."""
    width = order.shape[1]
    step = max(1, ROW_KEYS_PER_OP // (len(order) * KEYS_PER_CHUNK)) * KEYS_PER_CHUNK
    groups = [slice(start, min(start + step, width)) for start in range(0, width, step)]
    scores = torch.cat([_scores(queries, keys[order[:, group]], scale, softcap)
                        for group in groups], dim=-1)  # [R, H_kv, G, S_pad]
    scores = scores.masked_fill(~present[:, None, None], float("-inf"))
    if sink is not None:  # one more chunk: the sink's logit alone, weighing no value
        sink_chunk = scores.new_full((*scores.shape[:-1], KEYS_PER_CHUNK), float("-inf"))
        sink_chunk[..., 0] = sink
        scores = torch.cat((scores, sink_chunk), dim=-1)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # hidden keys: exact zeros
    sums = torch.cat([_chunk_sums(weights[..., group].contiguous(), values[order[:, group]])
                      for group in groups], dim=-1)  # [R, H_kv, G, D_v + 1, chunks]
    total = sums[..., 0]
    for chunk in range(1, sums.shape[-1]):  # one after another: trailing chunks add zeros
        total = total + sums[..., chunk]
    if sink is not None:  # its chunk's sum is its weight alone
        total = total + F.pad(weights[..., width, None], (total.shape[-1] - 1, 0))
    return total[..., :-1] / total[..., -1:]


def _scores(queries: torch.Tensor, group_keys: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """[R, H_kv, G, W]: each query's scores over its group of keys [R, W, H_kv, D]."""
    products = queries[:, None] * group_keys[:, :, :, None]  # [R, W, H_kv, G, D]
    scores = products.sum(-1).permute(0, 2, 3, 1).contiguous() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _chunk_sums(weights: torch.Tensor, group_values: torch.Tensor) -> torch.Tensor:
    """[R, H_kv, G, D_v + 1, W / C]: each chunk's weighted values (weights [R, H_kv, G, W],
    values [R, W, H_kv, D_v + 1]), each a sum over the chunk's KEYS_PER_CHUNK keys alone."""
    by_dim = group_values.permute(0, 2, 3, 1).contiguous()  # [R, H_kv, D_v + 1, W]
    products = weights[:, :, :, None] * by_dim[:, :, None]  # [R, H_kv, G, D_v + 1, W]
    return products.unflatten(-1, (-1, KEYS_PER_CHUNK)).sum(-1)
