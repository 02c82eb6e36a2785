"""Loading real weights into `Model`: Hugging Face T5 directories, T5X and Orbax checkpoints.

`load_checkpoint_model(path)` detects the format:

* **specdec_jax** (`save_model`): a directory with `specdec_config.json` (the
  `T5Config`) and `params/` (an Orbax PyTree checkpoint of the T5X tree).
* **Hugging Face**: a directory with `config.json` (model_type t5 / mt5) and
  `model.safetensors`, sharded `*.safetensors` with `model.safetensors.index.json`,
  or `pytorch_model.bin` (optionally sharded with an index), the latter read with
  `torch.load(weights_only=True)` so no pickled code runs. A hub id
  (`google/flan-t5-small`) is fetched with `huggingface_hub.snapshot_download`
  when that package is installed and the hub is reachable.
* **T5X**: a `checkpoint_N` directory (local or any TensorStore URL such as
  `gs://...`) holding the msgpack file `checkpoint` (`{'version', 'optimizer':
  {'target': params, 'state': ...}}`) whose large arrays are TensorStore zarr
  directories named with dots (`target.encoder.layers_0.attention.query.kernel`),
  referenced from the msgpack by TensorStore specs with relative paths.
* **Orbax**: any Orbax PyTree checkpoint with the T5X params tree somewhere
  inside (at the root, under `target`, `optimizer/target`, `params`, ...),
  including T5X's own Orbax format (`t5x.train`'s default), whose
  `checkpoint_N/state/` is read when `checkpoint_N` is given.

Optimizer state is never read. The config comes from `config.json` (HF), from
`specdec_config.json` (ours), or from the parameter shapes (T5X / Orbax: the
activations are inferred as gated GELU when `wi_0`/`wi_1` exist, else ReLU;
`relative_attention_max_distance` cannot be seen in the shapes and defaults to
128; pass a `config_overrides` to change either).

Memory: tensors are read one at a time, cast to the requested dtype and placed
on the device before the next is read, so peak host memory stays near one copy
of the params in the requested dtype plus the largest single tensor.

Hugging Face logits, three conventions (see REFERENCE.md section 4):
  * untied `lm_head.weight` (T5 1.1 / FLAN-T5): logits = lm_head(h);
  * tied with rescaling (original T5): logits = shared(h * d_model**-0.5), our
    `logits_via_embedding=True`;
  * tied without rescaling (saved by transformers 5.x with
    `scale_decoder_outputs: false`): logits = shared(h). `T5Config` has no way
    to say "tied, unscaled", so the loader materialises
    `decoder/logits_dense/kernel` = shared.T (T5 1.1 layout). Likewise an
    `lm_head.weight` in a config that rescales gets the scale folded into the
    kernel. Both cost one extra [emb, vocab] matrix and are exact up to float
    rounding.
"""

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from specdec_jax.core.dtypes import default_dtype, optional_dtype
from specdec_jax.families.hub import download_from_hub, looks_like_hub_id
from specdec_jax.families.tensor_io import (
    CheckpointError, Tensor, TensorView, cast, hf_weight_files, raise_on_mismatch,
    transposed_block, write_json_atomic, write_safetensors)
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.network import T5

SPECDEC_CONFIG = "specdec_config.json"
SPECDEC_PARAMS = "params"
_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------
# Public entry points.


def load_checkpoint_model(path, *, dtype: Optional[str] = None, progress: bool = False,
                          place=None, **config_overrides) -> Model:
  """Loads a checkpoint of any supported format into a `Model`.

  Args:
    path: a local directory or file, a TensorStore URL (T5X), or a Hugging Face
      hub id.
    dtype: 'float32' / 'bfloat16' / 'float16' for the params and compute;
      default `core.dtypes.default_dtype()` (float32 on CPU).
    progress: show a tqdm bar while reading tensors.
    place: `(key tuple, array-like) -> array` putting one tensor where it
      belongs (default: the whole tensor on the default device);
      `loading.load_sharded_model` passes one that reads and sends each
      device only its slice. Hugging Face and T5X formats call it tensor by
      tensor with a lazy `tensor_io.TensorView` (`view[index]` reads one
      block from disk, `np.asarray(view)` all of it). Orbax checkpoints
      restore into `place.sharding(key, shape)` when `place` has one (each
      process reads only its shards), else whole onto this process's first
      device.
    **config_overrides: `T5Config` fields to set on top of the inferred config
      (e.g. relative_attention_max_distance for T5X checkpoints).
  Raises:
    FileNotFoundError: no such path (and not a reachable hub id).
    CheckpointError: unknown format, another architecture, damaged files, or
      missing / unexpected / mis-shaped tensors (all listed in one message).
  """
  dtype = optional_dtype(dtype) or default_dtype()
  path = os.fspath(path)
  fmt, location = detect_format(path)
  loaders = {"specdec": _load_specdec, "hf": _load_hf, "t5x": _load_t5x, "orbax": _load_orbax}
  model = loaders[fmt](location, dtype, progress, config_overrides, place)
  return model


