"""Against the real T5X code: its checkpoints, its models, its `t5x.infer` binary.

T5X is not on PyPI. These tests import it from SPECDEC_T5X_PATH (default
../shared/third_party beside the repository: unmodified T5X sources) in an
environment with the `t5x` extra (`make test-t5x` builds .venv-t5x and runs
them). Anywhere else they skip, saying why.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import flax
import pytest
from flax import serialization, traverse_util

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T5X_PATH = os.path.abspath(os.environ.get("SPECDEC_T5X_PATH",
                                          os.path.join(REPO, "..", "shared", "third_party")))


def _import_t5x():
  """Imports T5X from T5X_PATH, or skips the module with the reason."""
  if os.path.isdir(os.path.join(T5X_PATH, "t5x")) and T5X_PATH not in sys.path:
    sys.path.insert(0, T5X_PATH)
  from specdec_jax.t5x import model as t5x_model
  t5x_model.alias_jestimator_partition_spec()
  try:
    import t5x.checkpoints  # noqa: F401
    import t5x.models  # noqa: F401
  except ImportError as e:
    if T5X_PATH in sys.path:  # Leave the rest of the session as it was.
      sys.path.remove(T5X_PATH)
    pytest.skip(f"T5X is not importable ({e}); T5X sources are looked for in SPECDEC_T5X_PATH="
                f"{T5X_PATH} and need the `t5x` extra: run `make test-t5x`",
                allow_module_level=True)
  if t5x_model._BASE is object:
    pytest.skip("specdec_jax.t5x.model was imported before T5X was importable, so "
                "SpeculativeEncoderDecoderModel does not subclass T5X's model; put T5X on "
                "PYTHONPATH (make test-t5x does)", allow_module_level=True)


_import_t5x()

# pylint: disable=g-import-not-at-top,wrong-import-position
from t5x import checkpoints as t5x_checkpoints
from t5x import decoding as t5x_decoding
from t5x import models as t5x_models
from t5x import partitioning as t5x_partitioning
from t5x import train_state as t5x_train_state
from t5x.examples.t5 import network as t5x_network

import specdec_jax
from specdec_jax.families.t5 import checkpoints
from specdec_jax.families.t5.config import T5Config

VOCAB = 64


def _network_config(gated: bool) -> t5x_network.T5Config:
  """T5X example-network configs: T5 1.1 (gated GELU, untied) or original T5 (ReLU, tied)."""
  return t5x_network.T5Config(
      vocab_size=VOCAB, dtype="float32", emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
      num_encoder_layers=2, num_decoder_layers=2 if gated else 3,
      mlp_activations=("gelu", "linear") if gated else ("relu",), dropout_rate=0.0,
      logits_via_embedding=not gated)


def _batch():
  """A T5X-style teacher-forcing batch with padding in both stacks."""
  encoder = np.array([[5, 6, 7, 1, 0, 0], [9, 3, 4, 5, 6, 1]], np.int32)
  targets = np.array([[3, 4, 5, 1], [8, 9, 1, 0]], np.int32)
  inputs = np.concatenate([np.zeros((2, 1), np.int32), targets[:, :-1]], axis=1)
  return {"encoder_input_tokens": encoder, "decoder_input_tokens": inputs,
          "decoder_target_tokens": targets,
          "decoder_loss_weights": (targets > 0).astype(np.float32)}


def _partitioner():
  return t5x_partitioning.PjitPartitioner(
      num_partitions=1, logical_axis_rules=t5x_partitioning.standard_logical_axis_rules())


def _t5x_checkpointer(variables, directory):
  state = t5x_train_state.InferenceState.create(variables)
  return state, t5x_checkpoints.Checkpointer(state, _partitioner(), str(directory))


@pytest.fixture(scope="module", params=["gated", "relu_tied"])
def t5x_written(request, tmp_path_factory):
  """(network, variables, checkpoint_0 dir) written by T5X's own Checkpointer.save."""
  network = t5x_network.Transformer(_network_config(request.param == "gated"))
  batch = _batch()
  variables = network.init(jax.random.PRNGKey(1), batch["encoder_input_tokens"],
                           batch["decoder_input_tokens"], batch["decoder_target_tokens"],
                           enable_dropout=False)
  directory = tmp_path_factory.mktemp(f"t5x_{request.param}")
  state, checkpointer = _t5x_checkpointer(variables, directory)
  checkpointer.save(state)
  return network, variables, os.path.join(directory, "checkpoint_0")


