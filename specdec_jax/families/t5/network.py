"""A T5 encoder-decoder whose decoder scores blocks of tokens from a KV cache.

The parameter tree is exactly T5X's (`token_embedder/embedding`,
`encoder/layers_0/attention/query/kernel`, ..., `decoder/logits_dense/kernel`),
so T5X checkpoints load without renaming. Unlike T5X's example network:

* cross-attention keys/values are computed once from the encoder output and
  kept in the cache, not recomputed at every decode step;
* `decode_block` scores k >= 1 tokens per row, each row starting at its own
  position, and writes keys/values by *setting* them. Entries past a row's
  current length are never attended to (causal mask) and are overwritten
  later, so rolling a row back after a rejected draft is just moving its
  position back.

Cache layout (a dict, one entry per decoder layer):
  cache['layers'][i]['self_key'], ['self_value']:   [batch, heads, max_len, head_dim]
  cache['layers'][i]['cross_key'], ['cross_value']: [batch, heads, enc_len, head_dim]
  cache['encoder_mask']:                            [batch, enc_len] bool
Keys and values are head-major, the layout of attention's batched products
(batch and heads lead, head_dim is contracted): reading the cache then needs
no transposed copy of it per layer and step.
"""

from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import rows
from specdec_jax.families.kernel_layout import kernel_shape, project
from specdec_jax.families.t5.config import T5Config

Array = jax.Array
Cache = Dict[str, Any]

# Large negative instead of -inf so a fully masked row (an all-padding input)
# gives a uniform softmax rather than NaN.
_MASK_VALUE = -1e10

_ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=True),
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "silu": nn.silu,
    "linear": lambda x: x,
}


def _dtype(config: T5Config):
  return jnp.dtype(config.dtype)


def _axes(x: Array, logical_axes: Tuple[str, ...]) -> Array:
  """Names x's dimensions for GSPMD (T5X style, see specdec_jax/sharding.py).

  A no-op unless the caller binds Flax logical axis rules and a mesh while
  tracing (`Partitioner.activation_axes`).
  """
  return nn.with_logical_constraint(x, logical_axes)


def relative_position_bucket(relative_position: Array, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> Array:
  """T5's bucketing of (key position - query position) into int32 buckets.

  Small distances get their own bucket; larger ones share logarithmically
  wider buckets up to `max_distance`. Bidirectional (encoder) spends half the
  buckets on keys after the query.
  """
  n = -relative_position
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # eps keeps log() finite at n = 0 (masked out by is_small anyway).
  large = max_exact + (
      jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps) /
      np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, n, large)


class RMSNorm(nn.Module):
  """T5's layer norm: scale only, no mean subtraction, computed in float32."""
  config: T5Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    # The mean a tree of adds (`core.rows`): a row's bits then do not depend on the batch.
    x32 = x32 * jax.lax.rsqrt(rows.row_mean(x32 * x32) + self.config.layer_norm_epsilon)
    return (x32 * scale.astype(jnp.float32)).astype(_dtype(self.config))


class Dense(nn.Module):
  """A bias-free projection with a 2-D `kernel` [in, out], as T5X stores it (or [out, in]:
  `config.kernel_layout`, `families.kernel_layout`)."""
  features: int
  config: T5Config
  init_scale: float = 1.0

  @nn.compact
  def __call__(self, x: Array) -> Array:
    init = nn.initializers.variance_scaling(self.init_scale, "fan_in", "truncated_normal")
    layout = self.config.kernel_layout
    kernel = self.param("kernel", init, kernel_shape(layout, x.shape[-1], self.features),
                        jnp.float32)
    dtype = _dtype(self.config)
    return project(x.astype(dtype), kernel.astype(dtype), layout)


