"""`load_model` / `load_sharded_model`: one loader for every model family.

A named config or a config object gives random weights; a path gives a
checkpoint. The family is found in the registry: by the config's type, by
which family names the config, or by which family recognises the checkpoint
(`Family.detect`: a Hugging Face config.json's architecture, a T5X or Orbax
layout). A checkpoint no family recognises is an error naming every
supported architecture.
"""

import difflib
import json
import os
from typing import Optional, Tuple

import jax

from specdec_jax import memory
from specdec_jax import sharding
from specdec_jax.families.kernel_layout import with_kernel_layout
from specdec_jax.core.dtypes import default_dtype, optional_dtype
# Imported for its registration: the Medusa-1 head format (`head_formats`).
from specdec_jax.drafts import dflash_checkpoints, medusa_checkpoints  # noqa: F401
from specdec_jax.families import head_formats
from specdec_jax.families.base import Family
from specdec_jax.families.hub import download_from_hub, looks_like_hub_id
from specdec_jax.families.tensor_io import CheckpointError
from specdec_jax.families.registry import (families, family_of, find_family, is_model,
                                          supported_architectures)

class UnsupportedCheckpoint(CheckpointError):
  """No registered family reads this checkpoint."""


def _named(name: str) -> Optional[Tuple[Family, object]]:
  for family in families():
    config = family.lookup_config(name)
    if config is not None:
      return family, config
  return None


def _resolve(source, dtype, overrides) -> Tuple[Family, object, Optional[str]]:
  """(family, config for random init or None, checkpoint path or None)."""
  family = find_family(source)
  if family is not None:
    config = source.replace(**overrides) if overrides else source
    return family, (config if dtype is None else config.replace(dtype=dtype)), None
  source = os.fspath(source) if isinstance(source, os.PathLike) else source
  if not isinstance(source, str):
    raise TypeError(f"load_model takes a config name, a config or a path, got "
                    f"{type(source).__name__}")
  if source.startswith("~"):
    source = os.path.expanduser(source)
  if not os.path.exists(source) and "://" not in source:
    named = _named(source)
    if named is not None:
      family, config = named
      config = config.replace(**overrides) if overrides else config
      return family, config.replace(dtype=dtype or default_dtype()), None
    if _looks_like_path(source):
      raise FileNotFoundError(f"checkpoint not found: {source!r} (no such file or directory)")
    if not looks_like_hub_id(source):
      raise ValueError(_unknown_config(source))
    source = download_from_hub(source)
  for family in families():
    if family.detect(source):
      return family, None, source
  raise UnsupportedCheckpoint(f"{source}: no model family reads this checkpoint"
                              f"{_what_it_holds(source)}. Supported architectures: "
                              f"{supported_architectures()}")


def _looks_like_path(source: str) -> bool:
  """Whether a string that is not a named config means a file: it starts with '/', '.' or
  '~', or holds a path separator and is not a hub id ('org/name')."""
  separators = (os.sep, os.altsep or os.sep, "/")
  return (source.startswith(("/", ".", "~")) or
          (any(sep in source for sep in separators) and not looks_like_hub_id(source)))


def _unknown_config(name: str) -> str:
  """The error for a name that is no named config, no path and no hub id: the nearest
  names first, then every family's."""
  known = sorted(n for f in families() for n in f.named_configs())
  near = difflib.get_close_matches(name.lower().replace("-", "_").replace(".", "_"), known,
                                   n=3, cutoff=0.6)
  hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else "."
  names = "; ".join(f"{f.name}: {', '.join(sorted(f.named_configs()))}" for f in families())
  return (f"Unknown model config {name!r} (and no such checkpoint path){hint} "
          f"Named configs: {names}")


def _check_params_memory(family, config, source) -> None:
  """Random weights: the parameter count and bytes logged, and an error before any
  allocation when they cannot fit (`memory.check_params_memory`)."""
  what = source if isinstance(source, str) else f"this {type(config).__name__}"
  memory.check_params_memory(family, config, what)


def _what_it_holds(path: str) -> str:
  """', which holds architectures=[...] (model_type ...)' from a config.json, if any."""
  config_file = os.path.join(path, "config.json")
  try:
    with open(config_file) as f:
      hf = json.load(f)
  except (OSError, ValueError):
    return ""
  return (f", whose config.json names architectures={hf.get('architectures')} "
          f"(model_type {hf.get('model_type')!r})")


