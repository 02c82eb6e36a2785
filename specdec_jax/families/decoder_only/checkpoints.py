"""Loading Hugging Face decoder-only directories into `DecoderOnlyModel`.

`load_hf_decoder_only(directory)` reads a `config.json` plus weights
(`model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
or `pytorch_model.bin`, optionally sharded with an index; the readers are
`specdec_jax.families.tensor_io`'), detects the architecture from
`config.json` (`architectures`, else `model_type`) and maps HF tensor names
onto the tree of `families/decoder_only/network.py`:

  Llama / Qwen2 (`LlamaForCausalLM`, `Qwen2ForCausalLM`), HF Linear weights
  [out, in] transposed to our kernels [in, out]:
    model.embed_tokens.weight                  -> embed_tokens/embedding
    model.layers.{i}.input_layernorm.weight    -> layers_{i}/input_layernorm/scale
    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
                                               -> layers_{i}/self_attn/{q,k,v,o}_proj/{kernel,bias}
    model.layers.{i}.post_attention_layernorm.weight -> layers_{i}/post_attention_layernorm/scale
    model.layers.{i}.mlp.{gate,up,down}_proj.{weight,bias}
                                               -> layers_{i}/mlp/{gate,up,down}_proj/{kernel,bias}
    model.norm.weight                          -> norm/scale
    lm_head.weight                             -> lm_head/kernel (untied only)
  Qwen3 / Mistral / Gemma (`Qwen3ForCausalLM`, `MistralForCausalLM`, `GemmaForCausalLM`,
  `Gemma2ForCausalLM`, `Gemma3ForCausalLM`): the same names, plus
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight (Gemma 2/3)
                                               -> layers_{i}/{pre,post}_feedforward_layernorm/scale
    model.layers.{i}.self_attn.{q,k}_norm.weight (Qwen3, Gemma 3)
                                               -> layers_{i}/self_attn/{q,k}_norm/scale
  Mixtral / Qwen3-MoE (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`): the Mistral / Qwen3
  names, with a mixture of experts in place of the MLP (Qwen3-MoE: on its MoE
  layers; its mlp_only_layers keep `mlp.{gate,up,down}_proj`). <moe> is
  `block_sparse_moe` (Mixtral) or `mlp` (Qwen3-MoE); expert e's Linear weights
  are transposed and stacked along a leading expert axis:
    model.layers.{i}.<moe>.gate.weight         -> layers_{i}/mlp/gate/kernel (the router)
    Mixtral   <moe>.experts.{e}.w1 / w3 / w2.weight
    Qwen3-MoE <moe>.experts.{e}.gate_proj / up_proj / down_proj.weight
                                               -> layers_{i}/mlp/experts/{gate,up,down}_proj[e]
  DeepSeek-V3 (`DeepseekV3ForCausalLM`): the Llama names, with latent attention in
  place of q/k/v_proj and a MoE with a shared expert from first_k_dense_replace on:
    model.layers.{i}.self_attn.{q_a_proj,q_b_proj,q_proj,kv_a_proj_with_mqa,kv_b_proj}.weight
    (+ .bias on q_a_proj / kv_a_proj_with_mqa / o_proj with attention_bias)
                                               -> layers_{i}/self_attn/<same>/kernel
    model.layers.{i}.self_attn.{q_a,kv_a}_layernorm.weight
                                               -> layers_{i}/self_attn/{q_a,kv_a}_layernorm/scale
    model.layers.{i}.mlp.gate.e_score_correction_bias
                                               -> layers_{i}/mlp/gate/e_score_correction_bias
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight
                                               -> layers_{i}/mlp/shared_experts/<same>/kernel
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight (or the fused form below)
  The MTP layers stored after the last layer (`num_nextn_predict_layers`, model.layers.{N}.*)
  are skipped, as transformers skips them. gpt-oss (`GptOssForCausalLM`): the Llama
  attention with q/k/v/o biases, plus
    model.layers.{i}.self_attn.sinks           -> layers_{i}/self_attn/sinks
    model.layers.{i}.mlp.router.{weight,bias}  -> layers_{i}/mlp/gate/{kernel,bias}
    model.layers.{i}.mlp.experts.gate_up_proj [experts, emb, 2 * mlp], gate and up
    interleaved (gate in the even columns), and its _bias [experts, 2 * mlp]
                                               -> layers_{i}/mlp/experts/{gate,up}_proj(_bias)
    model.layers.{i}.mlp.experts.down_proj [experts, mlp, emb] (+ _bias [experts, emb])
                                               -> layers_{i}/mlp/experts/down_proj(_bias)
  (gpt-oss experts are stored [in, out] already, fused, in the bf16 checkpoints and
  transformers 5's save_pretrained; the hub's MXFP4 `_blocks` / `_scales` and DeepSeek's
  FP8 `weight_scale_inv` checkpoints are refused by their quantization_config: load a
  dequantised copy.)
  These are the names the hub checkpoints hold and transformers 5's
  save_pretrained writes. transformers 5's in-memory fused form is read too:
  `<moe>.experts.gate_up_proj` [experts, 2 * mlp, emb] (gate rows first) and
  `<moe>.experts.down_proj` [experts, emb, mlp], and for Mixtral `mlp.` in place
  of `block_sparse_moe.`. The exporter writes the per-expert names.
  Gemma norm weights are stored around 0 (HF computes 1 + w) and copied as
  they are; `norm_offset` adds the 1. A multimodal
  `Gemma3ForConditionalGeneration` directory loads its text model: the
  `text_config`, tensors under `language_model.model.` / `model.language_model.`
  (and `language_model.lm_head.`), the vision tower and projector skipped.
  GPT-2 (`GPT2LMHeadModel`; Conv1D weights are already [in, out]; the
  `transformer.` prefix is optional, as in the original hub files):
    transformer.wte.weight / wpe.weight        -> embed_tokens / embed_positions embedding
    transformer.h.{i}.ln_1.{weight,bias}       -> layers_{i}/input_layernorm/{scale,bias}
    transformer.h.{i}.attn.c_attn.{weight,bias} split in three columns
                                               -> layers_{i}/self_attn/{q,k,v}_proj/{kernel,bias}
    transformer.h.{i}.attn.c_proj.{weight,bias} -> layers_{i}/self_attn/o_proj/{kernel,bias}
    transformer.h.{i}.ln_2.{weight,bias}       -> layers_{i}/post_attention_layernorm/{scale,bias}
    transformer.h.{i}.mlp.c_fc / c_proj        -> layers_{i}/mlp/up_proj / down_proj
    transformer.ln_f.{weight,bias}             -> norm/{scale,bias}

`export_hf_decoder_only(model, directory)` writes the reverse (config.json +
model.safetensors) for transformers to load.

Tied models (`tie_word_embeddings`, the GPT-2 and small-Qwen2 default) use the
token embedding as the output projection; an `lm_head.weight` stored beside it
is ignored, as HF ties it. Tensors are read one at a time, cast to the
requested dtype and placed before the next is read.
"""

