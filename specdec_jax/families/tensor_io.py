"""Family-neutral checkpoint tensor IO: lazy tensors, the safetensors / torch readers, the writer.

Every family's checkpoint module builds on these: `hf_weight_files(directory)`
lists a Hugging Face directory's tensors (single or sharded safetensors,
`pytorch_model.bin`) as lazy `Tensor`s, each read from disk only when the
loader asks, so a loader holds one tensor in host memory at a time;
`cast` makes the C-contiguous copy in the model's dtype (transposed, scaled);
`write_safetensors` streams tensors into a file one at a time. Nothing here
knows a model family: tensor names and layouts are the families' business.

Sharded loading reads less: `Tensor.block(index, dtype)` reads one
rectangular block (a device's shard) from the file, and `TensorView` is the
lazy array-like a loader hands to its `place` callback, so
`jax.make_array_from_callback` pulls from disk only the shards of the
devices this process owns (on several hosts: only this host's slices).
"""

import dataclasses
import json
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

Index = Tuple[slice, ...]

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
  """A checkpoint that cannot be loaded: the message names the file or keys."""


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a checkpoint, not yet read.

  Attributes:
    source: where it lives, for error messages ("model.safetensors: shared.weight").
    shape: its shape in the layout `read` returns (a family's view may transpose or
      split the stored tensor).
    read: dtype -> np.ndarray of `shape` in that dtype (reads the file now).
    read_block: (index, dtype) -> the block `read(dtype)[index]`, reading only
      that block's elements from the file; `index` is one `slice(start, stop)`
      per dimension, bounds resolved. None: the format can only be read whole.
  """
  source: str
  shape: Tuple[int, ...]
  read: Callable[[np.dtype], np.ndarray]
  read_block: Optional[Callable[[Index, np.dtype], np.ndarray]] = None

  def block(self, index, dtype) -> np.ndarray:
    """`read(dtype)[index]` for a tuple of slices (as `make_array_from_callback`
    passes), reading only the block where the format allows it."""
    index = resolve_index(index, self.shape)
    if self.read_block is None:
      return np.ascontiguousarray(self.read(dtype)[index])
    out = self.read_block(index, dtype)
    want = tuple(s.stop - s.start for s in index)
    if out.shape != want:  # A reader bug, not bad input.
      raise AssertionError(f"{self.source}: block {index} read as shape {out.shape}, not {want}")
    return out


def resolve_index(index, shape) -> Index:
  """A tuple of step-1 slices with explicit bounds, one per dimension."""
  index = tuple(index) if isinstance(index, tuple) else (index,)
  if len(index) > len(shape):
    raise IndexError(f"index {index} has more entries than shape {shape}")
  index = index + (slice(None),) * (len(shape) - len(index))
  out = []
  for entry, size in zip(index, shape):
    if not isinstance(entry, slice):
      raise TypeError(f"block reads take slices, got {entry!r}")
    start, stop, step = entry.indices(size)
    if step != 1:
      raise ValueError(f"block reads take step-1 slices, got {entry!r}")
    out.append(slice(start, max(start, stop)))
  return tuple(out)


def transposed_block(stored: Tensor, index: Index) -> np.ndarray:
  """Block `index` of stored.T, read in the stored layout (stored dtype)."""
  return stored.block(tuple(reversed(index)), None).T


class TensorView:
  """A `Tensor` as the lazy array a loader's `place` callback receives.

  `view[index]` reads that block (memoised: replicated devices ask for the same
  block, and it is read once); `np.asarray(view)` reads the whole tensor.
  Dropped after placement, so at most one tensor's blocks are held at a time.
  """

  def __init__(self, tensor: Tensor, dtype):
    self.tensor = tensor
    self.dtype = np.dtype(dtype)
    self.shape = tuple(tensor.shape)
    self.ndim = len(self.shape)
    self._blocks: Dict[Tuple[Tuple[int, int], ...], np.ndarray] = {}

  def __getitem__(self, index) -> np.ndarray:
    index = resolve_index(index, self.shape)
    key = tuple((s.start, s.stop) for s in index)
    if key not in self._blocks:
      self._blocks[key] = cast(self.tensor.block(index, None), self.dtype)
    return self._blocks[key]

  def __array__(self, dtype=None, copy=None):
    return self[()] if dtype is None else self[()].astype(dtype)


def cast(array: np.ndarray, dtype, transpose: bool = False, scale: Optional[float] = None):
  """One C-contiguous copy of `array` (transposed, scaled) in `dtype`."""
  if transpose:
    array = array.T
  if scale is not None:
    array = array.astype(np.float32) * np.float32(scale)
  out = np.empty(array.shape, dtype)  # C order: copyto transposes and casts in one pass.
  np.copyto(out, array, casting="unsafe")
  return out


# ----------------------------------------------------------------------------
# Hugging Face weight files.

def read_config_json(directory: str, what: str, holds: str) -> Dict[str, Any]:
  """A checkpoint directory's config.json as a dict; a CheckpointError names what is wrong
  (no directory, no config.json, unreadable JSON). what: 'an EAGLE head directory';
  holds: the files such a directory holds, for the message."""
  path = os.path.join(directory, "config.json")
  if not os.path.isdir(directory):
    raise CheckpointError(f"{directory}: no such directory ({what} holds {holds})")
  if not os.path.exists(path):
    raise CheckpointError(f"{directory}: not {what} (no config.json; found "
                          f"{sorted(os.listdir(directory))})")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: cannot read: {e}") from None


def hf_weight_files(directory: str, prefer: str = "safetensors") -> Dict[str, Tensor]:
  """HF tensor name -> stored tensor (read(None) gives the stored dtype, HF layout).

  prefer: which files win where a directory holds several: 'safetensors'
    (transformers' order: the safetensors index, the .bin index,
    model.safetensors, pytorch_model.bin) or 'bin' (EAGLE's head loader:
    pytorch_model.bin, then model.safetensors; the indexes, which EAGLE does
    not read, last).
  """
  if prefer not in ("safetensors", "bin"):
    raise ValueError(f"prefer must be 'safetensors' or 'bin', got {prefer!r}")

  def path(name):
    return os.path.join(directory, name)

  order = ["model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors",
           "pytorch_model.bin"]
  if prefer == "bin":
    order = order[3:1:-1] + order[:2]
  for name in order:
    if not os.path.exists(path(name)):
      continue
    reader = safetensors_tensors if "safetensors" in name else torch_tensors
    if not name.endswith(".index.json"):
      return reader(path(name))
    try:
      with open(path(name)) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{path(name)}: not a weight index ({e})") from None
    tensors = {}
    for shard in sorted(set(weight_map.values())):
      if not os.path.exists(path(shard)):
        raise CheckpointError(f"{path(name)} names shard {shard}, which is missing")
      tensors.update(reader(path(shard)))
    absent = sorted(k for k, shard in weight_map.items() if k not in tensors)
    if absent:
      raise CheckpointError(f"{path(name)} lists tensors that its shards lack: {absent}")
    return tensors
  raise CheckpointError(
      f"{directory} has a config.json but no weights: expected model.safetensors, "
      f"model.safetensors.index.json (+ shards), pytorch_model.bin or pytorch_model.bin.index.json; "
      f"found {sorted(os.listdir(directory))}")


SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def safetensors_tensors(filename: str) -> Dict[str, Tensor]:
  """Parses a .safetensors header; each tensor is read from the file on demand.

  The format is an 8-byte little-endian header length, a JSON header
  {name: {dtype, shape, data_offsets: [begin, end]}}, then the raw bytes. Reading
  with plain file reads (not mmap) keeps resident memory to one tensor at a time.
  """
  size = os.path.getsize(filename)
  with open(filename, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise CheckpointError(f"{filename}: truncated safetensors file ({size} bytes)")
    header_len = int.from_bytes(prefix, "little")
    if header_len > size - 8:
      raise CheckpointError(f"{filename}: truncated or not a safetensors file (header of "
                            f"{header_len} bytes, file of {size})")
    try:
      header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CheckpointError(f"{filename}: unreadable safetensors header ({e})") from None
  header.pop("__metadata__", None)
  data_start = 8 + header_len
  tensors = {}
  for name, info in header.items():
    if info.get("dtype") not in SAFETENSORS_DTYPES:
      raise CheckpointError(f"{filename}: tensor {name} has unsupported dtype {info.get('dtype')}")
    stored = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
    shape = tuple(int(d) for d in info["shape"])
    begin, end = (int(x) for x in info["data_offsets"])
    if end - begin != int(np.prod(shape)) * stored.itemsize:
      raise CheckpointError(f"{filename}: tensor {name} has {end - begin} bytes for shape {shape}")
    if data_start + end > size:
      raise CheckpointError(f"{filename}: truncated: tensor {name} ends at byte "
                            f"{data_start + end}, the file has {size}")

    def read(dtype, stored=stored, shape=shape, offset=data_start + begin):
      array = np.fromfile(filename, dtype=stored, count=int(np.prod(shape)), offset=offset)
      array = array.reshape(shape)
      return array if dtype is None else np.asarray(array, dtype=dtype)

    def read_block(index, dtype, stored=stored, shape=shape, offset=data_start + begin,
                   name=name):
      block = read_safetensors_block(filename, name, stored, shape, offset, index)
      return block if dtype is None else np.asarray(block, dtype=dtype)

    tensors[name] = Tensor(f"{os.path.basename(filename)}: {name}", shape, read, read_block)
  return tensors


def read_safetensors_block(filename: str, name: str, stored: np.dtype, shape, offset: int,
                           index: Index) -> np.ndarray:
  """Copies block `index` of one stored tensor out of a memory map of the file.

  Only the pages holding the block's elements are read from disk (a
  leading-dimension slice is one contiguous range). Every sharded read of a
  safetensors checkpoint goes through here, so a test can record what each
  process read.
  """
  del name  # For recording only.
  if not shape or 0 in shape:
    return np.fromfile(filename, dtype=stored, count=int(np.prod(shape)),
                       offset=offset).reshape(shape)[index]
  mapped = np.memmap(filename, dtype=stored, mode="r", offset=offset, shape=tuple(shape))
  try:
    return np.array(mapped[index])
  finally:
    del mapped


def torch_tensors(filename: str) -> Dict[str, Tensor]:
  """pytorch_model.bin via torch.load(weights_only=True), memory-mapped when possible."""
  try:
    import torch
  except ImportError:
    raise CheckpointError(f"{filename}: reading pytorch_model.bin needs torch (pip install "
                          f"torch), or convert the directory to safetensors") from None
  try:
    state = torch.load(filename, map_location="cpu", weights_only=True, mmap=True)
  except RuntimeError:
    # Files in torch's legacy (non-zip) format cannot be memory-mapped.
    try:
      state = torch.load(filename, map_location="cpu", weights_only=True)
    except Exception as e:
      raise CheckpointError(f"{filename}: cannot load with torch.load(weights_only=True): "
                            f"{e}") from None
  except Exception as e:
    raise CheckpointError(f"{filename}: cannot load with torch.load(weights_only=True): "
                          f"{e}") from None
  if not isinstance(state, Mapping):
    raise CheckpointError(f"{filename}: holds a {type(state).__name__}, not a state dict")
  tensors = {}
  for name, value in state.items():
    if not isinstance(value, torch.Tensor):
      raise CheckpointError(f"{filename}: entry {name} is a {type(value).__name__}, not a tensor")

    def read(dtype, value=value):
      if value.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits.
        array = value.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
      else:
        array = value.contiguous().numpy()
      return array if dtype is None else np.asarray(array, dtype=dtype)

    def read_block(index, dtype, value=value):
      block = value[index]
      if block.dtype == torch.bfloat16:
        array = block.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
      else:
        array = block.contiguous().numpy()
      return array if dtype is None else np.asarray(array, dtype=dtype)

    tensors[name] = Tensor(f"{os.path.basename(filename)}: {name}", tuple(value.shape), read,
                           read_block)
  return tensors


def write_safetensors(filename: str, tensors: Sequence[Tuple[str, Tuple[int, ...], Any,
                                                             Callable[[], np.ndarray]]],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
  """Streams tensors into a .safetensors file, computing one array at a time.

  Args:
    filename: output path (written to a temp file, then renamed).
    tensors: (name, shape, numpy dtype, make_array) in file order; make_array()
      returns the array, called once, right before it is written.
    metadata: optional string -> string header metadata.
  """
  codes = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
  header, offset = {}, 0
  for name, shape, dtype, _ in tensors:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = dict(dtype=codes[np.dtype(dtype)], shape=list(shape),
                        data_offsets=[offset, offset + nbytes])
    offset += nbytes
  if metadata:
    header["__metadata__"] = dict(metadata)
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # Align the data to 8 bytes.
  tmp = filename + ".tmp"
  with open(tmp, "wb") as f:
    f.write(len(encoded).to_bytes(8, "little"))
    f.write(encoded)
    for name, shape, dtype, make_array in tensors:
      array = np.ascontiguousarray(make_array(), dtype=dtype)
      if array.shape != tuple(shape):
        raise ValueError(f"{name}: made shape {array.shape}, declared {tuple(shape)}")
      f.write(array.tobytes())
      del array
  os.replace(tmp, filename)


def write_json_atomic(path: str, record) -> None:
  from specdec_jax import results
  results.write_text_atomic(path, json.dumps(record, indent=2, sort_keys=True))


def raise_on_mismatch(header: str, missing: Sequence[str], unexpected: Sequence[str],
                      mismatched: Sequence[str]) -> None:
  """One CheckpointError listing every missing, unexpected and mis-shaped tensor, if any."""
  if not (missing or unexpected or mismatched):
    return
  lines = [header]
  for title, items in (("missing", missing), ("unexpected", unexpected),
                       ("shape mismatch", mismatched)):
    if items:
      lines.append(f"  {title} ({len(items)}):")
      lines.extend(f"    {item}" for item in items)
  raise CheckpointError("\n".join(lines))