def load_model(source, *, dtype=None, seed: int = 0, **config_overrides):
  """Builds a model of any registered family.

  Args:
    source: a named config (`t5_1_1_small`, `tiny`, `gpt2`, `qwen2_0_5b`,
      `gemma2_2b`, ...), a config object (random init), or a checkpoint: a
      Hugging Face directory (T5, Llama, Qwen2, GPT-2, ...), a T5X or Orbax
      checkpoint, or a hub id (fetched when `huggingface_hub` is installed and
      online). A local path wins over a name of the same spelling.
    dtype: 'float32' / 'bfloat16' / 'float16' in any spelling
      `dtypes.canonical_dtype` accepts (jnp.bfloat16, 'bf16', ...); default
      float32 on CPU, bfloat16 elsewhere.
    seed: init seed for random weights.
    **config_overrides: config fields to change (random init; T5X checkpoints
      also take a few, e.g. relative_attention_max_distance).
  Raises:
    FileNotFoundError: a path (a string with a path separator that is not a
      hub id, or starting with '/', '.' or '~') that does not exist.
    ValueError: a name that is no named config (the nearest names first).
    memory.InsufficientMemory: random weights larger than the memory available
      (checked from shapes, before allocating; the count and bytes are logged
      at INFO either way).
  """
  dtype = optional_dtype(dtype)
  family, config, path = _resolve(source, dtype, config_overrides)
  if path is not None:
    return family.load(path, dtype=dtype, **config_overrides)
  _check_params_memory(family, config, source)
  return family.model_type(config, family.init_params(config, seed))


def load_sharded_model(source, partitioner: sharding.Partitioner, *, dtype=None,
                       seed: int = 0, **config_overrides):
  """`load_model` whose params land on the mesh already sharded.

  Random weights are initialised inside a jit with sharded outputs;
  checkpoints are read tensor by tensor, each device receiving only its slice
  of each tensor: each process reads from disk only its devices' blocks
  (safetensors and T5X TensorStore through `ShardedPlacement`'s lazy views,
  Orbax by restoring into the target shardings).
  """
  dtype = optional_dtype(dtype)
  family, config, path = _resolve(source, dtype, config_overrides)
  if path is None:
    shapes = family.abstract_params(config)
    init = jax.jit(lambda: family.init_params(config, seed),
                   out_shardings=partitioner.param_shardings(shapes, family))
    return family.model_type(config, init())

  model = family.load(path, dtype=dtype, place=ShardedPlacement(partitioner, family),
                      **config_overrides)
  return family.model_type(model.config, partitioner.shard_params(model.params, family))


class ShardedPlacement:
  """The `place` callback of a sharded load: each tensor onto `partitioner`'s mesh.

  `place(key, view)` builds the tensor from the blocks this process's devices
  hold (`view[index]` reads only that block: safetensors, T5X TensorStore);
  `place.sharding(key, shape)` is the sharding itself, for formats that
  restore into target shardings (Orbax: TensorStore then reads only this
  process's shards).
  """

  def __init__(self, partitioner: sharding.Partitioner, family: Family):
    self.partitioner = partitioner
    self.family = family

  def sharding(self, key: Tuple[str, ...], shape) -> jax.sharding.Sharding:
    shape = tuple(shape)
    spec = self.partitioner.spec(self.family.param_logical_axes(key, len(shape)), shape,
                                 "params/" + "/".join(key))
    return self.partitioner.sharding(spec)

  def __call__(self, key: Tuple[str, ...], array):
    return jax.make_array_from_callback(tuple(array.shape), self.sharding(key, array.shape),
                                        lambda index: array[index])


def shard_model(model, partitioner: sharding.Partitioner):
  """The same model with its params placed by `partitioner`'s rules."""
  family = family_of(model)  # A TypeError naming the known model types, not AttributeError.
  if getattr(model.config, "kernel_layout", "in_out") != "in_out":
    raise ValueError("shard_model: this model stores its kernels [out, in] (kernel_layout="
                     "'out_in', a CPU layout) and the sharding rules name [in, out] axes; "
                     "shard sj.with_kernel_layout(model, 'in_out')")
  return family.model_type(model.config, partitioner.shard_params(model.params, family))


def export_hf(model, directory) -> None:
  """Writes a model of any family as a Hugging Face directory (config.json +
  model.safetensors) that transformers and `load_model` read: T5 as
  `T5ForConditionalGeneration`, decoder-only as its architecture (Llama, Qwen2,
  GPT-2, ...). T5's own formats stay T5's (`export_t5x`, `save_model`).

  Raises:
    TypeError: `model` is not a model of a registered family.
    ValueError: a config the family's Hugging Face architecture cannot express.
  """
  family = family_of(model)
  if not is_model(model):
    raise TypeError(f"export_hf takes a model (config + params), got {type(model).__name__}")
  family.export_hf(with_kernel_layout(model, "in_out"), directory)  # checkpoints are in_out


def _head_format_for_target(path, kind: str, target, caller: str):
  if not is_model(target):
    raise TypeError(f"{caller} takes the target model, got {type(target).__name__}")
  return head_formats.find_head_format(path, kind, family_of(target), target.config)


