"""A trained demo pair at a large model's cost: `make demo`'s act 2.

The shipped targets are small (9.7M T5, 2.2M GPT-like), so on a CPU a
verification block costs several target steps and speculation barely pays:
the regime the paper is *not* about. Here the trained target is embedded
function-preservingly in a large shape (`families.widen`: T5 1.1 base, GPT-2
medium, ...): the same function (greedy outputs identical, logits within
float rounding), the large model's weights read at every step. The drafts are
the shipped ones: model drafts unchanged (their own small cost), feature and
Medusa heads grown with the target (they read its features; their cost is a
large layer's). Acceptance is the real trained pair's.

  scaled = scale_pair(load_demo_pair("decoder_only"), "gpt2_medium")
  scaled.target, scaled.drafts["feature"], scaled.needed_bytes

The embedding is built once and cached on disk, keyed by everything it
depends on (the shipped weights, the shape, dtype, kernel layout and this
module's format), so a second run reads it back; a corrupted cache file is
rebuilt with a warning. The bytes it needs are computed (`jax.eval_shape`)
and checked against a budget before anything is allocated.
"""

import dataclasses
import hashlib
import json
import os
import re
import time
import warnings
import zlib
from typing import Any, Dict, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specdec_jax.drafts import as_draft
from specdec_jax.families import kernel_layout as layouts
from specdec_jax.families import widen
from specdec_jax.families.registry import family_of, is_model
from specdec_jax.results import atomic_writer, write_json_atomic

# Bump when what a cache file holds, or how it is built, changes.
CACHE_FORMAT = 2  # 2: bfloat16 (any ml_dtypes type) stored as its bit pattern
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "specdec_jax", "scaled_pairs")
DEFAULT_MEMORY_BUDGET = 4 * 1024 ** 3
# What the process holds besides the embedded arrays (the runtime, the small pair, caches).
PROCESS_OVERHEAD_BYTES = 600 * 1024 ** 2


class MemoryBudgetError(ValueError):
  """The scaled pair would not fit the memory budget (raised before allocating)."""


def embed_model(model, shape, dtype: Optional[str] = None):
  """`model` (any family with an embedding) in a larger `shape`: the same function at the
  large shape's cost. shape: a named config of the model's family, with optional
  overrides, or a config (`shape_config`)."""
  family = family_of(model)
  model = layouts.with_kernel_layout(model, "in_out")  # the growing rules read [in, out]
  large = shape_config(model, shape)
  if dtype is not None:
    large = large.replace(dtype=dtype)
  return family.model_type(large, family.embed_params(model.params, model.config, large))


def _grown_params(draft, small_target, large_config):
  """A shipped draft's own arrays grown for the embedded target (in_out), or None (the
  draft's protocol: `Draft.grown_params`)."""
  return as_draft(draft).grown_params(small_target, large_config)


def embed_draft(draft, small_target, large_target):
  """A shipped draft of `small_target`, fit to drive `large_target` (`embed_model`'s).

  Model drafts and tables are returned as they are (they read nothing of the
  target: their cost stays their own). Feature and Medusa heads are grown with
  the target: they read its (repeated) features and, shared, its LM head.
  """
  params = _grown_params(draft, small_target, large_target.config.replace(
      kernel_layout="in_out"))
  if params is None:
    return draft
  if large_target.config.kernel_layout != "in_out":
    params = layouts.transpose_kernels(params)
  params = jax.tree_util.tree_map(lambda x: x.astype(large_target.config.dtype), params)
  return as_draft(draft).with_grown_params(large_target, params)


@dataclasses.dataclass
class ScaledPair:
  """A demo pair's target embedded in a large shape, with its drafts fit to it.

  pair: the small `DemoPair` (tokenizer, held-out inputs, the small models).
  shape: the shape's name (or config repr); target: the embedded model.
  drafts: {name: draft} in the pair's order (model drafts as shipped, heads grown).
  needed_bytes: {'target', 'heads', 'total'} the embedding needs (total adds
    the process overhead; what the budget was checked against).
  cache_path: the cache file; from_cache: read back rather than built;
  seconds: time to build or read it.
  """
  pair: Any
  shape: str
  target: Any
  drafts: Dict[str, Any]
  needed_bytes: Dict[str, int]
  cache_path: str
  from_cache: bool
  seconds: float


