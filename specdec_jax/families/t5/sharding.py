"""T5's logical axis names: parameters of the T5X tree and the head-major cache.

The generic partitioner (`specdec_jax.sharding`) maps these names to mesh
axes by its rules; this module only says which name each dimension has.
"""

from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.base import checked_axes, leaf_and_parent, path_names
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.network import T5

LogicalAxes = Tuple[Optional[str], ...]

# T5 caches are head-major (families/t5/network.py); decoder-only caches keep the
# projection's [batch, length, heads, kv] (decoder_only_sharding.py).
CACHE_KV_AXES = ("batch", "heads", "length", "kv")
ENCODER_MASK_AXES = ("batch", "length")


def param_logical_axes(path: Sequence[str], ndim: int) -> LogicalAxes:
  """Logical axes of one T5X parameter from its path (e.g. ('decoder', 'logits_dense', 'kernel')).

  Attention kernels are stored 2-D: query/key/value [embed, heads * head_dim]
  (`joined_kv`), out [joined_kv, embed].

  Raises:
    ValueError: an unknown parameter, or a rank that does not match its name.
  """
  leaf, parent = leaf_and_parent(path)
  axes = None
  if leaf == "embedding":
    axes = ("vocab", "embed")
  elif leaf == "rel_embedding":
    axes = ("heads", "relpos_buckets")
  elif leaf == "scale":
    axes = ("embed",)
  elif leaf == "kernel":
    if parent in ("query", "key", "value"):
      axes = ("embed", "joined_kv")
    elif parent == "out":
      axes = ("joined_kv", "embed")
    elif parent.startswith("wi"):
      axes = ("embed", "mlp")
    elif parent == "wo":
      axes = ("mlp", "embed")
    elif parent == "logits_dense":
      axes = ("embed", "vocab")
  return checked_axes(path, axes, ndim, "the T5X parameter tree (families/t5/network.py)")


def params_logical_axes(params) -> Any:
  """The params tree with each leaf replaced by its tuple of logical axis names."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: param_logical_axes(path_names(path), np.ndim(x)), params)


def is_t5_cache(tree) -> bool:
  """Whether `tree` is a cache from `T5.init_cache` (the draft state may be anything else)."""
  return (isinstance(tree, dict) and set(tree) == {"layers", "encoder_mask"} and
          isinstance(tree["layers"], (list, tuple)))


def cache_logical_axes(cache) -> Any:
  """Logical axes of a T5 cache: K/V [batch, heads, length, head_dim], mask [batch, length]."""
  if not is_t5_cache(cache):
    raise ValueError("expected a T5 cache {'layers': [...], 'encoder_mask': ...}, got "
                     f"{type(cache).__name__} with keys {sorted(cache) if isinstance(cache, dict) else '-'}")
  layers = [{name: CACHE_KV_AXES for name in layer} for layer in cache["layers"]]
  return dict(layers=layers, encoder_mask=ENCODER_MASK_AXES)


def abstract_params(config: T5Config):
  """ShapeDtypeStructs of the params `load_model` builds (config.dtype), no allocation."""
  module = T5(config)
  dummy = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda rng, x: module.init(rng, x, x)["params"],
                          jax.ShapeDtypeStruct((2,), jnp.uint32), dummy)
  dtype = jnp.dtype(config.dtype)
  return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)


def abstract_cache(config: T5Config, batch: int, encoder_len: int, max_decode_len: int):
  """ShapeDtypeStructs of `T5.init_cache` for [batch, encoder_len] inputs."""
  module = T5(config)
  tokens = jax.ShapeDtypeStruct((batch, encoder_len), jnp.int32)
  return jax.eval_shape(
      lambda p, t: module.apply({"params": p}, t, max_decode_len, method=T5.init_cache),
      abstract_params(config), tokens)
