"""Public EAGLE-1 / EAGLE-3 head checkpoints for decoder-only targets: reading and writing.

A loaded head computes what EAGLE's own code (SafeAILab/EAGLE `eagle/model/`
`cnets1.py` for EAGLE-1, `cnets.py` for EAGLE-3, at cb7e084) computes from
the same directory; `tests/test_eagle_conformance.py` checks it against
those modules.

A head directory holds `config.json` and `pytorch_model.bin` or
`model.safetensors`, EAGLE's precedence: the .bin first (sharded with an
index too, which EAGLE does not read: `tensor_io.hf_weight_files`). The
format is told by the tensor names (and config.json's `draft_vocab_size`):

EAGLE-3 (SafeAILab/EAGLE `Model`, vLLM / SGLang `LlamaForCausalLMEagle3`):
  fc.weight [h, 3H]                                  -> fc/kernel (transposed)
  midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight
                                                     -> midlayer/{...}/scale
  midlayer.self_attn.{q,k,v,o}_proj.weight           -> midlayer/self_attn/{...}/kernel (T)
  midlayer.mlp.{gate,up,down}_proj.weight            -> midlayer/mlp/{...}/kernel (T)
  norm.weight                                        -> norm/scale
  lm_head.weight [draft_vocab, h]                    -> lm_head/kernel (T)
  d2t [draft_vocab] int64, t2d [vocab] bool          -> the head's draft_to_target = arange + d2t
                                                        (absent: the whole vocabulary)
EAGLE-1 (SafeAILab/EAGLE `cnets1.py`; the LM head is the target's):
  fc.weight [h, 2h] (+ fc.bias [h])                  -> fc/kernel (T) (+ fc/bias)
  layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v biases with qkv_bias)
                                                     -> layer/self_attn/{...}/kernel (T) (+ bias)
  layers.0.mlp.{gate,up,down}_proj.weight            -> layer/mlp/{...}/kernel (T)
  layers.0.post_attention_layernorm.weight           -> layer/post_attention_layernorm/scale
Both:
  embed_tokens.weight [vocab, h] (optional)          -> EAGLE loads it over the target's
                                                        table: the head's own embed_tokens,
                                                        or the target's table (no copy) where
                                                        bit-identical in the head's dtype

The head's layer (heads, head_dim = hidden // heads, intermediate_size,
rotary base and scaling, rms_norm_eps, EAGLE-1's q/k/v biases) comes from
its config.json, as EAGLE builds it (`head_config`); its hidden size must be
the target's (`hidden_size`, and `target_hidden_size` where given), its
`vocab_size` the target's.

Targets: Llama, Qwen2 and Mistral layouts (`eagle3_head.check_rotary_target`):
EAGLE's released Llama and Qwen2 heads (EAGLE-1/2: Vicuna, LLaMA2-Chat,
LLaMA3-Instruct, Qwen2-Instruct; EAGLE-3: LLaMA3.1/3.3-Instruct, Vicuna,
DeepSeek-R1-Distill-LLaMA). Not yet: Qwen3 targets (no Qwen3 family here)
and Mixtral (no mixture-of-experts family).

The two formats are `EAGLE1` and `EAGLE3` ('eagle1' / 'eagle3'), which the
decoder-only family registers in `families.head_formats`.
"""

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specdec_jax.families.decoder_only import checkpoints as hf_checkpoints
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.eagle3_head import (Eagle3Head, check_draft_to_target,
                                                           check_rotary_target)
from specdec_jax.families.head_formats import HeadFormat
from specdec_jax.families.tensor_io import (CheckpointError, cast, hf_weight_files,
                                            raise_on_mismatch, read_config_json,
                                            write_safetensors)

FORMATS = ("eagle1", "eagle3")

# Buffers old checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def eagle3_names(own_embeddings: bool = False) -> Dict[str, Tuple[str, bool]]:
  """Our EAGLE-3 param path -> (checkpoint tensor name, transposed)."""
  names = {"fc/kernel": ("fc.weight", True), "norm/scale": ("norm.weight", False),
           "lm_head/kernel": ("lm_head.weight", True)}
  for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
    names[f"midlayer/{norm}/scale"] = (f"midlayer.{norm}.weight", False)
  for proj in _ATTENTION:
    names[f"midlayer/self_attn/{proj}/kernel"] = (f"midlayer.self_attn.{proj}.weight", True)
  for proj in _MLP:
    names[f"midlayer/mlp/{proj}/kernel"] = (f"midlayer.mlp.{proj}.weight", True)
  if own_embeddings:
    names["embed_tokens"] = ("embed_tokens.weight", False)
  return names