def _t5x_logits(network, variables, batch):
  return np.asarray(network.apply(variables, batch["encoder_input_tokens"],
                                  batch["decoder_input_tokens"], batch["decoder_target_tokens"],
                                  enable_dropout=False))


def _flat(tree):
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


# ---------------------------------------------------------------------------- reading T5X's


def test_load_checkpoint_written_by_t5x(t5x_written):
  network, variables, directory = t5x_written
  # What current T5X writes: relative kvstore paths with a trailing slash.
  with open(os.path.join(directory, "checkpoint"), "rb") as f:
    contents = serialization.msgpack_restore(f.read())
  spec = contents["optimizer"]["target"]["decoder"]["decoder_norm"]["scale"]
  assert spec["kvstore"]["path"] == "target.decoder.decoder_norm.scale/"
  model = specdec_jax.load_model(directory, dtype="float32")
  assert model.config.logits_via_embedding == network.config.logits_via_embedding
  assert model.config.num_decoder_layers == network.config.num_decoder_layers
  want = _flat(variables["params"])
  got = _flat(model.params)
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  batch = _batch()
  ours = np.asarray(model.logits(batch["encoder_input_tokens"], batch["decoder_input_tokens"]))
  theirs = _t5x_logits(network, variables, batch)
  # T5X masks padded decoder *queries* too (their logits are never used); our
  # plain model does not, so compare where targets are real.
  real = batch["decoder_target_tokens"] > 0
  np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4, rtol=0)


def test_load_orbax_checkpoint_written_by_t5x(t5x_written, tmp_path):
  """t5x.train's default format: checkpoint_N/state/ is an Orbax PyTree of T5X's state."""
  _, variables, _ = t5x_written
  state = t5x_train_state.InferenceState.create(variables)
  directory = tmp_path / "orbax_run"
  os.makedirs(directory)
  manager = t5x_checkpoints.OrbaxCheckpointManagerInterface(str(directory), state, _partitioner())
  manager.save(state)
  manager.wait_until_finished()
  checkpoint = directory / "checkpoint_0"
  assert sorted(os.listdir(checkpoint / "state")).count("_METADATA") == 1
  got = _flat(specdec_jax.load_model(str(checkpoint), dtype="float32").params)
  want = _flat(variables["params"])
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _rewrite_specs(directory, rewrite, version=None):
  """Rewrites every TensorStore spec of a T5X msgpack in place."""
  name = os.path.join(directory, "checkpoint")
  with open(name, "rb") as f:
    contents = serialization.msgpack_restore(f.read())
  is_spec = lambda x: isinstance(x, dict) and "driver" in x
  contents = jax.tree_util.tree_map(lambda x: rewrite(x) if is_spec(x) else x, contents,
                                    is_leaf=is_spec)
  if version is not None:
    contents["version"] = version
  with open(name, "wb") as f:
    f.write(serialization.msgpack_serialize(contents))


def _top_level_path(spec):  # tensorstore < 0.1.14
  path = spec["kvstore"]["path"]
  return dict(spec, path=path.rstrip("/"), kvstore={"driver": "file"})


def _gcs(spec):  # written to gs:// (dummy bucket), read locally
  return dict(spec, kvstore={"driver": "gcs", "bucket": "t5x-dummy-bucket",
                             "path": spec["kvstore"]["path"]})


def _gcs_top_level(spec):  # T5X's _get_spec for gs:// directories, before normalisation
  return dict(spec, path=spec["kvstore"]["path"].rstrip("/"),
              kvstore={"driver": "gcs", "bucket": "t5x-dummy-bucket"})


def _url(spec):
  return dict(spec, kvstore="gs://t5x-dummy-bucket/" + spec["kvstore"]["path"])