def load_feature_draft(path, target, *, dtype=None):
  """A `FeatureDraft` from a public EAGLE-1 or EAGLE-3 head directory, for `target`.

  The format is the registered feature-head format (`families.head_formats`)
  that serves the target's family and recognises the directory.

  Args:
    path: a directory with config.json and model.safetensors or
      pytorch_model.bin (or sharded, with an index): EAGLE-1 (`fc.*`,
      `layers.0.*`; the target's embeddings and LM head) or EAGLE-3
      (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`,
      `t2d`), told apart by the tensor names.
    target: the decoder-only Llama-layout model the head was trained for
      (Llama, Qwen2, Mistral layouts).
    dtype: the head's params dtype (EAGLE-3: also its compute dtype); default
      the target's.
  Raises:
    CheckpointError: missing files or tensors, unexpected tensors (named),
      the head's hidden size or vocabulary not the target's, a target layout
      the formats do not serve (`head_formats.UnsupportedHeadFormat` where no
      registered format serves the target's family).
  """
  from specdec_jax.drafts.feature_draft import FeatureDraft
  path = os.fspath(path)
  fmt = _head_format_for_target(path, "feature", target, "load_feature_draft")
  return FeatureDraft(target, **fmt.load(path, target, optional_dtype(dtype)))


def save_feature_draft(draft, path, format=None) -> None:
  """Writes a `FeatureDraft`'s head as a public EAGLE checkpoint (config.json +
  model.safetensors) that `load_feature_draft` (and EAGLE's own loaders) read.

  format: None (the head's own), 'eagle1' (the decoder-only family's EAGLE-1
  head) or 'eagle3' (an `Eagle3Head`), or another registered feature-head
  format's name; a head cannot be written in a format that does not hold it.
  """
  from specdec_jax.drafts.feature_draft import FeatureDraft
  if not isinstance(draft, FeatureDraft):
    raise TypeError(f"save_feature_draft takes a FeatureDraft, got {type(draft).__name__}")
  head_formats.head_format_for(draft, "feature", format).save(draft, path)


def load_medusa_draft(path, target, dtype=None):
  """Reads a public Medusa-1 head directory (config.json with `medusa_num_heads` /
  `medusa_num_layers`, and medusa_lm_head.safetensors or medusa_lm_head.pt) as a
  `MedusaDraft` for `target` (any family with features: the heads read its last
  hidden state).

  Args:
    path: the directory (`drafts/medusa_checkpoints.py` lists the tensor names).
    target: the model the heads were trained on (its hidden size and vocabulary
      are checked against every tensor).
    dtype: the heads' params dtype; default the target's.
  Raises:
    CheckpointError: naming the file and tensor at fault
      (`head_formats.UnsupportedHeadFormat` for a family without features).
  """
  from specdec_jax.drafts.medusa import MedusaDraft
  path = os.fspath(path)
  fmt = _head_format_for_target(path, "medusa", target, "load_medusa_draft")
  return MedusaDraft(target, **fmt.load(path, target, optional_dtype(dtype)))


def load_dflash_draft(path, target, dtype=None):
  """Reads a public DFlash drafter directory (z-lab's format: a Qwen3-style config.json with
  `dflash_config` {block_size, mask_token_id, target_layer_ids} and safetensors) as a
  `DFlashDraft` for `target` (decoder-only: Qwen3, Llama, ...; the drafter shares its
  embedding and LM head).

  Args:
    path: the directory (`drafts/dflash_checkpoints.py` lists the tensor names).
    target: the model the drafter was trained on (hidden size, vocabulary and layer ids
      are checked).
    dtype: the drafter's params dtype; default the target's.
  Raises:
    CheckpointError: naming the file, key or tensor at fault (DFlash-2 drafters and
      sliding-window drafters are refused by name).
  """
  from specdec_jax.drafts.dflash import DFlashDraft
  path = os.fspath(path)
  fmt = _head_format_for_target(path, "dflash", target, "load_dflash_draft")
  return DFlashDraft(target, **fmt.load(path, target, optional_dtype(dtype)))


