"""The decoder's cached block step as pure functions over fused kernels.

`families/t5/network.py` is the reference network and the saved/loaded format (T5X's
parameter tree). A decode step that mirrors that tree runs one small
operation per kernel, norm and softmax piece; on an accelerator a decoder
layer then costs a fixed ~60 µs of launches whatever its width.
This module computes the same function as `T5.decode_block` with fewer,
larger operations (counted per layer by `specdec_jax.tools.hlo_ops`):

* `prepare_decode_params` builds, once per set of weights, one [emb, 3,
  inner] kernel for the self-attention query/key/value projections and one
  [emb, n, mlp] kernel for the n gated-MLP input kernels (wi_0, wi_1), so a
  layer runs 5 projections instead of 9. Each pre-norm's scale is folded into
  the kernels it feeds, so a norm is one reduction whose 1/rms multiplies the
  projection's output inside operations that exist anyway (its sum a tree of
  adds, `core.rows.row_sum`, so a row's bits do not depend on the batch:
  `_inv_rms`);
* `decode_block` computes the relative position bias and both masks once per
  call, not per layer;
* softmax takes the max and the sum of exponentials in one reduction;
* attention reads the head-major cache ([batch, heads, len, head_dim], see
  `families/t5/network.py`) as it lies: no per-layer copy of it. On accelerators
  (`attention='in_layout'`) scores and outputs are multiply-and-sum fusions
  into which the softmax fuses (fewest operations); on CPU (`'dots'`),
  batched dots, which XLA CPU runs far faster than its reductions;
* on every backend, self-attention over a cache longer than `PREFIX_CHUNK` reads only
  the positions written so far, a chunk at a time, merged as FlashAttention
  merges them (`_attend_dots_prefix`): a decode step then costs the tokens it
  has, not the cache it was given, and its bits do not depend on how many
  chunks it ran (so neither on the cache's length nor on the batch's other
  rows);
* keys and values are set in the cache in place by a scatter on
  accelerators, and on CPU for blocks of 2+ tokens and wherever the prefix
  attention reads the cache (O(k) per step, not O(len)); on CPU one-token
  blocks over a whole short cache use one select pass (`_blend_block`),
  where XLA CPU would copy the cache around an in-place write. The cache is
  `families/t5/network.py`'s (`T5.init_cache` makes it, and sharding rules
  apply as is).

Numerics: RMS norm and softmax in float32, matrix products in `config.dtype`
as in `T5.decode_block`; the order of float operations differs, and with
bfloat16 weights so does the rounding of (norm scale x kernel), so logits
agree with the reference to float rounding, not bit for bit
(tests/test_decode_ops.py). Exactness of speculative decoding is unaffected:
target-only and speculative decoding both run this function.
"""

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core.rows import row_sum
from specdec_jax.core.token_tree import TreeAttention, tree_positions
from specdec_jax.families.kernel_layout import project
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.network import (_ACTIVATIONS, _MASK_VALUE, _axes, _set_block,
                                   relative_position_bucket)

Array = jax.Array
Prepared = Dict[str, Any]
Cache = Dict[str, Any]


def _mlp_kernel_names(config: T5Config) -> Tuple[str, ...]:
  acts = config.mlp_activations
  return ("wi",) if len(acts) == 1 else tuple(f"wi_{i}" for i in range(len(acts)))


