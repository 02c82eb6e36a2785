"""The generic partitioner: target and draft of any family on a device mesh, T5X style.

Every parameter and cache array gets *logical* axis names from its family
(`Family.param_logical_axes` / `cache_logical_axes`) (`vocab`, `embed`,
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

What a decode allocates is planned in `specdec_jax.memory` (bytes per
device from shapes alone); several processes are coordinated in
`specdec_jax.multihost`.
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

from specdec_jax.core.dtypes import canonical_dtype
from specdec_jax.families.base import Family, path_names
from specdec_jax.families.registry import family_of
from specdec_jax.multihost import put

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
# Expert parallelism for mixture-of-experts targets: whole experts on the `model` axis
# (each device holds E / model_size experts; the router's expert dimension follows), the
# rest as DEFAULT_RULES. Without it the expert dimension is replicated and each expert's
# units split over `model`, like a dense MLP (configs/sharding/expert_parallel.gin).
EXPERT_PARALLEL_RULES = (("expert", "model"),) + DEFAULT_RULES
# The draft is small: replicate its weights on every device, keep the batch
# split over `data` like the target's.
DRAFT_RULES = (("batch", "data"),)

LogicalAxes = Tuple[Optional[str], ...]
Rules = Tuple[Tuple[str, Optional[Union[str, Tuple[str, ...]]]], ...]

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
    name = prefix + "/".join(path_names(path))
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

  def param_specs(self, params, family: Family) -> Any:
    """Tree of PartitionSpecs for a `family` params tree (arrays or ShapeDtypeStructs)."""
    return _tree_specs(params, params_logical_axes(params, family), self.rules, self.mesh_shape,
                       self.on_indivisible, "params/")

  def param_shardings(self, params, family: Family) -> Any:
    return jax.tree_util.tree_map(self.sharding, self.param_specs(params, family))

  def cache_specs(self, cache, family: Family) -> Any:
    return _tree_specs(cache, family.cache_logical_axes(cache), self.rules, self.mesh_shape,
                       self.on_indivisible, "cache/")

  def cache_shardings(self, cache, family: Family) -> Any:
    return jax.tree_util.tree_map(self.sharding, self.cache_specs(cache, family))

  def constrain_cache(self, cache, family: Family):
    """Inside jit: pins a `family` cache to its sharding."""
    return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache, family))

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

  def shard_params(self, params, family: Family, dtype=None):
    """Places every leaf on the mesh with its sharding, casting leaf by leaf.

    Leaves may be numpy arrays, jax Arrays or lazy array-likes supporting
    slicing (e.g. tensorstore / memmap): each device receives only its own
    slice (`jax.make_array_from_callback`), so no device ever holds a full
    copy of a sharded weight and at most one leaf is materialised at a time.
    On several processes each process places only its own devices' slices
    (every process must hold the same values: see `put`).
    """
    dtype = None if dtype is None else jnp.dtype(canonical_dtype(dtype))

    def place(sharding, leaf):
      if isinstance(leaf, jax.Array):
        placed = put(leaf, sharding)
        return placed if dtype is None else placed.astype(dtype)
      def shard(index):
        block = np.asarray(leaf[index])
        return block if dtype is None else block.astype(dtype)
      return jax.make_array_from_callback(tuple(leaf.shape), sharding, shard)

    return jax.tree_util.tree_map(place, self.param_shardings(params, family), params)

  def shard_cache(self, cache, family: Family):
    return put(cache, self.cache_shardings(cache, family))


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
# Logical axes of a family's trees.

def params_logical_axes(params, family: Family) -> Any:
  """The params tree with each leaf replaced by its tuple of logical axis names."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: family.param_logical_axes(path_names(path), np.ndim(x)), params)


def init_sharded_cache(model, partitioner: Partitioner, tokens, max_decode_steps: int,
                       lengths=None):
  """The cache `generate` starts from (context encoded / prefilled), made in its sharding."""
  family = family_of(model)
  tokens, lengths = family.check_inputs(model.config, tokens, lengths, max_decode_steps)
  partitioner.batch_sharding(tokens.shape, "inputs")  # Checks the batch divides.

  def init(params, tokens, lengths):
    with partitioner.activation_axes():
      return family.start(model.config, params, tokens, lengths, int(max_decode_steps)).cache

  shapes = jax.eval_shape(init, model.params, tokens, lengths)
  fn = jax.jit(init, out_shardings=partitioner.cache_shardings(shapes, family))
  return fn(model.params, tokens, lengths)
