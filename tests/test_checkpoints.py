"""Checkpoint formats: T5X (msgpack + TensorStore zarr), Orbax, HF files, and bad input.

Parity of the Hugging Face name/layout mapping against transformers itself is in
test_parity_hf.py; here the files are written without torch.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import serialization, traverse_util

from specdec_jax import loading
from specdec_jax.families import tensor_io
from specdec_jax.families.t5 import checkpoints
from specdec_jax.families.t5.config import get_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
  return loading.load_model("tiny", vocab_size=64, dtype="float32", seed=3)


@pytest.fixture(scope="module")
def tiny_relu():
  config = get_config("tiny", vocab_size=64, mlp_activations=("relu",), logits_via_embedding=True,
                      num_encoder_layers=3, num_decoder_layers=2, num_heads=3, head_dim=8)
  return loading.load_model(config, dtype="float32", seed=4)


def _flat(params):
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()}


def _assert_same_params(actual, expected):
  actual, expected = _flat(actual), _flat(expected)
  assert sorted(actual) == sorted(expected)
  for key in expected:
    assert actual[key].dtype == expected[key].dtype, key
    np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def _zarr_dtype(dtype):
  return "bfloat16" if dtype == ml_dtypes.bfloat16 else np.dtype(dtype).str


def _write_t5x(directory, params, *, bf16_key=None, inline_key=None):
  """Writes `params` in T5X's on-disk layout (what t5x.checkpoints.Checkpointer.save makes).

  `checkpoint` is a flax msgpack of {'version': 3, 'optimizer': {'target': ...,
  'state': ...}}; each array lives in a gzip zarr directory named by its dotted
  path, and the msgpack holds a TensorStore spec with that relative path. An
  Adafactor-like optimizer state (which loading must ignore) is written the
  same way; `inline_key` is stored in the msgpack itself.
  """
  import tensorstore as ts
  os.makedirs(directory)

  def write_array(name, array):
    metadata = {"compressor": {"id": "gzip"}, "shape": list(array.shape),
                # Several chunks along the first axis, as T5X's 64 MiB chunking does for big arrays.
                "chunks": [max(1, array.shape[0] // 2)] + list(array.shape[1:]),
                "dtype": _zarr_dtype(array.dtype)}
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                   "path": os.path.join(directory, name)},
                     "metadata": metadata}, create=True).result()
    store.write(array).result()
    return {"driver": "zarr", "dtype": jnp.dtype(array.dtype).name,
            "kvstore": {"driver": "file", "path": name},
            "metadata": {k: v for k, v in metadata.items() if k != "dtype"}}

  target, param_states = {}, {}
  for path, value in traverse_util.flatten_dict(params).items():
    array = np.asarray(value)
    dotted = ".".join(path)
    if path == inline_key:
      target[path] = array
      continue
    if path == bf16_key:
      array = array.astype(ml_dtypes.bfloat16)
    target[path] = write_array(f"target.{dotted}", array)
    if array.ndim == 2:  # Adafactor's factored second moments.
      param_states[path + ("v_row",)] = write_array(
          f"state.param_states.{dotted}.v_row", np.ones(array.shape[:1], np.float32))
      param_states[path + ("v_col",)] = write_array(
          f"state.param_states.{dotted}.v_col", np.ones(array.shape[1:], np.float32))
  contents = {"version": 3, "optimizer": {
      "target": traverse_util.unflatten_dict(target),
      "state": {"step": np.int32(100),
                "param_states": traverse_util.unflatten_dict(param_states)}}}
  with open(os.path.join(directory, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(contents))


# ---------------------------------------------------------------------------- T5X


def test_t5x_round_trip_identical(tmp_path, tiny):
  directory = tmp_path / "checkpoint_100"
  _write_t5x(directory, tiny.params, inline_key=("encoder", "encoder_norm", "scale"))
  loaded = checkpoints.load_checkpoint_model(directory, dtype="float32")
  assert loaded.config == tiny.config
  _assert_same_params(loaded.params, tiny.params)
  # The msgpack file itself and a TensorStore URL name the same checkpoint.
  by_file = checkpoints.load_checkpoint_model(directory / "checkpoint", dtype="float32")
  _assert_same_params(by_file.params, tiny.params)
  by_url = loading.load_model(f"file://{directory}", dtype="float32")
  _assert_same_params(by_url.params, tiny.params)


def test_t5x_relu_tied_bfloat16_arrays_and_cast(tmp_path, tiny_relu):
  directory = tmp_path / "checkpoint_7"
  bf16_key = ("decoder", "relpos_bias", "rel_embedding")
  _write_t5x(directory, tiny_relu.params, bf16_key=bf16_key)
  loaded = checkpoints.load_checkpoint_model(directory, dtype="float32")
  assert loaded.config == tiny_relu.config  # relu, tied, 3/2 layers, 3 heads of 8.
  expected = jax.tree_util.tree_map(np.asarray, tiny_relu.params)
  expected["decoder"]["relpos_bias"]["rel_embedding"] = np.asarray(
      expected["decoder"]["relpos_bias"]["rel_embedding"].astype(ml_dtypes.bfloat16), np.float32)
  _assert_same_params(loaded.params, expected)
  as_bf16 = checkpoints.load_checkpoint_model(directory, dtype="bfloat16")
  assert as_bf16.config.dtype == "bfloat16"
  _assert_same_params(as_bf16.params, jax.tree_util.tree_map(
      lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), expected))


def test_t5x_missing_array_names_the_file(tmp_path, tiny):
  directory = tmp_path / "checkpoint_1"
  _write_t5x(directory, tiny.params)
  name = "target.decoder.layers_1.mlp.wo.kernel"
  os.rename(directory / name, tmp_path / "moved")
  with pytest.raises(tensor_io.CheckpointError, match=name):
    checkpoints.load_checkpoint_model(directory, dtype="float32")


def test_t5x_overrides_and_conflicting_override(tmp_path, tiny):
  directory = tmp_path / "checkpoint_2"
  _write_t5x(directory, tiny.params)
  loaded = checkpoints.load_checkpoint_model(directory, dtype="float32",
                                             relative_attention_max_distance=64)
  assert loaded.config.relative_attention_max_distance == 64
  with pytest.raises(tensor_io.CheckpointError, match="shape mismatch"):
    checkpoints.load_checkpoint_model(directory, dtype="float32", mlp_dim=100)


# ---------------------------------------------------------------------------- Orbax


def test_orbax_round_trip_through_load_model(tmp_path, tiny):
  path = tmp_path / "ours"
  checkpoints.save_model(tiny, path)
  loaded = loading.load_model(str(path), dtype="float32")
  assert loaded.config == tiny.config
  _assert_same_params(loaded.params, tiny.params)
  as_bf16 = loading.load_model(str(path), dtype="bfloat16")
  _assert_same_params(as_bf16.params, jax.tree_util.tree_map(
      lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), tiny.params))
  with pytest.raises(FileExistsError):
    checkpoints.save_model(tiny, path)
  checkpoints.save_model(tiny, path, overwrite=True)


def test_generic_orbax_with_optimizer_state(tmp_path, tiny_relu):
  import orbax.checkpoint as ocp
  path = tmp_path / "t5x_orbax"
  state = {"optimizer": {"target": jax.tree_util.tree_map(np.asarray, tiny_relu.params),
                         "state": {"step": np.int32(5), "v": np.zeros(3, np.float32)}}}
  ocp.PyTreeCheckpointer().save(path, state)
  loaded = checkpoints.load_checkpoint_model(path, dtype="float32")
  assert loaded.config == tiny_relu.config
  _assert_same_params(loaded.params, tiny_relu.params)


def test_convert_script_t5x_to_orbax(tmp_path, tiny):
  source, output = tmp_path / "checkpoint_3", tmp_path / "converted"
  _write_t5x(source, tiny.params)
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"),
       f"--input={source}", f"--output={output}", "--dtype=float32"],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-2000:]
  loaded = loading.load_model(str(output), dtype="float32")
  _assert_same_params(loaded.params, tiny.params)


# ---------------------------------------------------------------------------- HF files


def test_hf_export_round_trip(tmp_path, tiny, tiny_relu):
  for model in (tiny, tiny_relu):
    directory = tmp_path / ("untied" if model is tiny else "tied")
    checkpoints.export_hf(model, directory)
    loaded = checkpoints.load_checkpoint_model(directory, dtype="float32")
    assert loaded.config == model.config
    _assert_same_params(loaded.params, model.params)


@pytest.mark.parametrize("name", ["tiny", "llama_tiny", "qwen2_tiny", "gpt2_tiny"])
def test_one_export_hf_for_every_family(tmp_path, name):
  """`sj.export_hf` writes any family's model as the HF architecture `load_model` detects."""
  import specdec_jax as sj
  model = loading.load_model(name, vocab_size=64, dtype="float32", seed=2)
  sj.export_hf(model, tmp_path)
  with open(tmp_path / "config.json") as f:
    architecture = json.load(f)["architectures"][0]
  assert architecture in " ".join(sj.family_of(model).architectures)
  loaded = loading.load_model(str(tmp_path), dtype="float32")
  assert type(loaded) is type(model) and loaded.config == model.config
  _assert_same_params(loaded.params, model.params)
  with pytest.raises(TypeError, match="export_hf takes a model"):
    sj.export_hf(model.config, tmp_path)


