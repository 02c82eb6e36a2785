"""`Model`: a T5 config, its params and jit-compiled entry points.

Build one with `specdec_jax.load_model` (loading.py: named configs, configs,
checkpoints of every family).
"""

import functools

import jax
import jax.numpy as jnp

from specdec_jax.families.base import FamilyModel, check_block, check_tokens  # noqa: F401 (re-exported)
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5 import decode as t5_decode
from specdec_jax.families.t5.network import T5

Array = jax.Array


@functools.lru_cache(maxsize=None)
def _compiled(config: T5Config, method: str, static_argnums=()):
  module = T5(config)
  return jax.jit(functools.partial(module.apply, method=getattr(T5, method)),
                 static_argnums=static_argnums)


@functools.lru_cache(maxsize=None)
def _compiled_decode_block(config: T5Config):
  return jax.jit(lambda params, tokens, positions, cache, tree=None: t5_decode.block_fn(
      params, config)(tokens, positions, cache, tree))


class Model(FamilyModel):
  """A T5 network with its parameters.

  Attributes:
    config: the `T5Config`.
    params: T5X parameter tree (`{'token_embedder': ..., 'encoder': ...,
      'decoder': ...}`), arrays in `config.dtype`.
  """
  network = T5

  def encode(self, encoder_tokens) -> Array:
    """[batch, enc_len] int32 -> encoder output [batch, enc_len, emb]."""
    tokens = check_tokens(encoder_tokens)
    return _compiled(self.config, "encode")(self.variables, tokens)

  def logits(self, encoder_tokens, decoder_input_tokens) -> Array:
    """Teacher-forced logits [batch, dec_len, vocab] float32, no cache."""
    enc = check_tokens(encoder_tokens)
    dec = check_tokens(decoder_input_tokens, "decoder_input_tokens")
    if enc.shape[0] != dec.shape[0]:
      raise ValueError(f"batch mismatch: encoder {enc.shape[0]} vs decoder {dec.shape[0]}")
    return _compiled(self.config, "__call__")(self.variables, enc, dec)

  def init_cache(self, batch_size: int, max_decode_len: int, encoder_tokens=None):
    """Encodes `encoder_tokens` [batch_size, enc_len] once and allocates the cache.

    The cache holds `max_decode_len` self-attention positions per row and the
    cross-attention keys/values of the encoder output (see families/t5/network.py).
    """
    if encoder_tokens is None:
      raise ValueError("init_cache needs encoder_tokens: the cache holds the cross-attention "
                       "keys/values computed from the encoder output")
    tokens = check_tokens(encoder_tokens)
    if tokens.shape[0] != batch_size:
      raise ValueError(f"encoder_tokens has {tokens.shape[0]} rows, batch_size is {batch_size}")
    if int(max_decode_len) != max_decode_len or max_decode_len < 1:
      raise ValueError(f"max_decode_len must be an int >= 1, got {max_decode_len!r}")
    return _compiled(self.config, "init_cache", (2,))(self.variables, tokens, int(max_decode_len))

  def decode_block(self, tokens, positions, cache, tree=None):
    """Scores tokens [batch, k] starting at positions [batch] from the cache (with
    `tree`, a `core.token_tree.TreeAttention`: nodes of a token tree, see
    `decode.decode_block`).

    Returns logits [batch, k, vocab] float32 and the updated cache.
    """
    tokens, positions = check_block(tokens, positions, cache["layers"][0]["self_key"].shape[2])
    return _compiled_decode_block(self.config)(self.params, tokens, positions, cache, tree)

  def block_fn(self, params=None):
    """A block callback `(tokens, positions, cache, tree=None) -> (logits, cache)` for the
    decode loops.

    Runs the fused decode step (`families/t5/decode.py`, same function as
    `T5.decode_block`). Its fused kernels are built here from the T5X tree,
    so inside a jitted decode loop they are built once, before the loop.
    """
    params = self.params if params is None else params
    return t5_decode.block_fn(params, self.config)


@functools.lru_cache(maxsize=None)
def _init_fn(config: T5Config):
  module = T5(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  return jax.jit(lambda rng: module.init(rng, dummy, dummy)["params"])


def init_params(config: T5Config, seed: int = 0):
  """Random T5X-style initialisation, cast to `config.dtype`."""
  # One compiled initialiser per config: tests and launchers build many models.
  params = _init_fn(config)(jax.random.PRNGKey(seed))
  dtype = jnp.dtype(config.dtype)
  return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
