"""One process of tests/test_multihost.py (not a test module itself).

    python tests/multihost_worker.py CKPT_DIR OUT_DIR MODE [COORDINATOR PROCESSES PROCESS_ID]

MODE `reference` (one process, 8 CPU devices): decodes unsharded and on the
8-device meshes. MODE `multihost` (one of several processes under
`jax.distributed`, 4 CPU devices each): decodes on the same meshes spanning
every process. Both load the checkpoints in CKPT_DIR (written by the test)
with `load_sharded_model`, decode greedy and sampled for T5 and decoder-only,
and write OUT_DIR/<mode>_<process>.npz plus OUT_DIR/reads_<mode>_<process>.json:
every block each process read from the safetensors files, and every whole
tensor it read (np.fromfile), so the test can prove what each host touched.
"""

import json
import os
import sys

COMPARED = ("t5", "decoder_only")
T5_MESH, DECODER_MESH, LOAD_MESH = "1,8", "4,2", "1,8"
BATCH, STEPS, GAMMA = 8, 10, 3
SAMPLING = dict(temperature=0.9, topp=0.95)


def _log(message, start=[None]):
  import time
  now = time.perf_counter()
  start[0] = start[0] or now
  print(f"[{now - start[0]:7.2f} s] {message}", flush=True)


def main(argv):
  ckpt_dir, out_dir, mode = argv[1:4]
  _log(f"start {mode}")
  if mode == "multihost":
    from specdec_jax import sharding
    address, processes, process_id = argv[4], int(argv[5]), int(argv[6])
    # Before any other JAX call; bounded so a lost peer fails the test, not hangs it.
    sharding.initialize_distributed(address, processes, process_id, timeout_s=60)
  _log("initialized")
  import jax
  import numpy as np
  from specdec_jax import generate, loading, sharding
  from specdec_jax.families import tensor_io

  reads = {"blocks": [], "whole": []}
  read_block = tensor_io.read_safetensors_block

  def recording_block(filename, name, stored, shape, offset, index):
    reads["blocks"].append(dict(file=os.path.basename(os.path.dirname(filename)), tensor=name,
                                index=[[s.start, s.stop] for s in index]))
    return read_block(filename, name, stored, shape, offset, index)

  fromfile = np.fromfile

  def recording_fromfile(filename, *args, **kwargs):
    reads["whole"].append(dict(file=os.path.basename(os.path.dirname(str(filename))),
                               count=int(kwargs.get("count", -1))))
    return fromfile(filename, *args, **kwargs)

  tensor_io.read_safetensors_block = recording_block
  tensor_io.np.fromfile = recording_fromfile

  process = jax.process_index()
  expected_devices = 8 if mode == "reference" else 4
  assert jax.local_device_count() == expected_devices and jax.device_count() == 8, (
      jax.local_device_count(), jax.device_count())
  data = np.load(os.path.join(ckpt_dir, "inputs.npz"))
  out = {}

  # Loading: each process's view of every tensor, on a mesh whose model axis
  # spans the processes (each host holds half of each model-sharded tensor).
  load_part, _ = sharding.make_partitioners(LOAD_MESH)
  shards = {}
  for family in COMPARED:
    model = loading.load_sharded_model(os.path.join(ckpt_dir, family + "_target"), load_part)
    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    shards[family] = {jax.tree_util.keystr(path): sorted(
        [[s.start or 0, x.shape[d] if s.stop is None else s.stop]
         for d, s in enumerate(shard.index)] for shard in x.addressable_shards)
        for path, x in flat}
  _log("loaded")
  load_reads = {"blocks": list(reads["blocks"]), "whole": list(reads["whole"])}

  def decode(name, family, mesh_shape, **kwargs):
    target_dir = os.path.join(ckpt_dir, family + "_target")
    draft_dir = os.path.join(ckpt_dir, family + "_draft")
    lengths = data[family + "_lengths"] if family == "decoder_only" else None
    runs = []
    if mode == "reference":
      runs.append(("unsharded", loading.load_model(target_dir), loading.load_model(draft_dir),
                   None, None))
    target_part, draft_part = sharding.make_partitioners(mesh_shape)
    runs.append(("sharded", loading.load_sharded_model(target_dir, target_part),
                 loading.load_sharded_model(draft_dir, draft_part), target_part, draft_part))
    _log(f"{family} {name}: models loaded")
    for run, target, draft, target_part, draft_part in runs:
      result = generate(target, data[family + "_tokens"], lengths, max_decode_steps=STEPS,
                        draft=draft, gamma=GAMMA, eos_id=-1, partitioner=target_part,
                        draft_partitioner=draft_part, **kwargs)
      # Every process holds the whole, replicated outputs on its own device.
      assert result.sequences.is_fully_addressable
      out[f"{run}/{family}/{name}/sequences"] = np.asarray(result.sequences)
      out[f"{run}/{family}/{name}/accepted"] = np.asarray(result.stats.accepted)
      _log(f"{family} {name} {run}: decoded")

  for family, mesh_shape in (("t5", T5_MESH), ("decoder_only", DECODER_MESH)):
    decode("greedy", family, mesh_shape)
    decode("sampled", family, mesh_shape, rng=jax.random.PRNGKey(7), **SAMPLING)

  np.savez(os.path.join(out_dir, f"{mode}_{process}.npz"), **out)
  with open(os.path.join(out_dir, f"reads_{mode}_{process}.json"), "w") as f:
    json.dump(dict(reads=load_reads, shards=shards), f)
  if mode == "multihost":
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv)