def eagle1_names(paths) -> Dict[str, Tuple[str, bool]]:
  """Our EAGLE-1 param paths ('/'-joined: fc/..., layer/...) -> (checkpoint tensor name,
  transposed): fc/{kernel,bias} -> fc.{weight,bias}; layer/A/B/{kernel,bias,scale} ->
  layers.0.A.B.{weight,bias,weight} (so a Qwen2 target's q/k/v biases map too)."""
  names = {}
  for path in paths:
    if path == "embed_tokens":  # the head's own table (a checkpoint that stores one)
      names[path] = ("embed_tokens.weight", False)
      continue
    *module, leaf = path.split("/")
    suffix = {"kernel": "weight", "scale": "weight", "bias": "bias"}[leaf]
    if module[0] == "layer":
      module = ["layers", "0"] + module[1:]
    names[path] = (".".join(module + [suffix]), leaf == "kernel")
  return names


def detect_format(tensor_names, hf: Mapping[str, Any], origin: str) -> str:
  """'eagle3' (midlayer.* tensors or draft_vocab_size), 'eagle1' (layers.0.*), else an error."""
  names = set(tensor_names)
  if any(n.startswith("midlayer.") for n in names):
    return "eagle3"
  if any(n.startswith("layers.0.") for n in names):
    if "draft_vocab_size" in hf:
      raise CheckpointError(f"{origin}: config.json has draft_vocab_size (EAGLE-3) but the "
                            f"tensors are EAGLE-1's (layers.0.*, no midlayer.*)")
    return "eagle1"
  raise CheckpointError(f"{origin}: neither an EAGLE-1 head (layers.0.* tensors) nor an EAGLE-3 "
                        f"head (midlayer.* tensors); its tensors: {sorted(names)[:12]}")


def check_target(target_config, what: str = "an EAGLE head") -> None:
  """`eagle3_head.check_rotary_target`, raising CheckpointError."""
  check_rotary_target(target_config, what, CheckpointError)


def _eagle_rope(hf: Mapping[str, Any], origin: str) -> Dict[str, Any]:
  """config.json rotary keys as EAGLE's head code reads them, for `hf_config_to_decoder_config`.

  EAGLE (`cnets.py` / `cnets1.py` `_init_rope`) builds its rotary from the head's own
  config: base `rope_theta` (10000 when absent) without scaling; with
  `rope_scaling['type']` 'linear', positions / factor on base 10000 (it passes no
  base to the scaled rotary). A `rope_scaling` without 'type' (transformers'
  newer `rope_type`, as `save_head` writes) fails in EAGLE's code; it is read
  here as transformers reads it.
  """
  scaling = hf.get("rope_scaling")
  if not scaling or "type" not in scaling:
    return {}
  if scaling["type"] == "linear":
    return dict(rope_theta=10000.0, rope_scaling=dict(rope_type="linear",
                                                      factor=float(scaling["factor"])))
  raise CheckpointError(f"{origin}: rope_scaling {dict(scaling)}: EAGLE's head code knows "
                        f"'linear' and 'dynamic' (NTK scaling recomputed from the sequence "
                        f"length); only 'linear' is supported here")


