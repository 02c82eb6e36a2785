"""`load_model`: one loader for every model family.

A named config or a config object gives random weights; a path gives a
checkpoint. The family is read from what is given: a `T5Config` or T5 config
name, a `DecoderOnlyConfig` or decoder-only config name, or, for a Hugging
Face directory, its config.json (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`GPT2LMHeadModel` are decoder-only; T5 otherwise). T5X and Orbax checkpoints
are T5.

This module sits above both families' networks and loaders
(`model` / `checkpoints` for T5, `decoder_only_model` /
`checkpoints_decoder_only` for decoder-only), so none of them imports it back.
"""

import json
import os
from typing import Optional, Union

from specdec_jax.families.t5 import checkpoints
from specdec_jax.families.decoder_only import checkpoints as checkpoints_decoder_only
from specdec_jax.families.decoder_only.model import DecoderOnlyModel, init_decoder_only_params
from specdec_jax.core.dtypes import optional_dtype
from specdec_jax.families.t5.model import Model, default_dtype, init_params
from specdec_jax.families.t5.config import CONFIGS, T5Config, get_config
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                canonical_name, get_decoder_config)

AnyModel = Union[Model, DecoderOnlyModel]


def _is_decoder_only_directory(path: str) -> bool:
  """A Hugging Face directory whose config.json names a decoder-only architecture."""
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    return False
  with open(config_file) as f:
    hf = json.load(f)
  architectures = hf.get("architectures") or []
  return (any(a in checkpoints_decoder_only.ARCHITECTURES for a in architectures) or
          (not architectures and hf.get("model_type") in checkpoints_decoder_only.MODEL_TYPES))


def _random(config, dtype: Optional[str], seed: int, overrides) -> AnyModel:
  """A randomly initialised model of `config` (either family), overrides and dtype applied."""
  config = config.replace(**overrides) if overrides else config
  if dtype is not None:
    config = config.replace(dtype=dtype)
  if isinstance(config, DecoderOnlyConfig):
    return DecoderOnlyModel(config, init_decoder_only_params(config, seed))
  return Model(config, init_params(config, seed))


def load_model(source: Union[str, os.PathLike, T5Config, DecoderOnlyConfig], *,
               dtype=None, seed: int = 0, **config_overrides) -> AnyModel:
  """Builds a T5 `Model` or a `DecoderOnlyModel`.

  Args:
    source: a named config (`t5_1_1_small`, `tiny`, `gpt2`, `qwen2_0_5b`, ...),
      a `T5Config` / `DecoderOnlyConfig` (random init), or a checkpoint: a
      Hugging Face directory (T5, Llama, Qwen2, GPT-2), a T5X or Orbax
      checkpoint, or a hub id (fetched when `huggingface_hub` is installed and
      online). A local path wins over a name of the same spelling.
    dtype: 'float32' / 'bfloat16' / 'float16' in any spelling
      `dtypes.canonical_dtype` accepts (jnp.bfloat16, 'bf16', ...); default
      float32 on CPU, bfloat16 elsewhere.
    seed: init seed for random weights.
    **config_overrides: config fields to change (random init only).
  """
  dtype = optional_dtype(dtype)
  if isinstance(source, DecoderOnlyConfig):
    return load_decoder_only_model(source, dtype=dtype, seed=seed, **config_overrides)
  if isinstance(source, T5Config):
    return _random(source, dtype, seed, config_overrides)
  source = os.fspath(source) if isinstance(source, os.PathLike) else source
  if not isinstance(source, str):
    raise TypeError(f"load_model takes a config name, a T5Config / DecoderOnlyConfig or a path, "
                    f"got {type(source).__name__}")
  if not os.path.exists(source):
    if source in CONFIGS:
      return _random(get_config(source), dtype or default_dtype(), seed, config_overrides)
    if canonical_name(source) in DECODER_CONFIGS:
      return load_decoder_only_model(source, dtype=dtype, seed=seed, **config_overrides)
    if "/" not in source and os.sep not in source:
      raise ValueError(f"Unknown model config {source!r} (and no such checkpoint path). "
                       f"T5 configs: {', '.join(sorted(CONFIGS))}; decoder-only configs: "
                       f"{', '.join(sorted(DECODER_CONFIGS))}")
  if not os.path.exists(source) and checkpoints._looks_like_hub_id(source):
    source = checkpoints._download_from_hub(source)  # A clear error when offline.
  if os.path.isdir(source) and _is_decoder_only_directory(source):
    return load_decoder_only_model(source, dtype=dtype, **config_overrides)
  return checkpoints.load_checkpoint_model(source, dtype=dtype, **config_overrides)


def load_decoder_only_model(source: Union[str, DecoderOnlyConfig, os.PathLike], *,
                            dtype=None, seed: int = 0,
                            **config_overrides) -> DecoderOnlyModel:
  """Builds a `DecoderOnlyModel`.

  Args:
    source: a named config (`gpt2`, `qwen2-0.5b`, `llama_tiny`, ...) or a
      `DecoderOnlyConfig` (random init), or a Hugging Face directory of a
      LlamaForCausalLM / Qwen2ForCausalLM / GPT2LMHeadModel (see
      `checkpoints_decoder_only`), or a hub id (`Qwen/Qwen2-0.5B`), fetched
      with `huggingface_hub` when installed and reachable. A local path or
      named config wins over a hub id of the same spelling.
    dtype: 'float32' / 'bfloat16' / 'float16' (any spelling); default float32
      on CPU, bfloat16 elsewhere.
    seed: init seed for random weights.
    **config_overrides: DecoderOnlyConfig fields to change (random init only).
  """
  dtype = optional_dtype(dtype)
  if isinstance(source, DecoderOnlyConfig):
    return _random(source, dtype, seed, config_overrides)
  source = os.fspath(source) if isinstance(source, os.PathLike) else source
  if not isinstance(source, str):
    raise TypeError(f"load_decoder_only_model takes a config name, DecoderOnlyConfig or path, "
                    f"got {type(source)}")
  if not os.path.exists(source) and canonical_name(source) in DECODER_CONFIGS:
    return _random(get_decoder_config(source), dtype or default_dtype(), seed,
                   config_overrides)
  if not os.path.exists(source):
    if not checkpoints._looks_like_hub_id(source):
      raise ValueError(f"{source!r} is neither a decoder-only config name nor an existing "
                       f"directory. Known configs: {', '.join(sorted(DECODER_CONFIGS))}")
    source = checkpoints._download_from_hub(source)  # A clear error when offline.
  if config_overrides:
    raise ValueError(f"config overrides {sorted(config_overrides)} apply to random init only, "
                     f"not to a checkpoint (its config.json defines the shapes)")
  return checkpoints_decoder_only.load_hf_decoder_only(source, dtype=dtype)
