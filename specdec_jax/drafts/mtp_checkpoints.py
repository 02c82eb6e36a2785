"""A checkpoint's own MTP modules -> `MtpDraft` (`sj.load_mtp_draft`).

The modules live in the model's own directory, beside its layers (the loader
reads only them; the target's tensors are the target's business). Three
layouts, told apart by tensor names (or named with `layout=`); L is the
target's num_hidden_layers, module k in [0, N):

  deepseek (DeepSeek-V3 / R1, GLM-4.5; config.json `num_nextn_predict_layers: N`):
    model.layers.{L+k}.enorm.weight, .hnorm.weight, .eh_proj.weight [h, 2h]
    model.layers.{L+k}.shared_head.norm.weight, .shared_head.head.weight [vocab, h]
    model.layers.{L+k}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}
    model.layers.{L+k}.embed_tokens.weight (optional: read as the module's own table
      only where it differs from the target's)
  qwen3_next (Qwen3-Next, Qwen3.5; `num_nextn_predict_layers` or
  `mtp_num_hidden_layers`, else counted from the tensors):
    mtp.fc.weight [h, 2h], mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight,
    mtp.norm.weight (shared by the modules), mtp.layers.{k}.* (a layer of the target's kind)
  mimo (MiMo-7B; `num_nextn_predict_layers`, else counted):
    model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj [h, 2h],
    input_layernorm, self_attn.*, post_attention_layernorm, mlp.*, final_layernorm}

A module's decoder layer is read with the target layout's own tensor names
(`checkpoints.hf_names` of the target's config grown by N layers: the names of
its layer L + k, moved under the module's prefix), so it reads whatever layer
kind the target's family reads. Errors (CheckpointError): no MTP modules (naming,
per layout, the config keys and tensor prefixes looked for); a hidden size,
vocabulary or (DeepSeek) layer count unlike the target's; missing, unexpected
and mis-shaped tensors, all listed at once.
"""

import os
import re
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specdec_jax.families.tensor_io import (CheckpointError, cast, hf_weight_files,
                                            raise_on_mismatch, read_config_json)

WHAT = "a model directory with MTP modules"
HOLDS = "config.json and the model's safetensors, MTP modules included"
LAYOUTS = ("deepseek", "qwen3_next", "mimo")

LOOKED_FOR = {
    "deepseek": ("config.json num_nextn_predict_layers >= 1 and tensors "
                 "model.layers.{L + k}.{enorm, hnorm, eh_proj, shared_head.norm, "
                 "shared_head.head, self_attn.*, mlp.*} (L = num_hidden_layers)"),
    "qwen3_next": ("tensors mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, "
                   "mtp.norm, mtp.layers.{k}.* (config.json num_nextn_predict_layers or "
                   "mtp_num_hidden_layers)"),
    "mimo": ("tensors model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj, "
             "self_attn.*, mlp.*, final_layernorm} (config.json num_nextn_predict_layers)"),
}


def _value(hf: dict, *names):
  """The first of `names` set in config.json or its text_config (Qwen3.5)."""
  for source in (hf, hf.get("text_config") or {}):
    for name in names:
      if source.get(name) is not None:
        return source[name]
  return None


def _prefixes(layout: str, num_layers: int) -> str:
  return {"deepseek": f"model.layers.{num_layers}.", "qwen3_next": "mtp.",
          "mimo": "model.mtp_layers."}[layout]


def detect_layout(names, hf: dict, num_layers: int) -> Optional[str]:
  """Which layout a directory's tensor names hold (None: none)."""
  names = list(names)
  if any(n.startswith("mtp.") for n in names):
    return "qwen3_next"
  if any(n.startswith("model.mtp_layers.") for n in names):
    return "mimo"
  if (_value(hf, "num_nextn_predict_layers") or 0) >= 1 and any(
      n.startswith(f"model.layers.{num_layers}.") for n in names):
    return "deepseek"
  return None