import json
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specdec_jax.families.tensor_io import CheckpointError, raise_on_mismatch, write_safetensors
from specdec_jax.families.tensor_io import Tensor as _Tensor, cast as _cast
from specdec_jax.families.tensor_io import TensorView as _TensorView
from specdec_jax.families.tensor_io import transposed_block as _transposed_block
from specdec_jax.families.tensor_io import hf_weight_files as _hf_weight_files
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.core.dtypes import default_dtype
from specdec_jax.families.decoder_only.config import (FAMILY_CONVENTIONS, MOE_FAMILIES,
                                                      DecoderOnlyConfig, sliding_pattern)
from specdec_jax.families.decoder_only.network import DecoderOnly

# HF architecture class -> our family; model_type is the fallback.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3",
                 "GPT2LMHeadModel": "gpt2", "MistralForCausalLM": "mistral",
                 "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                 "Gemma3ForCausalLM": "gemma3",
                 "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss",
                 # Multimodal Gemma 3: its text model only.
                 "Gemma3ForConditionalGeneration": "gemma3"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2",
               "mistral": "mistral", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
               "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
               "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}

# transformers' config-class defaults for the fields a config.json may omit
# (the hub's multimodal Gemma 3 text_config omits most of them), so a missing
# field means what it means to transformers 5.24.
_GEMMA_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
                       eos_token_id=1, bos_token_id=2, attention_bias=False)
_HF_DEFAULTS = {
    "gemma": dict(_GEMMA_DEFAULTS, vocab_size=256000, head_dim=256,
                  hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192),
    "gemma2": dict(_GEMMA_DEFAULTS, vocab_size=256000, hidden_size=2304,
                   intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3": dict(_GEMMA_DEFAULTS, vocab_size=262208, hidden_size=2304,
                   intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=131072, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=None),
    "mistral": dict(sliding_window=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
    # Qwen3Config's head_dim defaults to 128, not hidden_size / heads.
    "qwen3": dict(head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attention_bias=False),
    # MixtralConfig / Qwen3MoeConfig (transformers 5.25) defaults. Qwen3-MoE's head_dim
    # falls back to hidden_size / heads (its attention's getattr), its norm_topk_prob to
    # False (the released checkpoints set it true).
    "mixtral": dict(max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2, sliding_window=None, rope_theta=1000000.0,
                    tie_word_embeddings=False, num_experts_per_tok=2),
    "qwen3_moe": dict(max_position_embeddings=32768, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attention_bias=False, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    # DeepseekV3Config / GptOssConfig (transformers 5.25) defaults.
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                        norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
                        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                        tie_word_embeddings=False, rope_interleave=True, attention_bias=False),
    # (num_local_experts: 128 unless num_local_experts / num_experts says, in _moe_fields.)
    "gpt_oss": dict(num_hidden_layers=36, vocab_size=201088,
                    hidden_size=2880, intermediate_size=2880, head_dim=64,
                    num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
                    tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-5, num_experts_per_tok=4, swiglu_alpha=1.702,
                    swiglu_limit=7.0, attention_bias=True, rope_theta=150000.0),
}
# GptOssConfig's rotary when a config.json names none.
_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)

# Where a MoE layer's router and experts live (`model.layers.{i}.<prefix>.`).
# (Per-expert Linear weights, or transformers 5's fused Linear stack; gpt-oss stores its
# experts fused and [in, out] only, through `hf_names`.)
_MOE_PREFIX = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp", "deepseek_v3": "mlp"}
# Per-expert Linear names of (our gate_proj, up_proj, down_proj).
_EXPERT_LINEARS = {"mixtral": ("w1", "w3", "w2"),
                   "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                   "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}

# HF activation names -> ours. HF's "gelu" is the exact erf GELU; "gelu_new"
# and "gelu_pytorch_tanh" are the tanh approximation.
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_new",
                   "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

# Buffers some HF checkpoints store that are not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def supported_architectures() -> str:
  """The architectures this family reads (the registry lists every family's)."""
  return f"{', '.join(sorted(ARCHITECTURES))} (model_type {', '.join(sorted(MODEL_TYPES))})"


def detect_family(hf: Mapping[str, Any], origin: str = "config.json") -> str:
  """Our family ('llama', 'gemma2', ...) from a config.json dict; CheckpointError otherwise."""
  architectures = hf.get("architectures") or []
  for name in architectures:
    if name in ARCHITECTURES:
      return ARCHITECTURES[name]
  model_type = hf.get("model_type")
  if not architectures and model_type in MODEL_TYPES:
    return MODEL_TYPES[model_type]
  raise CheckpointError(
      f"{origin}: unsupported architecture (architectures={architectures}, "
      f"model_type={model_type!r}); decoder-only loading supports {supported_architectures()}")


def _token_id(value, origin: str, name: str) -> Optional[int]:
  """An HF token id (an int, a list whose first entry is used, or None)."""
  if isinstance(value, (list, tuple)):
    # The decode loops stop on one EOS id; multi-EOS models use the first.
    value = value[0] if value else None
  if value is not None and not isinstance(value, int):
    raise CheckpointError(f"{origin}: {name} must be an int, a list of ints or null, got {value!r}")
  return value