def _edit_safetensors(filename, edit):
  tensors = tensor_io.safetensors_tensors(str(filename))
  arrays = {name.split(": ", 1)[1]: t.read(None) for name, t in
            ((t.source, t) for t in tensors.values())}
  edit(arrays)
  tensor_io.write_safetensors(str(filename), [(k, v.shape, v.dtype, lambda v=v: v)
                                              for k, v in arrays.items()])


def test_missing_unexpected_and_mis_shaped_tensors_in_one_error(tmp_path, tiny):
  checkpoints.export_hf(tiny, tmp_path)

  def edit(arrays):
    del arrays["encoder.block.1.layer.0.SelfAttention.k.weight"]
    arrays["encoder.block.7.layer.0.SelfAttention.k.weight"] = np.zeros((4, 4), np.float32)
    arrays["decoder.final_layer_norm.weight"] = np.ones(5, np.float32)

  _edit_safetensors(tmp_path / "model.safetensors", edit)
  with pytest.raises(tensor_io.CheckpointError) as info:
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  message = str(info.value)
  assert "missing (1)" in message and "encoder.block.1.layer.0.SelfAttention.k.weight" in message
  assert "unexpected (1)" in message and "encoder.block.7.layer.0.SelfAttention.k.weight" in message
  assert "shape mismatch (1)" in message and "decoder.final_layer_norm.weight" in message
  assert "model.safetensors" in message


