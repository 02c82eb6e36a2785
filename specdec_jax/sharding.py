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

`plan_memory` computes the bytes of params and caches per device for a config,
dtype, batch, lengths and mesh without allocating anything.
"""

import contextlib
import dataclasses
import math
import os
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
  total = tree_bytes(tree)
  per_device = sum(_shard_bytes(x.shape, x.dtype, s, mesh_shape)
                   for x, s in zip(leaves, spec_leaves))
  return total, per_device


def plan_memory(config, *, batch: int, context_len: int, max_decode_len: int, mesh_shape,
                rules=DEFAULT_RULES, dtype: Optional[str] = None, on_indivisible: str = "error",
                name: str = "model") -> MemoryPlan:
  """Bytes of params and cache per device, without devices or allocation, for any family.

  Args:
    config: model shapes (a config of any registered family); `dtype`
      overrides config.dtype (params and cache).
    batch / context_len / max_decode_len: the cache `generate` allocates for
      inputs [batch, context_len] (T5: encoder tokens; decoder-only: prompt
      width) and max_decode_len = max_decode_steps new tokens.
    mesh_shape: 'data,model' sizes (string or tuple) or a {'data': .., 'model': ..} dict.
    rules / on_indivisible: as for `Partitioner`.
  Returns:
    a MemoryPlan. Per-device numbers are the fullest device (all equal when
    every sharded dimension divides). Activations and XLA temporaries (e.g.
    the [batch, gamma + 1, vocab] float32 logits) are not counted.
  """
  family = family_of(config)
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
  params = family.abstract_params(config)
  cache = family.abstract_cache(config, batch, context_len, max_decode_len)
  param_specs = _tree_specs(params, params_logical_axes(params, family), rules, sizes,
                            on_indivisible, "params/")
  cache_specs = _tree_specs(cache, family.cache_logical_axes(cache), rules, sizes,
                            on_indivisible, "cache/")
  params_total, params_device = _plan_tree(params, param_specs, sizes)
  cache_total, cache_device = _plan_tree(cache, cache_specs, sizes)
  return MemoryPlan(name, sizes, config.dtype, params_total, cache_total, params_device,
                    cache_device)


def plan_speculative_memory(target_config, draft_config, *, batch: int, context_len: int,
                            max_decode_len: int, mesh_shape, dtype: Optional[str] = None,
                            rules=DEFAULT_RULES, draft_rules=DRAFT_RULES
                            ) -> Tuple[MemoryPlan, MemoryPlan]:
  """(target plan, draft plan) for `generate(..., draft=...)` on one mesh."""
  common = dict(batch=batch, context_len=context_len, max_decode_len=max_decode_len,
                mesh_shape=mesh_shape, dtype=dtype)
  return (plan_memory(target_config, rules=rules, name="target", **common),
          plan_memory(draft_config, rules=draft_rules, name="draft", **common))


def available_memory_bytes(device) -> Optional[int]:
  """Bytes a new allocation on `device` can still get, or None when unknown.

  CPU devices share the host's memory: its MemAvailable (/proc/meminfo, what
  the kernel can hand out without swapping), else free physical pages.
  Accelerators: bytes_limit - bytes_in_use from the device's memory_stats().
  """
  if device.platform == "cpu":
    try:
      with open("/proc/meminfo") as f:
        for line in f:
          if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    except OSError:
      pass
    try:
      return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
      return None
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def tree_bytes(tree) -> int:
  """Bytes of a tree of arrays or ShapeDtypeStructs."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def check_decode_memory(parts: Mapping[str, int], devices: Sequence[Any], what: str) -> None:
  """Raises MemoryError, before anything is allocated, if `parts` cannot fit.

  Args:
    parts: {name: bytes per device} of what a decode will allocate (caches,
      token buffers), e.g. from `plan_memory` or `tree_bytes` of abstract
      shapes.
    devices: the devices they go on. CPU devices share the host's memory, so
      there the per-device bytes count once per device against it.
    what: the setting to name in the error (e.g. 'max_decode_steps=10000000').
  """
  per_device = sum(parts.values())
  device = devices[0]
  shared = device.platform == "cpu"
  needed = per_device * (len(devices) if shared else 1)
  available = available_memory_bytes(device)
  if available is None or needed <= available:
    return
  where = ("host memory available" if shared else
           f"free on {device.device_kind} {device.id}")
  detail = ", ".join(f"{name} {_gib(n * (len(devices) if shared else 1))}"
                     for name, n in parts.items())
  raise MemoryError(
      f"{what} needs {needed} bytes ({_gib(needed)}: {detail}) before any activation, but "
      f"only {available} bytes ({_gib(available)}) are {where}. Lower max_decode_steps or "
      "the batch, use a narrower dtype, or shard the cache over more devices "
      "(sharding.plan_memory gives the bytes per device for a mesh).")


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
# Multi-host (T5X's model: every process runs the same program on the same
# host data; each process feeds only its own devices; one process writes).

