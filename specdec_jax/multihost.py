"""Several processes, one decode (T5X's model): every process runs the same program on the
same host data, feeds only its own devices, and one process writes.

`put` / `local_copy` move data across processes without copies, `global_batch`
joins per-host rows, `gather_rows` / `gather_texts` collect results for the
writer, and `assert_same_on_every_process` turns a silent mismatch between
processes into an error.
"""

from typing import Any, Dict, Mapping, Optional, Sequence

import jax
import numpy as np


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


def global_batch(partitioner, *local_arrays, check_shapes: bool = True):
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