@pytest.mark.parametrize("rewrite", [_top_level_path, _gcs, _gcs_top_level, _url])
def test_every_tensorstore_spec_layout(t5x_written, tmp_path, rewrite):
  _, variables, directory = t5x_written
  copy = str(tmp_path / "checkpoint_0")
  shutil.copytree(directory, copy)
  _rewrite_specs(copy, rewrite)
  got = _flat(specdec_jax.load_model(copy, dtype="float32").params)
  for key, value in _flat(variables["params"]).items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_version_2_uint16_bfloat16(t5x_written, tmp_path):
  """Before version 3, T5X stored bfloat16 arrays as uint16 bit patterns."""
  import tensorstore as ts
  _, variables, directory = t5x_written
  copy = str(tmp_path / "checkpoint_0")
  shutil.copytree(directory, copy)
  key = ("encoder", "layers_0", "mlp", "wo", "kernel")
  value = np.asarray(traverse_util.flatten_dict(variables["params"])[key])
  as_bf16 = value.astype(ml_dtypes.bfloat16)
  name = "target." + ".".join(key)
  shutil.rmtree(os.path.join(copy, name))
  store = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                  "path": os.path.join(copy, name) + "/"},
                   "metadata": {"shape": list(value.shape), "chunks": list(value.shape),
                                "dtype": "<u2", "compressor": {"id": "gzip"}}},
                  create=True).result()
  store.write(as_bf16.view(np.uint16)).result()
  _rewrite_specs(copy, lambda s: dict(s, dtype="uint16") if name in str(s) else s, version=2)
  got = _flat(specdec_jax.load_model(copy, dtype="float32").params)
  np.testing.assert_array_equal(got["/".join(key)], as_bf16.astype(np.float32))


# ---------------------------------------------------------------------------- writing for T5X


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_t5x_restores_in_t5x(t5x_written, tmp_path, dtype):
  """A checkpoint we write restores with T5X's own Checkpointer.restore, array for array."""
  network, variables, directory = t5x_written
  model = specdec_jax.load_model(directory, dtype=dtype)
  ours = checkpoints.export_t5x(model, tmp_path / "checkpoint_5", step=5)
  # A train state of T5X's network, initialised differently, then restored.
  batch = _batch()
  fresh = network.init(jax.random.PRNGKey(9), batch["encoder_input_tokens"],
                       batch["decoder_input_tokens"], batch["decoder_target_tokens"],
                       enable_dropout=False)
  _, checkpointer = _t5x_checkpointer(fresh, tmp_path / "t5x_dir")
  restored = checkpointer.restore(path=ours)
  assert int(restored.step) == 5
  want = _flat(model.params)
  got = _flat(restored.params)
  assert sorted(got) == sorted(want)
  for key in want:
    assert got[key].dtype == want[key].dtype, key
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # And our reader reads it back.
  again = _flat(specdec_jax.load_model(ours, dtype=dtype).params)
  for key in want:
    np.testing.assert_array_equal(again[key], want[key], err_msg=key)
  with pytest.raises(FileExistsError):
    checkpoints.export_t5x(model, ours)


# ---------------------------------------------------------------------------- the model in T5X


def _packed_batch():
  """Two examples packed per row, T5X style (segment ids, restarting positions)."""
  encoder = np.array([[5, 6, 1, 7, 8, 9, 1, 0], [4, 4, 4, 1, 0, 0, 0, 0]], np.int32)
  encoder_segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0, 0]], np.int32)
  encoder_positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 0, 0, 0, 0]], np.int32)
  targets = np.array([[3, 1, 9, 8, 1, 0], [2, 3, 5, 7, 1, 0]], np.int32)
  decoder_segments = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0]], np.int32)
  decoder_positions = np.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0]], np.int32)
  inputs = np.array([[0, 3, 0, 9, 8, 0], [0, 2, 3, 5, 7, 0]], np.int32)
  return {"encoder_input_tokens": encoder, "encoder_segment_ids": encoder_segments,
          "encoder_positions": encoder_positions, "decoder_target_tokens": targets,
          "decoder_input_tokens": inputs, "decoder_segment_ids": decoder_segments,
          "decoder_positions": decoder_positions,
          "decoder_loss_weights": (targets > 0).astype(np.float32)}


def _models(network, **kwargs):
  """(T5X's EncoderDecoderModel on its example network, ours) on the same target."""
  from seqio import PassThroughVocabulary
  vocabulary = PassThroughVocabulary(size=VOCAB, eos_id=1)
  theirs = t5x_models.EncoderDecoderModel(
      network, vocabulary, vocabulary, optimizer_def=None,
      decode_fn=t5x_decoding.temperature_sample)
  config = checkpoints.infer_config_from_shapes(
      {k: v.shape for k, v in _flat(network.init(
          jax.random.PRNGKey(0), *[jnp.ones((1, 2), jnp.int32)] * 3,
          enable_dropout=False)["params"]).items()}, "network", "float32", {})
  ours = specdec_jax.SpeculativeEncoderDecoderModel(config, input_vocabulary=vocabulary,
                                                    output_vocabulary=vocabulary, **kwargs)
  return theirs, ours