class RelativePositionBias(nn.Module):
  """One table `rel_embedding` [heads, buckets] shared by all layers of a stack."""
  config: T5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array) -> Array:
    """Bias for queries [batch|1, q] against keys [batch|1, k] -> [batch|1, heads, q, k]."""
    cfg = self.config
    table = self.param("rel_embedding",
                       nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                       (cfg.num_heads, cfg.relative_attention_num_buckets), jnp.float32)
    relative = key_positions[:, None, :] - query_positions[:, :, None]
    buckets = relative_position_bucket(relative, self.bidirectional,
                                       cfg.relative_attention_num_buckets,
                                       cfg.relative_attention_max_distance)
    bias = jnp.take(table, buckets, axis=1)  # [heads, batch, q, k]
    return jnp.transpose(bias, (1, 0, 2, 3))


def _attend(query: Array, key: Array, value: Array, bias: Array) -> Array:
  """Scaled-free dot-product attention.

  T5 folds 1/sqrt(head_dim) into the query initialisation, so none is applied.

  Args:
    query: [batch, q, heads, head_dim]; key, value: [batch, heads, k, head_dim]
      (head-major, as `project_key_value` returns them and the cache holds them).
    bias: broadcastable to [batch, heads, q, k], float32 (mask folded in).
  Returns:
    [batch, q, heads, head_dim] in the query's dtype.
  """
  scores = jnp.einsum("bqhd,bhkd->bhqk", query, key, preferred_element_type=jnp.float32)
  weights = rows.softmax(scores + bias, axis=-1).astype(value.dtype)  # batch-invariant bits
  return jnp.einsum("bhqk,bhkd->bqhd", weights, value)


class Attention(nn.Module):
  """Multi-head attention with T5X's `query`/`key`/`value`/`out` kernels."""
  config: T5Config

  def setup(self):
    cfg = self.config
    inner = cfg.num_heads * cfg.head_dim
    # T5X's query init divides by sqrt(head_dim): the run-time scaling lives in
    # the weights.
    self.query = Dense(inner, cfg, init_scale=1.0 / cfg.head_dim)
    self.key = Dense(inner, cfg)
    self.value = Dense(inner, cfg)
    self.out = Dense(cfg.emb_dim, cfg)

  def _split(self, x: Array) -> Array:
    x = x.reshape(x.shape[:-1] + (self.config.num_heads, self.config.head_dim))
    return _axes(x, ("batch", "length", "heads", "kv"))

  def project_query(self, x: Array) -> Array:
    return self._split(self.query(x))

  def project_key_value(self, x: Array) -> Tuple[Array, Array]:
    """x [batch, len, emb] -> key, value [batch, heads, len, head_dim] (head-major)."""
    return _head_major(self._split(self.key(x))), _head_major(self._split(self.value(x)))

  def project_out(self, heads: Array) -> Array:
    return self.out(heads.reshape(heads.shape[:-2] + (-1,)))

  def __call__(self, x_q: Array, x_kv: Array, bias: Array) -> Array:
    key, value = self.project_key_value(x_kv)
    return self.project_out(_attend(self.project_query(x_q), key, value, bias))


def _head_major(x: Array) -> Array:
  """[batch, len, heads, head_dim] -> [batch, heads, len, head_dim], named for GSPMD."""
  return _axes(jnp.swapaxes(x, 1, 2), ("batch", "heads", "length", "kv"))


class Mlp(nn.Module):
  """Feed-forward block: gated (wi_0, wi_1, ...) or plain (wi), then wo."""
  config: T5Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    acts = cfg.mlp_activations
    hidden = None
    for i, act in enumerate(acts):
      name = "wi" if len(acts) == 1 else f"wi_{i}"
      h = _ACTIVATIONS[act](Dense(cfg.mlp_dim, cfg, name=name)(x))
      hidden = h if hidden is None else hidden * h
    hidden = _axes(hidden, ("batch", "length", "mlp"))
    return Dense(cfg.emb_dim, cfg, name="wo")(hidden)


class EncoderLayer(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x: Array, bias: Array) -> Array:
    cfg = self.config
    h = RMSNorm(cfg, name="pre_attention_layer_norm")(x)
    x = x + Attention(cfg, name="attention")(h, h, bias)
    x = x + Mlp(cfg, name="mlp")(RMSNorm(cfg, name="pre_mlp_layer_norm")(x))
    return _axes(x, ("batch", "length", "embed"))