def _nbytes(tree) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree_util.tree_leaves(tree)))


def _digest(tree) -> str:
  """sha256 over a tree's paths, shapes, dtypes and bytes."""
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    x = np.ascontiguousarray(np.asarray(x))
    h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype};".encode())
    h.update(x.tobytes())
  return h.hexdigest()


def _shape_name(shape) -> str:
  return shape if isinstance(shape, str) else "custom"


def shape_config(small_model, shape):
  """The large config of `shape` for `small_model` (unchecked against a budget).

  shape: a config; a named config of the model's family ('t5_1_1_base',
  'gpt2_medium': `Family.embedded_config`'s reading of it); or a named config
  with overrides, 'gpt2_medium:num_layers=12,emb_dim=1536,num_heads=24,mlp_dim=6144'
  (num_kv_heads follows num_heads at the small model's group size unless given).
  Raises EmbeddingError naming a field the shape cannot take.
  """
  family = family_of(small_model)
  config = small_model.config
  if not isinstance(shape, str):
    return family.embedded_config(config, shape)
  name, _, rest = shape.partition(":")
  large = family.embedded_config(config, name)
  if not rest:
    return large
  overrides: Dict[str, Any] = {}
  for item in rest.split(","):
    field, eq, value = item.partition("=")
    field = field.strip()
    if not eq or not hasattr(large, field):
      raise widen.EmbeddingError(f"shape {shape!r}: {item!r} is not field=value of a "
                                 f"{type(large).__name__}")
    try:
      overrides[field] = int(value)
    except ValueError as e:
      raise widen.EmbeddingError(f"shape {shape!r}: {field}={value!r} is not an integer") from e
  if "num_heads" in overrides and "num_kv_heads" not in overrides and hasattr(config,
                                                                              "num_kv_heads"):
    overrides["num_kv_heads"] = overrides["num_heads"] // (config.num_heads //
                                                           config.num_kv_heads)
  if "num_layers" in overrides and getattr(large, "layer_types", None) is not None:
    types = tuple(large.layer_types)
    overrides["layer_types"] = (types + (types[-1],) * overrides["num_layers"])[
        :overrides["num_layers"]]
  return family.embedded_config(config, large.replace(**overrides))


def plan(pair, shape, *, dtype: Optional[str] = None, kernel_layout: str = "out_in",
         memory_budget_bytes: Optional[int] = DEFAULT_MEMORY_BUDGET):
  """(large config, {name: grown head shapes}, needed_bytes): shapes only, nothing allocated.

  Raises MemoryBudgetError (the bytes needed and the fix) when the embedding would not fit
  `memory_budget_bytes` (None: no check), and EmbeddingError for a shape that cannot hold
  the pair's function.
  """
  family = family_of(pair.target)
  small = layouts.with_kernel_layout(pair.target, "in_out")
  large = shape_config(small, shape)
  if dtype is not None:
    large = large.replace(dtype=dtype)
  large = large.replace(kernel_layout=kernel_layout)
  target_shapes = jax.eval_shape(
      lambda p: family.embed_params(p, small.config, large.replace(kernel_layout="in_out")),
      small.params)
  heads = {}
  for name, draft in pair.drafts.items():
    grown = jax.eval_shape(lambda d=draft: _grown_params(
        d, small, large.replace(kernel_layout="in_out")))
    if grown is not None:
      heads[name] = grown
  itemsize = jnp.dtype(large.dtype).itemsize
  target_bytes = _nbytes(target_shapes) // 4 * itemsize  # built in float32, cast to dtype
  head_bytes = sum(_nbytes(h) // 4 * itemsize for h in heads.values())
  largest = max(int(np.prod(x.shape)) * 4 for x in jax.tree_util.tree_leaves(target_shapes))
  needed = dict(target=target_bytes, heads=head_bytes,
                total=target_bytes + head_bytes + largest + PROCESS_OVERHEAD_BYTES)
  if memory_budget_bytes is not None and needed["total"] > memory_budget_bytes:
    gb = 1024 ** 3
    raise MemoryBudgetError(
        f"the {pair.family} pair embedded at {_shape_name(shape)} needs "
        f"{needed['total'] / gb:.2f} GB ({needed['target']:,} bytes of target weights, "
        f"{needed['heads']:,} of grown heads, {largest:,} for the largest tensor while "
        f"building, {PROCESS_OVERHEAD_BYTES:,} for the process), more than the "
        f"{memory_budget_bytes / gb:.2f} GB budget: choose a smaller shape or raise the "
        f"budget (make demo MEMORY_GB=..., --memory_budget_gb)")
  return large, heads, needed


def cache_key(pair, shape, large_config) -> str:
  """sha256 of everything the embedding depends on."""
  parts = dict(format=CACHE_FORMAT, family=pair.family, shape=_shape_name(shape),
               config=repr(large_config), target=_digest(pair.target.params),
               heads={name: _digest(as_draft(d).params) for name, d in pair.drafts.items()
                      if not is_model(d)})
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _file_checksum(path: str) -> int:
  crc = 1
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(64 * 1024 ** 2), b""):
      crc = zlib.adler32(chunk, crc)
  return crc


