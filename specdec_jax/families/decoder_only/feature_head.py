"""The decoder-only family's EAGLE-1 feature head (`families.feature_head.FeatureHead`).

    x   = fc([embedding(token_t); feature_{t-1}])           Linear(2h -> h)
          (+ wpe[t], the target's learned position t, for GPT-2 layouts)
    f_t = DecoderLayer(x)   (one layer of the target's config, its input norm
                             dropped, its own KV cache over positions)
    p(token_{t+1}) = the target's LM head(f_t)

Positions: rotary targets (Llama, Qwen2, Mistral, Gemma) rotate the head's
queries and keys by absolute position, as the target does. Learned-position
targets (GPT-2 layout) get no rotation; instead the target's own position
embedding wpe at the pair's absolute position t is added to fc's output, the
way the target adds it to its token embeddings (a reference in
`target_refs`, not a trained copy). Without it the head's attention would be
blind to order: GPT-2's layers have no positional signal of their own. (The
feature fed in carries the target's position information at t - 1 already;
adding wpe[t] after fc rather than inside its input keeps fc's [emb; feature]
layout the EAGLE-1 checkpoint layout.)

Params (`init_params`): fc/kernel [2 emb, emb] (+ bias with fc_bias),
layer/... (a `DecoderLayer` without input_layernorm). Refs (`target_refs`):
embed_tokens/embedding, lm_head (untied targets), embed_positions (GPT-2).
"""

from typing import Hashable

import flax.linen as nn
import jax
import jax.numpy as jnp

from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import (_MASK_VALUE, DecoderLayer, DecoderOnly,
                                                       Dense, rotary_tables)
from specdec_jax.families.feature_head import FeatureHead

Array = jax.Array


class HeadNetwork(nn.Module):
  """fc over [embedding; feature] then one decoder layer, from a cache of its own.

  Params: fc/kernel [2 emb, emb] (+ bias), layer/... (a `DecoderLayer` without
  input_layernorm).
  """
  config: DecoderOnlyConfig
  fc_bias: bool = False

  def setup(self):
    self.fc = Dense(self.config.emb_dim, self.config, self.fc_bias)
    self.layer = DecoderLayer(self.config, input_norm=False)

  def __call__(self, embeddings: Array, features: Array, positions: Array, cache,
               learned_positions=None):
    """embeddings, features [batch, k, emb] at absolute positions positions[b] + 0..k-1;
    cache dict(self_key, self_value) [batch, max_len, kv_heads, head_dim];
    learned_positions: None, or [batch, k, emb] added to fc's output (GPT-2).
    Returns (predicted features [batch, k, emb] in config.dtype, cache)."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x = self.fc(jnp.concatenate([embeddings.astype(dtype), features.astype(dtype)], axis=-1))
    if learned_positions is not None:
      x = x + learned_positions.astype(dtype)
    query_at = positions[:, None] + jnp.arange(x.shape[1])[None, :]
    key_at = jnp.arange(cache["self_key"].shape[1])[None]
    causal = key_at[:, None, None, :] <= query_at[:, None, :, None]
    bias = jnp.where(causal, 0.0, _MASK_VALUE).astype(jnp.float32)
    rotary = rotary_tables(query_at, cfg) if cfg.uses_rotary else None
    return self.layer(x, bias, rotary, cache, positions)


class DecoderOnlyFeatureHead(FeatureHead):
  """EAGLE-1 head for a decoder-only target (any layout; see the module docstring).

  Args:
    config: the target's `DecoderOnlyConfig`.
    fc_bias: whether fc has a bias (EAGLE-1 config `bias`).
  """

  feature_layers = None  # the last layer, after the final norm (EAGLE-1)

  def __init__(self, config: DecoderOnlyConfig, fc_bias: bool = False):
    if not isinstance(config, DecoderOnlyConfig):
      raise TypeError(f"DecoderOnlyFeatureHead takes a DecoderOnlyConfig, got "
                      f"{type(config).__name__}")
    self.config = config
    self.fc_bias = bool(fc_bias)

  @property
  def network(self) -> HeadNetwork:
    return HeadNetwork(self.config, self.fc_bias)

  def static_key(self) -> Hashable:
    return ("decoder_only_eagle1", self.config, self.fc_bias)

  def init_params(self, seed: int = 0):
    """Random head params (normal(0.02) kernels, unit norms), in config.dtype."""
    h = self.config.emb_dim
    params = self.network.init(
        jax.random.PRNGKey(seed), jnp.zeros((1, 1, h)), jnp.zeros((1, 1, h)),
        jnp.zeros((1,), jnp.int32), self.init_cache(None, 1, 1))["params"]
    return jax.tree_util.tree_map(lambda x: x.astype(self.config.dtype), params)

  def target_refs(self, target_params):
    """The target's embedding table, (untied) lm_head and (GPT-2) position table."""
    config = self.config
    refs = {"embed_tokens": target_params["embed_tokens"]}
    if not config.tie_word_embeddings:
      refs["lm_head"] = target_params["lm_head"]
    if not config.uses_rotary:
      refs["embed_positions"] = target_params["embed_positions"]
    return refs

  def init_cache(self, params, batch: int, max_len: int, memory=None):
    """dict(self_key, self_value) [batch, max_len, kv_heads, head_dim]; no memory."""
    if memory is not None:
      raise ValueError("a decoder-only feature head reads no memory")
    config = self.config
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    return dict(self_key=jnp.zeros(shape, config.dtype),
                self_value=jnp.zeros(shape, config.dtype))

  def embed(self, refs, ids: Array) -> Array:
    """The target's input token embedding of ids (Gemma's sqrt(emb) scale included)."""
    config = self.config
    x = jnp.take(refs["embed_tokens"]["embedding"], ids, axis=0, mode="clip").astype(
        config.dtype)
    if config.scale_embeddings:
      x = x * jnp.asarray(config.emb_dim ** 0.5, x.dtype)
    return x

  def apply(self, params, refs, tokens, features, positions, cache):
    learned = None
    if not self.config.uses_rotary:
      at = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
      # Clipped as the target clips: positions past the table belong to
      # drafts beyond the decode, never emitted.
      learned = jnp.take(refs["embed_positions"]["embedding"], at, axis=0, mode="clip")
    return self.network.apply({"params": params}, self.embed(refs, tokens), features,
                              positions, cache, learned)

  def logits(self, params, refs, hidden):
    """The target's LM head: hidden [..., emb] -> logits [..., vocab] float32."""
    return DecoderOnly(self.config).apply({"params": refs}, hidden,
                                          method=DecoderOnly.project_logits)
