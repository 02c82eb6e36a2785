"""Public DFlash drafter directories (z-lab's format) <-> `DFlashDraft`.

A z-lab drafter (`z-lab/Qwen3-8B-DFlash-b16`, `.../LLaMA3.1-8B-Instruct-DFlash-UltraChat`)
is a directory with a Qwen3-style config.json (`DFlashDraftModel`: hidden_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, rms_norm_eps, rope_theta or rope_parameters, attention_bias)
whose `dflash_config` (or top-level keys) gives `block_size`, `mask_token_id`
and `target_layer_ids` (the target layers whose outputs it reads: HF
`hidden_states[i + 1]`, our taps i + 1), and one or more safetensors files:

    fc.weight [h, n h]   hidden_norm.weight [h]   norm.weight [h]
    layers.{i}.input_layernorm.weight, post_attention_layernorm.weight [h]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias),
    layers.{i}.self_attn.{q,k}_norm.weight [head_dim]
    layers.{i}.mlp.{gate,up,down}_proj.weight

(no embedding, no LM head: the target's are shared). Optional config keys
`input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` are
read too. Not read: DFlash-2 drafters (`DFlash2DraftModel`: convolutions and a
candidate selector) and drafters with sliding-window layers (their attention is
causal): both are refused by name.
"""

import json
import os

import jax.numpy as jnp
import numpy as np

from specdec_jax.drafts.dflash import DFlashConfig, flatten, param_shapes, unflatten
from specdec_jax.families.head_formats import HeadFormat, register_head_format
from specdec_jax.families.registry import family_of
from specdec_jax.families.tensor_io import (CheckpointError, cast, hf_weight_files,
                                            raise_on_mismatch, read_config_json,
                                            write_json_atomic, write_safetensors)

WHAT = "a DFlash drafter directory"
HOLDS = "config.json with dflash_config (block_size, mask_token_id, target_layer_ids) and " \
        "model.safetensors"


def _dflash_value(hf: dict, name: str, default=None):
  return dict(hf.get("dflash_config") or {}).get(name, hf.get(name, default))


def _rope_theta(hf: dict, path: str) -> float:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in (None, "default"):
    raise CheckpointError(f"{path}: rope type {kind!r}: DFlash drafters with scaled rotary "
                          "positions are not read (only the default rotary)")
  return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def read_config(directory: str, target_config, num_target_layers: int) -> DFlashConfig:
  """The `DFlashConfig` of a z-lab directory for a target; CheckpointError naming the key."""
  hf = read_config_json(directory, WHAT, HOLDS)
  path = os.path.join(directory, "config.json")
  architectures = hf.get("architectures") or []
  if "DFlash2DraftModel" in architectures:
    raise CheckpointError(f"{path}: a DFlash-2 drafter (DFlash2DraftModel: convolutions and a "
                          "candidate selector) is not read; DFlash-1 drafters "
                          "(DFlashDraftModel) are")
  ids = _dflash_value(hf, "target_layer_ids")
  block = _dflash_value(hf, "block_size", 16)
  mask = _dflash_value(hf, "mask_token_id")
  if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
    raise CheckpointError(f"{path}: not {WHAT}: no dflash_config.target_layer_ids (a list of "
                          f"the target's layer indices), found {ids!r}")
  if any(not 0 <= i < num_target_layers for i in ids):
    raise CheckpointError(f"{path}: target_layer_ids {ids} fall outside the target's "
                          f"{num_target_layers} layers: this drafter was trained on another "
                          "target")
  if not isinstance(block, int) or block < 2:
    raise CheckpointError(f"{path}: block_size must be an int >= 2, got {block!r}")
  if not isinstance(mask, int):
    raise CheckpointError(f"{path}: dflash_config.mask_token_id must be an int (the mask id "
                          f"the drafter was trained with), got {mask!r}")
  layer_types = hf.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types) or hf.get("is_causal"):
    raise CheckpointError(f"{path}: layer_types {layer_types} / is_causal "
                          f"{hf.get('is_causal')!r}: drafters with causal or sliding-window "
                          "layers are not read (DFlash-1 layers attend to the whole block)")
  hidden = hf.get("hidden_size")
  if hidden != target_config.emb_dim:
    raise CheckpointError(f"{path}: hidden_size {hidden} differs from the target's "
                          f"{target_config.emb_dim}: this drafter was trained on another target "
                          "(DFlash shares the target's embedding and LM head)")
  vocab = hf.get("vocab_size", target_config.vocab_size)
  if vocab != target_config.vocab_size:
    raise CheckpointError(f"{path}: vocab_size {vocab} differs from the target's "
                          f"{target_config.vocab_size}")
  heads = hf.get("num_attention_heads")
  try:
    softcap = _dflash_value(hf, "final_logit_softcapping")
    return DFlashConfig(
        hidden=int(hidden), num_layers=int(hf["num_hidden_layers"]), num_heads=int(heads),
        num_kv_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        intermediate=int(hf["intermediate_size"]), taps=tuple(i + 1 for i in ids),
        block_size=block, mask_token_id=mask, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf, path), attention_bias=bool(hf.get("attention_bias", False)),
        cross_attention=False,
        input_scale=float(_dflash_value(hf, "input_embedding_scale", 1.0)),
        output_multiplier=float(_dflash_value(hf, "output_multiplier", 1.0)),
        final_logit_softcap=None if softcap in (None, 0) else float(softcap),
        dtype=str(target_config.dtype))
  except (KeyError, TypeError) as e:
    raise CheckpointError(f"{path}: a Qwen3 layer config needs {e}") from None