def _storable(x: np.ndarray) -> np.ndarray:
  """x as .npz can read it back: numpy knows no bfloat16 (ml_dtypes' types load as
  void, '|V2'), so such an array is stored as its bit pattern, unsigned of its width."""
  if x.dtype.kind == "V" or x.dtype.type.__module__.startswith("ml_dtypes"):
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))
  return x


def _restored(x: np.ndarray, dtype) -> np.ndarray:
  """The inverse of `_storable` for an array that should be `dtype`."""
  dtype = np.dtype(dtype)
  if x.dtype != dtype and x.dtype.kind == "u" and x.dtype.itemsize == dtype.itemsize:
    return x.view(dtype)
  return x


def _write_cache(path: str, key: str, arrays: Dict[str, Any]) -> None:
  """arrays {group/path: array} to path (.npz, streamed, atomic), then its manifest (.json):
  a cache entry is complete when its manifest exists and matches."""
  with atomic_writer(path) as f:
    np.savez(f, **{name: _storable(np.asarray(x)) for name, x in arrays.items()})
  write_json_atomic(path + ".json", dict(key=key, checksum=_file_checksum(path),
                                          bytes=os.path.getsize(path),
                                          arrays=sorted(arrays)))


def _read_cache(path: str, key: str, expected: Dict[str, Any]) -> Optional[Dict[str, Any]]:
  """The cached arrays, or None when absent; a present but unusable entry warns and gives
  None (rebuilt by the caller)."""
  manifest = path + ".json"
  if not (os.path.exists(path) and os.path.exists(manifest)):
    return None
  try:
    with open(manifest) as f:
      info = json.load(f)
    if info.get("key") != key:
      raise ValueError("its key does not match this pair's inputs")
    if os.path.getsize(path) != info["bytes"] or _file_checksum(path) != info["checksum"]:
      raise ValueError("its checksum does not match its manifest")
    out = {}
    with np.load(path) as npz:
      if sorted(npz.files) != sorted(expected):
        raise ValueError("it holds other arrays than this pair needs")
      for name, want in expected.items():
        x = _restored(npz[name], want.dtype)
        if x.shape != tuple(want.shape) or x.dtype != np.dtype(want.dtype):
          raise ValueError(f"{name} is {x.dtype}{list(x.shape)}, expected "
                           f"{np.dtype(want.dtype)}{list(want.shape)}")
        out[name] = jnp.asarray(x)
        del x
    return out
  except Exception as e:  # noqa: BLE001 -- any unreadable entry is rebuilt, never trusted
    warnings.warn(f"the scaled-pair cache {path} is unusable ({type(e).__name__}: {e}); "
                  "rebuilding it", stacklevel=3)
    for stale in (path, manifest):
      if os.path.exists(stale):
        os.remove(stale)
    return None


def _flat(tree) -> Dict[str, Any]:
  return traverse_util.flatten_dict(tree, sep="/")


def _build(pair, large_config, heads) -> Dict[str, Any]:
  """{group/path: array} of the embedded target and grown heads, in large_config's layout
  and dtype, built tensor by tensor (each float32 copy dropped as soon as it is cast)."""
  family = family_of(pair.target)
  small = layouts.with_kernel_layout(pair.target, "in_out")
  in_out = large_config.replace(kernel_layout="in_out")
  dtype = jnp.dtype(large_config.dtype)
  transpose = large_config.kernel_layout == "out_in"
  out: Dict[str, Any] = {}

  def take(group, tree):
    flat = _flat(tree)
    del tree
    for path in list(flat):
      x = flat.pop(path)
      if transpose and path.split("/")[-1] == "kernel" and x.ndim == 2:
        x = x.T
      out[f"{group}/{path}"] = jnp.asarray(x, dtype)
      del x

  take("target", family.embed_params(small.params, small.config, in_out))
  for name in heads:
    take(name, _grown_params(pair.drafts[name], small, in_out))
  return out