class Encoder(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, embedded: Array, encoder_mask: Array,
               attention_mask: Optional[Array] = None) -> Array:
    """embedded [batch, len, emb], encoder_mask [batch, len] -> [batch, len, emb].

    attention_mask: optional [batch, len, len] bool (query, key) replacing the
    key padding mask from encoder_mask (T5X's packed batches; t5x_model.py).
    """
    cfg = self.config
    positions = jnp.arange(embedded.shape[1])[None]
    bias = RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")(positions, positions)
    allowed = encoder_mask[:, None, None, :] if attention_mask is None else attention_mask[:, None]
    bias = bias + jnp.where(allowed, 0.0, _MASK_VALUE)
    x = embedded
    for i in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, name=f"layers_{i}")(x, bias)
    return RMSNorm(cfg, name="encoder_norm")(x)


class DecoderLayer(nn.Module):
  """One decoder layer; the same code serves the cached and uncached paths.

  self_attention_norm: False drops pre_self_attention_layer_norm (self-attention
  reads x itself): the layer of a feature head (`families/t5/feature_head.py`),
  whose input is already a projection of normed features, as EAGLE drops its
  layer's first norm. The target's layers keep it.
  """
  config: T5Config
  self_attention_norm: bool = True

  def setup(self):
    cfg = self.config
    if self.self_attention_norm:
      self.pre_self_attention_layer_norm = RMSNorm(cfg)
    self.self_attention = Attention(cfg)
    self.pre_cross_attention_layer_norm = RMSNorm(cfg)
    self.encoder_decoder_attention = Attention(cfg)
    self.pre_mlp_layer_norm = RMSNorm(cfg)
    self.mlp = Mlp(cfg)

  def cross_key_value(self, encoded: Array) -> Tuple[Array, Array]:
    return self.encoder_decoder_attention.project_key_value(encoded)

  def __call__(self, x: Array, self_bias: Array, cross_key: Array, cross_value: Array,
               cross_bias: Array, layer_cache: Optional[Dict[str, Array]] = None,
               positions: Optional[Array] = None):
    """x [batch, q, emb] -> ([batch, q, emb], updated layer cache or None).

    Without a cache, the q tokens attend to each other (teacher forcing). With
    one, their keys/values are set at rows' `positions` [batch] + 0..q-1 and the
    queries attend to the whole cache; `self_bias` masks what lies ahead.
    """
    h = self.pre_self_attention_layer_norm(x) if self.self_attention_norm else x
    key, value = self.self_attention.project_key_value(h)
    new_cache = None
    if layer_cache is not None:
      key = _set_block(layer_cache["self_key"], jnp.swapaxes(key, 1, 2), positions)
      value = _set_block(layer_cache["self_value"], jnp.swapaxes(value, 1, 2), positions)
      new_cache = dict(layer_cache, self_key=key, self_value=value)
    query = self.self_attention.project_query(h)
    x = x + self.self_attention.project_out(_attend(query, key, value, self_bias))
    h = self.pre_cross_attention_layer_norm(x)
    query = self.encoder_decoder_attention.project_query(h)
    x = x + self.encoder_decoder_attention.project_out(
        _attend(query, cross_key, cross_value, cross_bias))
    x = x + self.mlp(self.pre_mlp_layer_norm(x))
    return _axes(x, ("batch", "length", "embed")), new_cache


def _set_block(cache: Array, block: Array, positions: Array) -> Array:
  """Sets block [batch, q, heads, head_dim] into cache [batch, heads, len, head_dim].

  Row b's q entries go to positions[b] + 0..q-1 ([batch] int32). Writes past
  the end of the cache are dropped: they belong to tokens beyond the decode
  length, whose logits are never used.
  """
  batch, q = block.shape[:2]
  index = positions[:, None] + jnp.arange(q)[None, :]
  # Indices on dims 0 and 2 with a slice between: the indexed dims lead, so
  # the update is [batch, q, heads, head_dim], the block as it is.
  return cache.at[jnp.arange(batch)[:, None], :, index].set(block.astype(cache.dtype),
                                                            mode="drop")


