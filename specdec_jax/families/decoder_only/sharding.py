"""Decoder-only logical axis names, for the generic partitioner (`specdec_jax.sharding`).

The same logical names as T5's, so one set of rules serves both: the q/k/v/o projections are
[embed, joined_kv] / [joined_kv, embed], the MLP [embed, mlp] / [mlp, embed],
the embedding and untied head [vocab, embed] / [embed, vocab], norms and
biases follow their dimension; GPT-2's position table is replicated (its rows
are positions, which no rule shards). The cache is [batch, length, heads, kv]
per layer, where `heads` counts *key/value* heads: with grouped-query
attention (e.g. 2 KV heads) a `model` axis larger than that does not divide it,
an error by default and replication with `on_indivisible='replicate'`.

Mixture-of-experts layers (Mixtral, Qwen3-MoE): the stacked expert weights are
[expert, embed, mlp] (gate_proj, up_proj) and [expert, mlp, embed] (down_proj),
the router [embed, expert]. `specdec_jax.sharding.DEFAULT_RULES` has no rule for
`expert`, so by default the expert dimension is replicated and each expert is
split over `model` along its `mlp` units, as a dense MLP is (tensor-parallel
experts: the 'gather' dispatch then gathers locally, and Qwen3-30B-A3B's 768
units divide any power-of-two model axis up to 256). Expert parallelism is one
rule away: rules starting with ("expert", "model") put whole experts on devices
(the `mlp` rule then finds `model` taken and leaves the units whole), which suits
the 'dense' dispatch; the 'gather' dispatch then fetches the experts it reads from
the devices holding them (correct, measured equal on a 2x2 CPU mesh, but traffic).
gpt-oss's expert biases follow their dimension ([expert, mlp], [expert, embed]), its router
bias and DeepSeek-V3's e_score_correction_bias are [expert], gpt-oss's attention sinks
[heads] (split over `model` with the query heads).

DeepSeek-V3's latent attention: q_a_proj / kv_a_proj_with_mqa [embed, None] and the
latent norms [None] (the low-rank latents are small and replicated), q_b_proj / kv_b_proj
[None, joined_kv] (heads over `model`, as q/k/v_proj), o_proj [joined_kv, embed]. Its
latent cache (mla_cache 'latent', the default) is one self_key [batch, length, 1, kv_lora +
rope] per layer with no heads axis: [batch, length, None, kv], batch over `data` and
replicated over `model`, as vLLM replicates the latent across tensor-parallel ranks. Every
device's heads read every latent (the absorbed queries are per head, sharded with the heads;
the latent is shared by all of them), so splitting it over `model` would only trade a
576-wide replicated read for an all-gather per step; a long context could shard `length`
instead (a rule away, not done here). With mla_cache 'full' the cache is [batch, length,
heads, kv] like the others' (keys and values per head).
"""

from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.families.base import checked_axes, leaf_and_parent
from specdec_jax.families.decoder_only import network as decoder_only
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import DecoderOnly

LogicalAxes = Tuple[Optional[str], ...]

_KERNEL_AXES = {
    "q_proj": ("embed", "joined_kv"), "k_proj": ("embed", "joined_kv"),
    "v_proj": ("embed", "joined_kv"), "o_proj": ("joined_kv", "embed"),
    "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
    "gate": ("embed", "expert"),  # The MoE router.
    # DeepSeek-V3's latent attention.
    "q_a_proj": ("embed", None), "kv_a_proj_with_mqa": ("embed", None),
    "q_b_proj": (None, "joined_kv"), "kv_b_proj": (None, "joined_kv"),
}
# Stacked expert weights (leaves of `mlp/experts`).
_EXPERT_AXES = {"gate_proj": ("expert", "embed", "mlp"), "up_proj": ("expert", "embed", "mlp"),
                "down_proj": ("expert", "mlp", "embed"),
                # gpt-oss's expert biases.
                "gate_proj_bias": ("expert", "mlp"), "up_proj_bias": ("expert", "mlp"),
                "down_proj_bias": ("expert", "embed")}


def param_logical_axes(path: Sequence[str], ndim: int) -> LogicalAxes:
  """Logical axes of one decoder-only parameter from its path.

  Raises:
    ValueError: an unknown parameter, or a rank that does not match its name.
  """
  leaf, parent = leaf_and_parent(path)
  axes = None
  if leaf == "embedding":
    axes = ("vocab", "embed") if parent == "embed_tokens" else (None, "embed")
  elif leaf == "scale" and parent in ("q_norm", "k_norm"):
    axes = ("kv",)  # Gemma 3's and Qwen3's per-head q/k norms lie along head_dim.
  elif leaf == "scale" and parent in ("q_a_layernorm", "kv_a_layernorm"):
    axes = (None,)  # DeepSeek-V3's latent norms.
  elif leaf == "sinks":
    axes = ("heads",)  # gpt-oss: one logit per query head.
  elif leaf == "e_score_correction_bias":
    axes = ("expert",)
  elif leaf == "scale":
    axes = ("embed",)
  elif parent == "experts" and leaf in _EXPERT_AXES:
    axes = _EXPERT_AXES[leaf]
  elif parent in _KERNEL_AXES and leaf == "kernel":
    axes = _KERNEL_AXES[parent]
  elif parent in _KERNEL_AXES and leaf == "bias":
    axes = _KERNEL_AXES[parent][1:]  # A bias lies along the output dimension.
  elif leaf == "bias":
    axes = ("embed",)  # LayerNorm.
  return checked_axes(path, axes, ndim,
                      "the decoder-only parameter tree (families/decoder_only/network.py)")


# Unlike T5's head-major cache (sharding.CACHE_KV_AXES), the decoder-only
# cache is laid out as the projections produce it (families/decoder_only/network.py).
CACHE_KV_AXES = ("batch", "length", "heads", "kv")
# DeepSeek-V3's latent cache: one shared latent per token, no heads to split (docstring).
CACHE_LATENT_AXES = ("batch", "length", None, "kv")


def cache_logical_axes(cache) -> Any:
  """Logical axes of a decoder-only cache: K/V [batch, length, heads, kv] per layer; a
  layer holding a key alone (DeepSeek-V3's latent cache) [batch, length, None, kv]."""
  if not (isinstance(cache, dict) and set(cache) == {"layers"}):
    raise ValueError(f"expected a decoder-only cache {{'layers': [...]}}, got "
                     f"{sorted(cache) if isinstance(cache, dict) else type(cache).__name__}")
  return dict(layers=[{name: CACHE_LATENT_AXES if set(layer) == {"self_key"} else CACHE_KV_AXES
                       for name in layer} for layer in cache["layers"]])


def abstract_params(config: DecoderOnlyConfig):
  """ShapeDtypeStructs of the params (config.dtype), no allocation."""
  dummy = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda rng, x: DecoderOnly(config).init(rng, x)["params"],
                          jax.ShapeDtypeStruct((2,), jnp.uint32), dummy)
  dtype = jnp.dtype(config.dtype)
  return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)


def abstract_cache(config: DecoderOnlyConfig, batch: int, max_len: int):
  return jax.eval_shape(lambda: decoder_only.init_cache(config, batch, max_len))