def prepare_decode_params(params, config: T5Config) -> Prepared:
  """Fused decoder kernels for `decode_block`, built from a T5X parameter tree.

  Pure and cheap (a few products and concatenations of the decoder's
  kernels); call it once when a model is loaded, or inside a jitted decode
  loop, where it runs once before the loop.

  Args:
    params: the T5X tree (`{'token_embedder': ..., 'decoder': ...}`).
    config: the model's T5Config.
  Returns:
    {'embedding' [vocab, emb], 'rel_embedding' [heads, buckets] float32,
     'decoder_norm' [emb] float32, 'logits' [emb, vocab] or None (tied),
     'layers': per layer {
       'qkv' [emb, 3, heads * head_dim]: pre_self_attention_layer_norm's
         scale times the query, key and value kernels,
       'self_out' [heads * head_dim, emb],
       'cross_query' [emb, heads * head_dim]: pre_cross_attention_layer_norm's
         scale times the query kernel,
       'cross_out' [heads * head_dim, emb],
       'wi' [emb, len(mlp_activations), mlp]: pre_mlp_layer_norm's scale
         times wi_0, wi_1 (or wi),
       'wo' [mlp, emb]}};
    kernels in `config.dtype` (products formed in float32, then cast). With
    `config.kernel_layout == 'out_in'` every kernel is stored transposed ([out, in];
    qkv [3, inner, emb], wi [len(mlp_activations), mlp, emb]).
  """
  dtype = jnp.dtype(config.dtype)
  decoder = params["decoder"]
  missing = [f"layers_{i}" for i in range(config.num_decoder_layers)
             if f"layers_{i}" not in decoder]
  if missing:
    raise ValueError(f"params['decoder'] lacks {missing} for a config with "
                     f"{config.num_decoder_layers} decoder layers")
  # Kernels keep the stored orientation (`config.kernel_layout`): [in, out], or [out, in],
  # which XLA's CPU dot reads faster (`families.kernel_layout`). The norm scale multiplies
  # the `in` axis either way.
  out_in = config.kernel_layout == "out_in"
  stack_axis = 0 if out_in else 1
  kernel = lambda tree: jnp.asarray(tree["kernel"]).astype(dtype)
  scale = lambda tree: jnp.asarray(tree["scale"]).astype(jnp.float32)
  fold = lambda norm, tree: ((scale(norm)[None, :] if out_in else scale(norm)[:, None]) *
                             jnp.asarray(tree["kernel"]).astype(jnp.float32)).astype(dtype)
  layers = []
  for i in range(config.num_decoder_layers):
    layer = decoder[f"layers_{i}"]
    self_attn, cross_attn, mlp = (layer["self_attention"], layer["encoder_decoder_attention"],
                                  layer["mlp"])
    layers.append(dict(
        # Stacked on a new axis rather than concatenated, so each projection's
        # output dimension (sharded over `model` under a mesh) stays whole.
        qkv=jnp.stack([fold(layer["pre_self_attention_layer_norm"], self_attn[name])
                       for name in ("query", "key", "value")], axis=stack_axis),
        self_out=kernel(self_attn["out"]),
        cross_query=fold(layer["pre_cross_attention_layer_norm"], cross_attn["query"]),
        cross_out=kernel(cross_attn["out"]),
        wi=jnp.stack([fold(layer["pre_mlp_layer_norm"], mlp[name])
                      for name in _mlp_kernel_names(config)], axis=stack_axis),
        wo=kernel(mlp["wo"])))
  return dict(
      embedding=jnp.asarray(params["token_embedder"]["embedding"]).astype(dtype),
      rel_embedding=jnp.asarray(decoder["relpos_bias"]["rel_embedding"]).astype(jnp.float32),
      decoder_norm=scale(decoder["decoder_norm"]),
      logits=None if config.logits_via_embedding else kernel(decoder["logits_dense"]),
      layers=layers)


def _inv_rms(x: Array, config: T5Config) -> Array:
  """[..., emb] -> [..., 1] float32: 1 / RMS(x), T5's norm without its scale.

  The sum of squares is `core.rows.row_sum`, a tree of adds: a reduction would run
  on XLA CPU's own loop for a few rows and on YNNPACK, summing in another order,
  from 4096 elements on (batch 2 at block width 8 and emb 256), so a row's norm,
  and in bfloat16 its tokens, would depend on the batch beside it. The tree is one
  loop fusion per norm, as the two-stage reduction it replaces was.
  """
  return jax.lax.rsqrt(row_sum(jnp.square(x.astype(jnp.float32))) / x.shape[-1] +
                       config.layer_norm_epsilon)


def _rms_norm(x: Array, scale: Array, config: T5Config) -> Array:
  """T5's RMS norm of x [..., emb] in float32, returned in config.dtype."""
  return (x.astype(jnp.float32) * _inv_rms(x, config) * scale).astype(jnp.dtype(config.dtype))


def _max_and_sum_exp(a, b):
  """Combines two partial (max m, sum of exp(s - m)) into one."""
  (m1, z1), (m2, z2) = a, b
  m = jnp.maximum(m1, m2)
  return m, z1 * jnp.exp(m1 - m) + z2 * jnp.exp(m2 - m)