def test_get_initial_variables_is_t5x_tree(t5x_written):
  network, variables, _ = t5x_written
  theirs, ours = _models(network)
  shapes = {"encoder_input_tokens": (2, 6), "decoder_input_tokens": (2, 4),
            "decoder_target_tokens": (2, 4), "encoder_segment_ids": (2, 6),
            "decoder_segment_ids": (2, 4), "encoder_positions": (2, 6),
            "decoder_positions": (2, 4)}
  got = ours.get_initial_variables(jax.random.PRNGKey(0), shapes)
  want = theirs.get_initial_variables(jax.random.PRNGKey(0), shapes)
  assert jax.tree_util.tree_map(jnp.shape, got["params"]) == \
      jax.tree_util.tree_map(jnp.shape, want["params"])
  # The logical axes T5X's partitioner reads are T5X's own.
  from flax.linen import partitioning as flax_partitioning
  assert (flax_partitioning.get_axis_names(got["params_axes"]) ==
          flax_partitioning.get_axis_names(want["params_axes"]))
  # And T5X builds its train state (and its partitioning) from them.
  state = t5x_train_state.InferenceState.create(got)
  _partitioner().get_mesh_axes(state)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_score_batch_and_loss_equal_t5x(t5x_written, packed):
  network, variables, _ = t5x_written
  theirs, ours = _models(network)
  params = variables["params"]
  batch = _packed_batch() if packed else _batch()
  want = theirs.score_batch(params, batch)
  np.testing.assert_allclose(ours.score_batch(params, batch), want, rtol=1e-5, atol=1e-5)
  # Logits agree at every position, padding included (T5X's masks).
  np.testing.assert_allclose(ours._compute_logits(params, batch),
                             theirs._compute_logits(params, batch), rtol=0, atol=1e-4)
  loss, metrics = ours.loss_fn(params, batch, None)
  want_loss, want_metrics = theirs.loss_fn(params, batch, None)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert sorted(metrics) == sorted(want_metrics)
  for name in ("accuracy", "loss", "cross_ent_loss"):
    np.testing.assert_allclose(metrics[name].compute(), want_metrics[name].compute(), rtol=1e-5,
                               err_msg=name)


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
  """A one-layer draft for the 64-token vocabulary, written by T5X's Checkpointer."""
  config = t5x_network.T5Config(
      vocab_size=VOCAB, dtype="float32", emb_dim=8, num_heads=2, head_dim=4, mlp_dim=16,
      num_encoder_layers=1, num_decoder_layers=1, mlp_activations=("gelu", "linear"),
      dropout_rate=0.0, logits_via_embedding=False)
  batch = _batch()
  variables = t5x_network.Transformer(config).init(
      jax.random.PRNGKey(5), batch["encoder_input_tokens"], batch["decoder_input_tokens"],
      batch["decoder_target_tokens"], enable_dropout=False)
  directory = tmp_path_factory.mktemp("draft")
  state, checkpointer = _t5x_checkpointer(variables, directory)
  checkpointer.save(state)
  return os.path.join(directory, "checkpoint_0")


def test_greedy_predict_batch_equals_t5x(t5x_written, draft_checkpoint):
  """Target params as T5X passes them; the draft from its own T5X checkpoint."""
  network, variables, _ = t5x_written
  params = variables["params"]
  encoder = np.array([[5, 6, 7, 9, 1, 0], [9, 3, 4, 5, 6, 1], [2, 1, 0, 0, 0, 0]], np.int32)
  # T5X's infer passes the targets shifted right; without prompt_with_targets
  # they only give the decode length.
  batch = {"encoder_input_tokens": encoder,
           "decoder_input_tokens": np.tile(np.arange(10, dtype=np.int32), (3, 1))}
  theirs, plain = _models(network)
  _, speculative = _models(network, draft=draft_checkpoint, gamma=3,
                           decode_fn=specdec_jax.speculative_sample)
  want, want_aux = theirs.predict_batch_with_aux(params, batch)
  np.testing.assert_array_equal(plain.predict_batch(params, batch), want)
  decodes, aux = speculative.predict_batch_with_aux(params, batch)
  np.testing.assert_array_equal(decodes, want)
  # T5X's aux plus the speculative counters, one row per example.
  assert aux["scores"].shape == want_aux["scores"].shape == (3,)
  assert aux["iterations"].shape == (3,) and int(np.sum(aux["iterations"])) > 0
  # 'scores' is the target's log-likelihood of the decode (T5X's score_batch).
  targets = np.asarray(decodes)
  scored = dict(batch, decoder_target_tokens=targets,
                decoder_input_tokens=np.concatenate([np.zeros((3, 1), np.int32),
                                                     targets[:, :-1]], 1),
                decoder_loss_weights=(targets > 0).astype(np.float32))
  np.testing.assert_allclose(aux["scores"], theirs.score_batch(params, scored), rtol=1e-4,
                             atol=1e-4)