def _num_modules(layout: str, hf: dict, names, path: str) -> int:
  keys = {"deepseek": ("num_nextn_predict_layers",),
          "qwen3_next": ("mtp_num_hidden_layers", "num_nextn_predict_layers"),
          "mimo": ("num_nextn_predict_layers",)}[layout]
  value = _value(hf, *keys)
  if value is None and layout != "deepseek":
    pattern = re.compile(r"^(?:mtp\.layers|model\.mtp_layers)\.(\d+)\.")
    found = {int(m.group(1)) for m in map(pattern.match, names) if m}
    value = max(found) + 1 if found else None
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise CheckpointError(f"{path}: {' / '.join(keys)} must be an int >= 1 (the MTP modules), "
                          f"got {value!r}")
  return value


def _own_names(layout: str, k: int, num_layers: int) -> Dict[str, Tuple[str, bool]]:
  """Module k's own arrays: our flat name -> (tensor name, transpose)."""
  if layout == "deepseek":
    p = f"model.layers.{num_layers + k}."
    return {"token_norm/scale": (p + "enorm.weight", False),
            "hidden_norm/scale": (p + "hnorm.weight", False),
            "proj/kernel": (p + "eh_proj.weight", True),
            "final_norm/scale": (p + "shared_head.norm.weight", False),
            "head/kernel": (p + "shared_head.head.weight", True)}
  if layout == "qwen3_next":
    return {"token_norm/scale": ("mtp.pre_fc_norm_embedding.weight", False),
            "hidden_norm/scale": ("mtp.pre_fc_norm_hidden.weight", False),
            "proj/kernel": ("mtp.fc.weight", True),
            "final_norm/scale": ("mtp.norm.weight", False)}
  p = f"model.mtp_layers.{k}."
  return {"token_norm/scale": (p + "token_layernorm.weight", False),
          "hidden_norm/scale": (p + "hidden_layernorm.weight", False),
          "proj/kernel": (p + "input_proj.weight", True),
          "final_norm/scale": (p + "final_layernorm.weight", False)}


def _layer_prefix(layout: str, k: int, num_layers: int) -> str:
  return {"deepseek": f"model.layers.{num_layers + k}.", "qwen3_next": f"mtp.layers.{k}.",
          "mimo": f"model.mtp_layers.{k}."}[layout]


def _layer_names(head, layout: str, k: int):
  """Module k's decoder layer: (our flat name -> (tensor name, transpose), our expert
  params -> (per-expert tensor names, fused name)), the target layout's names for its layer
  L + k moved under the module's prefix."""
  from specdec_jax.families.decoder_only import checkpoints
  j = head.layer_index[k]
  ours, theirs = f"layers_{j}/", f"model.layers.{j}."
  prefix = _layer_prefix(layout, k, head.config.num_layers)

  def move(name):
    if not name.startswith(theirs):
      raise CheckpointError(f"the target layout names its layer {j}'s tensor {name}, which "
                            "an MTP module cannot hold")
    return prefix + name[len(theirs):]

  names = {}
  for key, (name, transform, part) in checkpoints.hf_names(head.extended).items():
    if key.startswith(ours):
      if part is not None or transform not in ("copy", "transpose"):
        raise CheckpointError(f"{key}: a fused or split tensor ({name}); MTP modules of this "
                              "layout are not read")
      names["layer/" + key[len(ours):]] = (move(name), transform == "transpose")
  experts = {}
  for key, (per_expert, fused) in checkpoints.hf_expert_names(head.extended).items():
    if key.startswith(ours):
      experts["layer/" + key[len(ours):]] = (tuple(move(n) for n in per_expert), move(fused))
  return names, experts


def _flat_shapes(head) -> Dict[str, Tuple[int, ...]]:
  """'{k}/{our flat name}' -> shape of every module array."""
  tree = jax.eval_shape(head._init, jax.random.PRNGKey(0))
  shapes = {}
  for k, module in enumerate(tree["modules"]):
    for key, leaf in traverse_util.flatten_dict(module, sep="/").items():
      shapes[f"{k}/{key}"] = tuple(leaf.shape)
  return shapes