def save_model(model: Model, path, *, overwrite: bool = False) -> None:
  """Saves `model` as an Orbax checkpoint that `load_model(path)` restores.

  Writes `path/params` (Orbax PyTree of the T5X params, in their dtype) and then
  `path/specdec_config.json` (the `T5Config`), atomically, so a directory with
  the JSON is complete. Local paths only.
  """
  import orbax.checkpoint as ocp
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path):
    if not overwrite:
      raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    shutil.rmtree(path)
  os.makedirs(path)
  ocp.PyTreeCheckpointer().save(os.path.join(path, SPECDEC_PARAMS), model.params)
  record = dict(format="specdec_jax", format_version=_FORMAT_VERSION,
                config=dataclasses.asdict(model.config))
  write_json_atomic(os.path.join(path, SPECDEC_CONFIG), record)


def detect_format(path: str) -> Tuple[str, str]:
  """Returns (format, location): format in {'specdec', 'hf', 't5x', 'orbax'}.

  `location` is the checkpoint directory (or URL); a hub id is downloaded first.
  """
  if "://" in path:
    # A TensorStore URL (gs://, s3://, file://, ...): a T5X msgpack is read
    # through TensorStore; otherwise remote paths go to Orbax, file:// to the
    # local checks below.
    if _remote_exists(path, "checkpoint"):
      return "t5x", path
    if not path.startswith("file://"):
      return "orbax", path
    path = path[len("file://"):]
  if not os.path.exists(path):
    if looks_like_hub_id(path):
      return "hf", download_from_hub(path)
    raise FileNotFoundError(f"No checkpoint at {path!r}: no such file or directory (and not a "
                            f"Hugging Face hub id like 'google/flan-t5-small')")
  if os.path.isfile(path):
    if os.path.basename(path) == "checkpoint":  # The T5X msgpack file itself.
      return "t5x", os.path.dirname(os.path.abspath(path))
    raise CheckpointError(f"{path} is a file; pass the checkpoint directory (a Hugging Face "
                          f"directory with config.json, a T5X checkpoint_N directory, or an "
                          f"Orbax checkpoint directory)")
  names = set(os.listdir(path))
  if ("checkpoint" not in names and "state" in names and
      os.path.isfile(os.path.join(path, "state", "_METADATA"))):
    # T5X's Orbax checkpoints (t5x.train's default): checkpoint_N/state/ is an
    # Orbax PyTree of T5X's state dict, beside dataset/ and Orbax step metadata.
    return "orbax", os.path.join(path, "state")
  if SPECDEC_CONFIG in names:
    return "specdec", path
  if "config.json" in names:
    return "hf", path
  if "checkpoint" in names and os.path.isfile(os.path.join(path, "checkpoint")):
    return "t5x", path
  if names & {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "checkpoint"}:
    return "orbax", path
  if names & {"model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"}:
    raise CheckpointError(f"{path} has Hugging Face weights but no config.json: copy the "
                          f"model's config.json next to them")
  raise CheckpointError(
      f"{path} is not a checkpoint directory: found {sorted(names)[:20]}, expected "
      f"config.json + model.safetensors / pytorch_model.bin (Hugging Face), a T5X 'checkpoint' "
      f"msgpack file, an Orbax checkpoint (_METADATA), or {SPECDEC_CONFIG} (save_model)")


# ----------------------------------------------------------------------------
# Shared: check every tensor against the config, then read and cast one by one.


def expected_shapes(config: T5Config) -> Dict[str, Tuple[int, ...]]:
  """Flat '/'-joined T5X param names -> shapes for `config` (no allocation)."""
  dummy = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  tree = jax.eval_shape(lambda a, b: T5(config).init(jax.random.PRNGKey(0), a, b), dummy, dummy)
  flat = traverse_util.flatten_dict(tree["params"], sep="/")
  return {k: tuple(v.shape) for k, v in flat.items()}