def tensor_names(config: DFlashConfig):
  """{z-lab tensor name: (our flat param name, transpose)}."""
  names = {"fc.weight": ("fc/kernel", True), "hidden_norm.weight": ("hidden_norm", False),
           "norm.weight": ("norm", False)}
  for i in range(config.num_layers):
    ours, theirs = f"layers/{i}", f"layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      names[f"{theirs}.{norm}.weight"] = (f"{ours}/{norm}", False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      names[f"{theirs}.self_attn.{proj}.weight"] = (f"{ours}/self_attn/{proj}/kernel", True)
      if config.attention_bias:
        names[f"{theirs}.self_attn.{proj}.bias"] = (f"{ours}/self_attn/{proj}/bias", False)
    for norm in ("q_norm", "k_norm"):
      names[f"{theirs}.self_attn.{norm}.weight"] = (f"{ours}/self_attn/{norm}", False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      names[f"{theirs}.mlp.{proj}.weight"] = (f"{ours}/mlp/{proj}/kernel", True)
  return names


def load(directory, target, dtype=None):
  """(DFlashConfig, params) of a z-lab directory for `target`; CheckpointError naming the
  file, key or tensor at fault."""
  directory = os.fspath(directory)
  depth = target.config.num_layers
  config = read_config(directory, target.config, depth)
  if dtype is not None:
    config = DFlashConfig(**{**config.__dict__, "dtype": str(jnp.dtype(dtype))})
  files = hf_weight_files(directory)
  names = tensor_names(config)
  shapes = param_shapes(config, family_of(target).feature_dim(target.config, config.taps))
  np_dtype = jnp.dtype(config.dtype)
  missing = [n for n in names if n not in files]
  unexpected = [files[k].source for k in sorted(files) if k not in names]
  mismatched = []
  for name, (ours, transpose) in names.items():
    if name in files:
      want = shapes[ours][::-1] if transpose else shapes[ours]
      if tuple(files[name].shape) != tuple(want):
        mismatched.append(f"{files[name].source}: {tuple(files[name].shape)} vs expected "
                          f"{tuple(want)}")
  raise_on_mismatch(f"DFlash drafter {directory} ({config.num_layers} layers, hidden "
                    f"{config.hidden}, {len(config.taps)} target layers) does not match:",
                    missing, unexpected, mismatched)
  flat = {ours: cast(files[name].read(None), np_dtype, transpose)
          for name, (ours, transpose) in names.items()}
  return config, unflatten(flat)


def save(draft, directory) -> None:
  """Writes a decoder-only `DFlashDraft` as a z-lab directory (config.json + model.safetensors)
  that `load` (and z-lab's `DFlashDraftModel`) read."""
  config = draft.config
  if config.cross_attention:
    raise ValueError("this DFlashDraft cross-attends to a T5 encoder; z-lab's format holds "
                     "decoder-only drafters (the demo pair stores T5's as npz)")
  directory = os.fspath(directory)
  flat = {k: np.asarray(v) for k, v in flatten(draft.head_params).items()}
  tensors = []
  for name, (ours, transpose) in sorted(tensor_names(config).items()):
    array = flat[ours].T if transpose else flat[ours]
    tensors.append((name, array.shape, array.dtype, lambda a=array: np.ascontiguousarray(a)))
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, "model.safetensors"), tensors,
                    metadata={"format": "pt"})
  write_json_atomic(os.path.join(directory, "config.json"), dict(
      architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=config.hidden,
      num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
      num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
      intermediate_size=config.intermediate, rms_norm_eps=config.rms_eps,
      rope_theta=config.rope_theta, attention_bias=config.attention_bias,
      vocab_size=draft.vocab_size, layer_types=["full_attention"] * config.num_layers,
      dflash_config=dict(block_size=config.block_size, mask_token_id=config.mask_token_id,
                         target_layer_ids=[t - 1 for t in config.taps],
                         input_embedding_scale=config.input_scale,
                         output_multiplier=config.output_multiplier,
                         final_logit_softcapping=config.final_logit_softcap)))


def detects(directory) -> bool:
  """Whether `directory` holds a config.json naming DFlash's target_layer_ids."""
  try:
    with open(os.path.join(os.fspath(directory), "config.json")) as f:
      hf = json.load(f)
  except (OSError, ValueError, TypeError):
    return False
  return isinstance(hf, dict) and _dflash_value(hf, "target_layer_ids") is not None


def _diagnose(directory) -> None:
  directory = os.fspath(directory)
  hf = read_config_json(directory, WHAT, HOLDS)
  if _dflash_value(hf, "target_layer_ids") is None:
    raise CheckpointError(f"{directory}: not {WHAT}: its config.json has no "
                          "dflash_config.target_layer_ids")


def _load(directory, target, dtype=None):
  config, params = load(directory, target, dtype)
  return dict(config=config, params=params)


ZLAB_DFLASH = register_head_format(HeadFormat(
    name="zlab_dflash", kind="dflash", families=("decoder_only",),
    targets="decoder-only targets (z-lab publishes Qwen3, Llama-3.1 and gpt-oss drafters)",
    detect=detects, load=_load, save=save,
    writes=lambda draft: not draft.config.cross_attention, diagnose=_diagnose))
