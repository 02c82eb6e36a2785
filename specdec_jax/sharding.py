"""Sharding T5 target and draft across devices with JAX's GSPMD, T5X style.

Every parameter and cache array gets *logical* axis names (`vocab`, `embed`,
`joined_kv`, `mlp`, `heads`, `kv`, `relpos_buckets`, `batch`, `length`);
*rules* map logical names to the axes of a device mesh (`data`, `model`); a
`Partitioner` (mesh + rules) turns them into `NamedSharding`s. The compiled
decode loop of `specdec_jax.generate` then runs under `jax.jit` with explicit
in/out shardings and GSPMD inserts the collectives: no hand-written
parallelism.

    target_part, draft_part = make_partitioners("1,8")   # or gin, see configs/sharding
    target = load_sharded_model("t5_1_1_xxl", target_part, dtype="bfloat16")
    draft = load_sharded_model("t5_1_1_small", draft_part, dtype="bfloat16")
    out = generate(target, tokens, max_decode_steps=64, draft=draft,
                   partitioner=target_part, draft_partitioner=draft_part)

Rules follow Flax/T5X semantics: for each dimension the first rule naming its
logical axis whose mesh axis is not already used by an earlier dimension of
the same array wins; a logical axis no rule names is replicated.

A mesh axis that does not divide the dimension it shards is an error by
default (`on_indivisible="error"`, naming the array, the dimension and the
fix). With `on_indivisible="replicate"` that dimension is replicated instead
and a warning says so; the memory planner follows the same choice.

`plan_memory` computes the bytes of params and caches per device for a config,
dtype, batch, lengths and mesh without allocating anything.
"""

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specdec_jax.core.dtypes import canonical_dtype, optional_dtype
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.network import T5

MESH_AXES = ("data", "model")

# (logical axis, mesh axis or None), T5X's `standard_logical_axis_rules` for
# 1-D parameter and activation partitioning: batch over `data`, heads / MLP /
# vocabulary over `model`, the residual stream (`embed`) replicated.
DEFAULT_RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
    ("relpos_buckets", None),
    ("length", None),
)
# The draft is small: replicate its weights on every device, keep the batch
# split over `data` like the target's.
DRAFT_RULES = (("batch", "data"),)

LogicalAxes = Tuple[Optional[str], ...]
Rules = Tuple[Tuple[str, Optional[Union[str, Tuple[str, ...]]]], ...]

# T5 caches are head-major (families/t5/network.py); decoder-only caches keep the
# projection's [batch, length, heads, kv] (decoder_only_sharding.py).
CACHE_KV_AXES = ("batch", "heads", "length", "kv")
ENCODER_MASK_AXES = ("batch", "length")


# ---------------------------------------------------------------------------
# Logical axis names.

def _path_names(path) -> Tuple[str, ...]:
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
  return tuple(names)


def param_logical_axes(path: Sequence[str], ndim: int) -> LogicalAxes:
  """Logical axes of one T5X parameter from its path (e.g. ('decoder', 'logits_dense', 'kernel')).

  Attention kernels are stored 2-D: query/key/value [embed, heads * head_dim]
  (`joined_kv`), out [joined_kv, embed].

  Raises:
    ValueError: an unknown parameter, or a rank that does not match its name.
  """
  path = tuple(path)
  leaf = path[-1] if path else ""
  parent = path[-2] if len(path) > 1 else ""
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
  if axes is None:
    raise ValueError(f"no logical axes known for parameter {'/'.join(path)!r}: "
                     "sharding expects the T5X parameter tree")
  if len(axes) != ndim:
    raise ValueError(f"parameter {'/'.join(path)!r} has rank {ndim}, expected {len(axes)} "
                     f"for logical axes {axes}")
  return axes