def _config_checks(hf: dict, target_config, path: str, layout: str) -> None:
  hidden = _value(hf, "hidden_size")
  if hidden is not None and hidden != target_config.emb_dim:
    raise CheckpointError(f"{path}: hidden_size {hidden} differs from the target's "
                          f"{target_config.emb_dim}: these MTP modules belong to another model "
                          "(they read its hidden states and feed its LM head)")
  vocab = _value(hf, "vocab_size")
  if vocab is not None and vocab != target_config.vocab_size:
    raise CheckpointError(f"{path}: vocab_size {vocab} differs from the target's "
                          f"{target_config.vocab_size}: these MTP modules belong to a model of "
                          "another vocabulary")
  layers = _value(hf, "num_hidden_layers")
  if layout == "deepseek" and layers is not None and layers != target_config.num_layers:
    raise CheckpointError(f"{path}: num_hidden_layers {layers} differs from the target's "
                          f"{target_config.num_layers}: DeepSeek's MTP module k is stored as "
                          "layer num_hidden_layers + k of this model")


def load(directory, target, layout: Optional[str] = None, dtype=None) -> dict:
  """The `MtpDraft` arguments (layout, num_modules, params, own_embeddings) of the MTP
  modules stored in `directory`, for `target`; CheckpointError naming what is at fault."""
  from specdec_jax.drafts.mtp import _mtp_head
  from specdec_jax.families.kernel_layout import transpose_kernels
  directory = os.fspath(directory)
  config = target.config
  hf = read_config_json(directory, WHAT, HOLDS)
  path = os.path.join(directory, "config.json")
  files = hf_weight_files(directory)
  layout = _resolved_layout(directory, hf, files, config.num_layers, layout)
  _config_checks(hf, config, path, layout)
  n = _num_modules(layout, hf, files, path)
  own_tables, own_embeddings = _own_embedding_tables(directory, files, target, layout, n)
  head = _mtp_head(target, layout, n, own_embeddings)
  names, expert_reads = _checked_names(directory, files, head, layout, n, own_tables,
                                       own_embeddings)
  flat = _read_flat(files, names, expert_reads, jnp.dtype(dtype or config.dtype))
  modules = []
  for k in range(n):
    mine = {key[len(f"{k}/"):]: value for key, value in flat.items() if key.startswith(f"{k}/")}
    modules.append(traverse_util.unflatten_dict(mine, sep="/"))
  params = jax.tree_util.tree_map(jnp.asarray, dict(modules=modules))
  if config.kernel_layout == "out_in":
    params = transpose_kernels(params)
  return dict(layout=layout, num_modules=n, params=params, own_embeddings=own_embeddings)


def _resolved_layout(directory: str, hf: dict, files, num_layers: int,
                     layout: Optional[str]) -> str:
  """The layout asked for, checked, or the one the stored names and config.json show."""
  if layout is not None:
    if layout not in LAYOUTS:
      raise ValueError(f"layout must be None or one of {LAYOUTS}, got {layout!r}")
    return layout
  # DeepSeek's modules sit after the layers config.json counts (a target of another depth
  # is then named by `_config_checks`).
  stored_layers = _value(hf, "num_hidden_layers")
  layout = detect_layout(files, hf, num_layers) or (
      detect_layout(files, hf, stored_layers) if isinstance(stored_layers, int) else None)
  if layout is None:
    looked = "; ".join(f"{name}: {what}" for name, what in LOOKED_FOR.items())
    keys = {k: hf[k] for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers",
                               "num_hidden_layers") if k in hf}
    raise CheckpointError(
        f"{directory}: no MTP modules found. Looked for {looked}. Its config.json has "
        f"{keys or 'none of those keys'} and its {len(files)} tensors none of those names "
        f"(L = {num_layers}, the target's layers)")
  return layout


def _own_embedding_tables(directory: str, files, target, layout: str, n: int):
  """({module: tensor name} of stored embed_tokens tables (DeepSeek), whether they differ
  from the target's): read only where stored, compared with the target's."""
  num_layers = target.config.num_layers
  own_tables = {}
  if layout == "deepseek":
    for k in range(n):
      name = f"model.layers.{num_layers + k}.embed_tokens.weight"
      if name in files:
        own_tables[k] = name
  own_embeddings = False
  if own_tables:
    target_table = np.asarray(target.params["embed_tokens"]["embedding"])
    for name in own_tables.values():
      stored = files[name]
      if tuple(stored.shape) != target_table.shape or not np.array_equal(
          cast(stored.read(None), target_table.dtype), target_table):
        own_embeddings = True
    if own_embeddings and len(own_tables) != n:
      raise CheckpointError(f"{directory}: only modules {sorted(own_tables)} of {n} store an "
                            "embed_tokens table unlike the target's")
  return own_tables, own_embeddings


