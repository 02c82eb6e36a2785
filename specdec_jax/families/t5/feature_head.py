"""The T5 family's feature head: EAGLE-1 for an encoder-decoder (`families.feature_head`).

    x   = fc([embedding(token_t); feature_{t-1}])             Linear(2 emb -> emb)
    f_t = DecoderLayer(x)   one T5 decoder layer of the target's config:
            self-attention over the head's own cache, with its own relative
              position bias table (no pre-self-attention norm: x is already
              a projection of normed features, as EAGLE drops its layer's
              first norm);
            cross-attention to the target's encoder outputs through its own
              key/value projections (computed once, in `init_cache`, from the
              memory `T5Family.start_features` returns), pre-norm;
            the config's MLP (T5 1.1: gated GELU), pre-norm.
    p(token_{t+1}) = the target's own logit projection of f_t

Features are the target decoder's last hidden state after its final norm
(what feeds its logits), so f_t regresses to them and the target's
projection applies to f_t as is: no final norm in the head (EAGLE-1 has
none). The projection is `Decoder.project_logits` with the target's arrays:
T5 1.1's untied `logits_dense`, or original T5's tied embedding with its
emb ** -0.5 scale.

The decoder starts from `decoder_start_id` at position 0, with no feature
before it (zeros), so the head has no prompt to prefill: the first proposal
scores (0, start token) at position 0.

Params (`init_params`): fc/kernel [2 emb, emb], relpos_bias/rel_embedding
[heads, buckets], layer/... (a T5 `DecoderLayer` without
pre_self_attention_layer_norm). Refs (`target_refs`):
token_embedder/embedding, decoder/logits_dense (untied). The layer modules are
the T5 network's own (`families/t5/network.py`).
"""

from typing import Hashable

import flax.linen as nn
import jax
import jax.numpy as jnp

from specdec_jax.core.token_tree import tree_positions
from specdec_jax.families.feature_head import FeatureHead
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.network import (_MASK_VALUE, Decoder, DecoderLayer, Dense,
                                             RelativePositionBias)

Array = jax.Array