def params_logical_axes(params) -> Any:
  """The params tree with each leaf replaced by its tuple of logical axis names."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: param_logical_axes(_path_names(path), np.ndim(x)), params)


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


# ---------------------------------------------------------------------------
# Rules -> PartitionSpecs.

def normalize_rules(rules) -> Rules:
  """Rules as a hashable tuple of (logical, mesh axis | tuple of mesh axes | None)."""
  out = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"a logical axis rule is (logical_name, mesh_axis or None), got {rule!r}")
    target = rule[1]
    if isinstance(target, (list, tuple)):
      target = tuple(target)
    elif target is not None and not isinstance(target, str):
      raise ValueError(f"rule {rule!r}: mesh axis must be a name, a tuple of names or None")
    out.append((rule[0], target))
  return tuple(out)


def logical_to_spec(logical_axes: LogicalAxes, shape: Sequence[int], rules: Rules,
                    mesh_shape: Mapping[str, int], name: str = "array",
                    on_indivisible: str = "error") -> PartitionSpec:
  """PartitionSpec for an array of `shape` with `logical_axes` under `rules`.

  Args:
    logical_axes: one logical name (or None) per dimension.
    shape: the array's shape.
    rules: (logical, mesh axes) pairs, first usable match wins.
    mesh_shape: mesh axis name -> size.
    name: used in error messages.
    on_indivisible: 'error' or 'replicate' (warn and leave the dimension whole).
  """
  if on_indivisible not in ("error", "replicate"):
    raise ValueError(f"on_indivisible must be 'error' or 'replicate', got {on_indivisible!r}")
  if len(logical_axes) != len(shape):
    raise ValueError(f"{name}: {len(logical_axes)} logical axes {logical_axes} for shape "
                     f"{tuple(shape)}")
  used = set()
  spec = []
  for dim, (logical, size) in enumerate(zip(logical_axes, shape)):
    chosen = None
    for rule_logical, mesh_axes in rules:
      if rule_logical != logical:
        continue
      axes = () if mesh_axes is None else (
          (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes))
      if used.intersection(axes):
        continue
      unknown = [a for a in axes if a not in mesh_shape]
      if unknown:
        raise ValueError(f"rule ({logical!r}, {mesh_axes!r}) names mesh axes {unknown} "
                         f"not in the mesh {dict(mesh_shape)}")
      chosen = axes
      break
    if chosen:
      parts = math.prod(mesh_shape[a] for a in chosen)
      if size % parts:
        where = "x".join(f"{a}={mesh_shape[a]}" for a in chosen)
        message = (f"{name}: dimension {dim} ({logical!r}, size {size}) is not divisible by "
                   f"mesh axis {where} ({parts} shards). Use a mesh whose {'/'.join(chosen)} "
                   f"size divides {size}, map {logical!r} to None in the rules, or pass "
                   "on_indivisible='replicate'.")
        if on_indivisible == "error":
          raise ValueError(message)
        warnings.warn(message + " Replicating this dimension.", stacklevel=2)
        chosen = ()
    used.update(chosen or ())
    spec.append(None if not chosen else (chosen[0] if len(chosen) == 1 else chosen))
  while spec and spec[-1] is None:
    spec.pop()
  return PartitionSpec(*spec)


def _tree_specs(tree, axes_tree, rules, mesh_shape, on_indivisible, prefix):
  def one(path, axes, x):
    name = prefix + "/".join(_path_names(path))
    return logical_to_spec(axes, np.shape(x), rules, mesh_shape, name, on_indivisible)
  return jax.tree_util.tree_map_with_path(one, axes_tree, tree, is_leaf=_is_axes)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


# ---------------------------------------------------------------------------
# Meshes.

def parse_mesh_shape(mesh_shape) -> Tuple[int, ...]:
  """'2,4' / '2x4' / (2, 4) -> (2, 4); -1 once means 'the rest of the devices'."""
  if isinstance(mesh_shape, str):
    parts = mesh_shape.replace("x", ",").split(",")
    try:
      shape = tuple(int(p) for p in parts)
    except ValueError:
      raise ValueError(f"mesh_shape {mesh_shape!r} must look like '2,4' (data,model)") from None
  else:
    shape = tuple(int(p) for p in mesh_shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f"mesh_shape {mesh_shape!r} must have {len(MESH_AXES)} sizes "
                     f"{MESH_AXES}, got {len(shape)}")
  if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ValueError(f"mesh_shape {mesh_shape!r}: sizes must be >= 1, with at most one -1")
  return shape


def make_mesh(mesh_shape, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A ('data', 'model') mesh over `devices` (default: all devices, all processes).

  The mesh may use a subset of the devices when its size divides their count
  (e.g. '1,2' on 8 devices uses the first two); a size that does not divide
  the count is an error.
  """
  shape = parse_mesh_shape(mesh_shape)
  devices = list(jax.devices() if devices is None else devices)
  count = len(devices)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if count % known:
      raise ValueError(f"mesh_shape {mesh_shape!r}: {known} does not divide the {count} devices")
    shape = tuple(count // known if s == -1 else s for s in shape)
  size = math.prod(shape)
  if count % size:
    raise ValueError(f"mesh_shape {mesh_shape!r} needs {size} devices, which does not divide "
                     f"the {count} available devices")
  if size == count:
    try:  # Topology-aware order on TPU (neighbouring chips on the model axis).
      from jax.experimental import mesh_utils
      grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
      grid = np.array(devices).reshape(shape)
  else:
    grid = np.array(devices[:size]).reshape(shape)
  return Mesh(grid, MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Partitioner:
  """A device mesh and logical-axis rules: how to lay arrays out on devices.

  Hashable (a `Mesh` and tuples), so it can key compiled programs.
  """
  mesh: Mesh
  rules: Rules = DEFAULT_RULES
  on_indivisible: str = "error"

  def __post_init__(self):
    object.__setattr__(self, "rules", normalize_rules(self.rules))
    if self.on_indivisible not in ("error", "replicate"):
      raise ValueError(f"on_indivisible must be 'error' or 'replicate', got "
                       f"{self.on_indivisible!r}")

  def replace(self, **changes) -> "Partitioner":
    return dataclasses.replace(self, **changes)

  @property
  def mesh_shape(self) -> Dict[str, int]:
    return dict(self.mesh.shape)

  def sharding(self, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def spec(self, logical_axes: LogicalAxes, shape, name: str = "array") -> PartitionSpec:
    return logical_to_spec(logical_axes, shape, self.rules, self.mesh_shape, name,
                           self.on_indivisible)

  def batch_sharding(self, shape, name: str = "batch array") -> NamedSharding:
    """Dimension 0 is `batch`, the rest replicated."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return self.sharding(self.spec(axes, shape, name))

  def param_specs(self, params) -> Any:
    """Tree of PartitionSpecs for a T5X params tree (arrays or ShapeDtypeStructs)."""
    return _tree_specs(params, params_logical_axes(params), self.rules, self.mesh_shape,
                       self.on_indivisible, "params/")

  def param_shardings(self, params) -> Any:
    return jax.tree_util.tree_map(self.sharding, self.param_specs(params))

  def cache_specs(self, cache) -> Any:
    return _tree_specs(cache, cache_logical_axes(cache), self.rules, self.mesh_shape,
                       self.on_indivisible, "cache/")

  def cache_shardings(self, cache) -> Any:
    return jax.tree_util.tree_map(self.sharding, self.cache_specs(cache))

  def constrain_cache(self, state):
    """Inside jit: pins a T5 cache to its sharding; any other draft state is left to GSPMD."""
    if not is_t5_cache(state):
      return state
    return jax.lax.with_sharding_constraint(state, self.cache_shardings(state))

  @contextlib.contextmanager
  def activation_axes(self):
    """While tracing under jit: binds these rules and this mesh so the
    activations families/t5/network.py names (`batch`, `length`, `embed`, `heads`,
    `kv`, `mlp`) are constrained to them. The jitted computation must run
    on this mesh (mesh-sharded inputs or explicit in_shardings), as in
    `generate` and `init_sharded_cache`."""
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), \
        nn.logical_axis_rules(self.rules):
      yield

  def shard_params(self, params, dtype=None):
    """Places every leaf on the mesh with its sharding, casting leaf by leaf.

    Leaves may be numpy arrays, jax Arrays or lazy array-likes supporting
    slicing (e.g. tensorstore / memmap): each device receives only its own
    slice (`jax.make_array_from_callback`), so no device ever holds a full
    copy of a sharded weight and at most one leaf is materialised at a time.
    """
    dtype = None if dtype is None else jnp.dtype(canonical_dtype(dtype))

    def place(sharding, leaf):
      if isinstance(leaf, jax.Array):
        placed = jax.device_put(leaf, sharding)
        return placed if dtype is None else placed.astype(dtype)
      def shard(index):
        block = np.asarray(leaf[index])
        return block if dtype is None else block.astype(dtype)
      return jax.make_array_from_callback(tuple(leaf.shape), sharding, shard)

    return jax.tree_util.tree_map(place, self.param_shardings(params), params)

  def shard_cache(self, cache):
    return jax.device_put(cache, self.cache_shardings(cache))


@gin.configurable(module="specdec_jax.sharding")
def make_partitioners(mesh_shape="1,-1", logical_axis_rules=DEFAULT_RULES,
                      draft_logical_axis_rules=DRAFT_RULES, on_indivisible: str = "error",
                      devices=None) -> Tuple[Partitioner, Partitioner]:
  """(target, draft) partitioners on one mesh; gin-configurable (configs/sharding/*.gin).

  Args:
    mesh_shape: 'data,model' sizes, e.g. '2,4'; -1 = the remaining devices.
    logical_axis_rules: target rules (default T5X-like, `DEFAULT_RULES`).
    draft_logical_axis_rules: draft rules (default: weights replicated,
      batch over `data`).
    on_indivisible: 'error' (default) or 'replicate'.
    devices: default all devices.
  """
  mesh = make_mesh(mesh_shape, devices)
  return (Partitioner(mesh, logical_axis_rules, on_indivisible),
          Partitioner(mesh, draft_logical_axis_rules, on_indivisible))


# ---------------------------------------------------------------------------
# Loading straight onto devices.

def init_sharded_params(config: T5Config, partitioner: Partitioner, seed: int = 0):
  """Random T5X init computed directly into its sharding (no host copy), in config.dtype."""
  module = T5(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  dtype = jnp.dtype(config.dtype)

  def init(rng):
    params = module.init(rng, dummy, dummy)["params"]
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)

  shapes = jax.eval_shape(init, jax.random.PRNGKey(seed))
  init = jax.jit(init, out_shardings=partitioner.param_shardings(shapes))
  return init(jax.random.PRNGKey(seed))


def load_sharded_model(name_or_path_or_config, partitioner: Partitioner, *,
                       dtype: Optional[str] = None, seed: int = 0, **config_overrides):
  """`load_model` whose params land on the mesh already sharded.

  Named configs / `T5Config`s are initialised inside a jit with sharded
  outputs; checkpoints are loaded then placed leaf by leaf (`shard_params`).
  """
  from specdec_jax.families.t5.model import Model, default_dtype
  from specdec_jax.families.t5.config import CONFIGS, get_config
  source = name_or_path_or_config
  dtype = optional_dtype(dtype)
  if isinstance(source, T5Config) or (isinstance(source, str) and source in CONFIGS):
    config = source if isinstance(source, T5Config) else get_config(source)
    config = config.replace(**config_overrides) if config_overrides else config
    if dtype is not None or not isinstance(source, T5Config):
      config = config.replace(dtype=dtype or default_dtype())
    return Model(config, init_sharded_params(config, partitioner, seed))
  from specdec_jax.families.t5 import checkpoints

  def place(key, array):
    # Each device receives only its slice of the host tensor.
    spec = partitioner.spec(param_logical_axes(key, array.ndim), array.shape, "/".join(key))
    return jax.make_array_from_callback(array.shape, partitioner.sharding(spec),
                                        lambda index: array[index])

  model = checkpoints.load_checkpoint_model(source, dtype=dtype, place=place, **config_overrides)
  # Formats restored whole (Orbax) are re-placed here; placed leaves stay put.
  return Model(model.config, partitioner.shard_params(model.params))


def shard_model(model, partitioner: Partitioner):
  """The same `Model` with its params placed by `partitioner`."""
  from specdec_jax.families.t5.model import Model
  return Model(model.config, partitioner.shard_params(model.params))


def init_sharded_cache(model, partitioner: Partitioner, encoder_tokens, max_decode_len: int):
  """Encodes and allocates the cache directly in its sharding (the layout `generate` uses)."""
  tokens = jnp.asarray(encoder_tokens, jnp.int32)
  partitioner.batch_sharding(tokens.shape, "encoder_tokens")  # Checks the batch divides.
  module = model.module

  def init(params, tokens):
    with partitioner.activation_axes():
      return module.apply({"params": params}, tokens, int(max_decode_len),
                          method=T5.init_cache)

  shapes = jax.eval_shape(init, model.params, tokens)
  fn = jax.jit(init, out_shardings=partitioner.cache_shardings(shapes))
  return fn(model.params, tokens)


# ---------------------------------------------------------------------------
# What `generation.generate` needs to run under a mesh.

@dataclasses.dataclass(frozen=True)
class GenerateShardings:
  """In/out shardings of generate's compiled program `(params, draft_params, tokens, rng)`.

  Outputs (sequences, stats) are replicated: small, and readable from every
  process on multi-host meshes.
  """
  target: Partitioner
  draft: Partitioner
  in_shardings: Tuple[Any, Any, NamedSharding, NamedSharding]
  out_shardings: NamedSharding


def generate_shardings(partitioner: Partitioner, draft_partitioner: Optional[Partitioner],
                       params, draft_params, encoder_tokens_shape) -> GenerateShardings:
  """Shardings for one `generate` call; raises clear errors for indivisible shapes.

  The draft defaults to `DRAFT_RULES` on the target's mesh (weights
  replicated). Params of drafts that are not T5 models (n-gram tables, ...)
  are replicated.
  """
  if draft_partitioner is None:
    draft_partitioner = partitioner.replace(rules=DRAFT_RULES)
  if draft_partitioner.mesh != partitioner.mesh:
    raise ValueError("target and draft partitioners must share one mesh (rules may differ)")
  if draft_params is None:
    draft_shardings = None
  else:
    try:
      params_logical_axes(draft_params)
      is_t5 = True
    except ValueError:
      is_t5 = False
    draft_shardings = (draft_partitioner.param_shardings(draft_params) if is_t5 else
                       jax.tree_util.tree_map(lambda _: draft_partitioner.replicated(),
                                              draft_params))
  in_shardings = (partitioner.param_shardings(params), draft_shardings,
                  partitioner.batch_sharding(encoder_tokens_shape, "encoder_tokens"),
                  partitioner.replicated())
  return GenerateShardings(partitioner, draft_partitioner, in_shardings,
                           partitioner.replicated())


# ---------------------------------------------------------------------------
# Memory planning.

@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes of one model's params and cache, in total and on the fullest device."""
  name: str
  mesh_shape: Dict[str, int]
  dtype: str
  params_bytes: int
  cache_bytes: int
  params_bytes_per_device: int
  cache_bytes_per_device: int

  @property
  def bytes_per_device(self) -> int:
    return self.params_bytes_per_device + self.cache_bytes_per_device


def _shard_bytes(shape, dtype, spec: PartitionSpec, mesh_shape) -> int:
  shard = list(shape)
  for dim, axes in enumerate(tuple(spec)):
    if axes is None:
      continue
    axes = (axes,) if isinstance(axes, str) else axes
    shard[dim] = -(-shard[dim] // math.prod(mesh_shape[a] for a in axes))
  return math.prod(shard) * jnp.dtype(dtype).itemsize


def _plan_tree(tree, specs, mesh_shape) -> Tuple[int, int]:
  leaves = jax.tree_util.tree_leaves(tree)
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
  total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
  per_device = sum(_shard_bytes(x.shape, x.dtype, s, mesh_shape)
                   for x, s in zip(leaves, spec_leaves))
  return total, per_device


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


def plan_memory(config: T5Config, *, batch: int, encoder_len: int, max_decode_len: int,
                mesh_shape, rules=DEFAULT_RULES, dtype: Optional[str] = None,
                on_indivisible: str = "error", name: str = "model") -> MemoryPlan:
  """Bytes of params and cache per device, without devices or allocation.

  Args:
    config: model shapes; `dtype` overrides config.dtype (params and cache).
    batch / encoder_len / max_decode_len: the cache is [batch, max_decode_len]
      self-attention plus [batch, encoder_len] cross-attention keys/values per
      decoder layer, as `generate` allocates it (max_decode_len =
      max_decode_steps).
    mesh_shape: 'data,model' sizes (string or tuple) or a {'data': .., 'model': ..} dict.
    rules / on_indivisible: as for `Partitioner`.
  Returns:
    a MemoryPlan. Per-device numbers are the fullest device (all equal when
    every sharded dimension divides). Activations and XLA temporaries (e.g.
    the [batch, gamma + 1, vocab] float32 logits) are not counted.
  """
  if dtype is not None:
    config = config.replace(dtype=dtype)
  if isinstance(mesh_shape, Mapping):
    sizes = dict(mesh_shape)
  else:
    shape = parse_mesh_shape(mesh_shape)
    if -1 in shape:
      raise ValueError("plan_memory needs explicit mesh sizes (no -1)")
    sizes = dict(zip(MESH_AXES, shape))
  rules = normalize_rules(rules)
  params = abstract_params(config)
  cache = abstract_cache(config, batch, encoder_len, max_decode_len)
  param_specs = _tree_specs(params, params_logical_axes(params), rules, sizes, on_indivisible,
                            "params/")
  cache_specs = _tree_specs(cache, cache_logical_axes(cache), rules, sizes, on_indivisible,
                            "cache/")
  params_total, params_device = _plan_tree(params, param_specs, sizes)
  cache_total, cache_device = _plan_tree(cache, cache_specs, sizes)
  return MemoryPlan(name, sizes, config.dtype, params_total, cache_total, params_device,
                    cache_device)


def plan_speculative_memory(target_config: T5Config, draft_config: T5Config, *, batch: int,
                            encoder_len: int, max_decode_len: int, mesh_shape,
                            dtype: Optional[str] = None, rules=DEFAULT_RULES,
                            draft_rules=DRAFT_RULES) -> Tuple[MemoryPlan, MemoryPlan]:
  """(target plan, draft plan) for `generate(..., draft=...)` on one mesh."""
  common = dict(batch=batch, encoder_len=encoder_len, max_decode_len=max_decode_len,
                mesh_shape=mesh_shape, dtype=dtype)
  return (plan_memory(target_config, rules=rules, name="target", **common),
          plan_memory(draft_config, rules=draft_rules, name="draft", **common))


def device_bytes(tree, device=None) -> int:
  """Bytes of `tree`'s shards that live on `device` (default: the first device used)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shards = leaf.addressable_shards
    target = shards[0].device if device is None else device
    total += sum(s.data.nbytes for s in shards if s.device == target)
  return total


def format_memory_table(rows: Sequence[Tuple[str, Sequence[MemoryPlan], float]]) -> str:
  """Markdown table; each row is (setting, plans for target/draft/..., device memory GiB)."""
  gib = 2 ** 30
  lines = ["| setting | model | mesh (data x model) | params / device | cache / device | "
           "total / device |", "|---|---|---|---|---|---|"]
  for setting, plans, capacity in rows:
    for plan in plans:
      mesh = f"{plan.mesh_shape['data']} x {plan.mesh_shape['model']}"
      lines.append(f"| {setting} | {plan.name} | {mesh} | "
                   f"{plan.params_bytes_per_device / gib:.2f} GiB | "
                   f"{plan.cache_bytes_per_device / gib:.2f} GiB | "
                   f"{plan.bytes_per_device / gib:.2f} GiB |")
    total = sum(p.bytes_per_device for p in plans)
    lines.append(f"| {setting} | **all** | | | | **{total / gib:.2f} GiB of {capacity:g} GiB** |")
  return "\n".join(lines)


# ---------------------------------------------------------------------------
# Multi-host.

def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> None:
  """`jax.distributed.initialize` (arguments None = auto-detect on TPU / SLURM / ...).

  Must run before any other JAX call; afterwards `jax.devices()` lists every
  process's devices and `make_mesh` spans them all.
  """
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


def is_output_process() -> bool:
  """Only process 0 writes results files."""
  return jax.process_index() == 0