def _rope_fields(hf: Mapping[str, Any], origin: str) -> Dict[str, Any]:
  """Rotary base and scaling from `rope_theta`/`rope_scaling` (transformers 4) or
  `rope_parameters` (transformers 5)."""
  params = dict(hf.get("rope_parameters") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or {}
  if params.get("rope_type", "default") != "default":
    scaling = params
  kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  fields = dict(rope_theta=float(theta))
  if kind == "default":
    return fields
  if kind == "linear":
    return dict(fields, rope_scaling="linear", rope_factor=float(scaling["factor"]))
  if kind == "llama3":
    return dict(fields, rope_scaling="llama3", rope_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling["low_freq_factor"]),
                rope_high_freq_factor=float(scaling["high_freq_factor"]),
                rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
  if kind == "yarn":
    # transformers' standardize_rope_params / _compute_yarn_parameters: the original length
    # defaults to max_position_embeddings, a null factor to their ratio, null betas to 32 / 1,
    # truncate to True; mscale / mscale_all_dim only count when both are set (the attention
    # factor) or for DeepSeek's softmax scale (mscale_all_dim).
    longest = hf.get("max_position_embeddings")
    original = (scaling.get("original_max_position_embeddings") or
                hf.get("original_max_position_embeddings") or longest)
    factor = scaling.get("factor")
    if original is None or (factor is None and longest is None):
      raise CheckpointError(f"{origin}: yarn rope scaling needs factor and "
                            f"original_max_position_embeddings (or max_position_embeddings)")
    original = int(original)
    factor = float(longest) / original if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    return dict(fields, rope_scaling="yarn", rope_factor=factor,
                rope_original_max_positions=original,
                rope_beta_fast=float(scaling.get("beta_fast") or 32.0),
                rope_beta_slow=float(scaling.get("beta_slow") or 1.0),
                rope_truncate=bool(scaling.get("truncate", True)),
                rope_mscale=float(scaling.get("mscale") or 0.0),
                rope_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
                rope_attention_factor=None if attention is None else float(attention))
  raise CheckpointError(f"{origin}: rope scaling {kind!r} is not supported (supported: default, "
                        f"linear, llama3, yarn)")


def _gemma3_rope_fields(hf: Mapping[str, Any], origin: str) -> Dict[str, Any]:
  """Gemma 3's two rotary tables: full layers (rope_theta, default 1M, and any
  scaling) and sliding layers (10k by default, never scaled).

  transformers 5 writes `rope_parameters` keyed by layer type; 4 wrote
  rope_theta, rope_local_base_freq and rope_scaling (which applies to the full
  layers only).
  """
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params or "sliding_attention" in params:
    full = dict(params.get("full_attention") or {})
    sliding = dict(params.get("sliding_attention") or {})
  else:
    full = dict(hf.get("rope_scaling") or {})
    full["rope_theta"] = hf.get("rope_theta", 1000000.0)
    sliding = dict(rope_theta=hf.get("rope_local_base_freq", 10000.0))
  full.setdefault("rope_theta", 1000000.0)
  sliding.setdefault("rope_theta", 10000.0)
  if sliding.get("rope_type", sliding.get("type", "default")) != "default":
    raise CheckpointError(f"{origin}: rope scaling on Gemma 3's sliding layers "
                          f"({sliding}) is not supported")
  if "type" in full and "rope_type" not in full:
    full["rope_type"] = full["type"]
  full.setdefault("rope_type", "default")
  return dict(_rope_fields(dict(rope_parameters=full), origin),
              sliding_rope_theta=float(sliding["rope_theta"]))


def _layout_fields(family: str, hf: Mapping[str, Any], origin: str) -> Dict[str, Any]:
  """Mistral / Gemma fields beyond Llama's: conventions, window, layer types, caps."""
  fields = dict(FAMILY_CONVENTIONS[family])
  if family.startswith("gemma") and hf.get("use_bidirectional_attention"):
    raise CheckpointError(f"{origin}: use_bidirectional_attention (an encoder use of Gemma) "
                          f"is not supported")
  num_layers = int(hf["num_hidden_layers"])
  window = hf.get("sliding_window") if family not in ("gemma", "deepseek_v3") else None
  if family == "gpt_oss":
    # GptOssConfig: layer_types default to sliding / full alternating from layer 0; a
    # null window makes every layer full.
    if window is not None:
      fields.update(sliding_window=int(window), layer_types=tuple(
          hf.get("layer_types") or sliding_pattern(num_layers, 2)))
    return fields
  if family in ("gemma2", "gemma3") and window is not None:
    layer_types = hf.get("layer_types")
    if layer_types is None:  # Hub configs: the pattern (HF's default when absent).
      layer_types = sliding_pattern(num_layers,
                                    2 if family == "gemma2" else
                                    int(hf.get("sliding_window_pattern", 6)))
    fields["layer_types"] = tuple(layer_types)
  # Mistral: layer_types None = the window on every layer (HF ignores
  # layer_types for Mistral). A null window (Mistral v0.2+, or Gemma 2/3 set
  # so) makes every layer full, as HF's masks do.
  if window is not None:
    fields["sliding_window"] = int(window)
  if family in ("gemma2", "gemma3"):
    fields["query_pre_attn_scalar"] = float(hf["query_pre_attn_scalar"])
    cap = hf.get("final_logit_softcapping")
    fields["final_logit_softcap"] = None if cap is None else float(cap)
  if family == "gemma2":
    # Gemma 3 configs may carry attn_logit_softcapping too; transformers 5.24's
    # Gemma 3 attention never applies it, so neither do we.
    cap = hf.get("attn_logit_softcapping")
    fields["attn_logit_softcap"] = None if cap is None else float(cap)
  return fields


def _moe_fields(family: str, hf: Mapping[str, Any]) -> Dict[str, Any]:
  """The mixture-of-experts fields of a Mixtral / Qwen3-MoE / DeepSeek-V3 / gpt-oss config.json
  (checked by DecoderOnlyConfig: a k above the expert count is an error naming both)."""
  if family == "deepseek_v3":
    # DeepseekV3ForCausalLM routes by sigmoid + correction bias + groups whatever
    # scoring_func / topk_method say (they are not read), as here.
    return dict(num_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_mlp_dim=hf["moe_intermediate_size"],
                n_shared_experts=hf.get("n_shared_experts") or 0,
                n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                routed_scaling_factor=float(hf["routed_scaling_factor"]),
                first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
                norm_topk_prob=bool(hf["norm_topk_prob"]))
  if family == "gpt_oss":
    return dict(num_experts=hf.get("num_local_experts", hf.get("num_experts", 128)),
                num_experts_per_tok=hf.get("num_experts_per_tok", hf.get("experts_per_token")),
                swiglu_limit=float(hf["swiglu_limit"]), swiglu_alpha=float(hf["swiglu_alpha"]))
  # MixtralConfig maps num_experts to num_local_experts; transformers 5.25 writes Qwen3-MoE's
  # num_experts as num_local_experts too, while its hub files say num_experts. The
  # defaults: MixtralConfig's 8, Qwen3MoeConfig's 128.
  experts = hf.get("num_local_experts", hf.get("num_experts"))
  if experts is None:
    experts = 8 if family == "mixtral" else 128
  fields = dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"])
  if family == "qwen3_moe":
    fields.update(moe_mlp_dim=hf["moe_intermediate_size"],
                  norm_topk_prob=bool(hf["norm_topk_prob"]),
                  decoder_sparse_step=hf["decoder_sparse_step"],
                  mlp_only_layers=tuple(sorted(set(hf.get("mlp_only_layers") or ()))))
  return fields


def _text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
  """A multimodal Gemma 3 config's text model: its text_config over the
  top-level token ids."""
  if "Gemma3ForConditionalGeneration" not in (hf.get("architectures") or []) and (
      hf.get("model_type") != "gemma3"):
    return hf
  ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
  return {**ids, **(hf.get("text_config") or {}), "architectures": ["Gemma3ForCausalLM"],
          "model_type": "gemma3_text"}


def hf_config_to_decoder_config(hf: Mapping[str, Any], origin: str = "config.json",
                                dtype: str = "float32") -> DecoderOnlyConfig:
  """Our `DecoderOnlyConfig` from a Hugging Face config.json dict."""
  family = detect_family(hf, origin)
  hf = dict(_HF_DEFAULTS.get(family, {}), **_text_config(hf))
  if family == "gpt_oss" and not hf.get("rope_scaling") and not hf.get("rope_parameters"):
    hf["rope_scaling"] = dict(_GPT_OSS_ROPE)
  try:
    if family == "gpt2":
      if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise CheckpointError(f"{origin}: GPT-2 attention scaling other than 1/sqrt(head_dim) "
                              f"(scale_attn_by_inverse_layer_idx / scale_attn_weights) is not "
                              f"supported")
      emb, heads = int(hf["n_embd"]), int(hf["n_head"])
      activation = hf.get("activation_function", "gelu_new")
      fields = dict(family="gpt2", vocab_size=int(hf["vocab_size"]), emb_dim=emb,
                    num_layers=int(hf["n_layer"]), num_heads=heads, num_kv_heads=heads,
                    head_dim=emb // heads, mlp_dim=int(hf.get("n_inner") or 4 * emb),
                    max_positions=int(hf["n_positions"]),
                    norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                    qkv_bias=True, out_bias=True, mlp_bias=True)
    else:
      if hf.get("use_sliding_window"):
        raise CheckpointError(f"{origin}: sliding-window attention (use_sliding_window) is not "
                              f"supported")
      emb, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
      if family in ("gemma2", "gemma3"):  # transformers reads hidden_activation only.
        activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
      else:
        activation = hf.get("hidden_act", "silu")
      if family == "gemma" and activation == "gelu":
        # transformers' GemmaConfig: the released configs' "gelu" means the
        # tanh approximation, and it is converted to gelu_pytorch_tanh.
        activation = "gelu_pytorch_tanh"
      attention_bias = bool(hf.get("attention_bias", False))
      fields = dict(family=family, vocab_size=int(hf["vocab_size"]), emb_dim=emb,
                    num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
                    num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                    head_dim=int(hf.get("head_dim") or emb // heads),
                    mlp_dim=int(hf["intermediate_size"]),
                    max_positions=int(hf.get("max_position_embeddings", 2048)),
                    norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                    # Qwen2 always has q/k/v biases and no output bias; Qwen3's
                    # attention_bias, like Llama's, covers q/k/v and o.
                    qkv_bias=family == "qwen2" or attention_bias,
                    out_bias=family != "qwen2" and attention_bias,
                    mlp_bias=bool(hf.get("mlp_bias", False)),
                    **(_gemma3_rope_fields(hf, origin) if family == "gemma3" else
                       _rope_fields(hf, origin)))
      if family in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        # Qwen3: its q/k norms. Its sliding_window / max_window_layers mean
        # nothing without use_sliding_window (refused above), as for Qwen2.
        fields.update(FAMILY_CONVENTIONS[family])
      else:
        fields.update(_layout_fields(family, hf, origin))
      if family in MOE_FAMILIES:
        fields.update(_moe_fields(family, hf))
      if family == "deepseek_v3":
        # Latent attention: every head's key and value come from the latent, so
        # num_key_value_heads is moot (transformers' attention only runs with it equal to
        # the heads); config.json's head_dim is the rotary width.
        nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        lora = hf.get("q_lora_rank")
        fields.update(head_dim=nope + rope, num_kv_heads=heads,
                      q_lora_rank=None if lora is None else int(lora),
                      kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=int(hf["v_head_dim"]),
                      rope_interleave=bool(hf.get("rope_interleave", True)))
  except KeyError as e:
    raise CheckpointError(f"{origin}: missing field {e.args[0]!r} for a {family} config") from None
  if activation not in _HF_ACTIVATIONS:
    raise CheckpointError(f"{origin}: activation {activation!r} is not supported (supported: "
                          f"{', '.join(sorted(_HF_ACTIVATIONS))})")
  eos = _token_id(hf.get("eos_token_id"), origin, "eos_token_id")
  bos = _token_id(hf.get("bos_token_id"), origin, "bos_token_id")
  pad = _token_id(hf.get("pad_token_id"), origin, "pad_token_id")
  vocab = fields["vocab_size"]
  in_vocab = lambda i: i if i is not None and 0 <= i < vocab else None  # noqa: E731
  try:
    return DecoderOnlyConfig(activation=_HF_ACTIVATIONS[activation], dtype=dtype,
                             bos_id=in_vocab(bos), eos_id=in_vocab(eos),
                             pad_id=pad if in_vocab(pad) is not None else 0, **fields)
  except ValueError as e:
    raise CheckpointError(f"{origin}: {e}") from None


def hf_names(config: DecoderOnlyConfig) -> Dict[str, Tuple[str, str, Optional[int]]]:
  """Our param name -> (HF tensor name, transform, part).

  transform: 'copy', 'transpose' (Linear weight -> kernel) or 'interleaved' (gpt-oss's
  fused gate_up_proj(_bias): part 0 the even columns of the last axis, 1 the odd ones);
  part: for GPT-2's fused c_attn, which third (0 = q, 1 = k, 2 = v) of the last axis, else
  None.
  """
  names = {}
  if config.family == "gpt2":
    names["embed_tokens/embedding"] = ("transformer.wte.weight", "copy", None)
    names["embed_positions/embedding"] = ("transformer.wpe.weight", "copy", None)
    names["norm/scale"] = ("transformer.ln_f.weight", "copy", None)
    names["norm/bias"] = ("transformer.ln_f.bias", "copy", None)
    for i in range(config.num_layers):
      ours, theirs = f"layers_{i}/", f"transformer.h.{i}."
      for norm, ln in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
        names[f"{ours}{norm}/scale"] = (f"{theirs}{ln}.weight", "copy", None)
        names[f"{ours}{norm}/bias"] = (f"{theirs}{ln}.bias", "copy", None)
      for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        names[f"{ours}self_attn/{proj}/kernel"] = (f"{theirs}attn.c_attn.weight", "copy", part)
        names[f"{ours}self_attn/{proj}/bias"] = (f"{theirs}attn.c_attn.bias", "copy", part)
      for param, hf_param in (("kernel", "weight"), ("bias", "bias")):
        names[f"{ours}self_attn/o_proj/{param}"] = (f"{theirs}attn.c_proj.{hf_param}", "copy",
                                                    None)
        names[f"{ours}mlp/up_proj/{param}"] = (f"{theirs}mlp.c_fc.{hf_param}", "copy", None)
        names[f"{ours}mlp/down_proj/{param}"] = (f"{theirs}mlp.c_proj.{hf_param}", "copy", None)
    if not config.tie_word_embeddings:
      names["lm_head/kernel"] = ("lm_head.weight", "transpose", None)
    return names

  names["embed_tokens/embedding"] = ("model.embed_tokens.weight", "copy", None)
  names["norm/scale"] = ("model.norm.weight", "copy", None)
  if not config.tie_word_embeddings:
    names["lm_head/kernel"] = ("lm_head.weight", "transpose", None)
  if config.uses_mla:
    biases = {"kv_a_proj_with_mqa": config.qkv_bias, "kv_b_proj": False,
              "o_proj": config.out_bias}
    biases.update({"q_proj": False} if config.q_lora_rank is None else
                  {"q_a_proj": config.qkv_bias, "q_b_proj": False})
  else:
    biases = {"q_proj": config.qkv_bias, "k_proj": config.qkv_bias, "v_proj": config.qkv_bias,
              "o_proj": config.out_bias}
  mlp = ("gate_proj", "up_proj", "down_proj")
  for i in range(config.num_layers):
    ours, theirs = f"layers_{i}/", f"model.layers.{i}."
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.sandwich_norms:
      norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if config.qk_norm:
      norms += ["self_attn/q_norm", "self_attn/k_norm"]
    if config.uses_mla:
      norms += ["self_attn/kv_a_layernorm"] + (
          [] if config.q_lora_rank is None else ["self_attn/q_a_layernorm"])
    for norm in norms:
      names[f"{ours}{norm}/scale"] = (f"{theirs}{norm.replace('/', '.')}.weight", "copy", None)
    if config.attention_sinks:
      names[f"{ours}self_attn/sinks"] = (f"{theirs}self_attn.sinks", "copy", None)
    projections = [(f"self_attn/{p}", f"self_attn.{p}", bias) for p, bias in biases.items()]
    if config.moe_layers[i] and config.family == "gpt_oss":
      # The biased router; the experts fused, [in, out], gate and up interleaved.
      projections.append(("mlp/gate", "mlp.router", True))
      experts = f"{theirs}mlp.experts."
      for part, proj in enumerate(("gate_proj", "up_proj")):
        names[f"{ours}mlp/experts/{proj}"] = (f"{experts}gate_up_proj", "interleaved", part)
        names[f"{ours}mlp/experts/{proj}_bias"] = (f"{experts}gate_up_proj_bias", "interleaved",
                                                   part)
      names[f"{ours}mlp/experts/down_proj"] = (f"{experts}down_proj", "copy", None)
      names[f"{ours}mlp/experts/down_proj_bias"] = (f"{experts}down_proj_bias", "copy", None)
    elif config.moe_layers[i]:  # The router; the experts are `hf_expert_names`'.
      projections.append(("mlp/gate", f"{_MOE_PREFIX[config.family]}.gate", False))
      if config.family == "deepseek_v3":
        names[f"{ours}mlp/gate/e_score_correction_bias"] = (
            f"{theirs}mlp.gate.e_score_correction_bias", "copy", None)
        if config.n_shared_experts:
          projections += [(f"mlp/shared_experts/{p}", f"mlp.shared_experts.{p}", False)
                          for p in mlp]
    else:
      projections += [(f"mlp/{p}", f"mlp.{p}", config.mlp_bias) for p in mlp]
    for ours_proj, theirs_proj, bias in projections:
      names[f"{ours}{ours_proj}/kernel"] = (f"{theirs}{theirs_proj}.weight", "transpose", None)
      if bias:
        names[f"{ours}{ours_proj}/bias"] = (f"{theirs}{theirs_proj}.bias", "copy", None)
  return names


def hf_expert_names(config: DecoderOnlyConfig) -> Dict[str, Tuple[Tuple[str, ...], str]]:
  """Our stacked expert params -> (the per-expert HF Linear weights, in expert order; the
  fused transformers 5 tensor that also holds them). Empty for dense layouts."""
  if config.family not in _MOE_PREFIX:
    return {}
  names = {}
  for i, sparse in enumerate(config.moe_layers):
    if not sparse:
      continue
    theirs = f"model.layers.{i}.{_MOE_PREFIX[config.family]}.experts."
    for ours, linear in zip(("gate_proj", "up_proj", "down_proj"),
                            _EXPERT_LINEARS[config.family]):
      fused = theirs + ("down_proj" if ours == "down_proj" else "gate_up_proj")
      names[f"layers_{i}/mlp/experts/{ours}"] = (
          tuple(f"{theirs}{e}.{linear}.weight" for e in range(config.num_experts)), fused)
  return names


def _stacked_tensor(experts, shape: Tuple[int, ...]) -> _Tensor:
  """Our [experts, in, out] view of per-expert HF Linear weights [out, in]: each one
  transposed, stacked along a new leading axis (blocks read expert by expert)."""
  def read(dtype):
    return np.stack([_cast(t.read(None), dtype, True) for t in experts])

  def read_block(index, dtype):
    return np.stack([_cast(_transposed_block(experts[e], index[1:]), dtype)
                     for e in range(index[0].start, index[0].stop)]).reshape(
                         tuple(s.stop - s.start for s in index))

  source = f"{experts[0].source} .. {experts[-1].source}"
  return _Tensor(source, shape, read,
                 read_block if all(t.read_block for t in experts) else None)


def _fused_tensor(stored: _Tensor, part: Optional[int]) -> _Tensor:
  """Our [experts, in, out] view of transformers 5's fused expert tensor: gate_up_proj
  [experts, 2 * mlp, emb] (part 0: the gate rows, 1: the up rows) or down_proj
  [experts, emb, mlp] (part None), the last two axes swapped."""
  experts, rows, cols = tuple(stored.shape)
  if part is not None and rows % 2:
    raise CheckpointError(f"{stored.source}: fused gate/up of shape {stored.shape} cannot be "
                          f"split in two equal parts")
  width = rows // 2 if part is not None else rows
  offset = 0 if part is None else part * width

  def read_block(index, dtype):
    e, i, o = index  # Ours [experts, cols, width]; stored [experts, rows, cols].
    block = stored.block((e, slice(o.start + offset, o.stop + offset), i), None)
    return _cast(np.swapaxes(block, 1, 2), dtype)

  def read(dtype):
    return read_block((slice(0, experts), slice(0, cols), slice(0, width)), dtype)

  return _Tensor(stored.source, (experts, cols, width), read, read_block)


def _expert_tensors(config: DecoderOnlyConfig, files: Dict[str, _Tensor],
                    want: Dict[str, Tuple[int, ...]]):
  """(our expert params -> tensors, HF names used, missing, mis-shaped) from `files`:
  the per-expert weights when every one is there, else the fused tensor."""
  tensors, used, missing, mismatched = {}, set(), [], []
  for ours, (per_expert, fused) in hf_expert_names(config).items():
    found = [name for name in per_expert if name in files]
    if len(found) == len(per_expert):
      used.update(per_expert)
      one = tuple(reversed(want[ours][1:]))  # Each expert's HF [out, in].
      bad = [f"{files[name].source}: checkpoint {tuple(files[name].shape)} vs expected {one} "
             f"(expert {e} of {ours})" for e, name in enumerate(per_expert)
             if tuple(files[name].shape) != one]
      if bad:
        mismatched += bad
      else:
        tensors[ours] = _stacked_tensor([files[name] for name in per_expert], want[ours])
    elif not found and fused in files:
      used.add(fused)
      part = None if ours.endswith("down_proj") else int(ours.endswith("up_proj"))
      tensors[ours] = _fused_tensor(files[fused], part)
    elif found:  # Some experts there: name each one that is not.
      missing += [f"{name} (expert {e} of {ours})" for e, name in enumerate(per_expert)
                  if name not in files]
    else:
      missing.append(f"{per_expert[0]} .. {per_expert[-1]}, or the fused {fused} (for {ours})")
  return tensors, used, missing, mismatched


def expected_shapes(config: DecoderOnlyConfig) -> Dict[str, Tuple[int, ...]]:
  """Flat '/'-joined param names -> shapes for `config` (no allocation)."""
  dummy = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  tree = jax.eval_shape(lambda t: DecoderOnly(config).init(jax.random.PRNGKey(0), t), dummy)
  return {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(tree["params"],
                                                                     sep="/").items()}


def _interleaved_tensor(stored: _Tensor, part: int) -> _Tensor:
  """Our view of every other column (from `part`) of the last axis of `stored`."""
  shape = tuple(stored.shape)
  if shape[-1] % 2:
    raise CheckpointError(f"{stored.source}: interleaved gate/up of shape {shape} cannot be "
                          f"split in two equal parts")
  shape = shape[:-1] + (shape[-1] // 2,)

  def read_block(index, dtype):
    last = index[-1]
    block = stored.block(index[:-1] + (slice(2 * last.start, 2 * last.stop),), None)
    return _cast(np.ascontiguousarray(block[..., part::2]), dtype)

  def read(dtype):
    return read_block(tuple(slice(0, n) for n in shape), dtype)

  return _Tensor(stored.source, shape, read, read_block)


def _mapped_tensor(stored: _Tensor, transform: str, part: Optional[int]) -> _Tensor:
  """Our view of one HF tensor: transposed, one third of GPT-2's fused c_attn, or one half
  of gpt-oss's interleaved gate_up_proj."""
  if transform == "interleaved":
    return _interleaved_tensor(stored, part)
  shape = tuple(stored.shape)
  if transform == "transpose":
    shape = tuple(reversed(shape))
  if part is not None:
    if shape[-1] % 3:
      raise CheckpointError(f"{stored.source}: fused q/k/v of shape {shape} cannot be split in "
                            f"three equal parts")
    shape = shape[:-1] + (shape[-1] // 3,)

  def read(dtype):
    array = stored.read(None)
    if part is not None:
      width = array.shape[-1] // 3
      array = array[..., part * width:(part + 1) * width]
    return _cast(array, dtype, transform == "transpose")

  def read_block(index, dtype):
    # Our index -> the fused tensor's (last dim offset by the part) -> stored.
    if part is not None:
      offset = part * shape[-1]
      index = index[:-1] + (slice(index[-1].start + offset, index[-1].stop + offset),)
    if transform == "transpose":
      return _cast(_transposed_block(stored, index), dtype)
    return _cast(stored.block(index, None), dtype)

  return _Tensor(stored.source, shape, read, read_block if stored.read_block else None)


# Multimodal Gemma 3: where its text model's tensors live (transformers 4 hub
# files, then transformers >= 4.52 / 5 saves) and what belongs to the vision side.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def _text_model_tensors(files: Dict[str, _Tensor]) -> Dict[str, _Tensor]:
  """A multimodal checkpoint's tensors renamed as its text model's, vision ones dropped."""
  out = {}
  for name, tensor in files.items():
    if name.startswith(_VISION_PREFIXES):
      continue
    for prefix, replacement in _TEXT_PREFIXES:
      if name.startswith(prefix):
        name = replacement + name[len(prefix):]
        break
    out[name] = tensor
  return out


def _describe(config: DecoderOnlyConfig) -> str:
  experts = (f", {config.num_experts} experts of {config.expert_mlp_dim} (top "
             f"{config.num_experts_per_tok}) on layers "
             f"{[i for i, moe in enumerate(config.moe_layers) if moe]}"
             if config.num_experts else "")
  return (f"({config.family}: vocab {config.vocab_size}, emb {config.emb_dim}, layers "
          f"{config.num_layers}, heads {config.num_heads}/{config.num_kv_heads} kv x "
          f"{config.head_dim}, mlp {config.mlp_dim}{experts}, "
          f"tied={config.tie_word_embeddings})")


def load_hf_decoder_only(directory, *, dtype: Optional[str] = None,
                         place: Optional[Callable[[Tuple[str, ...], np.ndarray], Any]] = None,
                         progress: bool = False) -> DecoderOnlyModel:
  """Loads a HF decoder-only directory (any of `ARCHITECTURES`).

  Args:
    directory: holding config.json and the weights.
    dtype: params and compute dtype; default float32 on CPU, bfloat16 elsewhere.
    place: `(key tuple, numpy array) -> array` putting one tensor where it
      belongs (default `jax.device_put`).
    progress: show a tqdm bar while reading tensors.
  Raises:
    CheckpointError: unreadable or unsupported config, missing / unexpected /
      mis-shaped tensors (all listed at once).
  """
  directory = os.fspath(directory)
  config_path = os.path.join(directory, "config.json")
  if not os.path.isdir(directory) or not os.path.exists(config_path):
    raise CheckpointError(f"{directory}: not a Hugging Face model directory (no config.json)")
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{config_path}: cannot read: {e}") from None
  config = hf_config_to_decoder_config(hf, config_path, dtype or default_dtype())
  quantization = hf.get("quantization_config")
  if quantization:
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    raise CheckpointError(
        f"{config_path}: a quantized checkpoint (quantization_config quant_method "
        f"{method!r}: e.g. gpt-oss's MXFP4 experts, DeepSeek-V3's FP8 blocks) is not "
        f"supported: load a dequantized (bf16 / fp32) copy")
  files = _hf_weight_files(directory)
  if config.family == "gpt2" and not any(k.startswith("transformer.") for k in files):
    # The original hub GPT-2 files name tensors without the `transformer.` prefix.
    files = {(k if k == "lm_head.weight" else "transformer." + k): v for k, v in files.items()}

  if "text_config" in hf:
    files = _text_model_tensors(files)
  if config.family == "mixtral":
    # transformers 5's in-memory names put Mixtral's MoE under `mlp.`.
    files = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in files.items()}
  wanted = hf_names(config)
  tensors = {ours: _mapped_tensor(files[theirs], transform, part)
             for ours, (theirs, transform, part) in wanted.items() if theirs in files}
  used = {theirs for theirs, _, _ in wanted.values()}
  if config.tie_word_embeddings:
    used.add("lm_head.weight")  # HF ties it to the embedding; a stored copy is redundant.
  want = expected_shapes(config)
  experts, expert_used, missing, expert_mismatched = _expert_tensors(config, files, want)
  used |= expert_used
  missing += [f"{wanted[k][0]} (for {k})" for k in want if k not in tensors and k in wanted]
  tensors.update(experts)
  skipped = ()
  if config.family == "deepseek_v3":
    # The MTP modules stored as layers N.. (transformers skips them too).
    extra = int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)
    skipped = tuple(f"model.layers.{config.num_layers + j}." for j in range(extra))
  unexpected = [files[k].source for k in sorted(files)
                if k not in used and not k.endswith(_IGNORED_SUFFIXES) and
                not (skipped and k.startswith(skipped))]
  mismatched = expert_mismatched + [
      f"{tensors[k].source}: checkpoint {tensors[k].shape} vs expected {want[k]} (for {k})"
      for k in want if k in tensors and tensors[k].shape != want[k]]
  raise_on_mismatch(f"Checkpoint {directory} does not match its config {_describe(config)}:",
                    missing, unexpected, mismatched)

  np_dtype = jnp.dtype(config.dtype)
  keys = list(want)
  if progress:
    from tqdm import tqdm
    keys = tqdm(keys, desc=f"loading {os.path.basename(directory.rstrip('/'))}", unit="tensor")
  flat = {}
  for key in keys:
    if place is None:
      flat[tuple(key.split("/"))] = jax.device_put(tensors[key].read(np_dtype))
    else:
      # A lazy view: a sharded `place` reads only the blocks its devices hold.
      flat[tuple(key.split("/"))] = place(tuple(key.split("/")),
                                          _TensorView(tensors[key], np_dtype))
  return DecoderOnlyModel(config, traverse_util.unflatten_dict(flat))


# ----------------------------------------------------------------------------
# Export: our model -> a Hugging Face directory transformers loads.

_EXPORT_ACTIVATIONS = {"silu": "silu", "gelu_new": "gelu_new", "gelu": "gelu", "relu": "relu"}


def _rope_scaling_fields(config: DecoderOnlyConfig) -> Dict[str, Any]:
  """config.json's `rope_scaling` for our rope settings ({} without scaling)."""
  if config.rope_scaling == "linear":
    return dict(rope_scaling=dict(rope_type="linear", factor=config.rope_factor))
  if config.rope_scaling == "llama3":
    return dict(rope_scaling=dict(
        rope_type="llama3", factor=config.rope_factor,
        low_freq_factor=config.rope_low_freq_factor,
        high_freq_factor=config.rope_high_freq_factor,
        original_max_position_embeddings=config.rope_original_max_positions))
  if config.rope_scaling == "yarn":
    scaling = dict(rope_type="yarn", factor=config.rope_factor,
                   original_max_position_embeddings=config.rope_original_max_positions,
                   beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                   truncate=config.rope_truncate)
    if config.rope_mscale:
      scaling["mscale"] = config.rope_mscale
    if config.rope_mscale_all_dim:
      scaling["mscale_all_dim"] = config.rope_mscale_all_dim
    if config.rope_attention_factor is not None:
      scaling["attention_factor"] = config.rope_attention_factor
    return dict(rope_scaling=scaling)
  return {}


def decoder_config_to_hf_config(config: DecoderOnlyConfig) -> Dict[str, Any]:
  """The config.json dict of `config` (transformers 4 field names, which 5 reads too).

  Raises:
    ValueError: a combination the HF architecture cannot express (e.g. Llama
      with q/k/v biases but no output bias: that is Qwen2's layout).
  """
  ids = dict(bos_token_id=config.bos_id, eos_token_id=config.eos_id, pad_token_id=config.pad_id,
             vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings)
  _check_exportable(config)
  if config.family == "gpt2":
    if not (config.qkv_bias and config.out_bias and config.mlp_bias):
      raise ValueError("GPT-2 has biases on every projection: qkv_bias, out_bias and mlp_bias "
                       "must all be True to export as GPT2LMHeadModel")
    if config.num_kv_heads != config.num_heads or config.num_heads * config.head_dim != (
        config.emb_dim):
      raise ValueError("GPT-2 needs num_kv_heads == num_heads and num_heads * head_dim == emb_dim")
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=config.emb_dim,
                n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.mlp_dim,
                n_positions=config.max_positions, n_ctx=config.max_positions,
                layer_norm_epsilon=config.norm_epsilon,
                activation_function=_EXPORT_ACTIVATIONS[config.activation], **ids)
  if config.family in ("mistral", "mixtral", "gemma", "gemma2", "gemma3"):
    return _mistral_gemma_hf_config(config, ids)
  if config.family in ("deepseek_v3", "gpt_oss"):
    return _deepseek_gpt_oss_hf_config(config, ids)
  if config.family == "qwen2":
    if not config.qkv_bias or config.out_bias or config.mlp_bias:
      raise ValueError("Qwen2 has q/k/v biases only: qkv_bias must be True, out_bias and "
                       "mlp_bias False to export as Qwen2ForCausalLM")
    bias_fields = {}
  elif config.family in ("qwen3", "qwen3_moe"):
    if config.qkv_bias != config.out_bias or config.mlp_bias:
      raise ValueError("Qwen3's attention_bias covers q/k/v and o together and its MLP has no "
                       "biases: qkv_bias must equal out_bias and mlp_bias be False to export as "
                       "Qwen3ForCausalLM / Qwen3MoeForCausalLM")
    bias_fields = dict(attention_bias=config.qkv_bias, use_sliding_window=False)
    if config.family == "qwen3_moe":
      bias_fields.update(num_experts=config.num_experts,
                         num_experts_per_tok=config.num_experts_per_tok,
                         moe_intermediate_size=config.expert_mlp_dim,
                         norm_topk_prob=config.norm_topk_prob,
                         decoder_sparse_step=config.decoder_sparse_step,
                         mlp_only_layers=list(config.mlp_only_layers))
  else:
    if config.qkv_bias != config.out_bias:
      raise ValueError("Llama's attention_bias covers q/k/v and o together: qkv_bias and "
                       "out_bias must be equal to export as LlamaForCausalLM")
    bias_fields = dict(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
  architecture = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3",
                  "qwen3_moe": "Qwen3Moe"}[config.family]
  hf = dict(architectures=[f"{architecture}ForCausalLM"],
            model_type=config.family, hidden_size=config.emb_dim,
            intermediate_size=config.mlp_dim, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
            head_dim=config.head_dim, max_position_embeddings=config.max_positions,
            rms_norm_eps=config.norm_epsilon,
            hidden_act=_EXPORT_ACTIVATIONS[config.activation], rope_theta=config.rope_theta,
            **bias_fields, **ids)
  hf.update(_rope_scaling_fields(config))
  return hf


def _check_exportable(config: DecoderOnlyConfig) -> None:
  """ValueError unless the family's HF class computes what `config` computes."""
  family = config.family
  wrong = {k: getattr(config, k) for k, v in FAMILY_CONVENTIONS[family].items()
           if getattr(config, k) != v}
  if wrong:
    raise ValueError(f"{family} fixes {FAMILY_CONVENTIONS[family]}; this config has {wrong}")
  allowed = {"gemma2": {"query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                        "sliding_window", "layer_types"},
             "gemma3": {"query_pre_attn_scalar", "final_logit_softcap", "sliding_window",
                        "layer_types", "sliding_rope_theta"},
             "mistral": {"sliding_window", "layer_types"},
             "mixtral": {"sliding_window", "layer_types"},
             "gpt_oss": {"sliding_window", "layer_types"}}.get(family, set())
  unsupported = [k for k in ("query_pre_attn_scalar", "attn_logit_softcap",
                             "final_logit_softcap", "sliding_window", "layer_types",
                             "sliding_rope_theta")
                 if getattr(config, k) is not None and k not in allowed]
  if unsupported:
    raise ValueError(f"{family}'s Hugging Face class has no counterpart of "
                     f"{', '.join(unsupported)}")
  if family == "gemma3" and config.rope_scaling is not None and config.sliding_rope_theta is None:
    raise ValueError("Gemma 3 scales the full layers' rotary only: set sliding_rope_theta to "
                     "export rope scaling")


def _deepseek_gpt_oss_hf_config(config: DecoderOnlyConfig, ids: Dict[str, Any]
                                ) -> Dict[str, Any]:
  """DeepseekV3ForCausalLM / GptOssForCausalLM config.json fields."""
  family = config.family
  if config.mlp_bias or config.qkv_bias != config.out_bias:
    raise ValueError(f"{family}'s attention_bias covers its input and output projections "
                     f"together and its MLPs have no biases: qkv_bias must equal out_bias and "
                     f"mlp_bias be False")
  if config.decoder_sparse_step != 1 or config.mlp_only_layers:
    raise ValueError(f"{family} has no decoder_sparse_step / mlp_only_layers: they must be 1 "
                     f"and ()")
  common = dict(hidden_size=config.emb_dim, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads,
                max_position_embeddings=config.max_positions, rms_norm_eps=config.norm_epsilon,
                hidden_act=_EXPORT_ACTIVATIONS[config.activation], rope_theta=config.rope_theta,
                attention_bias=config.qkv_bias, num_experts_per_tok=config.num_experts_per_tok,
                **ids)
  if family == "deepseek_v3":
    hf = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
              num_key_value_heads=config.num_heads, intermediate_size=config.mlp_dim,
              moe_intermediate_size=config.expert_mlp_dim, n_routed_experts=config.num_experts,
              n_shared_experts=config.n_shared_experts, n_group=config.n_group,
              topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
              first_k_dense_replace=config.first_k_dense_replace,
              norm_topk_prob=config.norm_topk_prob, q_lora_rank=config.q_lora_rank,
              kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
              qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
              rope_interleave=config.rope_interleave, num_nextn_predict_layers=0, **common)
  else:
    if config.moe_mlp_dim not in (None, config.mlp_dim):
      raise ValueError("GptOssForCausalLM's experts are intermediate_size wide: moe_mlp_dim "
                       "must be None (or mlp_dim)")
    if config.layer_types is None and config.sliding_window is not None:
      layer_types = ["sliding_attention"] * config.num_layers  # A window on every layer.
    else:
      layer_types = list(config.attention_types)
    hf = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
              num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
              intermediate_size=config.mlp_dim, num_local_experts=config.num_experts,
              sliding_window=config.sliding_window, layer_types=layer_types,
              swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha, **common)
  rope = _rope_scaling_fields(config)
  # GptOssConfig substitutes its yarn default for an absent rope_scaling: say 'default'.
  hf.update(rope or dict(rope_scaling=dict(rope_type="default")))
  return hf