def test_truncated_safetensors(tmp_path, tiny):
  checkpoints.export_hf(tiny, tmp_path)
  filename = tmp_path / "model.safetensors"
  size = os.path.getsize(filename)
  with open(filename, "r+b") as f:
    f.truncate(size - 100)
  with pytest.raises(tensor_io.CheckpointError, match=r"model\.safetensors: truncated"):
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  with open(filename, "r+b") as f:
    f.truncate(4)
  with pytest.raises(tensor_io.CheckpointError, match=r"model\.safetensors: truncated"):
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")


def test_directory_without_weights(tmp_path, tiny):
  checkpoints.export_hf(tiny, tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(tensor_io.CheckpointError, match="config.json but no weights"):
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(tensor_io.CheckpointError, match="not a checkpoint directory"):
    checkpoints.load_checkpoint_model(empty, dtype="float32")


def test_other_architecture(tmp_path, tiny):
  checkpoints.export_hf(tiny, tmp_path)
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  config["model_type"] = "gpt2"
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(tensor_io.CheckpointError, match=r"config\.json: model_type 'gpt2'"):
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")


def test_sharded_index_naming_a_missing_shard(tmp_path, tiny):
  checkpoints.export_hf(tiny, tmp_path)
  os.rename(tmp_path / "model.safetensors", tmp_path / "model-00001-of-00002.safetensors")
  names = checkpoints.hf_tensor_layout(tiny.config)
  index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in names}}
  index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
  with open(tmp_path / "model.safetensors.index.json", "w") as f:
    json.dump(index, f)
  with pytest.raises(tensor_io.CheckpointError, match="model-00002-of-00002.safetensors"):
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")


def test_pickled_object_is_refused(tmp_path, tiny):
  torch = pytest.importorskip("torch")
  checkpoints.export_hf(tiny, tmp_path)
  os.remove(tmp_path / "model.safetensors")
  torch.save({"shared.weight": torch.zeros(2, 2), "payload": _NotATensor()},
             tmp_path / "pytorch_model.bin")
  with pytest.raises(tensor_io.CheckpointError, match="pytorch_model.bin"):
    checkpoints.load_checkpoint_model(tmp_path, dtype="float32")


class _NotATensor:
  pass


def test_missing_path_and_unreachable_hub_id(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="no such file"):
    checkpoints.load_checkpoint_model(str(tmp_path / "nope"))
  hub = pytest.importorskip("huggingface_hub")

  def offline(*args, **kwargs):
    raise ConnectionError("offline")

  monkeypatch.setattr(hub, "snapshot_download", offline)
  with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
    loading.load_model("google/flan-t5-small-does-not-exist-here")