def head_config(hf: Mapping[str, Any], target_config: DecoderOnlyConfig, origin: str,
                dtype: str, kind: str = "eagle3") -> DecoderOnlyConfig:
  """The head's one-layer Llama config from its config.json, as EAGLE's code builds it.

  EAGLE reads the layer's settings from the head's config, not the target's:
  heads and kv heads, head_dim = hidden_size // num_attention_heads (a
  `head_dim` key is not read), intermediate size, `rms_norm_eps` (1e-6 when
  absent), `hidden_act`, the rotary (`_eagle_rope`) and, for EAGLE-1, q/k/v
  biases iff the config has `qkv_bias` true (`cnets1.py`'s `hasattr` test).
  The hidden size and vocabulary are checked against the target's.
  """
  hidden = hf.get("hidden_size")
  if hidden != target_config.emb_dim:
    raise CheckpointError(f"{origin}: the head's hidden_size {hidden} differs from the target's "
                          f"hidden size {target_config.emb_dim} (DecoderOnlyConfig.emb_dim, "
                          f"config.json hidden_size): this head was trained for another target")
  if "target_hidden_size" in hf and hf["target_hidden_size"] not in (None,
                                                                     target_config.emb_dim):
    raise CheckpointError(f"{origin}: target_hidden_size {hf['target_hidden_size']} differs from "
                          f"the target's hidden size {target_config.emb_dim} "
                          f"(DecoderOnlyConfig.emb_dim)")
  if hf.get("vocab_size", target_config.vocab_size) != target_config.vocab_size:
    raise CheckpointError(f"{origin}: vocab_size {hf['vocab_size']} differs from the target's "
                          f"vocabulary of {target_config.vocab_size} (DecoderOnlyConfig."
                          f"vocab_size): the head's token ids are another tokenizer's")
  for key in ("attention_bias", "mlp_bias", "norm_before_residual"):
    if hf.get(key):
      raise CheckpointError(f"{origin}: {key}=true is not supported in an EAGLE head (EAGLE's "
                            f"head code reads no such key)")
  if kind == "eagle3" and hf.get("qkv_bias"):
    raise CheckpointError(f"{origin}: qkv_bias=true in an EAGLE-3 head: EAGLE-3's attention "
                          f"(cnets.py) has no q/k/v biases")
  heads = hf.get("num_attention_heads")
  if not isinstance(heads, int) or heads < 1 or hidden % heads:
    raise CheckpointError(f"{origin}: num_attention_heads {heads!r} must divide hidden_size "
                          f"{hidden} (EAGLE's head_dim is hidden_size // num_attention_heads)")
  head_dim = hidden // heads
  if hf.get("head_dim") not in (None, head_dim):
    raise CheckpointError(f"{origin}: head_dim {hf['head_dim']}, but EAGLE's head code computes "
                          f"head_dim = hidden_size // num_attention_heads = {head_dim} and "
                          f"reads no head_dim key: this config describes a layer EAGLE would "
                          f"not build")
  llama = dict(hf, architectures=["LlamaForCausalLM"], model_type="llama",
               num_hidden_layers=1, vocab_size=target_config.vocab_size, head_dim=head_dim)
  llama.setdefault("rms_norm_eps", 1e-6)  # EAGLE's config default
  for key in ("bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias"):
    llama.pop(key, None)  # the target's token conventions; the biases: below
  eagle_rope = _eagle_rope(hf, origin)
  if eagle_rope:  # EAGLE's reading of rope_scaling['type'] overrides any other rotary key
    llama.pop("rope_parameters", None)
    llama.update(eagle_rope)
  config = hf_checkpoints.hf_config_to_decoder_config(llama, origin, dtype)
  return config.replace(bos_id=target_config.bos_id, eos_id=target_config.eos_id,
                        pad_id=target_config.pad_id,
                        qkv_bias=kind == "eagle1" and bool(hf.get("qkv_bias", False)))


def _read_json(directory: str) -> Dict[str, Any]:
  return read_config_json(directory, "an EAGLE head directory",
                          "config.json and pytorch_model.bin or model.safetensors")