def _checked_names(directory: str, files, head, layout: str, n: int, own_tables,
                   own_embeddings: bool):
  """({param key: (tensor name, transpose)}, {expert key: ('experts', names) or ('fused',
  name)}) of every module, every name present at its shape; else one CheckpointError
  listing what is missing, unexpected and mismatched."""
  config = head.config
  num_layers = config.num_layers
  # Shapes in the checkpoints' [in, out] kernel layout (an out_in target's kernels are
  # transposed after reading).
  from specdec_jax.families.decoder_only.mtp_head import MtpHead
  shapes = _flat_shapes(head if config.kernel_layout == "in_out" else MtpHead(
      config.replace(kernel_layout="in_out"), layout, n, own_embeddings))
  names, experts = {}, {}
  for k in range(n):
    for key, value in _own_names(layout, k, num_layers).items():
      names[f"{k}/{key}"] = value
    if own_embeddings:
      names[f"{k}/embed_tokens"] = (own_tables[k], False)
    layer, layer_experts = _layer_names(head, layout, k)
    names.update({f"{k}/{key}": value for key, value in layer.items()})
    experts.update({f"{k}/{key}": value for key, value in layer_experts.items()})
  if layout == "deepseek":
    stored = [m for m in files if m.startswith("model.layers.") and
              int(m.split(".")[2]) >= num_layers]
  else:
    stored = [m for m in files if m.startswith(_prefixes(layout, num_layers))]
  used = {name for name, _ in names.values()} | set(own_tables.values())
  missing, mismatched = [], []
  for key, (name, transpose) in names.items():
    if name not in files:
      missing.append(f"{name} (for module {key})")
      continue
    want = shapes[key][::-1] if transpose else shapes[key]
    if tuple(files[name].shape) != tuple(want):
      mismatched.append(f"{files[name].source}: {tuple(files[name].shape)} vs expected "
                        f"{tuple(want)}")
  expert_reads = {}
  for key, (per_expert, fused) in experts.items():
    one = tuple(reversed(shapes[key][1:]))
    if all(name in files for name in per_expert):
      used.update(per_expert)
      mismatched += [f"{files[name].source}: {tuple(files[name].shape)} vs expected {one}"
                     for name in per_expert if tuple(files[name].shape) != one]
      expert_reads[key] = ("experts", per_expert)
    elif fused in files:
      used.add(fused)
      expert_reads[key] = ("fused", fused)
    else:
      missing.append(f"{per_expert[0]} .. {per_expert[-1]} or {fused} (for module {key})")
  unexpected = [files[m].source for m in sorted(stored) if m not in used]
  raise_on_mismatch(f"MTP modules in {directory} ({layout}, {n} module"
                    f"{'s' if n > 1 else ''}, hidden {config.emb_dim}, vocabulary "
                    f"{config.vocab_size}) do not match the target:", missing, unexpected,
                    mismatched)
  return names, expert_reads


def _read_flat(files, names, expert_reads, np_dtype) -> dict:
  """{param key: array} read and cast: kernels transposed where stored [out, in], experts
  stacked (one tensor each) or split (transformers 5's fused gate/up)."""
  flat = {key: cast(files[name].read(None), np_dtype, transpose)
          for key, (name, transpose) in names.items()}
  for key, (kind, what) in expert_reads.items():
    if kind == "experts":
      flat[key] = np.stack([cast(files[name].read(None), np_dtype, True) for name in what])
    else:  # transformers 5's fused [experts, 2 mlp, emb] / [experts, emb, mlp]
      array = np.swapaxes(files[what].read(None), 1, 2)
      if key.endswith("down_proj"):
        flat[key] = cast(array, np_dtype)
      else:
        width = array.shape[2] // 2
        part = int(key.endswith("up_proj"))
        flat[key] = cast(np.ascontiguousarray(array[:, :, part * width:(part + 1) * width]),
                         np_dtype)
  return flat
