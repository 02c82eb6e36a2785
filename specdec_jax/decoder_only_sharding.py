"""Sharding decoder-only models: logical axes, placement and the memory planner.

The decoder-only counterpart of `specdec_jax.sharding`'s T5 parts, with the
same logical names, rules and `Partitioner`: the q/k/v/o projections are
[embed, joined_kv] / [joined_kv, embed], the MLP [embed, mlp] / [mlp, embed],
the embedding and untied head [vocab, embed] / [embed, vocab], norms and
biases follow their dimension; GPT-2's position table is replicated (its rows
are positions, which no rule shards). The cache is [batch, length, heads, kv]
per layer, where `heads` counts *key/value* heads: with grouped-query
attention (e.g. 2 KV heads) a `model` axis larger than that does not divide it,
an error by default and replication with `on_indivisible='replicate'`.

`decoder_only_generate(..., partitioner=...)` runs on the mesh with these
layouts; `load_sharded_decoder_only` reads a HF directory into them.
"""

from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import sharding
from specdec_jax.decoder_only_model import DecoderOnlyModel
from specdec_jax.models import decoder_only
from specdec_jax.models.decoder_configs import DecoderOnlyConfig
from specdec_jax.models.decoder_only import DecoderOnly

LogicalAxes = Tuple[Optional[str], ...]

_KERNEL_AXES = {
    "q_proj": ("embed", "joined_kv"), "k_proj": ("embed", "joined_kv"),
    "v_proj": ("embed", "joined_kv"), "o_proj": ("joined_kv", "embed"),
    "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
}


def param_logical_axes(path: Sequence[str], ndim: int) -> LogicalAxes:
  """Logical axes of one decoder-only parameter from its path.

  Raises:
    ValueError: an unknown parameter, or a rank that does not match its name.
  """
  path = tuple(path)
  leaf = path[-1] if path else ""
  parent = path[-2] if len(path) > 1 else ""
  axes = None
  if leaf == "embedding":
    axes = ("vocab", "embed") if parent == "embed_tokens" else (None, "embed")
  elif leaf == "scale" and parent in ("q_norm", "k_norm"):
    axes = ("kv",)  # Gemma 3's per-head q/k norms lie along head_dim.
  elif leaf == "scale":
    axes = ("embed",)
  elif parent in _KERNEL_AXES and leaf == "kernel":
    axes = _KERNEL_AXES[parent]
  elif parent in _KERNEL_AXES and leaf == "bias":
    axes = _KERNEL_AXES[parent][1:]  # A bias lies along the output dimension.
  elif leaf == "bias":
    axes = ("embed",)  # LayerNorm.
  if axes is None:
    raise ValueError(f"no logical axes known for parameter {'/'.join(path)!r}: expected the "
                     f"decoder-only parameter tree (models/decoder_only.py)")
  if len(axes) != ndim:
    raise ValueError(f"parameter {'/'.join(path)!r} has rank {ndim}, expected {len(axes)} "
                     f"for logical axes {axes}")
  return axes


def params_logical_axes(params) -> Any:
  """The params tree with each leaf replaced by its tuple of logical axis names."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: param_logical_axes(sharding._path_names(path), np.ndim(x)), params)


# Unlike T5's head-major cache (sharding.CACHE_KV_AXES), the decoder-only
# cache is laid out as the projections produce it (models/decoder_only.py).
CACHE_KV_AXES = ("batch", "length", "heads", "kv")


def cache_logical_axes(cache) -> Any:
  """Logical axes of a decoder-only cache: K/V [batch, length, heads, kv] per layer."""
  if not (isinstance(cache, dict) and set(cache) == {"layers"}):
    raise ValueError(f"expected a decoder-only cache {{'layers': [...]}}, got "
                     f"{sorted(cache) if isinstance(cache, dict) else type(cache).__name__}")
  return dict(layers=[{name: CACHE_KV_AXES for name in layer}
                      for layer in cache["layers"]])


def _specs(partitioner: sharding.Partitioner, tree, axes_tree, prefix: str):
  def one(path, axes, x):
    name = prefix + "/".join(sharding._path_names(path))
    return partitioner.spec(axes, np.shape(x), name)
  return jax.tree_util.tree_map_with_path(one, axes_tree, tree,
                                          is_leaf=lambda x: isinstance(x, tuple) and all(
                                              a is None or isinstance(a, str) for a in x))


def param_shardings(partitioner: sharding.Partitioner, params) -> Any:
  """Tree of NamedShardings for a decoder-only params tree (arrays or ShapeDtypeStructs)."""
  specs = _specs(partitioner, params, params_logical_axes(params), "params/")
  return jax.tree_util.tree_map(partitioner.sharding, specs,
                                is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def cache_shardings(partitioner: sharding.Partitioner, cache) -> Any:
  specs = _specs(partitioner, cache, cache_logical_axes(cache), "cache/")
  return jax.tree_util.tree_map(partitioner.sharding, specs,
                                is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def shard_decoder_only_model(model: DecoderOnlyModel,
                             partitioner: sharding.Partitioner) -> DecoderOnlyModel:
  """The same model with every parameter placed by `partitioner`'s rules."""
  shardings = param_shardings(partitioner, model.params)
  return DecoderOnlyModel(model.config, jax.tree_util.tree_map(
      lambda s, x: jax.device_put(x, s), shardings, model.params))


