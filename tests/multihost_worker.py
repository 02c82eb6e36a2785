"""One process of tests/test_multihost.py (not a test module itself).

    python tests/multihost_worker.py CKPT_DIR OUT_DIR MODE [COORDINATOR PROCESSES PROCESS_ID]

MODE `reference` (one process, 8 CPU devices): decodes unsharded and on the
8-device meshes. MODE `multihost` (one of several processes under
`jax.distributed`, 4 CPU devices each): decodes on the same meshes spanning
every process, each process passing only its own rows (`perhost/...`,
`generate(..., process_local=True)`: its rows of the outputs) and, greedy
only, every process passing the whole batch (`sharded/...`, the whole outputs
on every process: the same compiled program). Both modes load the checkpoints in CKPT_DIR (written by the test)
with `load_sharded_model`, decode greedy and sampled for T5 and decoder-only,
and write OUT_DIR/<mode>_<process>.npz plus OUT_DIR/reads_<mode>_<process>.json:
every block each process read from the safetensors files, every whole
tensor it read (np.fromfile), and every index range Orbax asked TensorStore
for (the T5 target saved with `save_model`), so the test can prove what each
host touched.
"""

import json
import os
import sys

COMPARED = ("t5", "decoder_only")
T5_MESH, DECODER_MESH, LOAD_MESH = "1,8", "4,2", "1,8"
BATCH, STEPS, GAMMA = 8, 10, 3
SAMPLING = dict(temperature=0.9, topp=0.95)
# T5 never stops (every row runs all steps); decoder-only stops at its EOS, as
# the launcher's decode of the same batch does (so it reuses this program).
EOS = {"t5": -1, "decoder_only": None}


def _log(message, start=[None]):
  import time
  now = time.perf_counter()
  start[0] = start[0] or now
  print(f"[{now - start[0]:7.2f} s] {message}", flush=True)