# ---------------------------------------------------------------------------- python -m t5x.infer


def _t5x_infer(tmp_path, checkpoints_by_name, name, *bindings,
               gin_file="configs/t5x/demo_pair_infer.gin"):
  """Runs T5X's infer binary with a demo-pair gin file; returns its output rows."""
  output_dir = str(tmp_path / f"infer_{name}")
  command = [sys.executable, "-m", "t5x.infer", f"--gin_search_paths={T5X_PATH},{REPO}",
             f"--gin_file={gin_file}",
             f"--gin.CHECKPOINT_PATH='{checkpoints_by_name['target']}'",
             f"--gin.DRAFT_CHECKPOINT='{checkpoints_by_name['small']}'",
             f"--gin.INFER_OUTPUT_DIR='{output_dir}'", *bindings]
  site = os.path.join(REPO, "experiments", "t5x_demo", "site")  # the jestimator alias
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([site, T5X_PATH, REPO]))
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
  assert result.returncode == 0, result.stderr[-4000:]
  written = [f for f in os.listdir(output_dir) if f.endswith("-00000-of-00001")]
  assert written == ["specdec_demo_pair_heldout-predict.jsonl-00000-of-00001"], written
  with open(os.path.join(output_dir, written[0])) as f:
    return [json.loads(line) for line in f]


def test_t5x_infer_demo_pair_end_to_end(tmp_path):
  """T5X's own infer and eval restore our T5X export of the demo pair and decode speculatively."""
  from experiments.t5x_demo.prepare import prepare
  from specdec_jax.t5x import tasks as t5x_tasks
  paths = prepare(str(tmp_path / "checkpoints"))
  speculative = _t5x_infer(tmp_path, paths, "speculative")
  # A --gin flag names the configurable by its module path: the gin files'
  # `t5x_model` alias is their own import, unknown to the flags.
  plain = _t5x_infer(tmp_path, paths, "plain",
                     "--gin.specdec_jax.t5x.model.SpeculativeEncoderDecoderModel.decode_fn="
                     "@decoding.temperature_sample")
  # T5X's own EncoderDecoderModel + example network + temperature_sample.
  t5x_own = _t5x_infer(tmp_path, paths, "t5x_own",
                       gin_file="configs/t5x/demo_pair_t5x_baseline.gin")
  rows = t5x_tasks.demo_heldout(limit=16)
  assert len(speculative) == len(plain) == len(t5x_own) == len(rows) == 16
  # Identical outputs, text and ids, example for example.
  for other in (plain, t5x_own):
    assert [r["prediction"] for r in speculative] == [r["prediction"] for r in other]
    assert ([r["prediction_tokens"] for r in speculative] ==
            [r["prediction_tokens"] for r in other])
  assert [r["inputs"]["inputs_pretokenized"] for r in speculative] == [r["input"] for r in rows]
  # t5x.eval (seqio's Evaluator) scores the same predictions.
  eval_dir = str(tmp_path / "eval")
  site = os.path.join(REPO, "experiments", "t5x_demo", "site")
  result = subprocess.run(
      [sys.executable, "-m", "t5x.eval", f"--gin_search_paths={T5X_PATH},{REPO}",
       "--gin_file=configs/t5x/demo_pair_eval.gin",
       f"--gin.CHECKPOINT_PATH='{paths['target']}'",
       f"--gin.DRAFT_CHECKPOINT='{paths['small']}'", f"--gin.EVAL_OUTPUT_DIR='{eval_dir}'"],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([site, T5X_PATH, REPO])))
  assert result.returncode == 0, result.stderr[-4000:]
  prefix = os.path.join(eval_dir, "inference_eval", "specdec_demo_pair_heldout")
  with open(prefix + "-000000.jsonl") as f:
    evaluated = [json.loads(line) for line in f]
  assert [r["prediction"] for r in evaluated] == [r["prediction"] for r in speculative]
  with open(prefix + "-metrics.jsonl") as f:
    metrics = json.loads(f.readline())
  exact = sum(r["prediction"] == r["target"] for r in evaluated)
  assert metrics["exact_match"] == pytest.approx(100.0 * exact / 16)
  # And they are the demo target's greedy decodes (specdec_jax.generate, no T5X).
  pair = specdec_jax.load_demo_pair()
  expected = specdec_jax.generate(pair.target, pair.heldout_inputs(16),
                                  max_decode_steps=pair.max_decode_steps).sequences
  for got, want in zip(speculative, np.asarray(expected)):
    want = list(want)
    want = want[:want.index(0)] if 0 in want else want
    assert got["prediction_tokens"] == [int(t) for t in want]