_HF_CLASSES = {"mistral": ("MistralForCausalLM", "mistral"),
               "mixtral": ("MixtralForCausalLM", "mixtral"),
               "gemma": ("GemmaForCausalLM", "gemma"),
               "gemma2": ("Gemma2ForCausalLM", "gemma2"),
               "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


def _mistral_gemma_hf_config(config: DecoderOnlyConfig, ids: Dict[str, Any]) -> Dict[str, Any]:
  family = config.family
  plain = family in ("mistral", "mixtral")  # No attention_bias field.
  if config.mlp_bias or (config.qkv_bias and plain):
    raise ValueError(f"{family} has no MLP biases{' nor attention biases' * plain}")
  if config.qkv_bias != config.out_bias:
    raise ValueError("Gemma's attention_bias covers q/k/v and o together: qkv_bias and "
                     "out_bias must be equal")
  architecture, model_type = _HF_CLASSES[family]
  hf = dict(architectures=[architecture], model_type=model_type, hidden_size=config.emb_dim,
            intermediate_size=config.mlp_dim, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
            head_dim=config.head_dim, max_position_embeddings=config.max_positions,
            rms_norm_eps=config.norm_epsilon, rope_theta=config.rope_theta, **ids)
  activation = _EXPORT_ACTIVATIONS[config.activation]
  if activation == "gelu_new":
    activation = "gelu_pytorch_tanh"  # The same function, under Gemma's name.
  if family in ("gemma2", "gemma3"):
    hf["hidden_activation"] = activation
  else:
    # Gemma 1 converts "gelu" to the tanh approximation; exact GELU cannot be said.
    if family == "gemma" and config.activation == "gelu":
      raise ValueError("GemmaConfig reads hidden_act 'gelu' as the tanh approximation: exact "
                       "GELU cannot be exported as Gemma")
    hf["hidden_act"] = activation
  if not plain:
    hf["attention_bias"] = config.qkv_bias
  if plain or config.sliding_window is not None:
    hf["sliding_window"] = config.sliding_window
  if family == "mixtral":
    if config.moe_mlp_dim not in (None, config.mlp_dim) or config.decoder_sparse_step != 1 or (
        config.mlp_only_layers) or not config.norm_topk_prob:
      raise ValueError("MixtralForCausalLM has a mixture of experts of intermediate_size on "
                       "every layer, renormalised: moe_mlp_dim must be None (or mlp_dim), "
                       "decoder_sparse_step 1, mlp_only_layers () and norm_topk_prob True")
    hf.update(num_local_experts=config.num_experts,
              num_experts_per_tok=config.num_experts_per_tok)
  if plain and config.layer_types is not None and (
      len(set(config.attention_types)) != 1 or (config.attention_types[0] == "full_attention")
      != (config.sliding_window is None)):
    raise ValueError(f"{architecture} has one window on every layer: layer_types must be "
                     "None (or uniform and matching sliding_window)")
  if family in ("gemma2", "gemma3"):
    hf["layer_types"] = list(config.attention_types)
    scalar = (config.head_dim if config.query_pre_attn_scalar is None
              else config.query_pre_attn_scalar)
    if not float(scalar).is_integer():  # transformers' config validates it as an int.
      raise ValueError(f"query_pre_attn_scalar {scalar} is not an integer, which "
                       f"{architecture}'s config requires")
    hf["query_pre_attn_scalar"] = int(scalar)
    hf["final_logit_softcapping"] = config.final_logit_softcap
  if family == "gemma2":
    hf["attn_logit_softcapping"] = config.attn_logit_softcap
  if family == "gemma3":
    hf["rope_local_base_freq"] = (config.rope_theta if config.sliding_rope_theta is None
                                  else config.sliding_rope_theta)
  hf.update(_rope_scaling_fields(config))
  return hf


def export_hf_decoder_only(model: DecoderOnlyModel, directory) -> None:
  """Writes `model` as a Hugging Face directory (config.json + model.safetensors).

  Tensors keep the params' dtype; kernels are transposed back to HF Linear
  weights, GPT-2's q/k/v are fused into c_attn, and stacked experts are written
  one Linear weight per expert (the hub's and save_pretrained's names).
  """
  config = model.config
  hf_config = decoder_config_to_hf_config(config)
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(model.params).items()}
  # HF name -> [(part, our name, transform)]: c_attn gathers three params.
  sources: Dict[str, list] = {}
  for ours, (theirs, transform, part) in hf_names(config).items():
    sources.setdefault(theirs, []).append((part, ours, transform))

  def make(parts):
    def build():  # Called by the writer right before it writes this tensor.
      arrays = [np.asarray(flat[ours]).T if transform == "transpose" else np.asarray(flat[ours])
                for _, ours, transform in parts]
      if parts[0][2] == "interleaved":  # gpt-oss's gate_up_proj: gate, up, gate, up, ...
        return np.stack(arrays, axis=-1).reshape(arrays[0].shape[:-1] + (-1,))
      return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-1)
    return build

  tensors = []
  for theirs in sorted(sources):
    parts = sorted(sources[theirs], key=lambda p: -1 if p[0] is None else p[0])
    shapes = [tuple(reversed(flat[ours].shape)) if transform == "transpose" else
              tuple(flat[ours].shape) for _, ours, transform in parts]
    shape = shapes[0][:-1] + (sum(s[-1] for s in shapes),)
    dtype = np.dtype(flat[parts[0][1]].dtype)
    tensors.append((theirs, shape, dtype, make(parts)))

  def expert(ours, e):
    return lambda: np.asarray(flat[ours][e]).T

  for ours, (per_expert, _) in hf_expert_names(config).items():
    dtype = np.dtype(flat[ours].dtype)
    for e, theirs in enumerate(per_expert):  # HF Linear [out, in] per expert.
      tensors.append((theirs, tuple(reversed(flat[ours].shape[1:])), dtype, expert(ours, e)))
  tensors.sort(key=lambda t: t[0])
  write_safetensors(os.path.join(directory, "model.safetensors"), tensors,
                    metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
