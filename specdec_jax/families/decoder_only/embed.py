"""Function-preserving embedding of a trained decoder-only model into a larger shape.

The large model computes the small one's function (up to float rounding: the
same products, summed in another order) at the large shape's cost, so a
trained draft's real acceptance meets a large target's step (the
cost-realistic pair of `make demo`'s act 2). The growing rules are
`families.widen`'s:

* width emb -> r * emb: the token and position embeddings, norm scales and
  biases, and the kernels writing the stream (o_proj, down_proj and their
  biases) repeat their emb axis; the kernels reading it (q/k/v, gate/up, the
  LM head) keep the small rows on each dimension's first copy, zeros on the
  others. LayerNorm and RMSNorm see the small statistics.
* heads: new query heads and new key/value heads are zero (their keys score
  0 against every query, their values add nothing, their o_proj rows are
  zero). head_dim and the query/key-value group size do not change: the
  attention scale 1/sqrt(head_dim), the rotary tables and the head-to-group
  map are the small model's.
* MLP units: new up/gate columns and down rows are zero (act(0) * 0 = 0).
* mixture-of-experts layers (Mixtral, Qwen3-MoE): each expert grows like an
  MLP (gate/up read the stream on first copies, new units zero; down repeats
  its output); the router reads the stream (first-copy rows), so its logits,
  the routing and the weights are the small model's. The expert count, k,
  norm_topk_prob and which of the small layers are MoE layers must match.
* gpt-oss: expert biases grow with their units (gate/up biases zero on new units; the
  down bias repeats along the stream), the router bias is kept, new query heads get
  sink 0 (their zero values add nothing whatever their share). The clamped SwiGLU of a
  new unit is (0 + 1) * 0 * sigmoid(0) = 0.
* DeepSeek-V3 latent attention: the latent ranks and per-head widths are kept (so are
  the latent norms); q_a_proj / kv_a_proj_with_mqa (or q_proj) read the stream on first
  copies, q_b_proj / kv_b_proj get zero columns for new heads, o_proj zero rows for
  them (and repeats its output). The shared experts grow like an MLP, the router's
  e_score_correction_bias is kept.
* layers: new layers come after the trained ones with every kernel and bias
  zero and unit norm scales: their attention and MLP add zero, the residual
  stream passes through (a new MoE layer routes to experts that output zero).
* the LM head: the large model is untied. A tied small model's table
  becomes both the (repeated) embedding and the (first-copy) LM head: one
  table cannot do both.

Refused with `EmbeddingError` naming the field: another vocabulary, position
table, norm epsilon, activation, rotary settings, bias layout or special ids;
embeddings scaled by sqrt(emb) (Gemma: the scale grows with the width); a
different head_dim or group size; a shape smaller in any size; a width that is
not a multiple; a tied large model.

  large = embed_model(pair.target, "gpt2_medium")   # GPT-2 medium's depth, heads and
                                                    # MLP ratio at width 6 x 192 = 1152
"""

import math
from typing import Any, Dict, Optional, Union

import jax
import jax.numpy as jnp
from flax import traverse_util

from specdec_jax.families import widen
from specdec_jax.families.widen import EmbeddingError
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                      canonical_name)
from specdec_jax.families.decoder_only.model import DecoderOnlyModel

# Fields that must be equal for the function to carry over.
_SAME_FIELDS = ("family", "vocab_size", "max_positions", "norm_epsilon", "activation",
                "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_positions", "qkv_bias", "out_bias",
                "mlp_bias", "bos_id", "eos_id", "pad_id", "norm_offset", "scale_embeddings",
                "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                "sandwich_norms", "qk_norm", "sliding_window", "sliding_rope_theta", "head_dim",
                "num_experts", "num_experts_per_tok", "norm_topk_prob", "rope_beta_fast",
                "rope_beta_slow", "rope_truncate", "rope_mscale", "rope_mscale_all_dim",
                "rope_attention_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "rope_interleave", "n_shared_experts",
                "n_group", "topk_group", "routed_scaling_factor", "swiglu_limit",
                "swiglu_alpha")
