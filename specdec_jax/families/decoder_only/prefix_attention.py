"""Attention over what a cache holds, not what it was allocated: chunks up to the written
length, merged as FlashAttention merges them.

A decode step's queries sit at known positions, and no key past the block's last write
(the batch's max(positions) + k) was ever written; a window layer's queries see nothing
older than their lowest position - W. `attend` reads the cache `chunk` keys at a time
over that span only, inside the compiled step (a `lax.fori_loop` with traced bounds: one
program for every length), and merges the chunks with a running max m, sum of
exponentials z and unnormalised output o per query (online softmax):

    m' = max(m, max_chunk s);  z' = z e^(m - m') + sum_chunk e^(s - m');
    o' = o e^(m - m') + sum_chunk e^(s - m') v;   output = o / z.

Why its bits do not depend on how many chunks run: a chunk whose keys are all masked for
a query adds exactly 0 to z and o and rescales by exactly 1 once a visible key has been
seen (e^(-1e10) underflows to 0); before that, what it adds is multiplied by exactly
0 = e^(-1e10 - s) when the first visible chunk arrives. So the visible chunks alone
decide the result, in the same order: it does not depend on the allocated length, on how
far the batch's other rows have got, or on a window layer's skipped start.

`KeyMask` is the mask rule, evaluated per chunk (never a [q, allocated] array per layer):
causal by absolute positions, a tree's `allowed`, a sliding window. Heads' own masks (EAGLE,
MTP) stay arrays; `attend` takes either and reads an array mask whole.

Reductions over a chunk are `core.rows` trees, so a row's bits do not depend on the
batch (as the whole-cache path's softmax). A sink logit (gpt-oss) is a virtual first key
with no value: the merge starts at (m, z, o) = (sink, 1, 0).
"""

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import rows

Array = jax.Array

# Large negative instead of -inf so a fully masked row gives a uniform softmax rather
# than NaN (the network's convention).
MASK_VALUE = -1e10

# Keys per chunk; caches of at most this many positions are read whole (one softmax).
PREFIX_CHUNK = 256


class KeyMask(NamedTuple):
  """Which cache keys each query of a block sees, evaluated a chunk at a time.

  query_at: [batch|1, q] int32 absolute positions of the queries.
  filled: int32 scalar, cache indices [0, filled) may hold written keys (the block's
    writes end there); later chunks are never read.
  key_at: None (a cache index is its position) or [batch, L] int32, the absolute
    position of each cache index (a tree block: `core.token_tree.tree_positions`).
  allowed: None or [batch, q, L] bool, ANDed in (a tree block).
  window: None, or W: query i sees key j iff i - W < j <= i (a sliding-window layer).
  """
  query_at: Array
  filled: Array
  key_at: Optional[Array] = None
  allowed: Optional[Array] = None
  window: Optional[int] = None

  def with_window(self, window: Optional[int]) -> "KeyMask":
    return self._replace(window=window)

  def bias(self, start, size: int) -> Array:
    """[batch|1, 1, q, size] float32: 0 where the query sees cache index start + j, else
    -1e10 (indices past key_at's / allowed's end read their last entry: mask them)."""
    index = start + jnp.arange(size, dtype=jnp.int32)
    if self.key_at is None:
      keys = index[None]
    else:
      keys = jnp.take(self.key_at, jnp.minimum(index, self.key_at.shape[1] - 1), axis=1)
    keys = keys[:, None, None, :]
    query = self.query_at[:, None, :, None]
    visible = keys <= query
    if self.window is not None:
      visible = visible & (keys > query - self.window)
    if self.allowed is not None:
      visible = visible & jnp.take(self.allowed, jnp.minimum(index, self.allowed.shape[2] - 1),
                                   axis=2)[:, None]
    return jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)

  def first_index(self) -> Array:
    """The lowest cache index any query may see: 0, or for a window layer its lowest
    query's position - W + 1 (a tree's keys lie at or after their cache index's root)."""
    if self.window is None:
      return jnp.int32(0)
    return jnp.maximum(jnp.min(self.query_at) - self.window + 1, 0)


def _scores(grouped: Array, keys: Array, scale: float, softcap: Optional[float]) -> Array:
  """[b, q, kvh, g, d] x [b, C, kvh, d] -> [b, kvh, g, q, C] float32 scaled (soft-capped)."""
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, keys, preferred_element_type=jnp.float32)
  scores = scores * np.float32(scale)
  if softcap is not None:
    scores = np.float32(softcap) * jnp.tanh(scores / np.float32(softcap))
  return scores


def _values(key: Array, value) -> Array:
  """The value array: `value` itself, or (an int n) the keys' first n dimensions (a latent
  cache whose keys hold the values: DeepSeek's absorbed attention)."""
  return key[..., :value] if isinstance(value, int) else value


def _attend_whole(grouped, key, value, bias, scale, softcap, sinks):
  """One softmax over every key: [b, q, kvh, g, dv] in value's dtype."""
  value = _values(key, value)
  scores = _scores(grouped, key, scale, softcap) + bias[:, :, None]
  if sinks is None:
    weights = rows.softmax(scores, axis=-1).astype(value.dtype)
  else:
    top = jnp.maximum(rows.row_max(scores), sinks)
    exp = jnp.exp(scores - top)
    weights = (exp / (rows.row_sum(exp) + jnp.exp(sinks - top))).astype(value.dtype)
  return jnp.einsum("bhgqk,bkhd->bqhgd", weights, value)