def load_sharded_decoder_only(path, partitioner: sharding.Partitioner, *,
                              dtype: Optional[str] = None) -> DecoderOnlyModel:
  """Loads a Hugging Face decoder-only directory straight into `partitioner`'s layout.

  Each tensor is read, cast and placed in its sharding before the next is
  read, so the host holds at most one tensor.
  """
  from specdec_jax.checkpoints_decoder_only import load_hf_decoder_only

  def place(key, array):
    spec = partitioner.spec(param_logical_axes(key, array.ndim), array.shape,
                            "params/" + "/".join(key))
    return jax.device_put(array, partitioner.sharding(spec))

  return load_hf_decoder_only(path, dtype=dtype, place=place)


def abstract_params(config: DecoderOnlyConfig):
  """ShapeDtypeStructs of the params (config.dtype), no allocation."""
  dummy = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda rng, x: DecoderOnly(config).init(rng, x)["params"],
                          jax.ShapeDtypeStruct((2,), jnp.uint32), dummy)
  dtype = jnp.dtype(config.dtype)
  return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)


def abstract_cache(config: DecoderOnlyConfig, batch: int, max_len: int):
  return jax.eval_shape(lambda: decoder_only.init_cache(config, batch, max_len))


def plan_decoder_only_memory(config: DecoderOnlyConfig, *, batch: int, max_len: int, mesh_shape,
                             rules=sharding.DEFAULT_RULES, dtype: Optional[str] = None,
                             on_indivisible: str = "error",
                             name: str = "model") -> sharding.MemoryPlan:
  """Bytes of params and cache per device, without devices or allocation.

  Args:
    config: model shapes; `dtype` overrides config.dtype (params and cache).
    batch / max_len: the cache's rows and positions (prompt width + new
      tokens - 1 under `decoder_only_generate`).
    mesh_shape: 'data,model' sizes or a {'data': .., 'model': ..} dict.
    rules / on_indivisible: as for `sharding.Partitioner`.
  """
  if dtype is not None:
    config = config.replace(dtype=dtype)
  if isinstance(mesh_shape, dict):
    sizes = dict(mesh_shape)
  else:
    shape = sharding.parse_mesh_shape(mesh_shape)
    if -1 in shape:
      raise ValueError("plan_decoder_only_memory needs explicit mesh sizes (no -1)")
    sizes = dict(zip(sharding.MESH_AXES, shape))
  rules = sharding.normalize_rules(rules)

  def specs(tree, axes, prefix):
    return jax.tree_util.tree_map_with_path(
        lambda path, a, x: sharding.logical_to_spec(
            a, x.shape, rules, sizes, prefix + "/".join(sharding._path_names(path)),
            on_indivisible),
        axes, tree, is_leaf=lambda x: isinstance(x, tuple) and all(
            a is None or isinstance(a, str) for a in x))

  params = abstract_params(config)
  cache = abstract_cache(config, batch, max_len)
  params_total, params_device = sharding._plan_tree(
      params, specs(params, params_logical_axes(params), "params/"), sizes)
  cache_total, cache_device = sharding._plan_tree(
      cache, specs(cache, cache_logical_axes(cache), "cache/"), sizes)
  return sharding.MemoryPlan(name, sizes, config.dtype, params_total, cache_total,
                             params_device, cache_device)