_GROWN_FIELDS = ("num_heads", "num_kv_heads", "mlp_dim", "num_layers", "expert_mlp_dim")


def embedded_config(config: DecoderOnlyConfig, shape: Union[str, DecoderOnlyConfig],
                    dtype: Optional[str] = None) -> DecoderOnlyConfig:
  """The large config: a named shape's depth and proportions, or a config as given.

  Args:
    config: the small model's config.
    shape: a named config of the same layout ('gpt2_medium', 'llama...'): its
      layer count, with its width rounded up to a multiple of the small width,
      its heads and MLP scaled with that width (the small head_dim and group
      size kept), and everything else the small model's; or a
      DecoderOnlyConfig used as given (and checked).
    dtype: override the result's dtype.
  """
  if isinstance(shape, str):
    key = canonical_name(shape)
    if key not in DECODER_CONFIGS:
      raise EmbeddingError(f"unknown shape {shape!r}; known: {', '.join(sorted(DECODER_CONFIGS))}")
    named = DECODER_CONFIGS[key]
    if named.family != config.family:
      raise EmbeddingError(f"{shape} is a {named.family} layout; the model is {config.family}")
    emb = math.ceil(named.emb_dim / config.emb_dim) * config.emb_dim
    group = config.num_heads // config.num_kv_heads
    heads = max(config.num_heads, math.ceil(named.num_heads * emb / named.emb_dim))
    heads = math.ceil(heads / group) * group
    large = config.replace(
        emb_dim=emb, num_heads=heads, num_kv_heads=heads // group,
        mlp_dim=max(config.mlp_dim, math.ceil(named.mlp_dim * emb / named.emb_dim)),
        moe_mlp_dim=None if config.moe_mlp_dim is None else max(
            config.moe_mlp_dim, math.ceil(named.expert_mlp_dim * emb / named.emb_dim)),
        num_layers=max(config.num_layers, named.num_layers), tie_word_embeddings=False,
        layer_types=None if config.layer_types is None else
        tuple(config.layer_types) + (config.layer_types[-1],) * max(
            0, named.num_layers - config.num_layers))
  else:
    large = shape
  return widen.checked_config(config, large, dtype, check_embeddable)


def check_embeddable(config: DecoderOnlyConfig, large: DecoderOnlyConfig) -> int:
  """Raises EmbeddingError naming every problem; returns the width ratio r."""
  problems = widen.layout_problems(config, large, _SAME_FIELDS, _GROWN_FIELDS)
  if config.scale_embeddings:
    problems.append("scale_embeddings: embeddings are scaled by sqrt(emb_dim), which grows "
                    "with the width (Gemma layouts cannot be embedded)")
  if large.tie_word_embeddings:
    problems.append("the large model is tied (tie_word_embeddings): its table cannot both "
                    "repeat the stream and read it once; embed into an untied shape")
  if config.num_heads * large.num_kv_heads != large.num_heads * config.num_kv_heads:
    problems.append(f"query heads per key/value head differ ({config.num_heads}/"
                    f"{config.num_kv_heads} vs {large.num_heads}/{large.num_kv_heads})")
  small_moe = config.moe_layers
  if tuple(large.moe_layers[:len(small_moe)]) != tuple(small_moe):
    problems.append(f"the first {len(small_moe)} layers' MLP kinds differ (mixture of experts: "
                    f"{small_moe} vs {large.moe_layers[:len(small_moe)]})")
  small_types, large_types = config.attention_types, large.attention_types
  if tuple(large_types[:len(small_types)]) != tuple(small_types):
    problems.append(f"the first {len(small_types)} layers' attention types differ "
                    f"({small_types} vs {large_types[:len(small_types)]})")
  return widen.checked_ratio(config, large, problems)