def scale_pair(pair, shape: Union[str, Any], *, dtype: Optional[str] = None,
               kernel_layout: str = "out_in", cache_dir: Optional[str] = None,
               memory_budget_bytes: Optional[int] = DEFAULT_MEMORY_BUDGET,
               log=print) -> ScaledPair:
  """`pair` embedded at `shape` (see the module docstring), from the cache when it holds it.

  Args:
    pair: a loaded `DemoPair` (either family).
    shape: a named config of the pair's family ('t5_1_1_base', 'gpt2_medium') or a config.
    dtype: the large model's dtype (default: the pair's).
    kernel_layout: 'out_in' (the fast CPU dot, default) or 'in_out'
      (`families.kernel_layout`); the function is the same.
    cache_dir: where cache entries live (default ~/.cache/specdec_jax/scaled_pairs, or
      $SPECDEC_JAX_SCALED_CACHE).
    memory_budget_bytes: checked before anything is allocated (None: unchecked).
    log: where progress lines go (None: silent).
  """
  start = time.perf_counter()
  large, heads, needed = plan(pair, shape, dtype=dtype, kernel_layout=kernel_layout,
                              memory_budget_bytes=memory_budget_bytes)
  cache_dir = cache_dir or os.environ.get("SPECDEC_JAX_SCALED_CACHE") or DEFAULT_CACHE_DIR
  key = cache_key(pair, shape, large)
  stem = f"{pair.family}-" + "".join(ch if ch.isalnum() or ch in "_." else "-"
                                     for ch in _shape_name(shape))
  path = os.path.join(cache_dir, f"{stem}-{key[:16]}.npz")
  small = layouts.with_kernel_layout(pair.target, "in_out")
  family = family_of(pair.target)
  expected = {f"target/{p}": x for p, x in _flat(jax.eval_shape(
      lambda q: family.embed_params(q, small.config, large.replace(kernel_layout="in_out")),
      small.params)).items()}
  for name, tree in heads.items():
    expected.update({f"{name}/{p}": x for p, x in _flat(tree).items()})
  dtype_ = jnp.dtype(large.dtype)
  transpose = large.kernel_layout == "out_in"
  expected = {n: jax.ShapeDtypeStruct(
      tuple(reversed(x.shape)) if transpose and n.endswith("/kernel") and len(x.shape) == 2
      else x.shape, dtype_) for n, x in expected.items()}

  arrays = _read_cache(path, key, expected)
  from_cache = arrays is not None
  if not from_cache:
    if log:
      log(f"building the {pair.family} pair at {_shape_name(shape)} "
          f"({needed['target'] / 1024 ** 3:.2f} GB of target weights); cached in {path}")
    arrays = _build(pair, large, heads)
    stale = re.compile(re.escape(stem) + r"-[0-9a-f]{16}\.npz(\.json)?")
    for old in os.listdir(cache_dir) if os.path.isdir(cache_dir) else []:
      if stale.fullmatch(old) and not old.startswith(os.path.basename(path)):
        os.remove(os.path.join(cache_dir, old))  # this pair and shape, inputs that changed
    _write_cache(path, key, arrays)

  groups: Dict[str, Dict[str, Any]] = {}
  for name in list(arrays):
    group, rest = name.split("/", 1)
    groups.setdefault(group, {})[rest] = arrays.pop(name)
  target = family.model_type(large, traverse_util.unflatten_dict(groups.pop("target"), sep="/"))
  drafts = {}
  for name, draft in pair.drafts.items():
    if name in groups:
      drafts[name] = as_draft(draft).with_grown_params(
          target, traverse_util.unflatten_dict(groups.pop(name), sep="/"))
    else:
      drafts[name] = draft
  return ScaledPair(pair=pair, shape=_shape_name(shape), target=target, drafts=drafts,
                    needed_bytes=needed, cache_path=path, from_cache=from_cache,
                    seconds=time.perf_counter() - start)