def _chunk(cache: Array, start, chunk: int) -> Array:
  """cache[:, start:start + chunk] ([batch, chunk, ...]); past the cache's end, copies of
  its last position (masked by the caller). A slice when chunks tile the cache, else a
  gather, so every chunk holds its own positions whatever the cache's length."""
  length = cache.shape[1]
  if length % chunk == 0:
    return jax.lax.dynamic_slice_in_dim(cache, start, chunk, axis=1)
  index = jnp.minimum(start + jnp.arange(chunk), length - 1)
  return jnp.take(cache, index, axis=1)


def _attend_chunks(grouped, key, value, mask: KeyMask, scale, softcap, sinks, chunk: int):
  """The online-softmax loop over the chunks [first, last] the mask can see (module
  docstring): [b, q, kvh, g, dv] in value's dtype. Chunk i holds cache indices
  [i * chunk, (i + 1) * chunk) whatever the cache's length (indices past it are masked),
  so a row's bits do not depend on how much was allocated."""
  f32 = jnp.float32
  batch, q, kv_heads, groups, _ = grouped.shape
  length = key.shape[1]
  stats = (batch, kv_heads, groups, q, 1)
  first = mask.first_index() // chunk
  last = jnp.clip((mask.filled + chunk - 1) // chunk, 1, -(-length // chunk))

  def merge(i, carry):
    top, total, out = carry  # [b, kvh, g, q, 1] x 2, [b, kvh, g, q, dv] float32
    start = i * chunk
    inside = start + jnp.arange(chunk) < length
    bias = jnp.where(inside, mask.bias(start, chunk), MASK_VALUE)
    keys = _chunk(key, start, chunk)
    scores = _scores(grouped, keys, scale, softcap) + bias[:, :, None]
    new_top = jnp.maximum(top, rows.row_max(scores))
    rescale = jnp.exp(top - new_top)
    weights = jnp.exp(scores - new_top)
    total = total * rescale + rows.row_sum(weights)
    values = _values(keys, value) if isinstance(value, int) else _chunk(value, start, chunk)
    out = out * rescale + jnp.einsum("bhgqk,bkhd->bhgqd", weights.astype(key.dtype), values,
                                     preferred_element_type=f32)
    return new_top, total, out

  if sinks is None:
    top, total = jnp.full(stats, jnp.finfo(f32).min, f32), jnp.zeros(stats, f32)
  else:  # The sink: a first key of logit `sinks` and no value.
    top, total = jnp.broadcast_to(sinks, stats).astype(f32), jnp.ones(stats, f32)
  width = value if isinstance(value, int) else value.shape[-1]
  out = jnp.zeros(stats[:-1] + (width,), f32)
  _, total, out = jax.lax.fori_loop(first, last, merge, (top, total, out))
  return jnp.moveaxis(out / total, 3, 1).astype(key.dtype)


def attend(query: Array, key: Array, value: Array, mask: Union[KeyMask, Array],
           num_kv_heads: int, scale: float, softcap: Optional[float] = None,
           sinks: Optional[Array] = None, chunk: int = PREFIX_CHUNK) -> Array:
  """Grouped-query dot-product attention, scores multiplied by `scale`.

  Query head h reads key/value head h // (heads / kv_heads), as HF's `repeat_kv` does,
  without materialising the repeated keys. With `softcap` (Gemma 2) scaled scores become
  softcap * tanh(scores / softcap) before the mask is added, HF's order. With `sinks`
  (gpt-oss, [heads]) head h's softmax denominator also holds exp(sinks[h]), a logit no
  value belongs to (transformers' eager_attention_forward concatenates it and drops its
  probability).

  Args:
    query: [batch, q, heads, head_dim]; key: [batch, L, kv_heads, head_dim]; value:
      [batch, L, kv_heads, value_dim] (the key's dtype), or an int value_dim: the keys'
      first value_dim dimensions are the values (a latent cache).
    mask: a `KeyMask` (a cached block: read in chunks up to what was written when L >
      chunk), or an array [batch|1, 1, q, L] float32 with the mask folded in (read whole).
    scale: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5.
    chunk: keys per step of the loop (module docstring); 0 reads the cache whole.
  Returns:
    [batch, q, heads, value_dim] in the value's dtype.
  """
  batch, q_len, heads, head_dim = query.shape
  groups = heads // num_kv_heads
  grouped = query.reshape(batch, q_len, num_kv_heads, groups, head_dim)
  if sinks is not None:
    # Query head h = kv head h // groups, group h % groups (the reshape above).
    sinks = sinks.astype(jnp.float32).reshape(1, num_kv_heads, groups, 1, 1)
  if isinstance(mask, KeyMask) and 0 < chunk < key.shape[1]:
    out = _attend_chunks(grouped, key, value, mask, scale, softcap, sinks, chunk)
  else:
    bias = mask.bias(0, key.shape[1]) if isinstance(mask, KeyMask) else mask
    out = _attend_whole(grouped, key, value, bias, scale, softcap, sinks)
  return out.reshape(batch, q_len, heads, out.shape[-1])