def main(argv):
  ckpt_dir, out_dir, mode = argv[1:4]
  _log(f"start {mode}")
  if mode == "multihost":
    from specdec_jax import multihost
    address, processes, process_id = argv[4], int(argv[5]), int(argv[6])
    # Before any other JAX call; bounded so a lost peer fails the test, not hangs it.
    multihost.initialize_distributed(address, processes, process_id, timeout_s=60)
  _log("initialized")
  import jax
  import numpy as np
  from specdec_jax import generate, loading, multihost, sharding
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

  # Orbax reads each distinct addressable block through this coroutine (one
  # TensorStore read per block, placed on every device that holds it).
  from orbax.checkpoint._src.serialization import serialization as orbax_serialization
  orbax_read = orbax_serialization._read_array_index_and_device_put
  reads["orbax"] = []

  async def recording_orbax_read(devices, index, store, **kwargs):
    reads["orbax"].append(dict(shape=list(store.shape), index=[
        [s.start or 0, store.shape[d] if s.stop is None else s.stop]
        for d, s in enumerate(index)]))
    return await orbax_read(devices, index, store, **kwargs)

  orbax_serialization._read_array_index_and_device_put = recording_orbax_read

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

  def held_blocks(model):
    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    return {jax.tree_util.keystr(path): sorted(
        [[s.start or 0, x.shape[d] if s.stop is None else s.stop]
         for d, s in enumerate(shard.index)] for shard in x.addressable_shards)
        for path, x in flat}

  loaded = {}
  for family in COMPARED:
    loaded[family] = loading.load_sharded_model(os.path.join(ckpt_dir, family + "_target"),
                                                load_part)
    shards[family] = held_blocks(loaded[family])
  # The same T5 target as an Orbax checkpoint (save_model): restored into the
  # target shardings, each process's shards equal the safetensors load's.
  orbax_model = loading.load_sharded_model(os.path.join(ckpt_dir, "t5_target_orbax"), load_part)
  shards["orbax"] = held_blocks(orbax_model)
  shapes = {"orbax": {jax.tree_util.keystr(path): list(x.shape) for path, x in
                      jax.tree_util.tree_flatten_with_path(orbax_model.params)[0]}}
  for got, want in zip(jax.tree_util.tree_leaves(orbax_model.params),
                       jax.tree_util.tree_leaves(loaded["t5"].params)):
    assert got.sharding == want.sharding, (got.sharding, want.sharding)
    for a, b in zip(got.addressable_shards, want.addressable_shards):
      np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
  del loaded, orbax_model
  _log("loaded")
  load_reads = {k: list(v) for k, v in reads.items()}

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
    tokens = data[family + "_tokens"]
    _, target, draft, target_part, draft_part = runs[-1]
    if mode == "multihost" and name != "greedy":
      runs = []  # The whole batch on every process: greedy only (the same program).
    for run, run_target, run_draft, run_target_part, run_draft_part in runs:
      result = generate(run_target, tokens, lengths, max_decode_steps=STEPS,
                        draft=run_draft, gamma=GAMMA, eos_id=EOS[family],
                        partitioner=run_target_part, draft_partitioner=run_draft_part, **kwargs)
      # Every process holds the whole, replicated outputs on its own device.
      assert result.sequences.is_fully_addressable
      out[f"{run}/{family}/{name}/sequences"] = np.asarray(result.sequences)
      out[f"{run}/{family}/{name}/accepted"] = np.asarray(result.stats.accepted)
      _log(f"{family} {name} {run}: decoded")
    if mode == "multihost":
      # Per-host rows: this process's block of the batch only (the same
      # compiled program: the global arrays have the same shapes and shardings).
      rows = multihost.process_row_block(BATCH // jax.process_count())
      result = generate(target, tokens[rows], None if lengths is None else lengths[rows],
                        max_decode_steps=STEPS, draft=draft, gamma=GAMMA, eos_id=EOS[family],
                        partitioner=target_part, draft_partitioner=draft_part,
                        process_local=True, **kwargs)
      assert result.sequences.shape == (BATCH // jax.process_count(), STEPS)
      out[f"perhost/{family}/{name}/sequences"] = np.asarray(result.sequences)
      out[f"perhost/{family}/{name}/accepted"] = np.asarray(result.stats.accepted)
      # Which placement the rows took: straight onto this process's devices
      # (the batch split over processes) or gathered first (replicated batch).
      out[f"perhost/{family}/direct"] = np.asarray(multihost.blocks_match_devices(
          target_part.batch_sharding(tokens.shape), tokens.shape, BATCH // jax.process_count()))
      _log(f"{family} {name} perhost: decoded")

  for family, mesh_shape in (("t5", T5_MESH), ("decoder_only", DECODER_MESH)):
    decode("greedy", family, mesh_shape)
    decode("sampled", family, mesh_shape, rng=jax.random.PRNGKey(7), **SAMPLING)

  if mode == "multihost":
    launcher(ckpt_dir, out_dir, process)

  np.savez(os.path.join(out_dir, f"{mode}_{process}.npz"), **out)
  with open(os.path.join(out_dir, f"reads_{mode}_{process}.json"), "w") as f:
    json.dump(dict(reads=load_reads, shards=shards, shapes=shapes), f)
  if mode == "multihost":
    jax.distributed.shutdown()


def launcher(ckpt_dir, out_dir, process):
  """experiments.run on the decoder-only pair, text in and out, on the 4,2 mesh,
  each process parsing only its own lines (recorded: the indices each asked
  `tasks.load_local` for). The batch is the one decoded above (the fixture
  tokenized the same prompts), so the speculative program is reused; the
  reference's decode of that batch stands for the single-process run."""
  import gin
  from experiments import run as run_lib
  from specdec_jax import tasks
  parsed = []
  load_local = tasks.load_local

  def recording_load_local(*args, **kwargs):
    parsed.append(None if kwargs.get("indices") is None else list(kwargs["indices"]))
    return load_local(*args, **kwargs)

  tasks.load_local = recording_load_local
  output_dir = os.path.join(out_dir, f"launcher_multihost_{process}")
  os.makedirs(output_dir)
  run_lib.parse_gin(["configs/pairs/local.gin", "configs/tasks/local_file.gin"], [
      f"TARGET_CHECKPOINT = '{os.path.join(ckpt_dir, 'decoder_only_target')}'",
      f"DRAFT_CHECKPOINT = '{os.path.join(ckpt_dir, 'decoder_only_draft')}'",
      f"INPUT_FILE = '{os.path.join(ckpt_dir, 'prompts.jsonl')}'",
      "MAX_INPUT_LENGTH = 7", f"MAX_DECODE_STEPS = {STEPS}", f"GAMMA = {GAMMA}",
      f"BATCH_SIZE = {BATCH}", "Experiment.timing_repeats = 1"])
  try:
    result = run_lib.run_experiment(run_lib.Experiment(), output_dir, mesh_shape=DECODER_MESH)
  finally:
    gin.clear_config()
    tasks.load_local = load_local
  with open(os.path.join(out_dir, f"launcher_multihost_{process}.json"), "w") as f:
    json.dump(dict(result=result, parsed=parsed), f)
  _log("launcher: done")


if __name__ == "__main__":
  main(sys.argv)