def test_xxl_small_gin_parses():
  """The paper-pairing gin file parses against T5X's infer.gin (running it needs the gs:// data)."""
  script = (
      "import sys, gin\n"
      "import t5x.infer as infer\n"
      "sys.modules['__main__'] = infer\n"  # infer.gin does `import __main__ as infer_script`.
      f"gin.add_config_file_search_path({T5X_PATH!r})\n"
      f"gin.add_config_file_search_path({REPO!r})\n"
      "gin.parse_config_files_and_bindings(['configs/t5x/t5_1_1_xxl_small_infer.gin'],\n"
      "    [\"MIXTURE_OR_TASK_NAME='task'\", \"INFER_OUTPUT_DIR='/tmp/out'\"])\n"
      "print(gin.query_parameter('specdec_jax.t5x.model.SpeculativeEncoderDecoderModel.gamma'),\n"
      "      gin.query_parameter('configs.get_config.name'))\n")
  site = os.path.join(REPO, "experiments", "t5x_demo", "site")
  result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu",
                                   PYTHONPATH=os.pathsep.join([site, T5X_PATH, REPO])))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split() == ["4", "t5_1_1_xxl"]


def test_draft_as_variables_restores_and_feeds_the_draft(t5x_written, draft_checkpoint, tmp_path):
  """The draft in T5X's train state: restored beside a target-only checkpoint, then used."""
  from specdec_jax.t5x import model as t5x_model
  network, variables, target_checkpoint = t5x_written
  _, model = _models(network, draft=draft_checkpoint, gamma=3, draft_as_variables=True,
                     decode_fn=specdec_jax.speculative_sample, temperature=1.0)
  shapes = {"encoder_input_tokens": (3, 6), "decoder_input_tokens": (3, 10)}
  initial = model.get_initial_variables(jax.random.PRNGKey(0), shapes)
  assert set(initial) == {"params", "params_axes", "draft", "draft_axes"}
  state, checkpointer = _t5x_checkpointer(initial, tmp_path / "restore")
  with pytest.raises(ValueError):  # The target's checkpoint alone lacks the draft...
    checkpointer.restore(path=target_checkpoint)
  restored = checkpointer.restore(  # ...which the transformation supplies.
      path=target_checkpoint, state_transformation_fns=[t5x_model.restore_draft_variables])
  draft = specdec_jax.load_model(draft_checkpoint, dtype="float32")
  for name, tree in (("params", variables["params"]), ("draft", draft.params)):
    got = _flat(restored.params if name == "params" else restored.flax_mutables["draft"])
    for key, value in _flat(tree).items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"{name}/{key}")
  # predict_batch takes the draft from flax_mutables (T5X passes them when the
  # signature names them): the same draft there gives the same samples and
  # counters as passing it explicitly; another draft changes them.
  batch = {"encoder_input_tokens": np.array([[5, 6, 7, 9, 1, 0], [9, 3, 4, 5, 6, 1],
                                             [2, 1, 0, 0, 0, 0]], np.int32),
           "decoder_input_tokens": np.zeros((3, 10), np.int32)}
  import inspect
  assert "flax_mutables" in inspect.signature(model.predict_batch).parameters
  rng = jax.random.PRNGKey(3)
  decodes, aux = model.predict_batch_with_aux(restored.params, batch, rng=rng,
                                              flax_mutables=restored.flax_mutables)
  explicit, explicit_aux = model.predict_batch_with_aux(
      {"target": restored.params, "draft": draft.params}, batch, rng=rng)
  np.testing.assert_array_equal(decodes, explicit)
  np.testing.assert_array_equal(aux["beta_sum"], explicit_aux["beta_sum"])
  zero_draft = jax.tree_util.tree_map(jnp.zeros_like, restored.flax_mutables["draft"])
  _, aux_zero = model.predict_batch_with_aux(restored.params, batch, rng=rng,
                                             flax_mutables={"draft": zero_draft})
  assert not np.array_equal(aux_zero["beta_sum"], aux["beta_sum"])