def softmax(scores: Array, axis: int) -> Array:
  """Softmax of float32 scores along `axis`, with one reduction for max and sum.

  A single two-output reduction carries the running max m and the sum of
  exp(s - m) (the "online softmax" of FlashAttention), where max-then-sum
  takes two passes (and on CPU two operations each, reductions over more
  than 32 values being split in two). It starts from the lowest finite
  float32, not -inf, so that combining two empty partials never computes
  exp(nan).
  """
  axis = axis % scores.ndim
  lowest = jnp.finfo(jnp.float32).min.astype(jnp.float32)
  top, total = jax.lax.reduce((scores, jnp.ones_like(scores)), (lowest, jnp.float32(0)),
                              _max_and_sum_exp, (axis,))
  top, total = jnp.expand_dims(top, axis), jnp.expand_dims(total, axis)
  return jnp.exp(scores - top) / total


def _attend_in_layout(query: Array, key: Array, value: Array, bias: Array,
                      query_scale: Optional[Array] = None) -> Array:
  """Attention of a few queries over a cache, as multiply-and-sum fusions.

  Args:
    query: [batch, q, heads, head_dim]; key, value: [batch, heads, len,
      head_dim] (the cache's head-major layout).
    bias: float32, broadcastable to [batch, q, heads, len] (mask folded in).
    query_scale: optional [batch, q] float32 multiplying the queries
      (applied to the scores, where it costs no extra operation).
  Returns:
    [batch, q, heads, head_dim] in value's dtype.

  Scores and outputs are each one multiply-and-sum fusion that reads the
  cache as it lies and keeps the queries' token-major order, so nothing is
  transposed, and the softmax fuses into them: the fewest operations, for
  accelerators, where a small decode step is launch-bound. Products are
  summed in float32, as the reference's dots accumulate. No 1/sqrt(head_dim):
  T5 folds it into the query weights.
  """
  f32 = jnp.float32
  scores = jnp.sum(query[:, :, :, None].astype(f32) * key[:, None].astype(f32), axis=-1)
  if query_scale is not None:
    scores = scores * query_scale[:, :, None, None]
  weights = softmax(scores + bias, axis=-1)  # [batch, q, heads, len]
  out = jnp.sum(weights[..., None] * value[:, None].astype(f32), axis=3)
  return out.astype(value.dtype)


def _attend_dots(query: Array, key: Array, value: Array, bias: Array,
                 query_scale: Optional[Array] = None) -> Array:
  """As `_attend_in_layout`, with batched dots (what XLA CPU runs fastest).

  The cache is each dot's first operand, as it lies: scores are key [batch,
  heads, len, head_dim] times the queries (head_dim contracted), outputs are
  value [batch, heads, len, head_dim] times the weights (len contracted).
  XLA CPU's batched dot copies a second operand that is not contracted on its
  major dimension, so with the cache second it would copy (transpose) the
  whole key cache per layer and step; with the cache first only the few
  queries and weights are laid out. Its dot kernels beat its reductions by
  far at these sizes.
  """
  f32 = jnp.float32
  scores = jnp.einsum("bhkd,bqhd->bhkq", key, query, preferred_element_type=f32)
  bias = jnp.moveaxis(bias, 1, 3)  # [batch, heads, len, q]
  if query_scale is not None:
    scores = scores * query_scale[:, None, None, :]
  weights = softmax(scores + bias, axis=2).astype(value.dtype)  # [batch, heads, len, q]
  out = jnp.einsum("bhkd,bhkq->bqhd", value, weights, preferred_element_type=f32)
  return out.astype(value.dtype)