def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           timeout_s: Optional[int] = None) -> None:
  """`jax.distributed.initialize` (arguments None = auto-detect on TPU / SLURM / ...).

  Must run before any other JAX call; afterwards `jax.devices()` lists every
  process's devices and `make_mesh` spans them all. On CPU the processes'
  collectives go through gloo (jax's default `jax_cpu_collectives_implementation`).
  `timeout_s` bounds the wait for the other processes (jax's default: 300 s).
  """
  kwargs = {} if timeout_s is None else dict(initialization_timeout=int(timeout_s))
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id, **kwargs)


def is_output_process() -> bool:
  """Only process 0 writes results files."""
  return jax.process_index() == 0


def spans_processes(sharding) -> bool:
  """Whether `sharding` puts data on devices of other processes too."""
  return not sharding.is_fully_addressable


def is_key_array(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def put(tree, shardings):
  """`jax.device_put(tree, shardings)` that also works across processes without copies.

  On one process this is `jax.device_put`. When a sharding spans several
  processes, a leaf that is host data (numpy, an array-like, or a jax Array on
  this process's devices) is taken to hold the same global value on every
  process, as in T5X, and becomes a global array from this process's own
  slices (`jax.make_array_from_callback`): nothing crosses hosts and nothing
  is compared (`jax.device_put` would all-gather each array to check it).
  Leaves already spanning the processes are resharded by `jax.device_put`.
  `shardings` is one sharding or a tree matching `tree` (None leaves pass).
  """
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree_util.tree_map(lambda _: shardings, tree)

  def one(sharding, x):
    if x is None or not spans_processes(sharding):
      return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or is_key_array(x)):
      return jax.device_put(x, sharding)
    host = np.asarray(x) if isinstance(x, jax.Array) else x
    if not hasattr(host, "shape"):
      host = np.asarray(host)
    return jax.make_array_from_callback(tuple(host.shape), sharding,
                                        lambda index: np.asarray(host[index]))

  return jax.tree_util.tree_map(one, shardings, tree, is_leaf=lambda x: x is None)


def local_copy(tree):
  """Replicated global arrays as arrays on this process's first device of each.

  Every process holds the whole value of a replicated array; this makes it
  an ordinary single-device array, so later eager ops and `np.asarray` run
  locally instead of as a program over every process's devices. Arrays that
  are fully addressable already are returned unchanged.
  """
  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    if not x.is_fully_replicated:
      raise ValueError(f"local_copy needs a replicated array; got one sharded as {x.sharding}")
    return x.addressable_data(0)
  return jax.tree_util.tree_map(one, tree)