def _check_tensors(config: T5Config, tensors: Mapping[str, Tensor], origin: str,
                   source_names: Optional[Mapping[str, str]] = None,
                   unexpected: Sequence[str] = ()):
  """Raises one CheckpointError listing every missing, unexpected or mis-shaped tensor.

  Args:
    tensors: our param name -> tensor found in the checkpoint.
    source_names: our param name -> the checkpoint's name for it, used when
      reporting it missing (default: our name).
    unexpected: checkpoint tensors the format reader could not place.
  """
  want = expected_shapes(config)
  source_names = source_names or {}
  missing = [source_names.get(k, k) for k in want if k not in tensors]
  unexpected = list(unexpected) + [f"{tensors[k].source}" for k in tensors if k not in want]
  mismatched = [f"{tensors[k].source}: checkpoint {tensors[k].shape} vs expected {want[k]}"
                for k in want if k in tensors and tuple(tensors[k].shape) != want[k]]
  raise_on_mismatch(f"Checkpoint {origin} does not match the model config {_describe(config)}:",
                    missing, unexpected, mismatched)


def _describe(config: T5Config) -> str:
  return (f"(vocab {config.vocab_size}, emb {config.emb_dim}, heads {config.num_heads}x"
          f"{config.head_dim}, mlp {config.mlp_dim} {'/'.join(config.mlp_activations)}, "
          f"layers {config.num_encoder_layers}/{config.num_decoder_layers}, "
          f"logits_via_embedding={config.logits_via_embedding})")


def _assemble(config: T5Config, tensors: Mapping[str, Tensor], origin: str, progress: bool,
              place, source_names: Optional[Mapping[str, str]] = None,
              unexpected: Sequence[str] = ()) -> Model:
  """Checks, then reads each tensor, casts it to config.dtype and puts it on the device."""
  _check_tensors(config, tensors, origin, source_names, unexpected)
  dtype = jnp.dtype(config.dtype)
  keys = list(expected_shapes(config))
  if progress:
    from tqdm import tqdm
    keys = tqdm(keys, desc=f"loading {os.path.basename(origin.rstrip('/')) or origin}",
                unit="tensor")
  flat = {}
  for key in keys:
    if place is not None:
      # A lazy view: a sharded `place` reads only the blocks its devices hold.
      flat[tuple(key.split("/"))] = place(tuple(key.split("/")), TensorView(tensors[key], dtype))
      continue
    array = tensors[key].read(dtype)
    if array.shape != tensors[key].shape or array.dtype != dtype:  # A reader bug, not input.
      raise AssertionError(f"{tensors[key].source} read as {array.shape} {array.dtype}")
    flat[tuple(key.split("/"))] = jax.device_put(array)
    del array  # Free the host copy before reading the next tensor.
  return Model(config, traverse_util.unflatten_dict(flat))


# ----------------------------------------------------------------------------
# Hugging Face.

HF_MODEL_TYPES = ("t5", "mt5")
# Present in some HF checkpoints, equal to `shared.weight` or unused by T5.
_HF_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
               "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")
# HF feed_forward_proj -> our mlp_activations. HF runs 'gated-gelu' with
# gelu_new (tanh approximation), which is what our 'gelu' computes.
_HF_ACTIVATIONS = {
    "relu": ("relu",),
    "gated-relu": ("relu", "linear"),
    "gated-gelu": ("gelu", "linear"),
    "gelu_new": ("gelu_new",),
    "gated-gelu_new": ("gelu_new", "linear"),
    "silu": ("silu",),
    "gated-silu": ("silu", "linear"),
}


def hf_config_to_t5config(hf: Mapping[str, Any], origin: str = "config.json") -> Tuple[T5Config, bool]:
  """Our `T5Config` from a Hugging Face T5 config dict, and whether logits are rescaled.

  Returns:
    (config, scale_decoder_outputs). `config.logits_via_embedding` is True only
    for the tied-and-rescaled original T5 case; see the module docstring.
  """
  model_type = hf.get("model_type")
  if model_type not in HF_MODEL_TYPES:
    raise CheckpointError(f"{origin}: model_type {model_type!r} is not a T5 encoder-decoder "
                          f"(supported: {', '.join(HF_MODEL_TYPES)})")
  proj = hf.get("feed_forward_proj", "relu")
  if proj not in _HF_ACTIVATIONS:
    raise CheckpointError(f"{origin}: feed_forward_proj {proj!r} is not supported (exact-erf "
                          f"'gelu' has no counterpart here); supported: {sorted(_HF_ACTIVATIONS)}")
  tied = hf.get("tie_word_embeddings", True) is not False
  # transformers >= 5 writes tie_word_embeddings: true always and records the
  # rescaling separately; older configs rescale exactly when tied.
  scale = bool(hf.get("scale_decoder_outputs", tied))
  eos = hf.get("eos_token_id", 1)
  if isinstance(eos, (list, tuple)):
    eos = eos[0]
  try:
    num_layers = int(hf["num_layers"])
    config = T5Config(
        vocab_size=int(hf["vocab_size"]), emb_dim=int(hf["d_model"]),
        num_heads=int(hf["num_heads"]), head_dim=int(hf["d_kv"]), mlp_dim=int(hf["d_ff"]),
        num_encoder_layers=num_layers,
        num_decoder_layers=int(hf.get("num_decoder_layers") or num_layers),
        mlp_activations=_HF_ACTIVATIONS[proj],
        logits_via_embedding=tied and scale,
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-6)),
        pad_id=int(hf.get("pad_token_id", 0) or 0), eos_id=int(eos),
        decoder_start_id=int(hf.get("decoder_start_token_id", 0) or 0))
  except KeyError as e:
    raise CheckpointError(f"{origin}: missing field {e.args[0]!r}") from None
  except ValueError as e:
    raise CheckpointError(f"{origin}: {e}") from None
  return config, scale


