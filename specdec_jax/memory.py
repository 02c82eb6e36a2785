"""Memory a decode needs, from shapes alone: params and caches per device, checked before work.

`plan_memory` computes the bytes of params and caches per device for a
config, dtype, batch, lengths and mesh without allocating anything (the
layout of `sharding.Partitioner`'s rules); `check_decode_memory` compares a
decode's parts with what the devices have free and raises an error naming
the bytes before anything is allocated; `check_params_memory` does the same
for the random weights `load_model` is about to create.
"""

import dataclasses
import functools
import math
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specdec_jax.families.registry import family_of
from specdec_jax.sharding import (DEFAULT_RULES, DRAFT_RULES, MESH_AXES, _tree_specs,
                                  normalize_rules, params_logical_axes, parse_mesh_shape)


class InsufficientMemory(MemoryError):
  """What a call would allocate does not fit the memory available; raised from shapes,
  before anything is allocated, naming the bytes and the fix."""


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
  """Raises `InsufficientMemory` (a MemoryError), before anything is allocated, if
  `parts` cannot fit.

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
  raise InsufficientMemory(
      f"{what} needs {needed} bytes ({_gib(needed)}: {detail}) before any activation, but "
      f"only {available} bytes ({_gib(available)}) are {where}. Lower max_decode_steps or "
      "the batch, use a narrower dtype, or shard the cache over more devices "
      "(plan_memory gives the bytes per device for a mesh).")


@functools.lru_cache(maxsize=256)
def params_size(family, config) -> Tuple[int, int]:
  """(parameter count, bytes in config.dtype) of `config`'s params, from the family's
  abstract params (shapes only; cached per config, as models are built many times)."""
  leaves = jax.tree_util.tree_leaves(family.abstract_params(config))
  return sum(math.prod(x.shape) for x in leaves), tree_bytes(leaves)


def check_params_memory(family, config, what: str, device=None) -> int:
  """Logs the parameter count and bytes of random weights of `config` at INFO, and
  raises `InsufficientMemory` when they exceed what `device` (default: JAX's first
  device, where initialisation puts them) has available; returns the bytes.

  Unknown available memory (`available_memory_bytes` None) skips the check.
  These are the weights themselves: random initialisation needs more for a
  while (the families initialise in float32, with XLA temporaries: about 3x
  the float32 bytes at its peak for qwen2_0_5b on CPU), so passing is
  necessary, not sufficient.
  """
  count, needed = params_size(family, config)
  logging.info("%s: %s parameters, %d bytes (%s) in %s", what, f"{count:,}", needed,
               _gib(needed), config.dtype)
  device = jax.devices()[0] if device is None else device
  available = available_memory_bytes(device)
  if available is None or needed <= available:
    return needed
  where = ("host memory available" if device.platform == "cpu" else
           f"free on {device.device_kind} {device.id}")
  narrower = count * jnp.dtype(jnp.bfloat16).itemsize
  fix = (f"load it with dtype='bfloat16' ({narrower} bytes, {_gib(narrower)}) or pick a "
         "smaller config" if narrower < needed else "pick a smaller config")
  raise InsufficientMemory(
      f"{what} has {count:,} parameters: {needed} bytes ({_gib(needed)}) in {config.dtype}, "
      f"but only {available} bytes ({_gib(available)}) are {where}: {fix} (nothing was "
      "allocated)")


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


def decode_parts(family, config, draft, global_shape, max_decode_len: int, gamma: int,
                 placement) -> Dict[str, int]:
  """{part: bytes per device} that a decode allocates for its whole length, from shapes only.

  The target cache from the family's `abstract_cache` (under a mesh,
  `plan_memory`'s bytes on the fullest device), the draft's state from its
  abstract `init_state` (a model draft under a mesh: its plan), and the
  loop's token buffers. Params exist already; activations are not counted
  (they do not grow with max_decode_len).

  Args:
    global_shape: (batch, C) of the whole decode.
    max_decode_len: loop positions, a draft's room included.
    gamma: the deepest proposal (`DraftStart.gamma`).
    placement: the decode's `placement.Placement`.
  """
  from specdec_jax.drafts.base import DraftStart  # drafts sit above this module
  from specdec_jax.families.registry import is_model
  batch, width = global_shape
  partitioner, draft_partitioner = placement.partitioner, placement.draft_partitioner
  plan = lambda cfg, part: plan_memory(  # noqa: E731
      cfg, batch=batch, context_len=width, max_decode_len=max_decode_len,
      mesh_shape=part.mesh_shape, rules=part.rules,
      on_indivisible=part.on_indivisible).cache_bytes_per_device
  if partitioner is None:
    target = tree_bytes(family.abstract_cache(config, batch, width, max_decode_len))
  else:
    target = plan(config, partitioner)
  parts = {"target cache": target}
  if draft is not None:
    draft_model = getattr(draft, "model", None)
    if draft_partitioner is not None and draft_model is not None and is_model(draft_model):
      parts["draft state"] = plan(draft_model.config, draft_partitioner)
    else:
      tokens = jax.ShapeDtypeStruct(tuple(global_shape), jnp.int32)
      lengths = jax.ShapeDtypeStruct(tuple(global_shape[:1]), jnp.int32)
      state = jax.eval_shape(
          lambda p, t, n: draft.init_state(p, DraftStart(family.context(t, n), max_decode_len, gamma)),
          draft.params, tokens, lengths)
      parts["draft state"] = tree_bytes(state)
  # The loop's inputs [batch, N] and sequences [batch, N + 1], and the output, int32.
  parts["token buffers"] = 3 * batch * (max_decode_len + 1) * 4
  return parts