class Decoder(nn.Module):
  config: T5Config

  def setup(self):
    cfg = self.config
    self.relpos_bias = RelativePositionBias(cfg, bidirectional=False)
    # A list attribute is named layers_0, layers_1, ... as in T5X.
    self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers)]
    self.decoder_norm = RMSNorm(cfg)
    if not cfg.logits_via_embedding:
      self.logits_dense = Dense(cfg.vocab_size, cfg)

  def cross_key_values(self, encoded: Array):
    return [layer.cross_key_value(encoded) for layer in self.layers]

  def __call__(self, embedded: Array, query_positions: Array, key_positions: Array,
               cross_kv, encoder_mask: Array, cache: Optional[Cache] = None,
               positions: Optional[Array] = None, self_mask: Optional[Array] = None,
               cross_mask: Optional[Array] = None, taps: Optional[Tuple[int, ...]] = None):
    """Runs the decoder stack up to the final norm.

    Args:
      embedded: [batch, q, emb] embedded decoder input tokens.
      query_positions: [batch|1, q] absolute positions of those tokens.
      key_positions: [batch|1, k] positions of the keys attended to (the q
        tokens themselves, or the whole cache).
      cross_kv: per layer (key, value), each [batch, heads, enc_len, head_dim].
      encoder_mask: [batch, enc_len] bool.
      cache / positions: see DecoderLayer.
      self_mask / cross_mask: optional [batch, q, k] / [batch, q, enc_len] bool
        replacing the causal mask / the encoder padding mask (T5X's padded and
        packed teacher-forced batches; t5x_model.py).
      taps: None, or hidden-state indices to return as features
        (`families.feature_head.feature_taps`): i < num_decoder_layers is
        layer i's input (0: the embedded tokens), num_decoder_layers the
        output after the final norm. None traces exactly the program without.
    Returns:
      (hidden [batch, q, emb], list of updated layer caches or None), and with
      taps a third item: features [batch, q, len(taps) * emb] float32.
    """
    self_bias = self.relpos_bias(query_positions, key_positions)
    causal = (key_positions[:, None, None, :] <= query_positions[:, None, :, None]
              if self_mask is None else self_mask[:, None])
    self_bias = self_bias + jnp.where(causal, 0.0, _MASK_VALUE)
    cross_allowed = encoder_mask[:, None, None, :] if cross_mask is None else cross_mask[:, None]
    cross_bias = jnp.where(cross_allowed, 0.0, _MASK_VALUE)
    x = embedded
    new_layer_caches = []
    tapped = {}
    for i, layer in enumerate(self.layers):
      if taps is not None and i in taps:
        tapped[i] = x
      layer_cache = None if cache is None else cache["layers"][i]
      x, new_layer_cache = layer(x, self_bias, cross_kv[i][0], cross_kv[i][1], cross_bias,
                                 layer_cache, positions)
      new_layer_caches.append(new_layer_cache)
    hidden = self.decoder_norm(x)
    if taps is None:
      return hidden, new_layer_caches
    tapped[len(self.layers)] = hidden
    features = jnp.concatenate([tapped[i].astype(jnp.float32) for i in taps], axis=-1)
    return hidden, new_layer_caches, features

  def project_logits(self, hidden: Array, embedding: Array) -> Array:
    if self.config.logits_via_embedding:
      # Original T5 scales the output before the tied projection.
      hidden = hidden * (self.config.emb_dim ** -0.5)
      return jnp.dot(hidden, embedding.astype(hidden.dtype).T,
                     preferred_element_type=jnp.float32)
    return self.logits_dense(hidden).astype(jnp.float32)