def _hf_names(config: T5Config) -> Dict[str, Tuple[str, bool]]:
  """Our param name -> (HF tensor name, transpose?) for everything but the logits."""
  names = {"token_embedder/embedding": ("shared.weight", False)}
  mlp = ["wi"] if len(config.mlp_activations) == 1 else [
      f"wi_{i}" for i in range(len(config.mlp_activations))]
  mlp += ["wo"]

  def attention(ours, theirs):
    for x, y in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
      names[f"{ours}/{x}/kernel"] = (f"{theirs}.{y}.weight", True)

  for stack, layers in (("encoder", config.num_encoder_layers),
                        ("decoder", config.num_decoder_layers)):
    names[f"{stack}/relpos_bias/rel_embedding"] = (
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True)
    names[f"{stack}/{stack}_norm/scale"] = (f"{stack}.final_layer_norm.weight", False)
    for i in range(layers):
      ours, theirs = f"{stack}/layers_{i}", f"{stack}.block.{i}.layer"
      if stack == "encoder":
        norms = ["pre_attention_layer_norm", "pre_mlp_layer_norm"]
        attention(f"{ours}/attention", f"{theirs}.0.SelfAttention")
      else:
        norms = ["pre_self_attention_layer_norm", "pre_cross_attention_layer_norm",
                 "pre_mlp_layer_norm"]
        attention(f"{ours}/self_attention", f"{theirs}.0.SelfAttention")
        attention(f"{ours}/encoder_decoder_attention", f"{theirs}.1.EncDecAttention")
      for j, norm in enumerate(norms):
        names[f"{ours}/{norm}/scale"] = (f"{theirs}.{j}.layer_norm.weight", False)
      for w in mlp:
        names[f"{ours}/mlp/{w}/kernel"] = (f"{theirs}.{len(norms) - 1}.DenseReluDense.{w}.weight",
                                           True)
  return names


def _load_hf(directory: str, dtype: str, progress: bool, overrides, place) -> Model:
  config_path = os.path.join(directory, "config.json")
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{config_path}: cannot read: {e}") from None
  config, scale = hf_config_to_t5config(hf, config_path)
  files = hf_weight_files(directory)
  has_lm_head = "lm_head.weight" in files
  if not config.logits_via_embedding or has_lm_head:
    config = config.replace(logits_via_embedding=False)
  config = config.replace(dtype=dtype, **overrides)

  wanted = dict(_hf_names(config))
  if not config.logits_via_embedding:
    head = "lm_head.weight" if has_lm_head else "shared.weight"
    wanted["decoder/logits_dense/kernel"] = (head, True)
  tensors = {}
  for ours, (theirs, transpose) in wanted.items():
    if theirs in files:
      # Rescaling the decoder output before an untied head = scaling its kernel.
      rescale = scale and ours == "decoder/logits_dense/kernel"
      tensors[ours] = _hf_tensor(files[theirs], transpose,
                                 config.emb_dim ** -0.5 if rescale else None)
  used = {theirs for theirs, _ in wanted.values()}
  unexpected = [f"{files[k].source}" for k in sorted(files)
                if k not in used and k not in _HF_IGNORED]
  source_names = {ours: f"{theirs} (for {ours})" for ours, (theirs, _) in wanted.items()}
  return _assemble(config, tensors, directory, progress, place, source_names, unexpected)


def _hf_tensor(stored: Tensor, transpose: bool, scale: Optional[float] = None) -> Tensor:
  shape = tuple(reversed(stored.shape)) if transpose else tuple(stored.shape)

  def read_block(index, dtype):
    block = transposed_block(stored, index) if transpose else stored.block(index, None)
    return cast(block, dtype, scale=scale)

  return Tensor(stored.source, shape,
                 lambda dtype: cast(stored.read(None), dtype, transpose, scale),
                 read_block if stored.read_block else None)