def _vocabulary_map(files, hf, target_config: DecoderOnlyConfig, origin: str) -> np.ndarray:
  """draft_to_target [draft_vocab] int32 from d2t/t2d, every inconsistency named."""
  vocab = target_config.vocab_size
  rows = files["lm_head.weight"].shape[0] if "lm_head.weight" in files else None
  draft_vocab = hf.get("draft_vocab_size", rows)
  if "d2t" not in files and "t2d" not in files:
    if draft_vocab != vocab:
      raise CheckpointError(f"{origin}: a draft vocabulary of {draft_vocab} ids "
                            f"(draft_vocab_size) but no d2t / t2d tensors to map it to the "
                            f"target's {vocab}")
    return np.arange(vocab, dtype=np.int32)
  for name in ("d2t", "t2d"):
    if name not in files:
      raise CheckpointError(f"{origin}: has {'t2d' if name == 'd2t' else 'd2t'} but no {name}")
  d2t = np.asarray(files["d2t"].read(None))
  t2d = np.asarray(files["t2d"].read(None))
  if d2t.shape != (draft_vocab,):
    raise CheckpointError(f"{origin}: d2t has shape {d2t.shape}, but draft_vocab_size is "
                          f"{draft_vocab}: it needs one offset per draft id")
  if t2d.shape != (vocab,):
    raise CheckpointError(f"{origin}: t2d has shape {t2d.shape}, but the target's vocabulary "
                          f"has {vocab} ids (DecoderOnlyConfig.vocab_size)")
  try:
    ids = check_draft_to_target(np.arange(draft_vocab) + d2t.astype(np.int64), vocab,
                                f"{origin}: d2t")
  except ValueError as e:
    raise CheckpointError(str(e)) from None
  mask = np.zeros(vocab, bool)
  mask[ids] = True
  if not np.array_equal(mask, t2d.astype(bool)):
    wrong = np.flatnonzero(mask != t2d.astype(bool))
    raise CheckpointError(f"{origin}: t2d disagrees with d2t at target ids {wrong[:8].tolist()} "
                          f"(t2d must be true exactly at the ids d2t maps to)")
  return ids


def _embeddings_shared(files, target_params, dtype, origin: str) -> bool:
  """Whether a stored embed_tokens.weight is the target's table as the head computes it.

  EAGLE's code loads the checkpoint's own table over the target's when it is
  stored. The head reads the target's table instead (no copy) only where
  the two are bit-identical once cast to the head's dtype, so the head
  computes what EAGLE computes either way; any other stored table (an fp16
  copy of an fp32 target, another target's table) becomes the head's own.
  """
  stored = files["embed_tokens.weight"]
  table = target_params["embed_tokens"]["embedding"]
  if tuple(stored.shape) != tuple(table.shape):
    raise CheckpointError(f"{stored.source}: shape {tuple(stored.shape)}, but the target's "
                          f"embedding table is {tuple(table.shape)} (vocab x hidden)")
  theirs = cast(stored.read(None), jnp.dtype(dtype), False)
  return bool(np.array_equal(np.asarray(theirs), np.asarray(jnp.asarray(table).astype(dtype))))


def _eagle1_head(target_config: DecoderOnlyConfig, layer: DecoderOnlyConfig, fc_bias: bool,
                 own_embeddings: bool):
  from specdec_jax.families.decoder_only.feature_head import DecoderOnlyFeatureHead
  return DecoderOnlyFeatureHead(target_config, fc_bias=fc_bias, layer_config=layer,
                                own_embeddings=own_embeddings)


def _check_eagle1_biases(files, hf, origin: str) -> bool:
  """fc's bias: the fc.bias tensor; config.json's `bias` (EAGLE's default true) and
  `qkv_bias` must agree with the tensors stored (EAGLE would drop or invent them)."""
  fc_bias = "fc.bias" in files
  if "bias" in hf and bool(hf["bias"]) != fc_bias:
    raise CheckpointError(f"{origin}: bias={hf['bias']} but the weights "
                          f"{'hold' if fc_bias else 'lack'} fc.bias")
  q_bias = "layers.0.self_attn.q_proj.bias" in files
  if q_bias != bool(hf.get("qkv_bias", False)):
    raise CheckpointError(f"{origin}: the weights {'hold' if q_bias else 'lack'} q/k/v biases "
                          f"(layers.0.self_attn.q_proj.bias) but config.json has "
                          f"qkv_bias={hf.get('qkv_bias')!r}: EAGLE-1 builds them from qkv_bias "
                          f"(set it to {str(q_bias).lower()})")
  return fc_bias