def _attend_dots_prefix(query: Array, key: Array, value: Array, bias: Array, filled: Array,
                        chunk: int) -> Array:
  """`_attend_dots` over the cache's first `filled` positions only, `chunk` keys at a time.

  Args:
    query: [batch, q, heads, head_dim]; key, value: [batch, heads, len,
      head_dim].
    bias: float32 [batch, heads, len, q] (mask folded in; keys-major, as the
      scores lie, transposed once per call by `decode_block`, not per layer).
    filled: int32 scalar, how many leading cache positions any row may attend
      (the batch's last written position + 1); later keys are never read.
    chunk: keys per step of the loop.
  Returns:
    [batch, q, heads, head_dim] in value's dtype.

  Why: a decode step attends to the positions written so far, but a cache
  built for n steps has n; reading all of them makes every step cost the
  whole cache (the growth `scripts/cache_growth.py` measures). The loop runs
  ceil(filled / chunk) chunks and merges them as FlashAttention does: a
  running max m, sum of exponentials z and unnormalised output o per query,
  rescaled by exp(m_old - m_new) as each chunk arrives, and o / z at the end.
  A chunk whose keys are all masked for a row changes that row's (m, z, o) by
  exactly nothing (its exponentials are exactly 0 and the rescale exactly 1,
  the first chunk always holding a visible key), so the result is the same
  bits however many chunks run: it does not depend on the cache's length, nor
  on how far the batch's other rows have got. The last chunk is shifted back
  to end at the cache's end when len is not a multiple of chunk, its keys
  before the chunk's own start masked so that none counts twice.
  """
  f32 = jnp.float32
  batch, q, heads, _ = query.shape
  length = key.shape[2]
  lowest = jnp.finfo(f32).min.astype(f32)
  count = jnp.clip((filled + chunk - 1) // chunk, 1, -(-length // chunk))

  def merge(i, carry):
    top, total, out = carry  # [batch, heads, 1, q] x 2, [batch, q, heads, head_dim]
    own_start = i * chunk
    start = jnp.minimum(own_start, length - chunk)
    keys = jax.lax.dynamic_slice_in_dim(key, start, chunk, axis=2)
    values = jax.lax.dynamic_slice_in_dim(value, start, chunk, axis=2)
    counted = (start + jnp.arange(chunk) < own_start)[None, None, :, None]
    scores = jnp.einsum("bhkd,bqhd->bhkq", keys, query, preferred_element_type=f32)
    scores = jnp.where(counted, _MASK_VALUE, scores
                       + jax.lax.dynamic_slice_in_dim(bias, start, chunk, axis=2))
    new_top = jnp.maximum(top, jnp.max(scores, axis=2, keepdims=True))
    rescale = jnp.exp(top - new_top)
    weights = jnp.exp(scores - new_top)
    total = total * rescale + jnp.sum(weights, axis=2, keepdims=True)
    out = out * jnp.moveaxis(rescale, (1, 3), (2, 1)) + jnp.einsum(
        "bhkd,bhkq->bqhd", values, weights.astype(value.dtype), preferred_element_type=f32)
    return new_top, total, out

  init = (jnp.full((batch, heads, 1, q), lowest, f32), jnp.zeros((batch, heads, 1, q), f32),
          jnp.zeros(query.shape, f32))
  _, total, out = jax.lax.fori_loop(0, count, merge, init)
  return (out / jnp.moveaxis(total, (1, 3), (2, 1))).astype(value.dtype)


ATTENTION = {"in_layout": _attend_in_layout, "dots": _attend_dots}

# Keys per chunk of the 'dots' path's self-attention over the filled prefix
# (`_attend_dots_prefix`); caches of at most this many positions attend whole.
PREFIX_CHUNK = 256


def default_attention() -> str:
  """'dots' on CPU, 'in_layout' on accelerators (see `decode_block`)."""
  return "dots" if jax.default_backend() == "cpu" else "in_layout"


def _heads(x: Array, config: T5Config) -> Array:
  """[..., heads * head_dim] -> [..., heads, head_dim], named for GSPMD."""
  x = x.reshape(x.shape[:-1] + (config.num_heads, config.head_dim))
  return _axes(x, ("batch", "length", "heads", "kv"))


def position_bias(rel_embedding: Array, config: T5Config, query_positions: Array,
                  max_len: int, key_positions: Optional[Array] = None,
                  allowed: Optional[Array] = None) -> Array:
  """Relative position bias plus causal mask for queries against the whole cache.

  Args:
    rel_embedding: [heads, buckets] float32.
    query_positions: [batch, q] int32.
    max_len: cache positions.
    key_positions: [batch, max_len] int32, the position of each row's key at
      each cache index (a tree block: `core.token_tree.tree_positions`); None: the
      index itself.
    allowed: [batch, q, max_len] bool ANDed into the causal mask (a tree
      block); None: the causal mask alone.
  Returns:
    [batch, q, heads, max_len] float32; keys after a query (or not allowed)
    get -1e10.
  """
  if key_positions is None:
    key_positions = jnp.arange(max_len)[None, None, :]
  else:
    key_positions = key_positions[:, None, :]
  relative = key_positions - query_positions[:, :, None]
  buckets = relative_position_bucket(relative, False, config.relative_attention_num_buckets,
                                     config.relative_attention_max_distance)
  bias = jnp.moveaxis(jnp.take(rel_embedding, buckets, axis=1), 0, 2)  # [batch, q, heads, len]
  causal = key_positions <= query_positions[:, :, None]
  if allowed is not None:
    causal = causal & allowed
  return bias + jnp.where(causal, 0.0, _MASK_VALUE)[:, :, None]


def _blend_block(cache: Array, block: Array, positions: Array) -> Array:
  """`families.t5.network._set_block` as one select over the cache (CPU, one-token blocks).

  Sets block [batch, k, heads, head_dim] into cache [batch, heads, len,
  head_dim] at positions [batch] + 0..k-1; writes past the end are dropped.
  A pass over the whole cache, so it is kept where XLA CPU leaves no cheaper
  choice: at k = 1 any in-place write (a scatter, a dynamic-update-slice, a
  clamped window of either) is fused twice, into the carried cache and into the
  matrix-vector attention dot that reads it (through the bitcast that drops
  the unit batch dimension), and each cache is then copied four times per
  layer and step to keep both in place; one select pass is a single fusion
  that both read.
  """
  length = cache.shape[2]
  offset = jnp.arange(length)[None, :] - positions[:, None]  # [batch, len]
  inside = (offset >= 0) & (offset < block.shape[1])
  rows = jnp.take_along_axis(block, jnp.clip(offset, 0, block.shape[1] - 1)[:, :, None, None],
                             axis=1)  # [batch, len, heads, head_dim]
  return jnp.where(inside[:, None, :, None], jnp.swapaxes(rows, 1, 2).astype(cache.dtype), cache)


def _set_block_cpu(cache: Array, block: Array, positions: Array) -> Array:
  """The 'dots' path's cache write, O(k) where XLA CPU allows it.

  Blocks of 2 or more tokens: the accelerators' scatter (`_set_block`), which
  XLA CPU compiles to one in-place dynamic-update-slice per cache that the
  attention dot reads from the carried buffer, no copy (it costs two small
  fusions more per layer than the select: the write's in-bounds window,
  O(k)). One token: the select pass `_blend_block` (see there).
  """
  if block.shape[1] == 1:
    return _blend_block(cache, block, positions)
  return _set_block(cache, block, positions)


def _fused_projection(x: Array, kernel: Array, out_in: bool) -> Array:
  """x [n, emb] through a stacked kernel ([emb, t, s], or [t, s, emb] out_in) -> [n, t, s]
  float32. out_in runs as one 2-D dot over [t * s, emb] (a contiguous reshape): XLA's CPU
  dot transposes a 3-D [t, s, emb] operand on every call (BENCHMARKS.md, "Issue 30")."""
  if out_in:
    t, s, emb = kernel.shape
    flat = project(x, kernel.reshape(t * s, emb), "out_in", preferred_element_type=jnp.float32)
    return flat.reshape(x.shape[0], t, s)
  return jnp.einsum("ne,ets->nts", x, kernel, preferred_element_type=jnp.float32)


def decode_block(prepared: Prepared, config: T5Config, tokens: Array, positions: Array,
                 cache: Cache, attention: Optional[str] = None,
                 tree: Optional[TreeAttention] = None, taps: Optional[Tuple[int, ...]] = None,
                 prefix_chunk: Optional[int] = None):
  """Scores a block of tokens per row from the cache; same contract as `T5.decode_block`.

  One function (about 90 lines) on purpose: it is the fused decoder step, read
  top to bottom as XLA runs it (embed, per layer self-attention over the
  cache, cross-attention, MLP, the logits), and its pieces share the layer's
  prepared weights and the cache update order.

  Args:
    prepared: from `prepare_decode_params`.
    config: the model's T5Config.
    tokens: [batch, k] int32 decoder input tokens.
    positions: [batch] int32, the position of each row's first token.
    cache: from `T5.init_cache` (`Model.init_cache`).
    attention: 'in_layout' (reductions over the cache as it lies: fewest
      operations, no copy of the cache; for accelerators, where a decode
      step is launch-bound) or 'dots' (batched dots: fastest with XLA CPU);
      default `default_attention()`.
    tree: None, or the block's `core.token_tree.TreeAttention`: token i then sits
      at position root + tree.depths[i] (root = positions - tree.root_offset),
      the relative position bias reads each key's own position (a tree
      slot's: root + its depth) and the causal mask is ANDed with the tree's
      `allowed` (`core.token_tree.tree_positions`). Cache writes are the same.
    taps: None, or hidden-state indices to return as features
      (`families.feature_head.feature_taps`: i < num_decoder_layers is layer
      i's input, num_decoder_layers the output after the final norm, which
      feeds the logits). None traces exactly the program without features.
    prefix_chunk: self-attention reads only the cache positions written so
      far (up to the batch's max(positions) + k), this many keys at a time
      (`_attend_dots_prefix`), when the cache holds more than this many;
      0: every position, masked. Default: `PREFIX_CHUNK` on every path: on an
      accelerator a loop per layer adds a few launches to a short cache's step,
      but a long cache's step then reads what was written, not what was allocated
      (issue 52); caches of at most `PREFIX_CHUNK` positions attend whole, as before.
  Returns:
    logits [batch, k, vocab] float32 (row b, index j predicts the token
    after token j: at position positions[b] + j + 1 without a tree), and the
    cache with the block's keys and values set at positions[b] + 0..k-1
    (writes past the cache are dropped). With taps, (logits, features
    [batch, k, len(taps) * emb] float32, cache).
  """
  attention = default_attention() if attention is None else attention
  if attention not in ATTENTION:
    raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
  attend = ATTENTION[attention]
  batch, k = tokens.shape
  dtype = jnp.dtype(config.dtype)
  max_len = cache["layers"][0]["self_key"].shape[2]
  if prefix_chunk is None:
    prefix_chunk = PREFIX_CHUNK
  if int(prefix_chunk) != prefix_chunk or prefix_chunk < 0:
    raise ValueError(f"prefix_chunk must be an int >= 0 (0: attend to the whole cache), "
                     f"got {prefix_chunk!r}")
  prefix_chunk = prefix_chunk if max_len > prefix_chunk else 0
  # The select pass is for a one-token write that a whole-cache dot reads; the
  # prefix loop's sliced reads let the in-place write stay in place.
  set_block = _set_block_cpu if attention == "dots" and not prefix_chunk else _set_block
  filled = jnp.max(positions) + k  # the block's writes end here (past it: never written)
  if tree is None:
    query_positions = positions[:, None] + jnp.arange(k)[None, :]
    self_bias = position_bias(prepared["rel_embedding"], config, query_positions, max_len)
  else:
    query_positions, key_positions, allowed = tree_positions(tree, positions, max_len)
    self_bias = position_bias(prepared["rel_embedding"], config, query_positions, max_len,
                              key_positions, allowed)
  if prefix_chunk:
    prefix_bias = jnp.moveaxis(self_bias, 1, 3)  # [batch, heads, len, q]: once, not per layer
  cross_bias = jnp.where(cache["encoder_mask"], 0.0, _MASK_VALUE)[:, None, None, :]  # [b,1,1,len]
  activations = [_ACTIVATIONS[a] for a in config.mlp_activations]
  layout = config.kernel_layout
  out_in = layout == "out_in"

  # The residual stream is [batch * k, emb]: 2-D operands for the projections.
  x = jnp.take(prepared["embedding"], tokens.reshape(-1), axis=0)
  rows = lambda y: y.reshape((batch, k) + y.shape[1:])
  flat = lambda y: y.reshape((batch * k,) + y.shape[2:])
  f32 = jnp.float32
  new_layers = []
  tapped = {}
  for index, (p, layer_cache) in enumerate(zip(prepared["layers"], cache["layers"])):
    if taps is not None and index in taps:
      tapped[index] = rows(x)
    # Self-attention: one projection for query, key and value (norm scale
    # folded in; 1/rms applied to its float32 output).
    qkv = _fused_projection(x, p["qkv"], out_in)
    qkv = (qkv * _inv_rms(x, config)[..., None]).astype(dtype)
    query, key, value = (_heads(rows(qkv[:, i]), config) for i in range(3))
    self_key = set_block(layer_cache["self_key"], key, positions)
    self_value = set_block(layer_cache["self_value"], value, positions)
    new_layers.append(dict(layer_cache, self_key=self_key, self_value=self_value))
    if prefix_chunk:
      heads = _attend_dots_prefix(query, self_key, self_value, prefix_bias, filled, prefix_chunk)
    else:
      heads = attend(query, self_key, self_value, self_bias)
    x = x + project(heads.reshape(batch * k, -1), p["self_out"], layout)

    # Cross-attention over the cached encoder keys/values; 1/rms scales the
    # scores rather than the query.
    query = _heads(rows(project(x, p["cross_query"], layout)), config)
    cross_key, cross_value = layer_cache["cross_key"], layer_cache["cross_value"]
    if attention == "in_layout":
      # XLA CPU (jax 0.10.2) miscompiles this read of the loop-invariant
      # cross-attention cache inside a decode loop (its YNNPACK
      # multiply-and-sum fusion gave wrong scores at batch 1;
      # tests/test_decode_ops.py decodes in a loop against the reference).
      # The barrier avoids it and moves no data.
      cross_key, cross_value = jax.lax.optimization_barrier((cross_key, cross_value))
    heads = attend(query, cross_key, cross_value, cross_bias,
                   query_scale=_inv_rms(x, config).reshape(batch, k))
    x = x + project(heads.reshape(batch * k, -1), p["cross_out"], layout)

    # Gated MLP: one projection for all input kernels.
    wi = _fused_projection(x, p["wi"], out_in)
    wi = wi * _inv_rms(x, config)[..., None]
    hidden = activations[0](wi[:, 0])
    for i, act in enumerate(activations[1:], start=1):
      hidden = hidden * act(wi[:, i])
    hidden = flat(_axes(rows(hidden.astype(dtype)), ("batch", "length", "mlp")))
    x = flat(_axes(rows(x + project(hidden, p["wo"], layout)), ("batch", "length", "embed")))

  h = normed = rows(_rms_norm(x, prepared["decoder_norm"], config))
  if prepared["logits"] is None:
    # Original T5 scales the output before the tied projection.
    h = h * (config.emb_dim ** -0.5)
    logits = jnp.dot(h, prepared["embedding"].T, preferred_element_type=jnp.float32)
  else:
    logits = project(h, prepared["logits"], layout).astype(jnp.float32)
  if taps is None:
    return logits, dict(cache, layers=new_layers)
  tapped[len(prepared["layers"])] = normed  # what the logits were projected from
  features = jnp.concatenate([tapped[i].astype(f32) for i in taps], axis=-1)
  return logits, features, dict(cache, layers=new_layers)


def block_fn(params, config: T5Config, attention: Optional[str] = None,
             prefix_chunk: Optional[int] = None):
  """A block callback `(tokens, positions, cache, tree=None) -> (logits, cache)` on the
  fused path.

  Prepares the fused kernels when called (once per trace of a decode loop),
  so `Model.block_fn` needs no prepared state. `attention`, `prefix_chunk`:
  see `decode_block`.
  """
  prepared = prepare_decode_params(params, config)
  return lambda tokens, positions, cache, tree=None: decode_block(
      prepared, config, tokens, positions, cache, attention, tree, prefix_chunk=prefix_chunk)


def feature_block_fn(params, config: T5Config, taps: Tuple[int, ...],
                     attention: Optional[str] = None, prefix_chunk: Optional[int] = None):
  """`block_fn` that also returns the features `taps` names: `(tokens, positions,
  cache, tree=None) -> (logits, features [batch, k, len(taps) * emb] float32,
  cache)` (`decode_block`'s taps; a tree block's features are its nodes').
  `attention`, `prefix_chunk`: see `decode_block`."""
  prepared = prepare_decode_params(params, config)
  return lambda tokens, positions, cache, tree=None: decode_block(
      prepared, config, tokens, positions, cache, attention, tree, taps, prefix_chunk)
