"""Public Medusa-1 head directories (FasterDecoding/Medusa): reading and writing.

A directory holds config.json, with `medusa_num_heads` and `medusa_num_layers`,
and the heads' weights in `medusa_lm_head.safetensors` or `medusa_lm_head.pt`
(a torch state dict; the safetensors file wins where both exist). Each head i
is an `nn.Sequential` of num_layers residual blocks then a bias-free LM head:

  {i}.{j}.linear.weight [h, h]  ->  kernel[j, i] (transposed: ours are [in, out])
  {i}.{j}.linear.bias   [h]     ->  bias[j, i]
  {i}.{L}.weight    [vocab, h]  ->  lm_head[i] (transposed)

for i < medusa_num_heads, j < L = medusa_num_layers. Shapes are checked
against the target (its hidden size and vocabulary) before anything is
read, and every problem names its file and tensor.

The format registers itself as 'medusa1' (`families.head_formats`), serving
every family that exposes its hidden states; `loading.load_medusa_draft` finds
it there.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.head_formats import HeadFormat, register_head_format
from specdec_jax.families.registry import family_of
from specdec_jax.families.tensor_io import (CheckpointError, cast, raise_on_mismatch,
                                            read_config_json, safetensors_tensors,
                                            torch_tensors, write_safetensors)

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def tensor_names(num_heads: int, num_layers: int):
  """{checkpoint tensor name: (our param, index tuple, transposed)}."""
  names = {}
  for i in range(num_heads):
    for j in range(num_layers):
      names[f"{i}.{j}.linear.weight"] = ("kernel", (j, i), True)
      names[f"{i}.{j}.linear.bias"] = ("bias", (j, i), False)
    names[f"{i}.{num_layers}.weight"] = ("lm_head", (i,), True)
  return names


def _read_config(directory: str):
  hf = read_config_json(directory, "a Medusa head directory",
                        f"config.json and {' or '.join(WEIGHT_FILES)}")
  path = os.path.join(directory, "config.json")
  for key in ("medusa_num_heads", "medusa_num_layers"):
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise CheckpointError(f"{path}: {key} must be an int >= 1 (a Medusa-1 config), got "
                            f"{value!r}")
  return hf


def _weight_file(directory: str):
  for name in WEIGHT_FILES:
    path = os.path.join(directory, name)
    if os.path.exists(path):
      return path, (safetensors_tensors if name.endswith(".safetensors") else torch_tensors)
  raise CheckpointError(f"{directory} has a config.json but no Medusa weights: expected "
                        f"{' or '.join(WEIGHT_FILES)}; found {sorted(os.listdir(directory))}")


def load_heads(directory, target, dtype=None):
  """Reads a Medusa-1 directory for `target`: (num_heads, num_layers, params of
  `MedusaDraft`, in `dtype`, default the target's).

  Raises:
    CheckpointError: naming the file and tensor at fault (a hidden size or vocabulary
      other than the target's, missing or unexpected tensors).
  """
  directory = os.fspath(directory)
  hf = _read_config(directory)
  heads, layers = hf["medusa_num_heads"], hf["medusa_num_layers"]
  path, reader = _weight_file(directory)
  files = reader(path)
  hidden = family_of(target).feature_dim(target.config, None)
  vocab = target.config.vocab_size
  names = tensor_names(heads, layers)
  shapes = {"kernel": (hidden, hidden), "bias": (hidden,), "lm_head": (vocab, hidden)}
  missing = [name for name in names if name not in files]
  unexpected = [files[k].source for k in sorted(files) if k not in names]
  mismatched = [f"{files[k].source}: {tuple(files[k].shape)} vs expected {shapes[names[k][0]]}"
                for k in names if k in files and tuple(files[k].shape) != shapes[names[k][0]]]
  raise_on_mismatch(f"Medusa heads {directory} ({heads} heads x {layers} layers) do not match "
                    f"the target (hidden size {hidden}, vocabulary {vocab}):", missing,
                    unexpected, mismatched)
  np_dtype = jnp.dtype(dtype or target.config.dtype)
  params = dict(kernel=np.zeros((layers, heads, hidden, hidden), np_dtype),
                bias=np.zeros((layers, heads, hidden), np_dtype),
                lm_head=np.zeros((heads, hidden, vocab), np_dtype))
  for name, (param, index, transpose) in names.items():
    params[param][index] = cast(files[name].read(None), np_dtype, transpose)
  return heads, layers, params


def save_heads(draft, directory) -> None:
  """Writes a `MedusaDraft`'s heads as a Medusa-1 directory (config.json +
  medusa_lm_head.safetensors) that `load_heads` (and Medusa's own code) read."""
  if draft.share_lm_head:
    raise ValueError("this MedusaDraft shares the target's output projection; the Medusa-1 "
                     "format stores an LM head per head: build it with share_lm_head=False")
  directory = os.fspath(directory)
  params = {k: np.asarray(v) for k, v in draft.head_params.items()}
  tensors = []
  for name, (param, index, transpose) in sorted(
      tensor_names(draft.num_heads, draft.num_layers).items()):
    array = params[param][index]
    array = array.T if transpose else array
    tensors.append((name, array.shape, array.dtype, lambda a=array: np.ascontiguousarray(a)))
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, WEIGHT_FILES[0]), tensors,
                    metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(dict(medusa_num_heads=draft.num_heads, medusa_num_layers=draft.num_layers,
                   hidden_size=draft.hidden_dim, vocab_size=draft.vocab_size), f, indent=2)


def detects(directory) -> bool:
  """Whether `directory` holds a Medusa-1 config.json (`medusa_num_heads`) and weights."""
  directory = os.fspath(directory)
  try:
    with open(os.path.join(directory, "config.json")) as f:
      hf = json.load(f)
  except (OSError, ValueError):
    return False
  return (isinstance(hf, dict) and "medusa_num_heads" in hf and
          any(os.path.exists(os.path.join(directory, name)) for name in WEIGHT_FILES))


def _diagnose(directory) -> None:
  """Raises the CheckpointError that says why `directory` holds no Medusa-1 heads."""
  directory = os.fspath(directory)
  _read_config(directory)
  _weight_file(directory)


def _load(directory, target, dtype=None):
  heads, layers, params = load_heads(directory, target, dtype)
  return dict(num_heads=heads, num_layers=layers,
              params=jax.tree_util.tree_map(jnp.asarray, params))


MEDUSA1 = register_head_format(HeadFormat(
    name="medusa1", kind="medusa", families=None,
    targets="any family that exposes its hidden states (Family.supports_features)",
    detect=detects, load=_load, save=save_heads,
    diagnose=_diagnose))