def load_mtp_draft(path, target, *, layout=None, dtype=None):
  """Reads a checkpoint's own multi-token-prediction modules as an `MtpDraft` for `target`
  (the model of that checkpoint: its embedding, LM head and layer kind).

  Layouts (`drafts/mtp_checkpoints.py` lists the tensor names): DeepSeek-V3 / GLM-4.5
  (config.json `num_nextn_predict_layers`, module k stored as layer num_hidden_layers + k
  with enorm, hnorm, eh_proj, shared_head), Qwen3-Next / Qwen3.5 (`mtp.fc`,
  `mtp.pre_fc_norm_*`, `mtp.layers.{k}`, `mtp.norm`) and MiMo (`model.mtp_layers.{k}`),
  told apart by the tensor names. Drafting chains the modules (step i runs module i mod N).

  Args:
    path: the model's directory (config.json and safetensors; only the MTP tensors are read).
    target: the decoder-only model itself.
    layout: None (detected), 'deepseek', 'qwen3_next' or 'mimo'.
    dtype: the modules' params dtype; default the target's.
  Raises:
    CheckpointError: no MTP modules (naming the config keys and tensor prefixes looked for,
      per layout); a hidden size, vocabulary or layer count unlike the target's; missing,
      unexpected or mis-shaped tensors (all named).
  """
  from specdec_jax.drafts import mtp_checkpoints
  from specdec_jax.drafts.mtp import MtpDraft
  if not is_model(target):
    raise TypeError(f"load_mtp_draft takes the target model, got {type(target).__name__}")
  found = mtp_checkpoints.load(os.fspath(path), target, layout, optional_dtype(dtype))
  return MtpDraft(target, **found)


def save_dflash_draft(draft, path) -> None:
  """Writes a decoder-only `DFlashDraft` as a z-lab directory that `load_dflash_draft` and
  z-lab's `DFlashDraftModel` read."""
  from specdec_jax.drafts.dflash import DFlashDraft
  if not isinstance(draft, DFlashDraft):
    raise TypeError(f"save_dflash_draft takes a DFlashDraft, got {type(draft).__name__}")
  head_formats.head_format_for(draft, "dflash").save(draft, path)


def mask_token_of(path) -> int:
  """The mask id a PARD directory was trained with: config.json's `pard_token` (AMD's
  checkpoints) or `mask_token_id`, else the tokenizer's mask token (tokenizer_config.json's
  `mask_token` looked up in tokenizer.json / added_tokens). CheckpointError naming the
  files looked at when none is found."""
  path = os.fspath(path)
  looked = []
  config_path = os.path.join(path, "config.json")
  looked.append(f"{config_path} (pard_token, mask_token_id)")
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, ValueError):
    hf = {}
  for key in ("pard_token", "mask_token_id"):
    value = hf.get(key)
    if isinstance(value, list) and value:
      value = value[0]
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  tok_config = os.path.join(path, "tokenizer_config.json")
  looked.append(f"{tok_config} (mask_token) with tokenizer.json's added tokens")
  try:
    with open(tok_config) as f:
      mask = json.load(f).get("mask_token")
    if isinstance(mask, dict):
      mask = mask.get("content")
    with open(os.path.join(path, "tokenizer.json")) as f:
      tokenizer = json.load(f)
    for token in tokenizer.get("added_tokens", []):
      if mask is not None and token.get("content") == mask:
        return int(token["id"])
    vocab = tokenizer.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict) and mask in vocab:
      return int(vocab[mask])
  except (OSError, ValueError, AttributeError):
    pass
  raise CheckpointError(f"{path}: no mask token found (looked in {'; '.join(looked)}); a "
                        "PARD drafter names the mask it was trained with: pass "
                        "mask_token_id=... to load_parallel_draft")


def load_parallel_draft(path, gamma: int = 4, mask_token_id: Optional[int] = None,
                        target_vocab_size: Optional[int] = None, **load_kwargs):
  """Reads a public PARD drafter (an ordinary HF causal LM whose config.json names its mask
  token, `pard_token`) as a `ParallelDraft` drafting `gamma` tokens per call.

  Args:
    path: the directory (`load_model` reads the model; `mask_token_of` the mask id).
    gamma: K, the most tokens one call drafts.
    mask_token_id: overrides the directory's mask id.
    target_vocab_size: as `ModelDraft`'s (tables padded to different sizes).
    **load_kwargs: `load_model`'s (dtype, ...).
  """
  from specdec_jax.drafts.pard import ParallelDraft
  path = os.fspath(path)
  mask = mask_token_of(path) if mask_token_id is None else mask_token_id
  model = load_model(path, **load_kwargs)
  return ParallelDraft(model, mask_token_id=mask, gamma=gamma,
                       target_vocab_size=target_vocab_size)


def save_medusa_draft(draft, path) -> None:
  """Writes a `MedusaDraft` (own LM heads) as a Medusa-1 directory (config.json +
  medusa_lm_head.safetensors) that `load_medusa_draft` and Medusa's code read."""
  from specdec_jax.drafts.medusa import MedusaDraft
  if not isinstance(draft, MedusaDraft):
    raise TypeError(f"save_medusa_draft takes a MedusaDraft, got {type(draft).__name__}")
  head_formats.head_format_for(draft, "medusa").save(draft, path)