class HeadNetwork(nn.Module):
  """fc, a relative position bias table and one decoder layer (see the module docstring)."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.fc = Dense(cfg.emb_dim, cfg)
    self.relpos_bias = RelativePositionBias(cfg, bidirectional=False)
    self.layer = DecoderLayer(cfg, self_attention_norm=False)

  def cross_key_value(self, encoded: Array):
    """encoded [batch, S, emb] -> the layer's cross key, value [batch, heads, S, head_dim]."""
    return self.layer.cross_key_value(encoded)

  def __call__(self, embeddings: Array, features: Array, positions: Array, cache, tree=None):
    """embeddings, features [batch, k, emb], written at cache indices positions[b] + 0..k-1
    (a causal block at those positions, or a `TreeAttention` block: positions and
    visibility from `core.token_tree.tree_positions`); cache: the head's
    (`T5FeatureHead.init_cache`). Returns (predicted features [batch, k, emb], cache)."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x = self.fc(jnp.concatenate([embeddings.astype(dtype), features.astype(dtype)], axis=-1))
    if tree is None:
      query_positions = positions[:, None] + jnp.arange(x.shape[1])[None, :]
      key_positions = jnp.arange(cache["self_key"].shape[2])[None]
      allowed = True
    else:
      query_positions, key_positions, allowed = tree_positions(tree, positions,
                                                               cache["self_key"].shape[2])
      allowed = allowed[:, None]
    causal = (key_positions[:, None, None, :] <= query_positions[:, None, :, None]) & allowed
    self_bias = self.relpos_bias(query_positions, key_positions) + jnp.where(
        causal, 0.0, _MASK_VALUE)
    cross_bias = jnp.where(cache["encoder_mask"][:, None, None, :], 0.0, _MASK_VALUE)
    layer_cache = {name: cache[name] for name in ("self_key", "self_value")}
    x, layer_cache = self.layer(x, self_bias, cache["cross_key"], cache["cross_value"],
                                cross_bias, layer_cache, positions)
    return x, dict(cache, **layer_cache)


class T5FeatureHead(FeatureHead):
  """EAGLE-1 head for a T5 target (T5 1.1 or original T5 conventions, by its config).

  Args:
    config: the target's `T5Config`.
  """

  feature_layers = None  # the decoder's last hidden state, after its final norm

  def __init__(self, config: T5Config):
    if not isinstance(config, T5Config):
      raise TypeError(f"T5FeatureHead takes a T5Config, got {type(config).__name__}")
    self.config = config

  @property
  def network(self) -> HeadNetwork:
    return HeadNetwork(self.config)

  def static_key(self) -> Hashable:
    return ("t5_eagle1", self.config)

  def init_params(self, seed: int = 0):
    """Random head params (T5X initialisers), in config.dtype."""
    cfg = self.config
    h = cfg.emb_dim
    memory = self.placeholder_memory(1, 1)

    def both(module, embeddings, features, positions):
      # The cross key/value projections run only in init_cache: initialise them too.
      cross_key, cross_value = module.cross_key_value(memory["encoded"])
      return module(embeddings, features, positions,
                    self._cache(1, 1, memory, cross_key, cross_value))

    def init(rng):
      return self.network.init(rng, jnp.zeros((1, 1, h)), jnp.zeros((1, 1, h)),
                               jnp.zeros((1,), jnp.int32), method=both)["params"]

    params = init(jax.random.PRNGKey(seed))
    return jax.tree_util.tree_map(lambda x: x.astype(cfg.dtype), params)

  def target_refs(self, target_params):
    """The target's token embedding and (untied) logits_dense."""
    refs = {"token_embedder": target_params["token_embedder"], "decoder": {}}
    if not self.config.logits_via_embedding:
      refs["decoder"]["logits_dense"] = target_params["decoder"]["logits_dense"]
    return refs

  def placeholder_memory(self, batch: int, context_width: int):
    cfg = self.config
    return dict(encoded=jnp.zeros((batch, context_width, cfg.emb_dim), cfg.dtype),
                encoder_mask=jnp.ones((batch, context_width), bool))

  def _cache(self, batch, max_len, memory, cross_key, cross_value):
    cfg = self.config
    shape = (batch, cfg.num_heads, max_len, cfg.head_dim)
    return dict(self_key=jnp.zeros(shape, cfg.dtype), self_value=jnp.zeros(shape, cfg.dtype),
                cross_key=cross_key, cross_value=cross_value,
                encoder_mask=memory["encoder_mask"])

  def init_cache(self, params, batch: int, max_len: int, memory=None):
    """self_key/self_value [batch, heads, max_len, head_dim] (zeros), the head's
    cross_key/cross_value [batch, heads, S, head_dim] of memory's encoder outputs
    (computed here, once per decode) and memory's encoder_mask [batch, S].

    memory: dict(encoded [batch, S, emb], encoder_mask [batch, S] bool), as
      `T5Family.start_features` returns it.
    """
    if memory is None or not {"encoded", "encoder_mask"} <= set(memory):
      raise ValueError("a T5 feature head attends to the target's encoder outputs: init_cache "
                       "needs memory=dict(encoded=..., encoder_mask=...) from "
                       "T5Family.start_features")
    cross_key, cross_value = self.network.apply({"params": params}, memory["encoded"],
                                                method=HeadNetwork.cross_key_value)
    return self._cache(batch, max_len, memory, cross_key, cross_value)

  def embed(self, refs, ids: Array) -> Array:
    """The target decoder's input embedding of ids (T5: the shared table, unscaled)."""
    return jnp.take(refs["token_embedder"]["embedding"], ids, axis=0).astype(self.config.dtype)

  def token_embeddings(self, refs, ids: Array) -> Array:
    return jnp.take(refs["token_embedder"]["embedding"], ids, axis=0, mode="clip")

  def apply(self, params, refs, tokens, features, positions, cache, tree=None):
    return self.network.apply({"params": params}, self.embed(refs, tokens), features,
                              positions, cache, tree)

  def logits(self, params, refs, hidden):
    """The target's logit projection: hidden [..., emb] -> [..., vocab] float32."""
    return Decoder(self.config).apply({"params": refs["decoder"]}, hidden,
                                      refs["token_embedder"]["embedding"],
                                      method=Decoder.project_logits)
