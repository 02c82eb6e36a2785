"""`DecoderOnlyModel`: a decoder-only config, its params and jit-compiled entry points.

Build one with `specdec_jax.load_model` (a named config, a `DecoderOnlyConfig` or
a Hugging Face directory).
"""

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.base import FamilyModel, check_block, check_tokens
from specdec_jax.families.decoder_only import network as decoder_only
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import DecoderOnly
from specdec_jax.families.feature_head import feature_taps

Array = jax.Array


@functools.lru_cache(maxsize=None)
def _compiled(config: DecoderOnlyConfig, method: str):
  module = DecoderOnly(config)
  return jax.jit(functools.partial(module.apply, method=getattr(DecoderOnly, method)))


def cache_length(cache) -> int:
  """Positions per row in a decoder-only cache."""
  return cache["layers"][0]["self_key"].shape[1]


def check_prompt_lengths(prompt_lengths, prompts: Array) -> Array:
  """Validates prompt_lengths [batch] in [1, P] for prompts [batch, P]; None = full rows."""
  batch, length = prompts.shape
  if prompt_lengths is None:
    return jnp.full((batch,), length, jnp.int32)
  lengths = np.asarray(prompt_lengths)
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"prompt_lengths must be [batch] = ({batch},) integers, got shape "
                     f"{lengths.shape} dtype {lengths.dtype}")
  if lengths.min() < 1 or lengths.max() > length:
    raise ValueError(f"prompt_lengths must lie in [1, {length}] (the prompts' width), got "
                     f"{lengths.tolist()}; an empty prompt has no token to continue from: "
                     f"start it with the BOS token")
  return jnp.asarray(lengths, jnp.int32)


class DecoderOnlyModel(FamilyModel):
  """A decoder-only network with its parameters.

  Attributes:
    config: the `DecoderOnlyConfig`.
    params: the parameter tree of `families/decoder_only/network.py`, arrays in
      `config.dtype`.
  """
  network = DecoderOnly

  def logits(self, tokens) -> Array:
    """Logits [batch, len, vocab] float32 of tokens [batch, len] at positions 0..len-1, no cache."""
    tokens = check_tokens(tokens, "tokens")
    self._check_positions(tokens.shape[1])
    return _compiled(self.config, "__call__")(self.variables, tokens)

  def _check_positions(self, length: int):
    cfg = self.config
    if not cfg.uses_rotary and length > cfg.max_positions:
      raise ValueError(f"{length} positions exceed this {cfg.family} model's learned position "
                       f"table of {cfg.max_positions} (prompt + generated tokens must fit)")

  def init_cache(self, batch_size: int, max_len: int):
    """An empty cache of `max_len` positions per row (prompt + generated tokens)."""
    if int(batch_size) != batch_size or batch_size < 1:
      raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if int(max_len) != max_len or max_len < 1:
      raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    self._check_positions(int(max_len))
    return decoder_only.init_cache(self.config, int(batch_size), int(max_len))

  def prefill(self, prompts, prompt_lengths, cache):
    """Writes right-padded prompts [batch, P] (row b: its first prompt_lengths[b]
    tokens) into the cache; returns the logits [batch, vocab] float32 at each
    row's last prompt token, and the cache."""
    prompts = check_tokens(prompts, "prompts")
    lengths = check_prompt_lengths(prompt_lengths, prompts)
    self._check_batch(prompts.shape[0], cache)
    if prompts.shape[1] > cache_length(cache):
      raise ValueError(f"prompts of {prompts.shape[1]} tokens are longer than the cache "
                       f"({cache_length(cache)} positions)")
    return _compiled(self.config, "prefill")(self.variables, prompts, lengths, cache)

  def _check_batch(self, batch: int, cache):
    rows = cache["layers"][0]["self_key"].shape[0]
    if rows != batch:
      raise ValueError(f"the cache holds {rows} rows, the tokens {batch}")

  def decode_block(self, tokens, positions, cache, tree=None):
    """Scores tokens [batch, k] starting at absolute positions [batch] from the cache
    (with `tree`, a `core.token_tree.TreeAttention`: nodes of a token tree, see
    `DecoderOnly.decode_block`).

    Returns logits [batch, k, vocab] float32 and the updated cache.
    """
    self._check_batch(np.shape(tokens)[0], cache)
    tokens, positions = check_block(tokens, positions, cache_length(cache))
    return _compiled(self.config, "decode_block")(self.variables, tokens, positions, cache,
                                                  tree)

  def block_fn(self, params=None):
    """A block callback `(tokens [batch, k], positions [batch], cache, tree=None) ->
    (logits, cache)` at *absolute* positions; `generate` shifts it to loop positions."""
    return absolute_block_fn(self.config, self.params if params is None else params)


