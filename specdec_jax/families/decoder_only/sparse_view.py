"""The decoder-only family's budgeted cache view (`families.sparse_view.SparseView`).

The target's cache is `network.init_cache`'s: per layer, arrays [batch, len, ...] indexed
by absolute position (a ring-buffered window layer's arrays are shorter: position p lies
at index p mod its length, and its window hides every position the ring no longer holds).
`gather` copies S positions of every layer array into a compact cache of S + room
indices, with the absolute position of each (`key_positions`); `step` runs the target's
own network over it (`DecoderOnly.decode_view`), so its masks, rotary angles, windows and
sinks are the target's at the true positions. Only the compact cache is read per step:
the draft's cost is its budget, not the context.
"""

from typing import Any, Dict

import jax
import jax.numpy as jnp

from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import DecoderOnly
from specdec_jax.families.sparse_view import SparseView

Array = jax.Array

# The key position of a slot nothing may attend to: after every query (causal masks hide it).
HIDDEN = 2 ** 30


def _length(cache) -> int:
  return max(layer["self_key"].shape[1] for layer in cache["layers"])


def chunk_keys(cache, chunk: int) -> Array:
  """[batch, L // chunk, f] float32: each whole chunk's mean key, layers concatenated
  (window layers' rings left out: they hold no old positions to retrieve)."""
  length = _length(cache)
  count = length // chunk
  means = []
  for layer in cache["layers"]:
    key = layer["self_key"]
    if key.shape[1] != length:
      continue
    batch = key.shape[0]
    blocks = key[:, :count * chunk].reshape((batch, count, chunk, -1)).astype(jnp.float32)
    means.append(jnp.mean(blocks, axis=2))
  return jnp.concatenate(means, axis=-1)


def key_at(cache, index: Array) -> Array:
  """[batch, f] float32: every full-length layer's key at cache index [batch]."""
  length = _length(cache)
  rows = jnp.arange(index.shape[0])
  return jnp.concatenate([layer["self_key"][rows, index].reshape(index.shape[0], -1)
                          .astype(jnp.float32) for layer in cache["layers"]
                          if layer["self_key"].shape[1] == length], axis=-1)


def gather(cache, index: Array, valid: Array, room: int) -> Dict[str, Any]:
  """A compact cache of the positions index [batch, S] names (valid [batch, S] bool;
  an invalid entry's key position is `HIDDEN`) plus `room` zero slots, and its
  key_positions [batch, S + room] (the room's set by `step` as it writes)."""
  def take(leaf):
    at = jnp.clip(index, 0) % leaf.shape[1]  # a ring layer's slot of each position
    picked = jnp.take_along_axis(leaf, at.reshape(at.shape + (1,) * (leaf.ndim - 2)), axis=1)
    pad = [(0, 0), (0, room)] + [(0, 0)] * (leaf.ndim - 2)
    return jnp.pad(picked, pad)

  layers = [{name: take(leaf) for name, leaf in layer.items()} for layer in cache["layers"]]
  key_positions = jnp.where(valid, index, HIDDEN).astype(jnp.int32)
  key_positions = jnp.pad(key_positions, ((0, 0), (0, room)), constant_values=HIDDEN)
  return dict(cache=dict(cache, layers=layers), key_positions=key_positions,
              start=index.shape[1])


def step_fn(config: DecoderOnlyConfig, params):
  """`step(view, tokens [batch], positions [batch], slot) -> (logits [batch, vocab], view)`."""
  module = DecoderOnly(config)

  def step(view, tokens, positions, slot):
    index = view["start"] + slot
    key_positions = view["key_positions"].at[:, index].set(positions)
    write = jnp.full(tokens.shape, index, jnp.int32)
    logits, cache = module.apply({"params": params}, tokens[:, None], positions[:, None],
                                 write, view["cache"], key_positions,
                                 method=DecoderOnly.decode_view)
    return logits[:, 0], dict(view, cache=cache, key_positions=key_positions)

  return step


def sparse_view(config: DecoderOnlyConfig, params) -> SparseView:
  return SparseView(chunk_keys, key_at, gather, step_fn(config, params))
