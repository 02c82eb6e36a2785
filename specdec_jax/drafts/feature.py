"""Feature drafts (EAGLE-1, arXiv 2401.15077): a one-layer head over the target's hidden states.

The head reads, at each position, the target's feature there (its last
hidden state after the final norm) and the embedding of the next token, and
predicts the next feature; the target's own LM head turns a feature into
logits. Drafting feeds its own predicted features back:

    x   = fc([embedding(token_t); feature_{t-1}])           Linear(2h -> h)
    f_t = DecoderLayer(x)   (the target family's layer, input norm dropped,
                             its own KV cache over positions)
    p(token_{t+1}) = lm_head(f_t)                            the target's head

Positions. Head position t holds the pair (feature_{t-1}, token_t) at the
token's absolute position t (position 0's feature is zeros: there is none),
and its output approximates feature_t. After a verification that kept n
drafts from a row at loop length l, the engine hands the draft the target's
features at loop positions l..l+n and the tokens l+1..l+n+1 (the kept drafts
and the correction/bonus token): the n + 1 pairs of token positions
l+1..l+n+1, which the next proposal feeds as one block (writing the head's
cache there) before drafting. Its output at the last pair is the predicted
feature of the bonus token's position, whose logits give x_1; each drafted
x_i is then fed with the previous predicted feature. Keys a proposal wrote
past the kept pairs are overwritten before anything reads them (the causal
mask and the positions' order, as for the target's cache).

The prompt: the engine's prefill gives the target's features at every
prompt slot; `init_state` runs the head over the prompt's pairs (its
"prefill") and leaves the last prompt token's pair pending, so the first
proposal drafts x_1 from the head's prediction at the last prompt token.

Params: the head's own (`fc`, `layer`: Linear and one `DecoderLayer` of the
target's config) and references to the target's embedding table and output
projection (the same arrays, not copies; frozen: nothing here trains them).
Decoder-only (Llama-layout) targets only; rotary positions.
"""

from typing import Any, Hashable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding
from specdec_jax.core import sampling
from specdec_jax.drafts.base import Draft
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import (_MASK_VALUE, DecoderLayer, DecoderOnly,
                                                       Dense, rotary_tables)
from specdec_jax.families.registry import family_of

Array = jax.Array


class FeatureHead(nn.Module):
  """fc over [embedding; feature] then one decoder layer, from a cache of its own.

  Params: fc/kernel [2 emb, emb] (+ bias), layer/... (a `DecoderLayer` without
  input_layernorm).
  """
  config: DecoderOnlyConfig
  fc_bias: bool = False

  def setup(self):
    self.fc = Dense(self.config.emb_dim, self.config, self.fc_bias)
    self.layer = DecoderLayer(self.config, input_norm=False)

  def __call__(self, embeddings: Array, features: Array, positions: Array, cache):
    """embeddings, features [batch, k, emb] at absolute positions positions[b] + 0..k-1;
    cache dict(self_key, self_value) [batch, max_len, kv_heads, head_dim].
    Returns (predicted features [batch, k, emb] in config.dtype, cache)."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x = self.fc(jnp.concatenate([embeddings.astype(dtype), features.astype(dtype)], axis=-1))
    query_at = positions[:, None] + jnp.arange(x.shape[1])[None, :]
    key_at = jnp.arange(cache["self_key"].shape[1])[None]
    causal = key_at[:, None, None, :] <= query_at[:, None, :, None]
    bias = jnp.where(causal, 0.0, _MASK_VALUE).astype(jnp.float32)
    rotary = rotary_tables(query_at, cfg) if cfg.uses_rotary else None
    return self.layer(x, bias, rotary, cache, positions)


def head_cache(config: DecoderOnlyConfig, batch: int, max_len: int):
  shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  return dict(self_key=jnp.zeros(shape, config.dtype), self_value=jnp.zeros(shape, config.dtype))


def init_head_params(config: DecoderOnlyConfig, seed: int = 0, fc_bias: bool = False):
  """Random head params (normal(0.02) kernels, unit norms), in config.dtype."""
  h = config.emb_dim
  params = FeatureHead(config, fc_bias).init(
      jax.random.PRNGKey(seed), jnp.zeros((1, 1, h)), jnp.zeros((1, 1, h)),
      jnp.zeros((1,), jnp.int32), head_cache(config, 1, 1))["params"]
  return jax.tree_util.tree_map(lambda x: x.astype(config.dtype), params)


def target_refs(config: DecoderOnlyConfig, target_params):
  """The target's arrays the head reads: its embedding table and (untied) lm_head."""
  refs = {"embed_tokens": target_params["embed_tokens"]}
  if not config.tie_word_embeddings:
    refs["lm_head"] = target_params["lm_head"]
  return refs


def embed(config: DecoderOnlyConfig, refs, ids: Array) -> Array:
  """The target's input embedding of ids (Gemma's sqrt(emb) scale included)."""
  x = jnp.take(refs["embed_tokens"]["embedding"], ids, axis=0, mode="clip").astype(config.dtype)
  if config.scale_embeddings:
    x = x * jnp.asarray(config.emb_dim ** 0.5, x.dtype)
  return x


def project(config: DecoderOnlyConfig, refs, hidden: Array) -> Array:
  """The target's LM head: hidden [..., emb] -> logits [..., vocab] float32."""
  return DecoderOnly(config).apply({"params": refs}, hidden, method=DecoderOnly.project_logits)