def assert_same_on_every_process(named: Mapping[str, Any],
                                 hint: str = "every process must pass the same global batch, "
                                             "rng and settings") -> None:
  """Raises ValueError naming the inputs whose host values differ between processes.

  T5X-style multi-host decoding feeds every process the same global batch;
  a process that read another file or shuffled differently would silently
  decode garbage rows. Compares one crc32 per input (one tiny all-gather).
  """
  if jax.process_count() == 1:
    return
  import zlib
  from jax.experimental import multihost_utils
  names = sorted(named)
  digests = np.array([zlib.crc32(np.ascontiguousarray(np.asarray(named[n])).tobytes())
                      for n in names], np.uint32)
  everyone = np.asarray(multihost_utils.process_allgather(digests))  # [processes, inputs]
  differ = [n for i, n in enumerate(names) if (everyone[:, i] != everyone[0, i]).any()]
  if differ:
    raise ValueError(f"multi-host generate: {', '.join(differ)} differ between processes "
                     f"(process {jax.process_index()} of {jax.process_count()}); {hint}")


# ---------------------------------------------------------------------------
# Per-host rows: each process passes only its own rows of the global batch.

def process_row_block(local_batch: int, process: Optional[int] = None) -> slice:
  """The global rows process `process` (default: this one) supplies: its block
  `[process * local_batch, (process + 1) * local_batch)`.

  The per-host contract of `global_batch` and `generate(..., process_local=True)`:
  the global batch is the processes' local batches concatenated in process
  order, whatever the mesh.
  """
  process = jax.process_index() if process is None else int(process)
  return slice(process * local_batch, (process + 1) * local_batch)


def _rows_held(sharding, global_shape) -> Dict[int, set]:
  """{process index: the global rows its devices hold} under `sharding`."""
  held: Dict[int, set] = {}
  for device, index in sharding.devices_indices_map(tuple(global_shape)).items():
    start, stop, _ = index[0].indices(global_shape[0]) if index else (0, global_shape[0], 1)
    held.setdefault(device.process_index, set()).update(range(start, stop))
  return held


def blocks_match_devices(sharding, global_shape, local_batch: int) -> bool:
  """Whether every process's devices hold exactly its own row block under `sharding`.

  Then each process's rows go straight onto its devices
  (`jax.make_array_from_process_local_data`, nothing crosses hosts); otherwise
  (the batch replicated across processes, e.g. a `1,8` mesh, or a device order
  that interleaves processes) the rows must be gathered first.
  """
  held = _rows_held(sharding, global_shape)
  return all(rows == set(range(p * local_batch, (p + 1) * local_batch))
             for p, rows in held.items())


def gather_rows(tree):
  """This process's host rows -> every process's, concatenated in process order.

  A tree of host arrays with a leading batch dimension (the same shape on
  every process); the result is numpy on every process. One all-gather over
  the processes' devices per leaf (token rows: bytes, not weights).
  """
  if jax.process_count() == 1:
    return jax.tree_util.tree_map(np.asarray, tree)
  from jax.experimental import multihost_utils
  return jax.tree_util.tree_map(
      np.asarray, multihost_utils.process_allgather(
          jax.tree_util.tree_map(np.asarray, tree), tiled=True))


