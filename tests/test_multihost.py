"""Multi-host: two `jax.distributed` processes x 4 CPU devices on localhost.

T5X's model: every process runs the same program, inputs are made global
from host-local data, each process feeds only its own devices. One
reference process with 8 CPU devices decodes unsharded and on the 8-device
meshes; two processes with 4 devices each decode on the same meshes spanning
both (tests/multihost_worker.py), with per-host rows (each process passes
only its half: `generate(..., process_local=True)`) and, greedy, once more
with the whole batch on every process. All run at once. The outputs must be
equal, for T5 (mesh 1,8: the model axis crosses the hosts, the batch is
replicated, so the rows are gathered before placement) and decoder-only
(mesh 4,2: the batch crosses the hosts, each process's rows go straight onto
its devices), greedy and sampled with one key; and a checkpoint loaded on the
1,8 mesh, safetensors or Orbax, must have been read by each process only in
its own devices' slices.

The launcher (experiments.run) also runs on the two processes with per-host
input on a text prompt file, and must give the reference's completions.

Runtime (`make test-multihost`, under nice, on the shared 2-core machine):
54 s before per-host rows at load ~2; back to back against the previous
version, 143 s vs 122 s at load ~4-5 (165 s vs 138 s at ~7). What costs: the
launcher's extra programs (target-only at widths 4 and 1, three timing
blocks; its speculative decode reuses the per-host program) and the Orbax
load. Each process's log (its steps' wall times) is
kept in the output directory.
"""

import collections
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from specdec_jax import loading
from specdec_jax.families import tensor_io
from specdec_jax.families.t5 import checkpoints as t5_checkpoints
from specdec_jax import text
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.registry import family_of
from specdec_jax.core.outputs import sequence_lengths
from specdec_jax.tools.testing import random_encoder_tokens, tiny_pair

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "multihost_worker.py")
# One layer per stack; every dimension a mesh axis shards divides 8.
T5_TINY = dict(vocab_size=64, num_heads=8, head_dim=8, emb_dim=32, mlp_dim=64,
               num_encoder_layers=1, num_decoder_layers=1)
CHEAP_COMPILES = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TIMEOUT_S = 240


LAUNCHER_PROMPTS = ["the cat sat on", "hello world", "a quick brown fox", "the dog sat",
                    "hello again", "the other model"]