def flat_shapes(head) -> Dict[str, Tuple[int, ...]]:
  """The head's param paths ('/'-joined) -> shapes (no allocation)."""
  tree = jax.eval_shape(head.init_params)
  return {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def _read_head_dir(directory: str):
  """(config.json, tensors, 'eagle1' / 'eagle3') of a head directory, or a CheckpointError
  naming what it lacks (the directory, config.json, weights, EAGLE tensors)."""
  hf = _read_json(directory)
  files = hf_weight_files(directory, prefer="bin")
  return hf, files, detect_format(files, hf, directory)


def detects(directory, kind: str) -> bool:
  """Whether `directory` holds an EAGLE head of `kind` ('eagle1' / 'eagle3'), told as
  `load_head` tells it (config.json read, tensor names listed, nothing loaded)."""
  try:
    return _read_head_dir(os.fspath(directory))[2] == kind
  except CheckpointError:
    return False


def load_head(directory, target_config: DecoderOnlyConfig, target_params,
              dtype: Optional[str] = None, expect: Optional[str] = None):
  """Reads a public EAGLE head directory for a target, to compute what EAGLE's code computes.

  Args:
    directory: config.json + pytorch_model.bin or model.safetensors (EAGLE's
      precedence: the .bin first), or a sharded index.
    target_config, target_params: the target's config and params (a stored
      `embed_tokens.weight` is compared with its table: `_embeddings_shared`).
    dtype: the head's params and compute dtype; default the target's.
    expect: None, or the format the directory must hold ('eagle1' / 'eagle3').
  Returns:
    (head: an `Eagle3Head` or the family's EAGLE-1 `DecoderOnlyFeatureHead`,
     each with the layer its config.json describes (`head_config`),
     params: its param tree).
  Raises:
    CheckpointError: naming the file, tensor or config key at fault.
  """
  directory = os.fspath(directory)
  check_target(target_config)
  hf, files, kind = _read_head_dir(directory)
  origin = os.path.join(directory, "config.json")
  if expect is not None and kind != expect:
    raise CheckpointError(f"{directory}: holds an {kind} head, not {expect}")
  dtype = dtype or target_config.dtype
  layer = head_config(hf, target_config, origin, dtype, kind)
  used = set()
  own = False
  if "embed_tokens.weight" in files:
    used.add("embed_tokens.weight")
    own = not _embeddings_shared(files, target_params, dtype, directory)
  if kind == "eagle3":
    head = Eagle3Head(target_config, layer, _vocabulary_map(files, hf, target_config, directory),
                      own_embeddings=own)
    used |= {"d2t", "t2d"}
    names = eagle3_names(own)
  else:
    head = _eagle1_head(target_config, layer, _check_eagle1_biases(files, hf, origin), own)
  shapes = flat_shapes(head)
  if kind == "eagle1":
    names = eagle1_names(shapes)
  if set(names) != set(shapes):  # A mapping bug, not bad input.
    raise AssertionError(f"{kind} names {sorted(names)} vs head params {sorted(shapes)}")
  used |= {theirs for theirs, _ in names.values()}
  missing = [f"{theirs} (for {ours})" for ours, (theirs, _) in names.items() if theirs not in files]
  unexpected = [files[k].source for k in sorted(files)
                if k not in used and not k.endswith(_IGNORED_SUFFIXES)]
  mismatched = []
  for ours, (theirs, transpose) in names.items():
    if theirs in files:
      want = tuple(reversed(shapes[ours])) if transpose else shapes[ours]
      if tuple(files[theirs].shape) != want:
        mismatched.append(f"{files[theirs].source}: {tuple(files[theirs].shape)} vs expected "
                          f"{want}")
  raise_on_mismatch(f"EAGLE-{kind[-1]} head {directory} does not match its config.json and "
                    f"the target (hidden {target_config.emb_dim}, vocab "
                    f"{target_config.vocab_size}; head layer {layer.num_heads}/"
                    f"{layer.num_kv_heads} heads x {layer.head_dim}, mlp {layer.mlp_dim}):",
                    missing, unexpected, mismatched)
  np_dtype = jnp.dtype(dtype)
  flat = {}
  for ours, (theirs, transpose) in names.items():
    array = files[theirs].read(None)
    flat[tuple(ours.split("/"))] = jax.device_put(cast(array, np_dtype, transpose))
  return head, traverse_util.unflatten_dict(flat)


# ----------------------------------------------------------------------------
# Writing.

def head_format(head) -> str:
  """'eagle3' for an `Eagle3Head`, 'eagle1' for the family's EAGLE-1 head."""
  from specdec_jax.families.decoder_only.feature_head import DecoderOnlyFeatureHead
  if isinstance(head, Eagle3Head):
    return "eagle3"
  if isinstance(head, DecoderOnlyFeatureHead):
    return "eagle1"
  raise ValueError(f"a {type(head).__name__} has no public EAGLE checkpoint format (EAGLE-1: "
                   f"the decoder-only family's head; EAGLE-3: Eagle3Head)")


def save_head(head, params, directory, format: Optional[str] = None) -> None:
  """Writes a head in its public format: config.json + model.safetensors.

  Args:
    head: an `Eagle3Head` ('eagle3') or the decoder-only EAGLE-1 head ('eagle1').
    params: its param tree (kept in their dtype).
    format: None (the head's own) or 'eagle1' / 'eagle3', which must be the head's.
  """
  kind = head_format(head)
  if format is not None and format not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
  if format is not None and format != kind:
    raise ValueError(f"this head is an {kind} head; it cannot be written as {format} (the two "
                     f"formats hold different layers)")
  check_target(head.config, f"an {kind} head")
  directory = os.fspath(directory)
  flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(params).items()}
  shapes = flat_shapes(head)
  wrong = sorted(k for k in set(flat) | set(shapes)
                 if k not in flat or k not in shapes or tuple(flat[k].shape) != shapes[k])
  if wrong:
    raise ValueError(f"these params are not this {kind} head's (missing, unexpected or "
                     f"mis-shaped): {wrong}")
  target_config = head.config
  dtype = np.dtype(next(iter(flat.values())).dtype).name
  if kind == "eagle3":
    names = eagle3_names(head.own_embeddings)
    layer = head.layer_config
    hf = hf_checkpoints.decoder_config_to_hf_config(layer)
    hf.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=head.draft_vocab_size,
              target_hidden_size=target_config.emb_dim)
  else:
    names = eagle1_names(shapes)
    layer = head.layer_config
    if layer.out_bias or layer.mlp_bias or layer.num_heads * layer.head_dim != layer.emb_dim:
      raise ValueError(f"this EAGLE-1 head's layer (out_bias={layer.out_bias}, mlp_bias="
                       f"{layer.mlp_bias}, {layer.num_heads} heads x {layer.head_dim} for "
                       f"hidden {layer.emb_dim}) is not one EAGLE-1's code builds (a Llama "
                       f"layer, q/k/v biases at most, head_dim = hidden // heads)")
    hf = hf_checkpoints.decoder_config_to_hf_config(layer.replace(
        family="llama", layer_types=None, sliding_window=None, qkv_bias=False, out_bias=False))
    hf.update(architectures=["LlamaForCausalLM"], bias=bool(head.fc_bias),
              qkv_bias=bool(layer.qkv_bias))
  hf.update(num_hidden_layers=1, vocab_size=target_config.vocab_size, torch_dtype=dtype)
  tensors = []
  for ours, (theirs, transpose) in sorted(names.items(), key=lambda item: item[1][0]):
    array = flat[ours]
    shape = tuple(reversed(array.shape)) if transpose else tuple(array.shape)
    tensors.append((theirs, shape, np.dtype(array.dtype),
                    lambda a=array, t=transpose: np.asarray(a).T if t else np.asarray(a)))
  if kind == "eagle3":
    ids = head.draft_to_target.astype(np.int64)
    d2t = ids - np.arange(ids.size)
    mask = head.in_draft_vocab()
    tensors.append(("d2t", d2t.shape, np.dtype(np.int64), lambda: d2t))
    tensors.append(("t2d", mask.shape, np.dtype(np.bool_), lambda: mask))
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, "model.safetensors"), tensors,
                    metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------
# The formats, as the head-format registry lists them (`families.head_formats`;
# the decoder-only family registers them).

def _diagnose(directory) -> None:
  """Raises the CheckpointError that says why `directory` holds no EAGLE head."""
  _read_head_dir(os.fspath(directory))


def _format(kind: str) -> HeadFormat:
  def load(directory, target, dtype=None):
    head, params = load_head(directory, target.config, target.params, dtype, expect=kind)
    return dict(head=head, head_params=params)

  def writes(draft) -> bool:
    try:
      return head_format(getattr(draft, "head", None)) == kind
    except ValueError:
      return False

  return HeadFormat(
      name=kind, kind="feature", families=("decoder_only",),
      targets="decoder-only Llama-layout targets",
      detect=lambda directory: detects(directory, kind), load=load,
      save=lambda draft, directory: save_head(draft.head, draft.head_params, directory, kind),
      writes=writes, diagnose=_diagnose)


EAGLE1 = _format("eagle1")
EAGLE3 = _format("eagle3")