class FeatureDraft(Draft):
  """An EAGLE-1 feature head drafting for a decoder-only target.

  Args:
    target: the target model (`DecoderOnlyModel`): its config shapes the
      head, its embedding and LM head are referenced (not copied).
    head_params: the head's params (`init_head_params`' tree); None: random.
    seed: for random head params.
    fc_bias: whether fc has a bias (EAGLE-1 config `bias`).
  """

  wants_features = True
  feature_layers = None  # the last layer, after the final norm (EAGLE-1)

  def __init__(self, target, head_params=None, seed: int = 0, fc_bias: bool = False):
    family = family_of(target)
    if not family.supports_features or not isinstance(target.config, DecoderOnlyConfig):
      raise ValueError(f"FeatureDraft serves decoder-only targets; a {family.name} target "
                       "has no feature head here yet")
    if not target.config.uses_rotary:
      raise ValueError(f"FeatureDraft needs a rotary target; a {target.config.family} layout "
                       "(learned positions) is not supported")
    self.config = target.config
    self.fc_bias = bool(fc_bias)
    self.head_params = (init_head_params(self.config, seed, self.fc_bias) if head_params is None
                        else head_params)
    self.target_params = target_refs(self.config, target.params)
    self.vocab_size = self.config.vocab_size
    self.eos_id = self.config.eos_id
    self.pad_id = self.config.pad_id

  @property
  def params(self) -> Any:
    return dict(head=self.head_params, target=self.target_params)

  def static_key(self) -> Hashable:
    return ("feature", self.config, self.fc_bias)

  def check_compatible(self, target_config) -> None:
    if target_config != self.config:
      raise ValueError("this FeatureDraft was built for another target config: a feature head "
                       "reads one target's hidden states, embedding and LM head")

  def _head(self, params, embeddings, features, positions, cache):
    return FeatureHead(self.config, self.fc_bias).apply(
        {"params": params["head"]}, embeddings, features, positions, cache)

  def init_state(self, params, context, max_decode_len, features=None, gamma=None):
    """Runs the head over the prompt's pairs; the last prompt token's pair is pending.

    features: the target's features at every context slot [batch, C, emb]
      (`Family.start_features`); None only for shape queries (zeros).
    """
    tokens, lengths = context.tokens, context.lengths
    batch, width = tokens.shape
    h = self.config.emb_dim
    if features is None:
      features = jnp.zeros((batch, width, h), jnp.float32)
    gamma = decoding.DEFAULT_BLOCK_WIDTH - 1 if gamma is None else int(gamma)
    rows = jnp.arange(batch)
    # Pair t = (feature_{t-1}, token_t); token 0 has no feature before it.
    shifted = jnp.concatenate([jnp.zeros((batch, 1, h), jnp.float32),
                               features[:, :-1].astype(jnp.float32)], axis=1)
    cache = head_cache(self.config, batch, width + max_decode_len + gamma)
    _, cache = self._head(params, embed(self.config, params["target"], tokens), shifted,
                          jnp.zeros((batch,), jnp.int32), cache)
    last = lengths - 1
    return dict(
        cache=cache,
        pending_features=jnp.zeros((batch, gamma + 1, h), jnp.float32).at[:, 0].set(
            shifted[rows, last]),
        pending_tokens=jnp.zeros((batch, gamma + 1), jnp.int32).at[:, 0].set(
            tokens[rows, last]),
        count=jnp.ones((batch,), jnp.int32),
        offset=last.astype(jnp.int32))

  def observe_fn(self, params, gamma):
    def observe(state, features, tokens, count):
      return dict(state, pending_features=features.astype(jnp.float32),
                  pending_tokens=tokens.astype(jnp.int32), count=count.astype(jnp.int32))
    return observe

  def propose_fn(self, params, gamma, temperature, topk, topp):
    cfg = self.config
    greedy = temperature < sampling.MIN_TEMPERATURE

    def draw(hidden, step_rng):
      probs = sampling.adjust_probs(project(cfg, params["target"], hidden), temperature, topk,
                                    topp)
      return sampling.sample(step_rng, probs, greedy=greedy), probs

    def propose(rng, state, sequences, lengths, max_drafted=None):
      batch = sequences.shape[0]
      rows = jnp.arange(batch)
      offset, count = state["offset"], state["count"]
      limit = (jnp.full((batch,), gamma, jnp.int32) if max_drafted is None else
               jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
      rngs = jax.random.split(rng, gamma)
      # The pending pairs: token positions lengths - count + 1 .. lengths.
      hidden, cache = self._head(params, embed(cfg, params["target"], state["pending_tokens"]),
                                 state["pending_features"], lengths - count + 1 + offset,
                                 state["cache"])
      last = hidden[rows, jnp.clip(count - 1, 0, hidden.shape[1] - 1)]
      token, probs = draw(last, rngs[0])
      tokens, laws = [token], [probs]
      for i in range(1, gamma):
        # Feeds (predicted feature of position lengths + i - 1, x_i) at lengths + i.
        hidden, cache = self._head(params, embed(cfg, params["target"], token[:, None]),
                                   last[:, None], lengths + i + offset, cache)
        last = hidden[:, 0]
        token, probs = draw(last, rngs[i])
        tokens.append(token)
        laws.append(probs)
      keep = jnp.arange(gamma)[None] < limit[:, None]
      draft_tokens = jnp.where(keep, jnp.stack(tokens, axis=1), 0)
      draft_probs = jnp.where(keep[..., None], jnp.stack(laws, axis=1), 0.0)
      return draft_tokens, draft_probs, limit, dict(state, cache=cache)

    return propose