def check_same_local_shapes(named: Mapping[str, Any]) -> None:
  """Raises ValueError naming the host arrays whose shapes differ between processes.

  `global_batch` needs every process to pass the same number of rows of the
  same width; a process with fewer rows would otherwise fail deep inside a
  collective or hang. One tiny all-gather.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  names = sorted(named)
  shapes = [tuple(np.shape(named[n])) for n in names]
  rank = max([len(s) for s in shapes] + [1])
  mine = np.array([list(s) + [-1] * (rank - len(s)) for s in shapes], np.int64)
  everyone = np.asarray(multihost_utils.process_allgather(mine))  # [processes, names, rank]
  differ = [f"{n} ({', '.join(str(tuple(d for d in everyone[p, i] if d >= 0)) for p in range(everyone.shape[0]))})"
            for i, n in enumerate(names) if (everyone[:, i] != everyone[0, i]).any()]
  if differ:
    raise ValueError(f"per-host rows: the processes' local shapes differ: {'; '.join(differ)} "
                     f"(by process 0..{everyone.shape[0] - 1}); every process must pass the same "
                     "number of rows of the same width (pad the last batch)")


def global_batch(partitioner: "Partitioner", *local_arrays, check_shapes: bool = True):
  """Global arrays of the batch from each process's own rows (T5X's host-local input).

  Args:
    partitioner: the mesh and rules the decode runs on; dimension 0 of every
      array is `batch` (split over `data`), the rest replicated.
    *local_arrays: host arrays [local_batch, ...], this process's rows, the
      same shapes on every process (checked: `check_same_local_shapes`).
  Returns:
    one global jax.Array per input, [processes * local_batch, ...], laid out
    by `partitioner.batch_sharding`, whose rows `process_row_block(local_batch, p)`
    are process p's rows. When every process's devices hold exactly its own
    block, each process places only its rows (`make_array_from_process_local_data`,
    nothing crosses hosts); otherwise the rows are gathered first (`gather_rows`).
    On one process: `put` of the arrays.
  """
  arrays = [np.asarray(a) for a in local_arrays]
  if not arrays:
    raise ValueError("global_batch needs at least one array")
  if any(a.ndim == 0 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
    raise ValueError(f"global_batch: every array needs the same leading (batch) dimension, got "
                     f"shapes {[a.shape for a in arrays]}")
  if check_shapes:
    check_same_local_shapes({f"array {i}": a for i, a in enumerate(arrays)})
  processes = jax.process_count()
  local_batch = arrays[0].shape[0]
  out = []
  for i, array in enumerate(arrays):
    shape = (processes * local_batch,) + array.shape[1:]
    batch_sharding = partitioner.batch_sharding(shape, f"global_batch array {i}")
    if processes == 1 or not spans_processes(batch_sharding):
      out.append(put(array, batch_sharding) if processes == 1 else None)
    elif blocks_match_devices(batch_sharding, shape, local_batch):
      out.append(jax.make_array_from_process_local_data(batch_sharding, array, shape))
    else:
      out.append(put(gather_rows(array), batch_sharding))
  if any(x is None for x in out):
    raise ValueError("global_batch: the partitioner's mesh lies on this process's devices "
                     f"only, but there are {processes} processes; per-host rows need a mesh "
                     "over every process (make_partitioners' default)")
  return tuple(out) if len(out) > 1 else out[0]


def local_rows(tree, local_batch: int):
  """This process's block of rows (`process_row_block`) of host / replicated outputs."""
  block = process_row_block(local_batch)
  return jax.tree_util.tree_map(lambda x: x[block], tree)


def gather_ragged(rows: Sequence[Sequence[int]], dtype=np.int32) -> list:
  """Ragged host rows (token lists, utf-8 bytes) of every process, in process order.

  Every process passes the same number of rows; lengths may differ. Two
  all-gathers (the lengths, then the rows padded to the longest).
  """
  if jax.process_count() == 1:
    return [np.asarray(r, dtype) for r in rows]
  lengths = gather_rows(np.array([len(r) for r in rows], np.int64))
  padded = np.zeros((len(rows), max(1, int(lengths.max(initial=0)))), dtype)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  everyone = gather_rows(padded)
  return [everyone[i, :n] for i, n in enumerate(lengths)]


def gather_texts(texts: Sequence[str]) -> list:
  """Strings of every process (the same count on each), in process order."""
  encoded = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
  return [bytes(b).decode("utf-8") for b in gather_ragged(encoded, np.uint8)]


def on_every_process(fn, what: str):
  """`fn()` here; if it raised on any process, raises on every process.

  Per-host work (reading and tokenizing this process's rows) can fail on one
  process only; the others would then wait at the next collective until a
  timeout. One tiny all-gather of a failure flag turns that into an error on
  every process (the failing one raises its own).
  """
  error = None
  try:
    result = fn()
  except Exception as e:  # Re-raised below, here or as the others' error.
    error = e
  if jax.process_count() > 1:
    failed = np.flatnonzero(gather_rows(np.array([error is not None], np.int32)))
    if error is None and failed.size:
      raise RuntimeError(f"{what} failed on process(es) {failed.tolist()} (see their logs); "
                         f"process {jax.process_index()} stops too")
  if error is not None:
    raise error
  return result