def hf_tensor_layout(config: T5Config) -> Dict[str, Tuple[str, Tuple[int, ...], bool]]:
  """HF tensor name -> (our param name, HF shape, transposed?) for `config`.

  Untied models get `lm_head.weight` (from `decoder/logits_dense/kernel`); tied
  ones (logits_via_embedding) have none, as original T5 directories.
  """
  shapes = expected_shapes(config)
  layout = {}
  for ours, (theirs, transpose) in _hf_names(config).items():
    layout[theirs] = (ours, tuple(reversed(shapes[ours])) if transpose else shapes[ours],
                      transpose)
  if not config.logits_via_embedding:
    layout["lm_head.weight"] = ("decoder/logits_dense/kernel",
                                tuple(reversed(shapes["decoder/logits_dense/kernel"])), True)
  return layout


def t5config_to_hf_config(config: T5Config) -> Dict[str, Any]:
  """A transformers `config.json` dict in the published (pre-5.x) convention."""
  reverse = {v: k for k, v in _HF_ACTIVATIONS.items()}
  if config.mlp_activations not in reverse:
    raise ValueError(f"mlp_activations {config.mlp_activations} have no Hugging Face "
                     f"feed_forward_proj")
  return dict(
      architectures=["T5ForConditionalGeneration"], model_type="t5", is_encoder_decoder=True,
      vocab_size=config.vocab_size, d_model=config.emb_dim, d_kv=config.head_dim,
      d_ff=config.mlp_dim, num_heads=config.num_heads, num_layers=config.num_encoder_layers,
      num_decoder_layers=config.num_decoder_layers,
      feed_forward_proj=reverse[config.mlp_activations],
      tie_word_embeddings=config.logits_via_embedding,
      relative_attention_num_buckets=config.relative_attention_num_buckets,
      relative_attention_max_distance=config.relative_attention_max_distance,
      layer_norm_epsilon=config.layer_norm_epsilon, dropout_rate=0.0,
      pad_token_id=config.pad_id, eos_token_id=config.eos_id,
      decoder_start_token_id=config.decoder_start_id)