def _bpe_tokenizer(path):
  """A BPE tokenizer.json of at most 96 ids (<pad> 0, <s> 1, </s> 2 = llama_tiny's EOS)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.train_from_iterator(LAUNCHER_PROMPTS * 4 + ["the lazy dog jumps over the log"], trainers.BpeTrainer(
      vocab_size=90, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False))
  tok.save(str(path))
  return tok


def _decoder_only_pair():
  base = loading.load_model("llama_tiny", vocab_size=96, num_layers=1, seed=1, dtype="float32")
  # Scaled weights: confident, non-tied logits, so greedy agreement is not luck.
  target = DecoderOnlyModel(base.config, jax.tree_util.tree_map(
      lambda x: x * 5.0 if x.ndim == 2 else x, base.params))
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  draft = DecoderOnlyModel(target.config, jax.tree_util.tree_unflatten(
      treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
  return target, draft


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  directory = tmp_path_factory.mktemp("multihost_ckpt")
  t5_target, t5_draft = tiny_pair(noise=0.1, **T5_TINY)
  do_target, do_draft = _decoder_only_pair()
  for name, model in (("t5_target", t5_target), ("t5_draft", t5_draft),
                      ("decoder_only_target", do_target), ("decoder_only_draft", do_draft)):
    loading.export_hf(model, str(directory / name))
  t5_checkpoints.save_model(t5_target, str(directory / "t5_target_orbax"))  # Orbax
  # Text prompts and a BPE tokenizer: the decoder-only batch is the 6 prompts
  # tokenized, padded to 8 rows with the last (as the launcher batches them),
  # so the launcher's speculative decode is that batch's (and its program).
  tokenizer = _bpe_tokenizer(directory / "decoder_only_target" / "tokenizer.json")
  (directory / "prompts.jsonl").write_text("".join(
      json.dumps({"inputs": p}) + "\n" for p in LAUNCHER_PROMPTS))
  rows = [tokenizer.encode(p).ids for p in LAUNCHER_PROMPTS]
  rows += [rows[-1]] * (8 - len(rows))
  tokens, lengths = family_of(do_target).text_inputs(do_target.config, rows, 7)
  np.savez(directory / "inputs.npz",
           t5_tokens=np.asarray(random_encoder_tokens(8, 8, 64, seed=3)),
           decoder_only_tokens=tokens, decoder_only_lengths=lengths)
  return directory


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
  """Runs the reference and the two workers at once; returns their output directory."""
  out = tmp_path_factory.mktemp("multihost_out")
  address = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)

  def log_file(name):
    return out / f"{name.replace(' ', '_')}.log"

  def start(name, mode, devices, *extra):
    env_i = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                f"{CHEAP_COMPILES}")
    # Each worker's output goes to its own file (each step's wall time, for when
    # this gets slow), not a pipe: a pipe nobody drains while the test waits on
    # another process would block a worker that logs much (JAX_LOG_COMPILES).
    with open(log_file(name), "w") as log:
      return subprocess.Popen([sys.executable, WORKER, str(checkpoints), str(out), mode, *extra],
                              cwd=REPO, env=env_i, stdout=log, stderr=subprocess.STDOUT)

  procs = {"reference": start("reference", "reference", 8)}
  for i in range(2):
    procs[f"process {i}"] = start(f"process {i}", "multihost", 4, address, "2", str(i))
  failed = []
  try:
    for name, proc in procs.items():
      proc.wait(timeout=TIMEOUT_S)
      if proc.returncode:
        failed.append(name)
  finally:
    for proc in procs.values():  # Only the processes this test started.
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  assert not failed, "\n\n".join(f"{name} (rc {procs[name].returncode}):\n"
                                 f"{log_file(name).read_text()[-4000:]}" for name in failed)
  return out


def _outputs(runs, name):
  with np.load(runs / f"{name}.npz") as f:
    return dict(f)


@pytest.mark.parametrize("family", ["t5", "decoder_only"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_two_processes_decode_like_one_and_like_unsharded(runs, family, mode):
  reference = _outputs(runs, "reference_0")
  processes = [_outputs(runs, f"multihost_{process}") for process in (0, 1)]
  for field in ("sequences", "accepted"):
    want = reference[f"unsharded/{family}/{mode}/{field}"]
    np.testing.assert_array_equal(reference[f"sharded/{family}/{mode}/{field}"], want)
    for got in processes:  # The whole batch on every process (greedy): whole outputs.
      if mode == "greedy":
        np.testing.assert_array_equal(got[f"sharded/{family}/{mode}/{field}"], want)
    # Per-host rows: process p passed rows [4p, 4p + 4) and got those rows back.
    np.testing.assert_array_equal(processes[0][f"perhost/{family}/{mode}/{field}"], want[:4])
    np.testing.assert_array_equal(processes[1][f"perhost/{family}/{mode}/{field}"], want[4:])
  # Both placements ran: T5's replicated batch gathered, decoder-only's direct.
  for got in processes:
    assert bool(got[f"perhost/{family}/direct"]) == (family == "decoder_only")
  accepted = reference[f"unsharded/{family}/{mode}/accepted"]
  steps = reference[f"unsharded/{family}/{mode}/sequences"].shape[1]
  # The draft disagrees sometimes: both branches of the rejection rule ran.
  assert 0 < accepted.sum() < accepted.size * steps


def _cells(boxes):
  """Set of (start, stop) boxes -> the element count they cover (boxes are disjoint)."""
  return sum(int(np.prod([b - a for a, b in box])) for box in boxes)


@pytest.mark.parametrize("family", ["t5", "decoder_only"])
def test_each_process_reads_only_its_own_slices(runs, checkpoints, family):
  directory = f"{family}_target"
  tensors = tensor_io.hf_weight_files(str(checkpoints / directory))
  sizes = {name: int(np.prod(t.shape)) for name, t in tensors.items()}
  halves = 0
  for process in (0, 1):
    with open(runs / f"reads_multihost_{process}.json") as f:
      record = json.load(f)
    reads = [r for r in record["reads"]["blocks"] if r["file"] == directory]
    # No tensor of this checkpoint was read whole: only blocks.
    assert not [r for r in record["reads"]["whole"] if r["file"] == directory]
    by_tensor = {}
    for r in reads:
      by_tensor.setdefault(r["tensor"], []).append(tuple(map(tuple, r["index"])))
    # Every tensor the model uses (the file may hold ignored duplicates).
    assert set(by_tensor) <= set(tensors) and len(by_tensor) == len(record["shards"][family])
    # Each block once (replicated devices share one read), and no more
    # elements than this process's devices hold: the sum over tensors of the
    # distinct blocks this process's shards need (in our layout; the stored
    # tensor may be the transpose).
    for blocks in by_tensor.values():
      assert len(blocks) == len(set(blocks))
    read_elements = sum(_cells(set(b)) for b in by_tensor.values())
    held_elements = sum(_cells({tuple(map(tuple, s)) for s in boxes})
                        for boxes in record["shards"][family].values())
    assert read_elements == held_elements
    assert read_elements < sum(sizes[name] for name in by_tensor)
    halves += sum(1 for name, blocks in by_tensor.items()
                  if _cells(set(blocks)) * 2 == sizes[name])
  # The model-sharded tensors (most of them) were read half by each process.
  assert halves >= len(by_tensor)


def test_launcher_per_host_rows_like_one_process(runs, checkpoints):
  """experiments.run on the two processes (mesh 4,2, one batch of 8: the 6
  prompts and 2 repeats of the last), each parsing only its own lines of the
  prompt file, gives the completions of the reference's single-process and
  unsharded greedy decode of the same batch; only process 0 writes results."""
  tokenizer = text.checkpoint_tokenizer(str(checkpoints / "decoder_only_target"), None)
  reference = _outputs(runs, "reference_0")
  eos = loading.load_model(str(checkpoints / "decoder_only_target")).config.eos_id
  want = {}
  for run in ("unsharded", "sharded"):
    sequences = reference[f"{run}/decoder_only/greedy/sequences"]
    lengths = np.asarray(sequence_lengths(sequences, eos))
    want[run] = text.decode_rows(tokenizer, sequences, lengths, eos)[:len(LAUNCHER_PROMPTS)]
  assert want["sharded"] == want["unsharded"] and any(want["unsharded"])
  for process in (0, 1):
    with open(runs / f"launcher_multihost_{process}.json") as f:
      record = json.load(f)
    # Process 0 fed rows 0-3 of the batch, process 1 rows 4-7 (examples 4, 5, 5, 5).
    assert record["parsed"] == [[[0, 1, 2, 3]], [[4, 5, 5, 5]]][process]
    result = record["result"]
    assert result["per_host_input"] and result["processes"] == 2
    assert result["identical_outputs"] is True
    assert [c["input"] for c in result["completions"]] == LAUNCHER_PROMPTS
    assert [c["speculative"] for c in result["completions"]] == want["unsharded"]
    assert [c["baseline"] for c in result["completions"]] == want["unsharded"]
  written = json.loads((runs / "launcher_multihost_0" / "results.json").read_text())
  assert written["completions"] == result["completions"]
  assert not (runs / "launcher_multihost_1" / "results.json").exists()


def test_orbax_load_reads_only_each_process_shards(runs):
  """The Orbax T5 target restored into the 1,8 shardings: each process asked
  TensorStore exactly for the distinct blocks its devices hold, each once (its
  shards equal the safetensors load's: checked in the worker)."""
  for process in (0, 1):
    with open(runs / f"reads_multihost_{process}.json") as f:
      record = json.load(f)
    held, shapes = record["shards"]["orbax"], record["shapes"]["orbax"]
    want = collections.Counter(
        (tuple(shapes[name]), box) for name, boxes in held.items()
        for box in {tuple(map(tuple, b)) for b in boxes})
    got = collections.Counter((tuple(r["shape"]), tuple(map(tuple, r["index"])))
                              for r in record["reads"]["orbax"])
    assert got == want
    read_elements = sum(_cells([box]) * n for (_, box), n in got.items())
    whole_elements = sum(int(np.prod(shape)) for shape in shapes.values())
    # The model-sharded tensors (most of the elements) were read half.
    assert read_elements < 0.75 * whole_elements, (read_elements, whole_elements)
    halves = sum(1 for name, boxes in held.items()
                 if _cells({tuple(map(tuple, b)) for b in boxes}) * 2 == np.prod(shapes[name]))
    assert halves >= len(held) // 2


@pytest.mark.parametrize("name", ["tiny", "llama_tiny", "gpt2_tiny"])
def test_block_reads_equal_slices_of_whole_reads(tmp_path, name):
  """Every family's lazy views (transposed, GPT-2's fused q/k/v split) read blocks
  equal to slices of the whole tensor, in a single process."""
  from specdec_jax.families.registry import family_of
  model = loading.load_model(name, seed=3, dtype="float32")
  loading.export_hf(model, str(tmp_path))
  family = family_of(model)
  placed = {}

  def place(key, view):
    whole = np.asarray(view)
    assert whole.shape == view.shape and whole.dtype == view.dtype
    rng = np.random.RandomState(len(placed))
    for _ in range(3):
      index = []
      for size in view.shape:
        start = rng.randint(0, size)
        index.append(slice(start, rng.randint(start + 1, size + 1)))
      np.testing.assert_array_equal(view[tuple(index)], whole[tuple(index)])
    placed[key] = whole
    return jax.device_put(whole)

  loaded = family.load(str(tmp_path), dtype="float32", place=place)
  assert len(placed) == len(jax.tree_util.tree_leaves(model.params))
  for got, want in zip(jax.tree_util.tree_leaves(loaded.params),
                       jax.tree_util.tree_leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