class _Grower:
  """The growing rules of the module docstring, by parameter name (network.py's tree)."""

  def __init__(self, config: DecoderOnlyConfig, large: DecoderOnlyConfig):
    self.r = check_embeddable(config, large)
    self.config, self.large = config, large
    self.dtype = jnp.dtype(large.dtype)

  def _heads(self, x, axis, kv: bool, width: Optional[int] = None):
    """x's fused [heads * width] axis (width: head_dim unless given) grown by zero heads."""
    c, l = self.config, self.large
    width = c.head_dim if width is None else width
    return widen.pad_heads(x, axis, c.num_kv_heads if kv else c.num_heads, width,
                           l.num_kv_heads if kv else l.num_heads, width)

  def leaf(self, parent: str, name: str, x, grandparent: Optional[str] = None):
    """One array of a layer (or the head's layer), grown."""
    r, mlp = self.r, self.large.mlp_dim
    c = self.config
    if parent == "gate":  # The MoE router [emb, experts] reads the stream; its biases stay.
      return widen.first_copy(x, 0, r) if name == "kernel" else jnp.asarray(x, jnp.float32)
    if parent == "experts":  # Stacked experts [experts, in, out], each grown like an MLP.
      width = self.large.expert_mlp_dim
      if name == "down_proj_bias":  # [experts, emb] (gpt-oss)
        return widen.repeat(x, 1, r)
      if name.endswith("_bias"):  # gate / up [experts, units]
        return widen.pad(x, 1, width)
      return (widen.repeat(widen.pad(x, 1, width), 2, r) if name == "down_proj" else
              widen.pad(widen.first_copy(x, 1, r), 2, width))
    if parent == "self_attn" and name == "sinks":  # [heads]; new heads' sinks 0.
      return widen.pad(x, 0, self.large.num_heads)
    if parent in ("q_a_proj", "kv_a_proj_with_mqa"):  # Latent projections read the stream.
      return widen.first_copy(x, 0, r) if name == "kernel" else jnp.asarray(x, jnp.float32)
    if parent in ("q_a_layernorm", "kv_a_layernorm"):  # Along the latent: unchanged.
      return jnp.asarray(x, jnp.float32)
    if parent == "q_b_proj":
      return self._heads(x, -1, kv=False)
    if parent == "kv_b_proj":
      return self._heads(x, -1, kv=False, width=c.qk_nope_head_dim + c.v_head_dim)
    if parent == "o_proj" and c.uses_mla:
      return widen.repeat(self._heads(x, 0, kv=False, width=c.v_head_dim), 1, r) if (
          name == "kernel") else widen.repeat(x, 0, r)
    if parent in ("q_proj", "k_proj", "v_proj"):
      grown = self._heads(x, -1, kv=parent != "q_proj")
      return widen.first_copy(grown, 0, r) if name == "kernel" else grown
    if parent == "o_proj":
      return widen.repeat(self._heads(x, 0, kv=False), 1, r) if name == "kernel" else (
          widen.repeat(x, 0, r))
    if grandparent == "shared_experts":  # DeepSeek's shared experts grow with the experts.
      mlp = self.large.n_shared_experts * self.large.expert_mlp_dim
    if parent in ("gate_proj", "up_proj"):
      return (widen.pad(widen.first_copy(x, 0, r), 1, mlp) if name == "kernel" else
              widen.pad(x, 0, mlp))
    if parent == "down_proj":
      return widen.repeat(widen.pad(x, 0, mlp), 1, r) if name == "kernel" else (
          widen.repeat(x, 0, r))
    if parent in ("q_norm", "k_norm"):  # per head_dim (Gemma 3, Qwen3; head_dim kept): unchanged
      return jnp.asarray(x, jnp.float32)
    if parent.endswith("layernorm") or parent == "norm":
      return widen.repeat(x, 0, r)
    raise EmbeddingError(f"no growing rule for {parent}/{name}")

  def tree(self, tree: Dict[str, Any]) -> Dict[str, Any]:
    """A layer's (nested) tree grown leaf by leaf, cast to the large dtype."""
    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({
        path: self.leaf(path[-2], path[-1], x, path[-3] if len(path) > 2 else None).astype(
            self.dtype) for path, x in flat.items()})

  def identity_layer(self, template):
    """A layer shaped like `template` (already large) that adds nothing."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.ones if path[-1].key == "scale" else jnp.zeros)(x.shape, self.dtype),
        template)


def embed_params(params, config: DecoderOnlyConfig, large: DecoderOnlyConfig):
  """The large model's parameter tree computing the small model's function.

  Args:
    params: the small model's tree (network.py's layout).
    config: its config; large: the large one (`embedded_config`).
  Returns:
    The large tree in `large.dtype`, built tensor by tensor (peak memory: the
    large tree plus its largest tensor in float32).
  """
  grow = _Grower(config, large)
  r = grow.r
  out: Dict[str, Any] = {
      "embed_tokens": {"embedding": widen.repeat(params["embed_tokens"]["embedding"], 1, r)
                       .astype(grow.dtype)},
      "norm": grow.tree({"norm": params["norm"]})["norm"],
  }
  if "embed_positions" in params:
    out["embed_positions"] = {"embedding": widen.repeat(
        params["embed_positions"]["embedding"], 1, r).astype(grow.dtype)}
  for i in range(config.num_layers):
    out[f"layers_{i}"] = grow.tree(params[f"layers_{i}"])
  templates = None
  if large.num_experts and large.num_layers > config.num_layers:
    # New layers may be MoE or dense (Qwen3-MoE's mlp_only_layers): shaped as the large
    # config says (abstract shapes, nothing allocated).
    from specdec_jax.families.decoder_only.sharding import abstract_params
    templates = abstract_params(large)
  for i in range(config.num_layers, large.num_layers):
    out[f"layers_{i}"] = grow.identity_layer(
        out[f"layers_{config.num_layers - 1}"] if templates is None else templates[f"layers_{i}"])
  reads = (params["embed_tokens"]["embedding"].T if config.tie_word_embeddings else
           params["lm_head"]["kernel"])  # [emb, vocab]
  out["lm_head"] = {"kernel": widen.first_copy(reads, 0, r).astype(grow.dtype)}
  return out


def embed_feature_head_params(head_params, config: DecoderOnlyConfig, large: DecoderOnlyConfig):
  """A decoder-only EAGLE-1 head (`families.decoder_only.feature_head`) of the small target,
  grown to drive the embedded target with the same function.

  The head reads the embedded target's features (the small ones repeated) and its
  (repeated) embedding and positions; fc's two input halves read the stream, its output
  writes it; its layer grows like the target's; its logits are the large target's LM head.
  """
  grow = _Grower(config, large)
  r, emb = grow.r, config.emb_dim
  fc = jnp.asarray(head_params["fc"]["kernel"], jnp.float32)  # [2 emb, emb]
  halves = [widen.repeat(widen.first_copy(fc[i * emb:(i + 1) * emb], 0, r), 1, r)
            for i in range(2)]
  out: Dict[str, Any] = {"fc": {"kernel": jnp.concatenate(halves, 0).astype(grow.dtype)},
                         "layer": grow.tree(head_params["layer"])}
  if "bias" in head_params["fc"]:
    out["fc"]["bias"] = widen.repeat(head_params["fc"]["bias"], 0, r).astype(grow.dtype)
  if "embed_tokens" in head_params:
    out["embed_tokens"] = widen.repeat(head_params["embed_tokens"], 1, r).astype(grow.dtype)
  return out


def embed_model(model: DecoderOnlyModel, shape: Union[str, DecoderOnlyConfig],
                dtype: Optional[str] = None) -> DecoderOnlyModel:
  """`model` embedded in a larger shape (see the module docstring); same function, large cost.

  Args:
    model: the trained small `DecoderOnlyModel`.
    shape: a named config ('gpt2_medium') or a DecoderOnlyConfig.
    dtype: the large model's dtype (default: the small model's).
  """
  large = embedded_config(model.config, shape, dtype)
  return DecoderOnlyModel(large, embed_params(model.params, model.config, large))
