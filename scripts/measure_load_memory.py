"""Measures peak host memory while loading a large random checkpoint.

Writes a random Hugging Face directory (sharded safetensors + index, streamed
one tensor at a time) for a named config, then loads it in a fresh child
process and reports the child's peak RSS (VmHWM) above its RSS right before
loading (after imports), next to the size of the loaded params.

  python scripts/measure_load_memory.py --config=t5_1_1_large --file_dtype=float32 \
      --load_dtype=bfloat16 --workdir=/tmp/measure_load
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags
import numpy as np

_CONFIG = flags.DEFINE_string("config", "t5_1_1_large", "Named T5 config to shape the checkpoint.")
_FILE_DTYPE = flags.DEFINE_enum("file_dtype", "float32", ["float32", "bfloat16"],
                                "dtype of the tensors in the written files.")
_LOAD_DTYPE = flags.DEFINE_enum("load_dtype", "bfloat16", ["float32", "bfloat16"],
                                "dtype requested from the loader.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/measure_load", "Where the checkpoint is written.")
_SHARD_BYTES = flags.DEFINE_integer("shard_bytes", 2 << 30, "Bytes per safetensors shard.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the written checkpoint.")
_CHILD = flags.DEFINE_string("child", None, "Internal: load this directory and report memory.")


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"{field} not in /proc/self/status")


def _child(directory: str, dtype: str) -> None:
  import time
  import jax
  from specdec_jax.families.t5 import checkpoints
  before = _status_kib("VmRSS")
  start = time.time()
  model = checkpoints.load_checkpoint_model(directory, dtype=dtype)
  jax.block_until_ready(model.params)
  seconds = time.time() - start
  peak = _status_kib("VmHWM")
  params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
  print(json.dumps(dict(rss_before_gib=before / 2**20, peak_rss_gib=peak / 2**20,
                        peak_delta_gib=(peak - before) / 2**20,
                        params_gib=params_bytes / 2**30, load_seconds=seconds,
                        num_params=model.config.num_params)))


def _write_random_hf(directory: str, config, file_dtype, shard_bytes: int) -> int:
  """Streams a random HF checkpoint of `config`; returns its size in bytes."""
  from specdec_jax.families.t5 import checkpoints
  os.makedirs(directory, exist_ok=True)
  dtype = np.dtype(file_dtype)
  layout = checkpoints.hf_tensor_layout(config)
  shards, current, size = [], [], 0
  for name, (_, shape, _) in layout.items():
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if current and size + nbytes > shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape))
    size += nbytes
  shards.append(current)
  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    entries = []
    for j, (name, shape) in enumerate(shard):
      def make(shape=shape, seed=hash((i, j)) % 2**32):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal(shape, np.float32) * 0.05).astype(dtype)
      entries.append((name, shape, dtype, make))
      weight_map[name] = filename
    checkpoints.write_safetensors(os.path.join(directory, filename), entries, {"format": "pt"})
    total += os.path.getsize(os.path.join(directory, filename))
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(checkpoints.t5config_to_hf_config(config), f)
  return total


def main(argv):
  del argv
  if _CHILD.value:
    _child(_CHILD.value, _LOAD_DTYPE.value)
    return
  import ml_dtypes
  from specdec_jax.families.t5.config import get_config
  config = get_config(_CONFIG.value)
  file_dtype = ml_dtypes.bfloat16 if _FILE_DTYPE.value == "bfloat16" else np.float32
  directory = os.path.join(_WORKDIR.value, f"{_CONFIG.value}_{_FILE_DTYPE.value}")
  if not os.path.exists(os.path.join(directory, "config.json")):
    size = _write_random_hf(directory, config, file_dtype, _SHARD_BYTES.value)
  else:
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
  out = subprocess.run([sys.executable, __file__, f"--child={directory}",
                        f"--load_dtype={_LOAD_DTYPE.value}"],
                       capture_output=True, text=True, check=False,
                       env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
  if out.returncode != 0:
    raise RuntimeError(out.stderr[-3000:])
  result = json.loads(out.stdout.strip().splitlines()[-1])
  result.update(config=_CONFIG.value, file_dtype=_FILE_DTYPE.value,
                load_dtype=_LOAD_DTYPE.value, checkpoint_gib=size / 2**30,
                peak_over_params=result["peak_delta_gib"] / result["params_gib"])
  print(json.dumps(result, indent=1))
  if not _KEEP.value:
    import shutil
    shutil.rmtree(directory)


if __name__ == "__main__":
  app.run(main)