def export_hf(model: Model, directory) -> None:
  """Writes `model` as a Hugging Face directory (config.json + model.safetensors).

  The layout is the published one (T5 1.1: separate `lm_head.weight`,
  `tie_word_embeddings: false`; original T5: tied, rescaled), which both
  transformers 4.x and 5.x load.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  flat = traverse_util.flatten_dict(model.params, sep="/")
  dtype = np.dtype(jnp.dtype(model.config.dtype))
  entries = []
  for theirs, (ours, shape, transpose) in hf_tensor_layout(model.config).items():
    def make(ours=ours, transpose=transpose):
      array = np.asarray(flat[ours])
      return array.T if transpose else array
    entries.append((theirs, shape, dtype, make))
  write_safetensors(os.path.join(directory, "model.safetensors"), entries, {"format": "pt"})
  write_json_atomic(os.path.join(directory, "config.json"),
                     t5config_to_hf_config(model.config))


# ----------------------------------------------------------------------------
# T5X (msgpack + TensorStore) and Orbax.

# Top-level subtrees that may hold the params, most specific first.
_PARAM_PREFIXES = (("optimizer", "target"), ("target",), ("params",), ("state", "params"),
                   ("params", "params"), ())


def _find_params(tree: Mapping[str, Any], origin: str) -> Tuple[Tuple[str, ...], Mapping]:
  for prefix in _PARAM_PREFIXES:
    node = tree
    for key in prefix:
      node = node.get(key) if isinstance(node, Mapping) else None
    if isinstance(node, Mapping) and "token_embedder" in node:
      return prefix, node
  raise CheckpointError(f"{origin}: no T5 params tree (with token_embedder/encoder/decoder) at "
                        f"any of {['/'.join(p) or '<root>' for p in _PARAM_PREFIXES]}; top-level "
                        f"keys: {sorted(tree)[:20]}")


def infer_config_from_shapes(shapes: Mapping[str, Sequence[int]], origin: str,
                             dtype: str, overrides) -> T5Config:
  """A `T5Config` from flat T5X param names -> shapes.

  Shapes fix every size; activations are inferred as gated GELU (T5 1.1) when
  `wi_0` exists, else ReLU; `relative_attention_max_distance` defaults to 128.
  """
  needed = ["token_embedder/embedding", "encoder/relpos_bias/rel_embedding",
            "encoder/layers_0/attention/query/kernel", "encoder/layers_0/mlp/wo/kernel"]
  absent = [k for k in needed if k not in shapes]
  if absent:
    raise CheckpointError(f"{origin}: cannot infer the model config, missing params {absent}")

  def count(stack):
    return len({k.split("/")[1] for k in shapes
                if k.startswith(f"{stack}/layers_") and k.split("/")[1][7:].isdigit()})

  vocab, emb = shapes["token_embedder/embedding"]
  heads, buckets = shapes["encoder/relpos_bias/rel_embedding"]
  inner = shapes["encoder/layers_0/attention/query/kernel"][1]
  gated = "encoder/layers_0/mlp/wi_0/kernel" in shapes
  fields = dict(
      vocab_size=int(vocab), emb_dim=int(emb), num_heads=int(heads),
      head_dim=int(inner) // int(heads), mlp_dim=int(shapes["encoder/layers_0/mlp/wo/kernel"][0]),
      num_encoder_layers=count("encoder"), num_decoder_layers=count("decoder"),
      mlp_activations=("gelu", "linear") if gated else ("relu",),
      logits_via_embedding="decoder/logits_dense/kernel" not in shapes,
      relative_attention_num_buckets=int(buckets), dtype=dtype)
  fields.update(overrides)
  try:
    return T5Config(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{origin}: inferred config is invalid: {e}") from None


def _local_or_url(location: str) -> str:
  return location if "://" in location else os.path.abspath(location)


def _remote_exists(url: str, name: str) -> bool:
  import tensorstore as ts
  try:
    store = ts.KvStore.open(url.rstrip("/") + "/").result()
    return store.read(name).result().state == "value"
  except Exception:  # Unreachable or unsupported: let the Orbax path report it.
    return False


def _read_t5x_msgpack(location: str) -> bytes:
  if "://" in location:
    import tensorstore as ts
    result = ts.KvStore.open(location.rstrip("/") + "/").result().read("checkpoint").result()
    if result.state != "value":
      raise CheckpointError(f"{location}/checkpoint: not found")
    return bytes(result.value)
  with open(os.path.join(location, "checkpoint"), "rb") as f:
    return f.read()


def _load_t5x(location: str, dtype: str, progress: bool, overrides, place) -> Model:
  from flax import serialization
  location = _local_or_url(location)
  msgpack_file = f"{location.rstrip('/')}/checkpoint"
  try:
    contents = serialization.msgpack_restore(_read_t5x_msgpack(location))
  except CheckpointError:
    raise
  except Exception as e:
    raise CheckpointError(f"{msgpack_file}: not a T5X msgpack checkpoint ({e})") from None
  if not isinstance(contents, Mapping):
    raise CheckpointError(f"{msgpack_file}: not a T5X msgpack checkpoint")
  version = int(contents.get("version", 0))
  prefix, params = _find_params(contents, msgpack_file)
  flat = traverse_util.flatten_dict(params, sep="/", is_leaf=_is_ts_spec)
  tensors = {k: _t5x_tensor(location, k, leaf, version, msgpack_file) for k, leaf in flat.items()}
  shapes = {k: t.shape for k, t in tensors.items()}
  config = infer_config_from_shapes(shapes, msgpack_file, dtype, overrides)
  return _assemble(config, tensors, location, progress, place)


def _is_ts_spec(path, node) -> bool:
  del path
  return isinstance(node, Mapping) and "driver" in node and ("kvstore" in node or "path" in node)


def _t5x_relative_path(spec: Mapping[str, Any]) -> str:
  """The array directory, relative to the checkpoint, named by a T5X TensorStore spec.

  T5X has written three layouts over time (see t5x/checkpoints.py `_get_spec`
  and `_update_ts_path_from_relative_to_absolute`):
    * tensorstore < 0.1.14: `{'driver': 'zarr', 'path': 'target.x', 'kvstore': {...}}`;
    * later: `{'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': 'target.x/'}}`
      (current tensorstore normalises the path with a trailing slash);
    * written to GCS: `{'kvstore': {'driver': 'gcs', 'bucket': 't5x-dummy-bucket',
      'path': 'target.x/'}}` (or the path at the top level), the bucket a dummy.
  A kvstore given as a URL string ('gs://bucket/target.x/', 'file://target.x')
  is reduced the same way. Returns '' when the spec names no path.
  """
  kvstore = spec.get("kvstore")
  if isinstance(kvstore, str):
    scheme, _, rest = kvstore.partition("://")
    # gs://bucket/path: the bucket is T5X's dummy or the original one; either
    # way the array now lives next to the msgpack.
    relative = rest.partition("/")[2] if scheme in ("gs", "s3") else rest
  elif isinstance(kvstore, Mapping) and kvstore.get("path"):
    relative = kvstore["path"]
  else:
    relative = spec.get("path") or ""
  # Joining 'dir' + 'target.x/' + '/' would give '//', which the file driver
  # rejects ("Invalid file path"); T5X only ever writes one directory level.
  return str(relative).strip("/")


def _t5x_tensor(location: str, key: str, leaf: Any, version: int, origin: str) -> Tensor:
  """A msgpack leaf: an inline array, or a TensorStore spec with a relative path."""
  if not _is_ts_spec((), leaf):
    array = np.asarray(leaf)
    if array.dtype == object or not np.issubdtype(array.dtype, np.number):
      raise CheckpointError(f"{origin}: param {key} is a {type(leaf).__name__}, not an array")
    return Tensor(f"{origin}: {key} (inline)", tuple(array.shape),
                   lambda dtype: np.asarray(array, dtype=dtype),
                   lambda index, dtype: np.asarray(array[index], dtype=dtype))
  import tensorstore as ts
  relative = _t5x_relative_path(leaf)
  if not relative:
    raise CheckpointError(f"{origin}: param {key} has a TensorStore spec without a path: {leaf}")
  # The spec's own kvstore driver (file / gcs with a dummy bucket) is where the
  # checkpoint was written; the arrays now live next to the msgpack file.
  if "://" in location:
    spec = {"driver": leaf["driver"], "kvstore": f"{location.rstrip('/')}/{relative}/"}
  else:
    spec = {"driver": leaf["driver"],
            "kvstore": {"driver": "file", "path": os.path.join(location, relative) + "/"}}
  source = f"{location.rstrip('/')}/{relative}"
  try:
    store = ts.open(spec, read=True, open=True).result()
  except Exception as e:
    raise CheckpointError(f"{source}: cannot open array for param {key} ({e})") from None
  shape = tuple(int(d) for d in store.shape)
  # T5X checkpoints before version 3 stored bfloat16 as uint16 bit patterns.
  as_bfloat16 = version < 3 and store.dtype == ts.uint16

  def read(dtype, index=()):
    # TensorStore reads only the chunks overlapping `index`.
    try:
      view = store[index] if index else store
      if as_bfloat16:
        return np.asarray(view.read().result().view(ml_dtypes.bfloat16), dtype=dtype)
      if dtype is None:
        return view.read().result()
      return ts.cast(view, ts.dtype(jnp.dtype(dtype).name)).read().result()
    except Exception as e:
      raise CheckpointError(f"{source}: cannot read array for param {key} ({e})") from None

  return Tensor(source, shape, read, lambda index, dtype: read(dtype, index))


# T5X's chunk budget (t5x/checkpoints.py `_choose_chunk_shape`): reads of a
# large array proceed chunk by chunk instead of one huge gzip stream.
_T5X_CHUNK_BYTES = 64 * 1024 * 1024
T5X_VERSION = 3  # What t5x.checkpoints.VERSION has been since 2021.


def export_t5x(model: Model, directory, *, step: int = 0, overwrite: bool = False) -> str:
  """Writes `model` as a T5X checkpoint that `t5x.checkpoints.Checkpointer.restore` reads.

  The layout is what T5X's own `Checkpointer.save` writes for an
  `InferenceState` (no optimizer state): a msgpack file `checkpoint` holding
  `{'version': 3, 'optimizer': {'target': <params>, 'state': {'step': step}}}`,
  every param a TensorStore zarr spec whose kvstore path, relative to the
  directory, names a gzip zarr array `target.<dotted.param.path>` beside it.
  T5X restores it into any train state of the same network (its optimizer
  state, absent here, comes from initialisation); `load_model(directory)`
  reads it back. Arrays are written in the model's dtype, one at a time.

  Args:
    model: the model to write.
    directory: the checkpoint directory to create (T5X names it checkpoint_<step>).
    step: the training step recorded in the checkpoint.
    overwrite: replace an existing directory.
  Returns:
    the directory's absolute path.
  """
  import tensorstore as ts
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    shutil.rmtree(directory)
  # Like T5X: write into a temporary sibling and rename, so a directory with a
  # `checkpoint` file is always complete.
  os.makedirs(os.path.dirname(directory), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp-",
                         dir=os.path.dirname(directory))
  try:
    specs = {}
    for path, value in traverse_util.flatten_dict(model.params).items():
      array = np.asarray(value)
      name = "target." + ".".join(path)
      row_bytes = max(1, array.nbytes // max(1, array.shape[0]))
      chunks = [max(1, min(array.shape[0], _T5X_CHUNK_BYTES // row_bytes))] + list(array.shape[1:])
      metadata = {"chunks": chunks, "compressor": {"id": "gzip", "level": 1},
                  "shape": list(array.shape)}
      dtype = jnp.dtype(array.dtype).name
      store = ts.open({"driver": "zarr", "dtype": dtype, "metadata": metadata,
                       "kvstore": {"driver": "file", "path": os.path.join(tmp, name) + "/"}},
                      create=True).result()
      store.write(array).result()
      # T5X keeps the path relative so the directory can move (even to GCS).
      specs[path] = {"driver": "zarr", "dtype": dtype, "metadata": metadata,
                     "kvstore": {"driver": "file", "path": name + "/"}}
      del array, store
    contents = {"version": T5X_VERSION,
                "optimizer": {"target": traverse_util.unflatten_dict(specs),
                              "state": {"step": np.int32(step)}}}
    from flax import serialization
    with open(os.path.join(tmp, "checkpoint"), "wb") as f:
      f.write(serialization.msgpack_serialize(contents))
    os.replace(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return directory


def _orbax_metadata_tree(location: str):
  import orbax.checkpoint as ocp
  try:
    metadata = ocp.PyTreeCheckpointer().metadata(location)
  except Exception as e:
    raise CheckpointError(f"{location}: not a readable Orbax checkpoint ({e})") from None
  tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
  if not isinstance(tree, Mapping):
    raise CheckpointError(f"{location}: unexpected Orbax metadata {type(metadata).__name__}")
  return tree


def _restore_orbax(location: str, prefix: Tuple[str, ...], config: T5Config, origin: str,
                   metadata_params: Mapping, progress: bool, place=None) -> Model:
  """Checks shapes from Orbax metadata, then restores only the params, cast on read.

  With a sharded `place` (one with `.sharding(key, shape)`, as
  `loading.ShardedPlacement`), every array is restored straight into its
  target sharding: Orbax asks TensorStore for the index ranges of this
  process's devices only (each distinct block once), so no process reads a
  tensor whole. Otherwise each array lands whole on this process's first
  device.
  """
  import orbax.checkpoint as ocp
  flat = traverse_util.flatten_dict(metadata_params, sep="/")
  tensors = {k: Tensor(f"{origin}: {k}", tuple(getattr(v, "shape", ()) or ()), None)
             for k, v in flat.items()}
  _check_tensors(config, tensors, origin)
  dtype = jnp.dtype(config.dtype)
  # jax.local_devices: on several processes jax.devices()[0] is process 0's.
  local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  sharding_of = getattr(place, "sharding", None)
  target = traverse_util.unflatten_dict(
      {tuple(k.split("/")): jax.ShapeDtypeStruct(s, dtype)
       for k, s in expected_shapes(config).items()})
  restore_args = traverse_util.unflatten_dict({
      key: ocp.ArrayRestoreArgs(dtype=s.dtype, sharding=local if sharding_of is None else
                                sharding_of(key, s.shape))
      for key, s in traverse_util.flatten_dict(target).items()})
  for key in reversed(prefix):
    target, restore_args = {key: target}, {key: restore_args}
  if progress:
    print(f"restoring {len(tensors)} tensors from {origin} (Orbax) ...", flush=True)
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        location, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                              partial_restore=True))
  except Exception as e:
    raise CheckpointError(f"{origin}: Orbax restore failed ({e})") from None
  for key in prefix:
    restored = restored[key]
  return Model(config, restored)


def _load_orbax(location: str, dtype: str, progress: bool, overrides, place) -> Model:
  location = _local_or_url(location)
  tree = _orbax_metadata_tree(location)
  prefix, params = _find_params(tree, location)
  shapes = {k: tuple(getattr(v, "shape", ()) or ())
            for k, v in traverse_util.flatten_dict(params, sep="/").items()}
  config = infer_config_from_shapes(shapes, location, dtype, overrides)
  return _restore_orbax(location, prefix, config, location, params, progress, place)


def _load_specdec(directory: str, dtype: str, progress: bool, overrides, place) -> Model:
  config_path = os.path.join(directory, SPECDEC_CONFIG)
  try:
    with open(config_path) as f:
      record = json.load(f)
    fields = dict(record["config"])
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise CheckpointError(f"{config_path}: unreadable ({e})") from None
  if record.get("format") != "specdec_jax" or record.get("format_version") != _FORMAT_VERSION:
    raise CheckpointError(f"{config_path}: unknown format {record.get('format')!r} version "
                          f"{record.get('format_version')!r}")
  fields.update(overrides, dtype=dtype)
  try:
    config = T5Config(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{config_path}: invalid config ({e})") from None
  location = os.path.join(os.path.abspath(directory), SPECDEC_PARAMS)
  if not os.path.isdir(location):
    raise CheckpointError(f"{directory}: has {SPECDEC_CONFIG} but no {SPECDEC_PARAMS}/ directory")
  params = _orbax_metadata_tree(location)
  return _restore_orbax(location, (), config, location, params, progress, place)