class T5(nn.Module):
  """T5 encoder-decoder (T5 1.1 / FLAN-T5 or original T5, by config)."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = _Embedding(cfg)
    self.encoder = Encoder(cfg)
    self.decoder = Decoder(cfg)

  def encode(self, encoder_tokens: Array) -> Array:
    """encoder_tokens [batch, enc_len] int32 (0 = padding) -> [batch, enc_len, emb]."""
    mask = encoder_tokens != self.config.pad_id
    return self.encoder(self.token_embedder(encoder_tokens), mask)

  def __call__(self, encoder_tokens: Array, decoder_input_tokens: Array) -> Array:
    """Teacher-forced logits [batch, dec_len, vocab] float32 (no cache)."""
    encoded = self.encode(encoder_tokens)
    cross_kv = self.decoder.cross_key_values(encoded)
    positions = jnp.arange(decoder_input_tokens.shape[1])[None]
    hidden, _ = self.decoder(self.token_embedder(decoder_input_tokens), positions, positions,
                             cross_kv, encoder_tokens != self.config.pad_id)
    return self.decoder.project_logits(hidden, self.token_embedder.embedding)

  def decoder_features(self, encoder_tokens: Array, decoder_input_tokens: Array,
                       taps: Tuple[int, ...]) -> Array:
    """Teacher-forced decoder features [batch, dec_len, len(taps) * emb] float32 (no
    cache; `Decoder.__call__`'s taps): what a feature head reads and regresses to."""
    encoded = self.encode(encoder_tokens)
    cross_kv = self.decoder.cross_key_values(encoded)
    positions = jnp.arange(decoder_input_tokens.shape[1])[None]
    return self.decoder(self.token_embedder(decoder_input_tokens), positions, positions,
                        cross_kv, encoder_tokens != self.config.pad_id, taps=taps)[2]

  def init_cache(self, encoder_tokens: Array, max_decode_len: int) -> Cache:
    """Encodes once and returns a cache with cross-attention keys/values filled."""
    return self.init_cache_encoded(encoder_tokens, max_decode_len)[0]

  def init_cache_encoded(self, encoder_tokens: Array, max_decode_len: int
                         ) -> Tuple[Cache, Array]:
    """`init_cache`, and the encoder output [batch, enc_len, emb] it was computed from
    (the memory a feature head attends to)."""
    cfg = self.config
    batch = encoder_tokens.shape[0]
    encoded = self.encode(encoder_tokens)
    shape = (batch, cfg.num_heads, max_decode_len, cfg.head_dim)
    layers = []
    for cross_key, cross_value in self.decoder.cross_key_values(encoded):
      layers.append(dict(self_key=jnp.zeros(shape, _dtype(cfg)),
                         self_value=jnp.zeros(shape, _dtype(cfg)),
                         cross_key=cross_key, cross_value=cross_value))
    return dict(layers=layers, encoder_mask=encoder_tokens != cfg.pad_id), encoded

  def decode_block(self, tokens: Array, positions: Array, cache: Cache) -> Tuple[Array, Cache]:
    """Scores a block of tokens per row from the cache.

    Args:
      tokens: [batch, k] int32 decoder input tokens.
      positions: [batch] int32, the position of each row's first token.
      cache: from `init_cache`.
    Returns:
      logits [batch, k, vocab] float32 (row b, index j predicts the token at
      position positions[b] + j + 1), and the cache with the block's keys and
      values set.
    """
    k = tokens.shape[1]
    max_len = cache["layers"][0]["self_key"].shape[2]
    query_positions = positions[:, None] + jnp.arange(k)[None, :]
    key_positions = jnp.arange(max_len)[None]
    cross_kv = [(layer["cross_key"], layer["cross_value"]) for layer in cache["layers"]]
    hidden, new_layers = self.decoder(self.token_embedder(tokens), query_positions,
                                      key_positions, cross_kv, cache["encoder_mask"], cache,
                                      positions)
    logits = self.decoder.project_logits(hidden, self.token_embedder.embedding)
    return logits, dict(cache, layers=new_layers)


class _Embedding(nn.Module):
  """`token_embedder/embedding` [vocab, emb], T5X's normal(1.0) init."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.embedding = self.param("embedding", nn.initializers.normal(stddev=1.0),
                                (cfg.vocab_size, cfg.emb_dim), jnp.float32)

  def __call__(self, tokens: Array) -> Array:
    return jnp.take(self.embedding, tokens, axis=0).astype(_dtype(self.config))