# ---------------------------------------------------------------------------
# Pieces of the family's decode start (family.py): the loop's first input is
# each row's last prompt token, so loop position j is absolute position
# L - 1 + j for a prompt of length L.

def decode_cache_length(prompt_width: int, max_decode_steps: int) -> int:
  """Cache positions for right-padded prompts of width P and N new tokens.

  The last loop input sits at loop position N - 1, absolute position
  L + N - 2 <= P + N - 2; the prefill writes positions 0..P-1.
  """
  return prompt_width + max_decode_steps - 1


def prefilled_cache(config: DecoderOnlyConfig, params, prompts: Array, prompt_lengths: Array,
                    max_len: int):
  """A cache of `max_len` positions with each row's prompt written (traceable)."""
  cache = decoder_only.init_cache(config, prompts.shape[0], max_len)
  _, cache = DecoderOnly(config).apply({"params": params}, prompts, prompt_lengths, cache,
                                       method=DecoderOnly.prefill)
  return cache


def absolute_block_fn(config: DecoderOnlyConfig, params):
  """`(tokens, absolute positions, cache, tree=None) -> (logits, cache)` for traced params."""
  module = DecoderOnly(config)
  return lambda tokens, positions, cache, tree=None: module.apply(
      {"params": params}, tokens, positions, cache, tree, method=DecoderOnly.decode_block)


def feature_layers(config: DecoderOnlyConfig, layers=None) -> Tuple[int, ...]:
  """The hidden-state indices of a feature set (`DecoderOnly._hidden`'s taps):
  `families.feature_head.feature_taps` over the config's layers (None / "last":
  after the final norm; "eagle3": (2, L // 2, L - 3); or HF `hidden_states`
  indices)."""
  return feature_taps(config.num_layers, layers)


def absolute_feature_block_fn(config: DecoderOnlyConfig, params, layers=None):
  """`(tokens, absolute positions, cache, tree=None) -> (logits, features, cache)` for
  traced params (`DecoderOnly.decode_block_features`; causal or tree blocks)."""
  module = DecoderOnly(config)
  taps = feature_layers(config, layers)
  return lambda tokens, positions, cache, tree=None: module.apply(
      {"params": params}, tokens, positions, cache, taps, tree,
      method=DecoderOnly.decode_block_features)


def prefilled_cache_features(config: DecoderOnlyConfig, params, prompts: Array, max_len: int,
                             layers=None):
  """`prefilled_cache` that also returns every prompt slot's features [batch, P, f]."""
  cache = decoder_only.init_cache(config, prompts.shape[0], max_len)
  features, cache = DecoderOnly(config).apply(
      {"params": params}, prompts, cache, feature_layers(config, layers),
      method=DecoderOnly.prefill_features)
  return features, cache


def teacher_forced_features(config: DecoderOnlyConfig, params, tokens: Array, layers=None
                            ) -> Array:
  """Features [batch, T, f] float32 of tokens [batch, T] at absolute positions 0..T-1
  (uncached, causal; traced): `DecoderOnly._hidden`'s taps of `layers`."""
  return DecoderOnly(config).apply(
      {"params": params}, tokens, jnp.arange(tokens.shape[1])[None],
      taps=feature_layers(config, layers), method=DecoderOnly._hidden)[2]


@functools.lru_cache(maxsize=None)
def _init_fn(config: DecoderOnlyConfig):
  module = DecoderOnly(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  return jax.jit(lambda rng: module.init(rng, dummy)["params"])


def init_decoder_only_params(config: DecoderOnlyConfig, seed: int = 0):
  """Random HF-style initialisation (normal(0.02) weights, unit norms), cast to `config.dtype`."""
  params = _init_fn(config)(jax.random.PRNGKey(seed))
  dtype = jnp.dtype(config.dtype)
  return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
