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

Attention: causal over the head's own keys, with the engine's zero first
pair hidden from later queries (`families.feature_head.pair_visible`), as
EAGLE-1 trains and drafts; training (`train.feature_heads`) runs this same
`apply`, so the heads trained here follow the same rule.

The layer: by default one of the target's own (its config); a head read
from an EAGLE-1 checkpoint passes `layer_config`, the Llama layer its
config.json describes (EAGLE's `cnets1.py` builds the layer from the head's
config: heads, eps, rotary base and scaling, q/k/v biases), on the target's
hidden size. Embeddings: the target's table, or the head's own
`embed_tokens` (`own_embeddings`; a checkpoint that stores one, which
EAGLE's code loads over the target's).

Params (`init_params`): fc/kernel [2 emb, emb] (+ bias with fc_bias),
layer/... (a `DecoderLayer` without input_layernorm), embed_tokens [vocab,
emb] with own_embeddings. Refs (`target_refs`): embed_tokens/embedding
(unless own), lm_head (untied targets), embed_positions (GPT-2).
"""

from typing import Hashable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from specdec_jax.core.token_tree import tree_positions
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import (_MASK_VALUE, DecoderLayer, DecoderOnly,
                                                       Dense, rotary_tables)
from specdec_jax.families.feature_head import FeatureHead, pair_visible

Array = jax.Array


class HeadNetwork(nn.Module):
  """fc over [embedding; feature] then one decoder layer, from a cache of its own.

  Params: fc/kernel [2 emb, emb] (+ bias), layer/... (a `DecoderLayer` without
  input_layernorm), embed_tokens [vocab, emb] with own_embeddings (read by the
  head's `embed`, not here).
  """
  config: DecoderOnlyConfig  # the head's layer
  fc_bias: bool = False
  own_embeddings: bool = False

  def setup(self):
    self.fc = Dense(self.config.emb_dim, self.config, self.fc_bias)
    self.layer = DecoderLayer(self.config, input_norm=False)
    if self.own_embeddings:
      self.embed_tokens = self.param("embed_tokens", nn.initializers.normal(0.02),
                                     (self.config.vocab_size, self.config.emb_dim), jnp.float32)

  def __call__(self, embeddings: Array, features: Array, positions: Array, cache,
               learned_positions=None, query_at=None, key_at=None, allowed=None):
    """embeddings, features [batch, k, emb], written at cache indices positions[b] + 0..k-1;
    cache dict(self_key, self_value) [batch, max_len, kv_heads, head_dim];
    learned_positions: None, or [batch, k, emb] added to fc's output (GPT-2);
    query_at [batch, k] / key_at [batch, max_len] / allowed [batch, k, max_len]: a tree
    block's absolute positions and visibility (`core.token_tree.tree_positions`); None: a
    causal block at absolute positions positions[b] + 0..k-1.
    Returns (predicted features [batch, k, emb] in config.dtype, cache)."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x = self.fc(jnp.concatenate([embeddings.astype(dtype), features.astype(dtype)], axis=-1))
    if learned_positions is not None:
      x = x + learned_positions.astype(dtype)
    if query_at is None:
      query_at = positions[:, None] + jnp.arange(x.shape[1])[None, :]
      key_at = jnp.arange(cache["self_key"].shape[1])[None]
    visible = pair_visible(key_at[:, None, None, :], query_at[:, None, :, None])
    if allowed is not None:
      visible = visible & allowed[:, None]
    bias = jnp.where(visible, 0.0, _MASK_VALUE).astype(jnp.float32)
    rotary = rotary_tables(query_at, cfg) if cfg.uses_rotary else None
    return self.layer(x, bias, rotary, cache, positions)


class DecoderOnlyFeatureHead(FeatureHead):
  """EAGLE-1 head for a decoder-only target (any layout; see the module docstring).

  Args:
    config: the target's `DecoderOnlyConfig`.
    fc_bias: whether fc has a bias (EAGLE-1 config `bias`).
    layer_config: the head's layer; None: the target's own (its layer
      settings and dtype). Its emb_dim and vocabulary must be the target's.
    own_embeddings: the head holds its own `embed_tokens` [vocab, emb]
      instead of reading the target's table.
  """

  feature_layers = None  # the last layer, after the final norm (EAGLE-1)

  def __init__(self, config: DecoderOnlyConfig, fc_bias: bool = False,
               layer_config: Optional[DecoderOnlyConfig] = None, own_embeddings: bool = False):
    if not isinstance(config, DecoderOnlyConfig):
      raise TypeError(f"DecoderOnlyFeatureHead takes a DecoderOnlyConfig, got "
                      f"{type(config).__name__}")
    if layer_config is not None and (layer_config.emb_dim, layer_config.vocab_size) != (
        config.emb_dim, config.vocab_size):
      raise ValueError(f"the head's layer config has emb_dim {layer_config.emb_dim} and "
                       f"vocab_size {layer_config.vocab_size}; the target's are "
                       f"{config.emb_dim} and {config.vocab_size} (an EAGLE-1 head reads the "
                       f"target's features and feeds its LM head)")
    self.config = config
    self.layer_config = config if layer_config is None else layer_config
    self.fc_bias = bool(fc_bias)
    self.own_embeddings = bool(own_embeddings)

  @property
  def network(self) -> HeadNetwork:
    return HeadNetwork(self.layer_config, self.fc_bias, self.own_embeddings)

  def static_key(self) -> Hashable:
    return ("decoder_only_eagle1", self.config, self.fc_bias, self.layer_config,
            self.own_embeddings)

  def init_params(self, seed: int = 0):
    """Random head params (normal(0.02) kernels, unit norms), in the layer's dtype."""
    h = self.config.emb_dim
    params = self.network.init(
        jax.random.PRNGKey(seed), jnp.zeros((1, 1, h)), jnp.zeros((1, 1, h)),
        jnp.zeros((1,), jnp.int32), self.init_cache(None, 1, 1))["params"]
    return jax.tree_util.tree_map(lambda x: x.astype(self.layer_config.dtype), params)

  def target_refs(self, target_params):
    """The target's LM head (its lm_head, or its tied embedding table), its embedding
    table (unless the head has its own) and (GPT-2) its position table."""
    config = self.config
    refs = {}
    if not self.own_embeddings or config.tie_word_embeddings:
      refs["embed_tokens"] = target_params["embed_tokens"]
    if not config.tie_word_embeddings:
      refs["lm_head"] = target_params["lm_head"]
    if not config.uses_rotary:
      refs["embed_positions"] = target_params["embed_positions"]
    return refs

  def init_cache(self, params, batch: int, max_len: int, memory=None):
    """dict(self_key, self_value) [batch, max_len, kv_heads, head_dim]; no memory."""
    if memory is not None:
      raise ValueError("a decoder-only feature head reads no memory")
    layer = self.layer_config
    shape = (batch, max_len, layer.num_kv_heads, layer.head_dim)
    return dict(self_key=jnp.zeros(shape, layer.dtype), self_value=jnp.zeros(shape, layer.dtype))

  def embed(self, params, refs, ids: Array) -> Array:
    """The input token embedding of ids (Gemma's sqrt(emb) scale included): the target's
    table, or the head's own."""
    config = self.config
    table = params["embed_tokens"] if self.own_embeddings else refs["embed_tokens"]["embedding"]
    x = jnp.take(table, ids, axis=0, mode="clip").astype(self.layer_config.dtype)
    if config.scale_embeddings:
      x = x * jnp.asarray(config.emb_dim ** 0.5, x.dtype)
    return x

  def token_embeddings(self, refs, ids: Array) -> Array:
    return jnp.take(refs["embed_tokens"]["embedding"], ids, axis=0, mode="clip")

  def apply(self, params, refs, tokens, features, positions, cache, tree=None):
    query_at = key_at = allowed = None
    if tree is not None:
      query_at, key_at, allowed = tree_positions(tree, positions, cache["self_key"].shape[1])
    learned = None
    if not self.config.uses_rotary:
      at = (positions[:, None] + jnp.arange(tokens.shape[1])[None, :] if query_at is None
            else query_at)
      # Clipped as the target clips: positions past the table belong to
      # drafts beyond the decode, never emitted.
      learned = jnp.take(refs["embed_positions"]["embedding"], at, axis=0, mode="clip")
    return self.network.apply({"params": params}, self.embed(params, refs, tokens), features,
                              positions, cache, learned, query_at, key_at, allowed)

  def logits(self, params, refs, hidden):
    """The target's LM head: hidden [..., emb] -> logits [..., vocab] float32."""
    return DecoderOnly(self.config).apply({"params": refs}, hidden,
                                          method=DecoderOnly.project_logits)
