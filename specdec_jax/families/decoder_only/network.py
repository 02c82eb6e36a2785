"""A decoder-only Transformer (Llama / Qwen2 / Qwen3 / Mistral / Gemma 1-3 / GPT-2 / Mixtral /
Qwen3-MoE / DeepSeek-V3 / gpt-oss layouts) scoring token blocks from a KV cache.

The block contract is the T5 decoder's (families/t5/network.py), so the decode loops in
`specdec_jax.core.decoding` run either family unchanged:

* `decode_block(tokens [batch, k], positions [batch], cache)` scores k tokens
  per row, row b's first token sitting at absolute position positions[b];
  keys/values are *set* at those positions, never added. Entries past a row's
  current length are never attended to (causal mask) and are overwritten
  later, so rolling a row back after a rejected draft is moving its position.
* `decode_block(..., tree)` scores k nodes of a token tree
  (`core.token_tree.TreeAttention`): keys/values are still set at cache index
  positions + i, but token i sits at absolute position root + depths[i]
  (its rotary angles or learned position, for its query and its key), and
  the mask is the causal / sliding-window rule by absolute positions (a tree
  slot's key at root + its depth) AND the tree's `allowed`
  (`core.token_tree.tree_positions`). Without a tree the program is unchanged.
* `prefill(prompts [batch, P], prompt_lengths [batch], cache)` writes each
  row's right-padded prompt at positions 0..P-1 and returns the logits at each
  row's last prompt token. Padding positions get junk keys/values, which the
  causal mask hides from the real prompt and generation overwrites.
* Sliding-window layers mask by absolute position: the query at position i
  sees key j iff i - W < j <= i, in the uncached forward, the prefill and every
  block. The cache stays full length (no ring buffer), so a block at any
  per-row positions, and a roll-back after rejected drafts, need nothing more.

Layouts (`DecoderOnlyConfig.family`):
* llama / qwen2: RMSNorm, rotary positions (HF `rotate_half` convention:
  the two halves of each head are the rotated pairs), grouped-query attention,
  SwiGLU MLP, tied or untied output; Qwen2 adds q/k/v biases.
* qwen3: the Llama layout (biases only with attention_bias) plus per-head
  q/k norms: RMSNorm x * w over head_dim (the `qk_norm` path Gemma 3 uses,
  without Gemma's 1 + w), after the projection and before rotary.
* gpt2: LayerNorm with bias, learned absolute positions, GELU (tanh) MLP,
  biases everywhere, tied output.
* mistral: the Llama layout with a sliding window on every layer.
* gemma / gemma2 / gemma3: (1 + w) RMSNorm, embeddings scaled by sqrt(emb),
  tanh-GELU gated MLP, tied output; Gemma 2/3 add sandwich norms, attention
  scaled by query_pre_attn_scalar, sliding layers by layer_types and (Gemma 2)
  soft-capped scores and logits; Gemma 3 adds per-head q/k norms and a
  separate rotary base on sliding layers.
* mixtral: the Mistral layout (a window on every layer when sliding_window is
  set) whose MLPs are mixtures of SwiGLU experts (`MoeMlp`).
* qwen3_moe: the Qwen3 layout whose MLPs are mixtures of experts on the layers
  `DecoderOnlyConfig.moe_layers` names, dense SwiGLU MLPs on the others.
* deepseek_v3 (transformers' `DeepseekV3ForCausalLM`): multi-head latent attention
  (`MlaAttention`): q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)), per head
  [qk_nope | qk_rope]; kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope
  (qk_rope_head_dim, one key shared by every head)]; kv_b_proj(kv_a_layernorm(latent))
  = per head [k_nope | value (v_head_dim)]; key = [k_nope | rotated k_rope]. The two
  latent norms use eps 1e-6 whatever rms_norm_eps (transformers' default). Rotary on
  the rope part only, the stored interleaved pairs first de-interleaved
  (`rope_interleave`: transformers' `apply_rotary_pos_emb_interleave`, which returns
  the rotated part in that de-interleaved order for both q and k, so the scores are
  the same); YaRN frequencies, cos/sin times yarn's attention factor, the softmax
  scale (qk_nope + qk_rope) ** -0.5 times mscale(factor, mscale_all_dim) ** 2. The
  cache (`mla_cache` 'latent', the default: DeepSeek's and vLLM's) holds per token and
  layer [normed latent | rotated k_rope], kv_lora_rank + qk_rope_head_dim values (576
  for DeepSeek-V3, against 128 heads x 320 = 40960 for full keys and values: 71x
  less). A cached block attends through the absorbed projections: kv_b_proj's kernel
  splits per head into W_uk [kv_lora, heads, nope] and W_uv [kv_lora, heads, v]; the
  query [q_nope W_uk^T (formed in float32) | rotated q_rope] scores the cached [latent |
  k_rope] exactly as [q_nope | q_rope] scores [k_nope | k_rope]; that is grouped-query
  attention with one kv head whose values are the keys' first kv_lora dims, and the
  attended latent times W_uv is the head's value mix. The uncached forward (and
  `mla_cache` 'full', which caches per-head keys [heads, qk_nope + qk_rope] and values
  [heads, v_head_dim]) expands keys and values as transformers does; both forms agree to
  float rounding. The first
  first_k_dense_replace layers have a dense MLP; the others a MoE with DeepSeek's
  router (below) plus `shared_experts`, a SwiGLU of n_shared_experts * moe_mlp_dim
  units that every token runs.
* gpt_oss (`GptOssForCausalLM`): q/k/v/o biases, attention sinks (a learned logit
  per query head joins each softmax denominator and takes its share of the mass, then
  is dropped), sliding / full layers by layer_types, YaRN rotary (cos/sin times the
  attention factor, 1 + 0.1 ln 32 for gpt-oss-20b), and MoE layers whose router has a
  bias and whose experts have biases and the clamped SwiGLU: gate = min(x W_g + b_g,
  limit), up = clip(x W_u + b_u, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate),
  then W_d + b_d.

Mixture-of-experts MLPs (`MoeMlp`, transformers' `MixtralSparseMoeBlock` /
`Qwen3MoeSparseMoeBlock`): router logits x @ gate (in the compute dtype, as HF's
Linear), softmax over all experts in float32, the top k of those probabilities
(`jax.lax.top_k`), divided by their sum when norm_topk_prob (Mixtral always);
each chosen expert computes down(silu(x @ gate_e) * (x @ up_e)) and the layer
returns the sum of the k outputs weighted by the k probabilities.
  DeepSeek-V3 (`DeepseekV3TopkRouter`, the "noaux_tc" rule): logits in float32 (as
  transformers keeps the router), scores = sigmoid(logits); the choice uses scores +
  e_score_correction_bias: each of n_group groups scores the sum of its top two, the
  topk_group best groups stay, the top k experts among them are chosen; their weights
  are the plain scores, divided by (their sum + 1e-20) when norm_topk_prob, times
  routed_scaling_factor. gpt-oss (`GptOssTopKRouter`): logits x @ gate + bias, the top
  k logits, softmax over those k.

  Routing is transformers' whenever the k-th and (k+1)-th probabilities differ;
  an exact tie across that boundary is resolved towards the lower expert index
  (`jax.lax.top_k`'s documented rule). transformers' choice there is whatever
  torch.topk's selection algorithm returns (on CPU an nth_element / partial
  sort, not index order, and another rule on CUDA), which no other program
  reproduces; ties inside the chosen k change nothing (the same set, the same
  weights).

  Dispatch (`DecoderOnlyConfig.moe_dispatch`), both exact to rounding and both
  computing each token from its own row only (no token's output depends on
  another's routing, so a verification block and a target-only block of the
  same width round identically: bf16 speculative greedy stays bit-identical):
  - 'gather': each token gathers its k experts' weights ([tokens, k, emb, mlp]
    per projection) and runs them as a batched matmul. It reads only the
    chosen experts: one decode token of Qwen3-30B-A3B touches 8 of 128. The
    gathered slices are materialised, so it costs about 2 * tokens * k expert
    reads and cannot serve a long prefill.
  - 'dense': every expert computes every token, [tokens, experts, mlp], times
    a [tokens, experts] weight matrix that is zero off the top k, then one
    matmul over (expert, unit) into the stream: E / k times the FLOPs and every
    expert's weights read, but no gather and no [tokens, k, ...] copies. A
    prefill or a wide block routes to most experts anyway.
  - 'auto' (default): gather when 2 * tokens * k <= num_experts (the gathered
    bytes stay under the dense read: Qwen3-30B-A3B blocks of up to 8 tokens,
    Mixtral blocks of 1-2), else dense. The choice is static per block shape,
    so both loops at one block width take the same path. Measured on the
    2-core CPU (one layer, 64 experts of 384 units, emb 1024, k 4, float32):
    gather 5 / 78 / 132 / 281 ms at 1 / 4 / 8 / 16 tokens, dense 148 / 157 /
    196 / 176 ms: the crossover sits at 2 * tokens * k = num_experts.
  A sorted / grouped formulation (tokens sorted by expert, `jax.lax.ragged_dot`)
  would serve long prefills at k / E of dense's FLOPs; it is not implemented.

Parameter tree (kernels are [in, out], Flax's convention; HF Linear weights are
their transpose; `checkpoints_decoder_only` holds the name mapping):
  embed_tokens/embedding                       [vocab, emb]
  embed_positions/embedding                    [max_positions, emb]   GPT-2 only
  layers_{i}/input_layernorm/scale (+ bias)    [emb]                  bias: GPT-2
  layers_{i}/self_attn/q_proj/kernel (+ bias)  [emb, heads * head_dim]
  layers_{i}/self_attn/k_proj/kernel (+ bias)  [emb, kv_heads * head_dim]
  layers_{i}/self_attn/v_proj/kernel (+ bias)  [emb, kv_heads * head_dim]
  layers_{i}/self_attn/o_proj/kernel (+ bias)  [heads * head_dim, emb]
  layers_{i}/self_attn/{q,k}_norm/scale        [head_dim]             qk_norm (Gemma 3, Qwen3) only
  layers_{i}/post_attention_layernorm/scale (+ bias)
  layers_{i}/{pre,post}_feedforward_layernorm/scale [emb]             sandwich_norms (Gemma 2/3)
  layers_{i}/mlp/gate_proj/kernel (+ bias)     [emb, mlp]             gated (Llama, Qwen2) only
  layers_{i}/mlp/up_proj/kernel (+ bias)       [emb, mlp]
  layers_{i}/mlp/down_proj/kernel (+ bias)     [mlp, emb]
  layers_{i}/mlp/gate/kernel                   [emb, experts]         MoE layers: the router
  layers_{i}/mlp/experts/{gate,up}_proj        [experts, emb, moe_mlp] (3-D, whatever
  layers_{i}/mlp/experts/down_proj             [experts, moe_mlp, emb]  the kernel_layout)
  layers_{i}/mlp/gate/bias                     [experts]              gpt-oss: router bias
  layers_{i}/mlp/experts/{gate,up}_proj_bias   [experts, moe_mlp]     gpt-oss
  layers_{i}/mlp/experts/down_proj_bias        [experts, emb]         gpt-oss
  layers_{i}/self_attn/sinks                   [heads]                gpt-oss
  layers_{i}/mlp/gate/e_score_correction_bias  [experts]              DeepSeek-V3
  layers_{i}/mlp/shared_experts/{gate,up,down}_proj/kernel            DeepSeek-V3 (an Mlp)
  DeepSeek-V3 attention (in place of q/k/v_proj; q_lora_rank None: one q_proj
  [emb, heads * (nope + rope)] in place of q_a_proj, q_a_layernorm, q_b_proj):
  layers_{i}/self_attn/q_a_proj/kernel (+ bias) [emb, q_lora]
  layers_{i}/self_attn/q_a_layernorm/scale     [q_lora]
  layers_{i}/self_attn/q_b_proj/kernel         [q_lora, heads * (nope + rope)]
  layers_{i}/self_attn/kv_a_proj_with_mqa/kernel (+ bias) [emb, kv_lora + rope]
  layers_{i}/self_attn/kv_a_layernorm/scale    [kv_lora]
  layers_{i}/self_attn/kv_b_proj/kernel        [kv_lora, heads * (nope + v)]
  layers_{i}/self_attn/o_proj/kernel (+ bias)  [heads * v, emb]
  norm/scale (+ bias)                          [emb]
  lm_head/kernel                               [emb, vocab]           untied only

Cache layout (a dict, one entry per layer; keys are stored already rotated, as
HF does, so a cached key never needs its position again):
  cache['layers'][i]['self_key'], ['self_value']: [batch, max_len, kv_heads, head_dim]
  DeepSeek-V3 (mla_cache 'latent'): ['self_key'] alone, [batch, max_len, 1, kv_lora_rank
  + qk_rope_head_dim] = [normed latent | rotated k_rope]; mla_cache 'full': keys [..,
  heads, qk_nope + qk_rope], values [.., heads, v_head_dim]

Dtypes follow the T5 model: params are stored in float32 at init (cast to
`config.dtype` by the caller), matmuls run in `config.dtype`, norms, softmax
and rotary tables in float32, logits come out float32.
"""

import math
from typing import Any, Dict, List, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import rows
from specdec_jax.core.token_tree import TreeAttention, tree_positions
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.prefix_attention import MASK_VALUE, KeyMask, attend
from specdec_jax.families.kernel_layout import kernel_shape, project

Array = jax.Array
Cache = Dict[str, Any]

# Large negative instead of -inf so a fully masked row gives a uniform softmax
# rather than NaN (heads build their own mask arrays with it).
_MASK_VALUE = MASK_VALUE

# HF initialises every weight of these models with normal(0.02).
_INIT = nn.initializers.normal(stddev=0.02)

_ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "relu": nn.relu,
}


def _dtype(config: DecoderOnlyConfig):
  return jnp.dtype(config.dtype)


def _axes(x: Array, logical_axes: Tuple[str, ...]) -> Array:
  """Names x's dimensions for GSPMD (a no-op unless logical axis rules are bound)."""
  return nn.with_logical_constraint(x, logical_axes)


def _yarn_inv_freq(config: DecoderOnlyConfig, d: int) -> np.ndarray:
  """transformers' `_compute_yarn_parameters` frequencies (float64 here): each frequency
  between the extrapolated (unscaled) and interpolated (/ factor) one by a linear ramp
  over the dimensions between the beta_fast and beta_slow correction bounds."""
  base, factor = config.rope_theta, config.rope_factor
  old_len = config.rope_original_max_positions

  def correction_dim(rotations):
    return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
  if config.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp.
  ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
  return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotary_inv_freq(config: DecoderOnlyConfig, sliding: bool = False) -> np.ndarray:
  """Rotary inverse frequencies [rotary_dim // 2] float32, with the config's scaling.

  sliding: for a sliding-window layer; with `sliding_rope_theta` set (Gemma 3)
  that base, unscaled, else the same table as full layers.

  Computed in float64 on the host (static per config) and rounded once; HF
  computes them in float32, a difference far below the logits tolerance.
  """
  d = config.rotary_dim
  if sliding and config.sliding_rope_theta is not None:
    return (1.0 / (config.sliding_rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
            ).astype(np.float32)
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if config.rope_scaling == "linear":
    inv_freq = inv_freq / config.rope_factor
  elif config.rope_scaling == "llama3":
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between interpolated smoothly (HF `_compute_llama3_parameters`).
    old_len = config.rope_original_max_positions
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / config.rope_factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / config.rope_factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(medium, smoothed, scaled)
  elif config.rope_scaling == "yarn":
    inv_freq = _yarn_inv_freq(config, d)
  return inv_freq.astype(np.float32)


def rotary_tables(positions: Array, config: DecoderOnlyConfig,
                  sliding: bool = False) -> Tuple[Array, Array]:
  """cos, sin [batch|1, q, 1, rotary_dim] float32 for positions [batch|1, q]; with yarn
  (not on Gemma 3's separately based sliding layers) times its attention factor, as
  transformers scales them."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(
      rotary_inv_freq(config, sliding))
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  factor = config.yarn_attention_factor
  if factor != 1.0 and not (sliding and config.sliding_rope_theta is not None):
    cos, sin = cos * np.float32(factor), sin * np.float32(factor)
  return cos, sin


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates x [batch, q, heads, head_dim] by position (HF's rotate_half pairing)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def deinterleave(x: Array) -> Array:
  """Pairs (x0, x1), (x2, x3), ... -> [x0, x2, ... | x1, x3, ...] on the last axis, the
  rotate_half pairing (DeepSeek's `rope_interleave`)."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class Dense(nn.Module):
  """A projection with a 2-D `kernel` [in, out] (or [out, in]: `config.kernel_layout`) and an
  optional `bias` [out]."""
  features: int
  config: DecoderOnlyConfig
  use_bias: bool = False
  float32_output: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    dtype = _dtype(self.config)
    out_type = jnp.float32 if self.float32_output else dtype
    layout = self.config.kernel_layout
    kernel = self.param("kernel", _INIT, kernel_shape(layout, x.shape[-1], self.features),
                        jnp.float32)
    y = project(x.astype(dtype), kernel.astype(dtype), layout, preferred_element_type=out_type)
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
      y = y + bias.astype(out_type)
    return y


class Norm(nn.Module):
  """RMSNorm (`scale`) or, for GPT-2, LayerNorm (`scale`, `bias`), in float32.

  RMSNorm multiplies by (norm_offset + scale) in float32 and casts the product
  (Gemma's (1 + w), HF `GemmaRMSNorm`; Llama's offset is 0). Init makes the
  multiplier 1 either way. epsilon: None is config.norm_epsilon (DeepSeek's latent
  norms use transformers' default 1e-6 whatever rms_norm_eps).
  """
  config: DecoderOnlyConfig
  epsilon: Optional[float] = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    init = nn.initializers.constant(1.0 - cfg.norm_offset)
    scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    if cfg.uses_layer_norm:
      bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
      # Means as trees of adds (`core.rows`): a row's bits then do not depend on the batch.
      centred = x32 - rows.row_mean(x32)
      x32 = centred * jax.lax.rsqrt(rows.row_mean(centred * centred) + cfg.norm_epsilon)
      return (x32 * scale + bias).astype(_dtype(cfg))
    eps = cfg.norm_epsilon if self.epsilon is None else self.epsilon
    x32 = x32 * jax.lax.rsqrt(rows.row_mean(x32 * x32) + eps)
    if cfg.norm_offset:
      # Gemma: (1 + w) formed in float32 (w may be stored in bf16).
      return (x32 * (cfg.norm_offset + scale.astype(jnp.float32))).astype(_dtype(cfg))
    return (x32 * scale).astype(_dtype(cfg))


class Embed(nn.Module):
  """An `embedding` table [num_embeddings, emb] looked up by integer ids."""
  num_embeddings: int
  config: DecoderOnlyConfig

  def setup(self):
    self.embedding = self.param("embedding", _INIT, (self.num_embeddings, self.config.emb_dim),
                                jnp.float32)

  def __call__(self, ids: Array) -> Array:
    # Clipping only touches ids past the table: GPT-2 positions of tokens that
    # lie beyond the cache, whose writes are dropped and logits never read.
    return jnp.take(self.embedding, ids, axis=0, mode="clip").astype(_dtype(self.config))


def _set_block(cache: Array, block: Array, positions: Array) -> Array:
  """Sets block [batch, q, ...] into cache [batch, len, ...] at positions [batch].

  Writes past the end of the cache are dropped: they belong to tokens beyond
  the decode length, whose logits are never used.
  """
  batch, q = block.shape[:2]
  index = positions[:, None] + jnp.arange(q)[None, :]
  return cache.at[jnp.arange(batch)[:, None], index].set(block.astype(cache.dtype), mode="drop")


class Attention(nn.Module):
  """Causal self-attention with q/k/v/o projections, rotary for Llama/Qwen2."""
  config: DecoderOnlyConfig

  def setup(self):
    cfg = self.config
    self.q_proj = Dense(cfg.num_heads * cfg.head_dim, cfg, cfg.qkv_bias)
    self.k_proj = Dense(cfg.num_kv_heads * cfg.head_dim, cfg, cfg.qkv_bias)
    self.v_proj = Dense(cfg.num_kv_heads * cfg.head_dim, cfg, cfg.qkv_bias)
    self.o_proj = Dense(cfg.emb_dim, cfg, cfg.out_bias)
    if cfg.qk_norm:
      self.q_norm = Norm(cfg)
      self.k_norm = Norm(cfg)
    if cfg.attention_sinks:
      self.sinks = self.param("sinks", _INIT, (cfg.num_heads,), jnp.float32)

  def _split(self, x: Array, heads: int) -> Array:
    x = x.reshape(x.shape[:-1] + (heads, self.config.head_dim))
    return _axes(x, ("batch", "length", "heads", "kv"))

  def __call__(self, x: Array, mask, rotary: Optional[Tuple[Array, Array]],
               layer_cache: Optional[Dict[str, Array]], positions: Optional[Array]):
    """x [batch, q, emb] -> ([batch, q, emb], updated layer cache or None); mask: a
    `prefix_attention.KeyMask`, or [batch|1, 1, q, keys] float32 (heads' own masks)."""
    cfg = self.config
    query = self._split(self.q_proj(x), cfg.num_heads)
    key = self._split(self.k_proj(x), cfg.num_kv_heads)
    value = self._split(self.v_proj(x), cfg.num_kv_heads)
    if cfg.qk_norm:  # Per head, over head_dim, before rotary (HF Gemma 3, Qwen3).
      query = self.q_norm(query)
      key = self.k_norm(key)
    if rotary is not None:
      query = apply_rotary(query, *rotary)
      key = apply_rotary(key, *rotary)
    new_cache = None
    if layer_cache is not None:
      key = _set_block(layer_cache["self_key"], key, positions)
      value = _set_block(layer_cache["self_value"], value, positions)
      new_cache = dict(layer_cache, self_key=key, self_value=value)
    heads = attend(query, key, value, mask, cfg.num_kv_heads, cfg.attention_scale,
                   cfg.attn_logit_softcap, self.sinks if cfg.attention_sinks else None,
                   cfg.attention_chunk)
    return self.o_proj(heads.reshape(heads.shape[:-2] + (-1,))), new_cache


class LatentUp(nn.Module):
  """DeepSeek-V3's `kv_b_proj`: the latent's up-projection, one `kernel` [kv_lora, heads *
  (nope + v)] ([out, in] with kernel_layout 'out_in'), the param `Dense` would hold. Its
  per-head halves are W_uk [kv_lora, heads, nope] (keys) and W_uv [kv_lora, heads, v]
  (values), which the latent cache's attention absorbs (`MlaAttention`)."""
  config: DecoderOnlyConfig

  def setup(self):
    # A setup param (not a compact Dense): it exists whichever method runs first, so a
    # cached-only init (the MTP head's) still creates it.
    cfg = self.config
    width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    self.kernel = self.param("kernel", _INIT,
                             kernel_shape(cfg.kernel_layout, cfg.kv_lora_rank, width), jnp.float32)

  def __call__(self, latent: Array) -> Array:
    """latent [batch, q, kv_lora] -> [batch, q, heads * (nope + v)], as `Dense`."""
    dtype = _dtype(self.config)
    return project(latent.astype(dtype), self.kernel.astype(dtype), self.config.kernel_layout,
                   preferred_element_type=dtype)

  def _halves(self) -> Tuple[Array, Array, str]:
    """(W_uk, W_uv, their einsum axes) in the kernel's stored order: [kv_lora, heads,
    nope | v] ('chd', in_out) or [heads, nope | v, kv_lora] ('hdc', out_in), no
    transpose."""
    cfg = self.config
    nope = cfg.qk_nope_head_dim
    if cfg.kernel_layout == "out_in":
      w = self.kernel.reshape(cfg.num_heads, -1, cfg.kv_lora_rank)
      return w[:, :nope], w[:, nope:], "hdc"
    w = self.kernel.reshape(cfg.kv_lora_rank, cfg.num_heads, -1)
    return w[..., :nope], w[..., nope:], "chd"

  def absorb(self, q_nope: Array) -> Array:
    """q_nope [batch, q, heads, nope] -> q_nope @ W_uk^T per head [batch, q, heads, kv_lora]
    in config.dtype. Formed in float32 at full precision (bf16 operands are exact in
    float32, so only the one final cast rounds, as k_nope was rounded once in the expanded
    form) and cast: the scores' einsum takes the cache's dtype."""
    w_uk, _, axes = self._halves()
    f32 = jnp.float32
    q = jnp.einsum(f"bqhd,{axes}->bqhc", q_nope.astype(f32), w_uk.astype(f32),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
    return q.astype(_dtype(self.config))

  def values(self, attended: Array) -> Array:
    """attended latents [batch, q, heads, kv_lora] -> [batch, q, heads, v] (@ W_uv per
    head) in config.dtype."""
    _, w_uv, axes = self._halves()
    dtype = _dtype(self.config)
    return jnp.einsum(f"bqhc,{axes}->bqhd", attended.astype(dtype), w_uv.astype(dtype),
                      preferred_element_type=dtype)


class MlaAttention(nn.Module):
  """DeepSeek-V3's multi-head latent attention (module docstring). With mla_cache 'latent'
  (default) a cached block stores each token's normed latent and rotated rotary key and
  attends through the absorbed projections; the uncached forward and mla_cache 'full'
  expand per-head keys and values (transformers' form; 'full' caches them)."""
  config: DecoderOnlyConfig

  def setup(self):
    cfg = self.config
    heads = cfg.num_heads
    if cfg.q_lora_rank is None:
      self.q_proj = Dense(heads * cfg.head_dim, cfg)
    else:
      self.q_a_proj = Dense(cfg.q_lora_rank, cfg, cfg.qkv_bias)
      self.q_a_layernorm = Norm(cfg, epsilon=1e-6)
      self.q_b_proj = Dense(heads * cfg.head_dim, cfg)
    self.kv_a_proj_with_mqa = Dense(cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg, cfg.qkv_bias)
    self.kv_a_layernorm = Norm(cfg, epsilon=1e-6)
    self.kv_b_proj = LatentUp(cfg)
    self.o_proj = Dense(cfg.emb_dim, cfg, cfg.out_bias)

  def _project(self, x: Array, rotary: Tuple[Array, Array]):
    """x [batch, q, emb] -> (q_nope [b, q, heads, nope], rotated q_rope [b, q, heads, rope],
    normed latent [b, q, kv_lora], rotated shared k_rope [b, q, 1, rope])."""
    cfg = self.config
    batch, q_len = x.shape[:2]
    if cfg.q_lora_rank is None:
      query = self.q_proj(x)
    else:
      query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    query = query.reshape(batch, q_len, cfg.num_heads, cfg.head_dim)
    compressed = self.kv_a_proj_with_mqa(x)
    latent, k_rot = compressed[..., :cfg.kv_lora_rank], compressed[..., cfg.kv_lora_rank:]
    q_nope, q_rot = query[..., :cfg.qk_nope_head_dim], query[..., cfg.qk_nope_head_dim:]
    k_rot = k_rot[:, :, None, :]  # One rotary key per token, shared by every head.
    if cfg.rope_interleave:
      q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
    q_rot, k_rot = apply_rotary(q_rot, *rotary), apply_rotary(k_rot, *rotary)
    return q_nope, q_rot, self.kv_a_layernorm(latent), k_rot

  def _expanded(self, q_nope, q_rot, normed, k_rot, mask, layer_cache, positions):
    """Per-head keys [nope | rope] and values from kv_b_proj (cached as such with
    mla_cache 'full'): ([batch, q, heads, v], updated layer cache or None)."""
    cfg = self.config
    batch, q_len, heads, nope = q_nope.shape
    kv = self.kv_b_proj(normed).reshape(batch, q_len, heads, nope + cfg.v_head_dim)
    k_nope, value = kv[..., :nope], kv[..., nope:]
    query = _axes(jnp.concatenate([q_nope, q_rot], axis=-1), ("batch", "length", "heads", "kv"))
    key = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, k_nope.shape[:-1] + k_rot.shape[-1:])],
                          axis=-1)
    key = _axes(key, ("batch", "length", "heads", "kv"))
    value = _axes(value, ("batch", "length", "heads", "kv"))
    new_cache = None
    if layer_cache is not None:
      key = _set_block(layer_cache["self_key"], key, positions)
      value = _set_block(layer_cache["self_value"], value, positions)
      new_cache = dict(layer_cache, self_key=key, self_value=value)
    out = attend(query, key, value, mask, heads, cfg.attention_scale,
                 chunk=cfg.attention_chunk)
    return out, new_cache

  def _absorbed(self, q_nope, q_rot, normed, k_rot, mask, layer_cache, positions):
    """The latent cache: self_key [batch, max_len, 1, kv_lora + rope] holds [normed latent |
    rotated k_rope] per token. Score(h, j) = q_nope_h . (W_uk_h c_j) + q_rope_h . k_rope_j
    = [q_nope_h W_uk_h^T | q_rope_h] . key_j: grouped-query attention with one kv head,
    `heads` groups and values the keys' first kv_lora dims; the output's latent through
    W_uv_h is head h's value mix. Returns ([batch, q, heads, v], updated layer cache)."""
    cfg = self.config
    query = jnp.concatenate([self.kv_b_proj.absorb(q_nope), q_rot], axis=-1)
    query = _axes(query, ("batch", "length", "heads", "kv"))
    key = jnp.concatenate([normed[:, :, None, :], k_rot.astype(normed.dtype)], axis=-1)
    # One latent per token, no heads axis: replicated over `model` (sharding.py).
    key = _set_block(layer_cache["self_key"], _axes(key, ("batch", "length", None, "kv")),
                     positions)
    out = attend(query, key, cfg.kv_lora_rank, mask, 1, cfg.attention_scale,
                 chunk=cfg.attention_chunk)
    return self.kv_b_proj.values(out), dict(layer_cache, self_key=key)

  def __call__(self, x: Array, mask, rotary: Tuple[Array, Array],
               layer_cache: Optional[Dict[str, Array]], positions: Optional[Array]):
    """x [batch, q, emb] -> ([batch, q, emb], updated layer cache or None); mask as
    `Attention`'s."""
    cfg = self.config
    parts = self._project(x, rotary)
    if layer_cache is not None and cfg.mla_cache == "latent":
      out, new_cache = self._absorbed(*parts, mask, layer_cache, positions)
    else:
      out, new_cache = self._expanded(*parts, mask, layer_cache, positions)
    batch, q_len = x.shape[:2]
    return self.o_proj(out.reshape(batch, q_len, cfg.num_heads * cfg.v_head_dim)), new_cache


class Mlp(nn.Module):
  """down_proj(act(gate_proj(x)) * up_proj(x)) (gated) or down_proj(act(up_proj(x))).

  width: the hidden units (None: mlp_dim; DeepSeek's shared experts:
  n_shared_experts * moe_mlp_dim).
  """
  config: DecoderOnlyConfig
  width: Optional[int] = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    act = _ACTIVATIONS[cfg.activation]
    width = cfg.mlp_dim if self.width is None else self.width
    if cfg.gated_mlp:
      hidden = act(Dense(width, cfg, cfg.mlp_bias, name="gate_proj")(x)) * Dense(
          width, cfg, cfg.mlp_bias, name="up_proj")(x)
    else:
      hidden = act(Dense(width, cfg, cfg.mlp_bias, name="up_proj")(x))
    hidden = _axes(hidden, ("batch", "length", "mlp"))
    return Dense(cfg.emb_dim, cfg, cfg.mlp_bias, name="down_proj")(hidden)


class Experts(nn.Module):
  """The experts' stacked weights, float32 params: gate_proj, up_proj [experts, emb,
  moe_mlp], down_proj [experts, moe_mlp, emb]; with moe_bias (gpt-oss) also
  gate_proj_bias, up_proj_bias [experts, moe_mlp] and down_proj_bias [experts, emb]."""
  config: DecoderOnlyConfig

  @nn.compact
  def __call__(self) -> Dict[str, Array]:
    cfg = self.config
    num, emb, width = cfg.num_experts, cfg.emb_dim, cfg.expert_mlp_dim
    weights = dict(gate_proj=self.param("gate_proj", _INIT, (num, emb, width), jnp.float32),
                   up_proj=self.param("up_proj", _INIT, (num, emb, width), jnp.float32),
                   down_proj=self.param("down_proj", _INIT, (num, width, emb), jnp.float32))
    if cfg.moe_bias:
      zeros = nn.initializers.zeros
      weights.update(
          gate_proj_bias=self.param("gate_proj_bias", zeros, (num, width), jnp.float32),
          up_proj_bias=self.param("up_proj_bias", zeros, (num, width), jnp.float32),
          down_proj_bias=self.param("down_proj_bias", zeros, (num, emb), jnp.float32))
    return weights


class Router(nn.Module):
  """A MoE layer's router: `kernel` [emb, experts] (config.kernel_layout); gpt-oss adds a
  `bias` [experts], DeepSeek-V3 an `e_score_correction_bias` [experts] (choice only).

  Returns (logits [batch, q, experts], the correction bias or None): in the compute dtype
  (Mixtral, Qwen3-MoE, gpt-oss: HF's Linear), in float32 for DeepSeek-V3 (transformers
  runs its router in float32).
  """
  config: DecoderOnlyConfig

  @nn.compact
  def __call__(self, x: Array) -> Tuple[Array, Optional[Array]]:
    cfg = self.config
    layout, num = cfg.kernel_layout, cfg.num_experts
    kernel = self.param("kernel", _INIT, kernel_shape(layout, x.shape[-1], num), jnp.float32)
    if cfg.family == "deepseek_v3":
      correction = self.param("e_score_correction_bias", nn.initializers.zeros, (num,),
                              jnp.float32)
      logits = project(x.astype(jnp.float32), kernel.astype(jnp.float32), layout,
                       preferred_element_type=jnp.float32)
      return logits, correction.astype(jnp.float32)
    dtype = _dtype(cfg)
    logits = project(x.astype(dtype), kernel.astype(dtype), layout, preferred_element_type=dtype)
    if cfg.moe_bias:
      logits = logits + self.param("bias", nn.initializers.zeros, (num,),
                                   jnp.float32).astype(dtype)
    return logits, None


def route(config: DecoderOnlyConfig, logits: Array, correction: Optional[Array]
          ) -> Tuple[Array, Array]:
  """(weights [batch, q, k] float32, expert index [batch, q, k]) by the family's rule
  (module docstring). Ties: lower index first (`jax.lax.top_k`)."""
  k = config.num_experts_per_tok
  if config.family == "gpt_oss":
    top, index = jax.lax.top_k(logits.astype(jnp.float32), k)
    return jax.nn.softmax(top, axis=-1), index
  if config.family == "deepseek_v3":
    num, groups = config.num_experts, config.n_group
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction
    per_group = choice.reshape(choice.shape[:-1] + (groups, num // groups))
    group_scores = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, config.topk_group)
    kept = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.int32), axis=-2) > 0
    kept = jnp.repeat(kept, num // groups, axis=-1)
    _, index = jax.lax.top_k(jnp.where(kept, choice, -jnp.inf), k)
    weights = jnp.take_along_axis(scores, index, axis=-1)
    if config.norm_topk_prob:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + np.float32(1e-20))
    return weights * np.float32(config.routed_scaling_factor), index
  # HF Mixtral / Qwen3-MoE: softmax and top-k in float32.
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, index = jax.lax.top_k(probs, k)
  if config.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, index


def _expert_glu(config: DecoderOnlyConfig):
  """(gate, up) -> the experts' hidden units: act(gate) * up, or gpt-oss's clamped form."""
  if config.family == "gpt_oss":
    limit, alpha = np.float32(config.swiglu_limit), np.float32(config.swiglu_alpha)

    def clamped(gate, up):
      gate = jnp.minimum(gate, limit.astype(gate.dtype))
      up = jnp.clip(up, -limit.astype(up.dtype), limit.astype(up.dtype))
      return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha.astype(gate.dtype)))
    return clamped
  act = _ACTIVATIONS[config.activation]
  return lambda gate, up: act(gate) * up


class MoeMlp(nn.Module):
  """A mixture of experts behind a top-k router (module docstring), plus DeepSeek-V3's
  shared experts.

  Params: `gate` (the `Router`), `experts` (`Experts`) and, for DeepSeek-V3,
  `shared_experts` (an `Mlp` of n_shared_experts * moe_mlp_dim units).
  """
  config: DecoderOnlyConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dtype = _dtype(cfg)
    num, k = cfg.num_experts, cfg.num_experts_per_tok
    x = x.astype(dtype)
    weights, index = route(cfg, *Router(cfg, name="gate")(x))
    w = Experts(cfg, name="experts")()
    glu = _expert_glu(cfg)
    tokens = x.shape[0] * x.shape[1]
    gather = cfg.moe_dispatch == "gather" or (cfg.moe_dispatch == "auto" and
                                              2 * tokens * k <= num)
    if gather:
      take = lambda w: jnp.take(w, index, axis=0).astype(dtype)  # noqa: E731 [b, q, k, ...]
      gate = jnp.einsum("bqd,bqkdm->bqkm", x, take(w["gate_proj"]), preferred_element_type=dtype)
      up = jnp.einsum("bqd,bqkdm->bqkm", x, take(w["up_proj"]), preferred_element_type=dtype)
      if cfg.moe_bias:
        gate, up = gate + take(w["gate_proj_bias"]), up + take(w["up_proj_bias"])
      hidden = _axes(glu(gate, up), ("batch", "length", None, "mlp"))
      hidden = hidden * weights[..., None].astype(dtype)
      out = jnp.einsum("bqkm,bqkmd->bqd", hidden, take(w["down_proj"]),
                       preferred_element_type=dtype)
      if cfg.moe_bias:  # Each chosen expert's output bias, weighted like its output.
        out = out + jnp.einsum("bqk,bqkd->bqd", weights.astype(dtype),
                               take(w["down_proj_bias"]), preferred_element_type=dtype)
    else:
      gate = jnp.einsum("bqd,edm->bqem", x, w["gate_proj"].astype(dtype),
                        preferred_element_type=dtype)
      up = jnp.einsum("bqd,edm->bqem", x, w["up_proj"].astype(dtype), preferred_element_type=dtype)
      if cfg.moe_bias:
        gate = gate + w["gate_proj_bias"].astype(dtype)
        up = up + w["up_proj_bias"].astype(dtype)
      hidden = _axes(glu(gate, up), ("batch", "length", "expert", "mlp"))
      # [batch, q, experts]: the top-k weights where chosen, zero elsewhere.
      combine = jnp.sum(jax.nn.one_hot(index, num, dtype=jnp.float32) * weights[..., None],
                        axis=-2)
      hidden = hidden * combine[..., None].astype(dtype)
      out = jnp.einsum("bqem,emd->bqd", hidden, w["down_proj"].astype(dtype),
                       preferred_element_type=dtype)
      if cfg.moe_bias:
        out = out + jnp.einsum("bqe,ed->bqd", combine.astype(dtype),
                               w["down_proj_bias"].astype(dtype), preferred_element_type=dtype)
    if cfg.n_shared_experts:
      out = out + Mlp(cfg, cfg.n_shared_experts * cfg.expert_mlp_dim, name="shared_experts")(x)
    return out


class DecoderLayer(nn.Module):
  """Pre-norm layer: x + attn(norm(x)), then + mlp(norm(x)); one code path, cached or not.

  With sandwich_norms (Gemma 2/3) each sub-block's output is normed too:
  x + post_attention_layernorm(attn(input_layernorm(x))), then
  x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))).

  input_norm: False drops input_layernorm (attention reads x itself): the
  layer of an EAGLE-1 feature head (`drafts.feature_draft`), whose input is
  already a projection of normed features. The target's layers keep it.
  moe: the MLP is a mixture of experts (`MoeMlp`; the target's layers where
  `config.moe_layers` says so); False: the dense `Mlp` of mlp_dim.
  """
  config: DecoderOnlyConfig
  input_norm: bool = True
  moe: bool = False

  def setup(self):
    cfg = self.config
    if self.input_norm:
      self.input_layernorm = Norm(cfg)
    self.self_attn = MlaAttention(cfg) if cfg.uses_mla else Attention(cfg)
    self.post_attention_layernorm = Norm(cfg)
    if cfg.sandwich_norms:
      self.pre_feedforward_layernorm = Norm(cfg)
      self.post_feedforward_layernorm = Norm(cfg)
    self.mlp = MoeMlp(cfg) if self.moe else Mlp(cfg)

  def __call__(self, x, mask, rotary, layer_cache=None, positions=None):
    attended, new_cache = self.self_attn(self.input_layernorm(x) if self.input_norm else x,
                                         mask, rotary, layer_cache, positions)
    if self.config.sandwich_norms:
      x = x + self.post_attention_layernorm(attended)
      x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
    else:
      x = x + attended
      x = x + self.mlp(self.post_attention_layernorm(x))
    return _axes(x, ("batch", "length", "embed")), new_cache


def init_cache(config: DecoderOnlyConfig, batch: int, max_len: int) -> Cache:
  """An all-zero cache of `max_len` positions per row (needs no params)."""
  if config.uses_mla and config.mla_cache == "latent":
    # DeepSeek-V3: one key per token, [normed latent | rotated k_rope], no values (they
    # are the keys' first kv_lora_rank dims; `MlaAttention._absorbed`).
    latent = (batch, max_len, 1, config.kv_lora_rank + config.qk_rope_head_dim)
    return dict(layers=[dict(self_key=jnp.zeros(latent, _dtype(config)))
                        for _ in range(config.num_layers)])
  shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  value_shape = shape[:-1] + (config.value_head_dim,)
  return dict(layers=[dict(self_key=jnp.zeros(shape, _dtype(config)),
                           self_value=jnp.zeros(value_shape, _dtype(config)))
                      for _ in range(config.num_layers)])


class DecoderOnly(nn.Module):
  """A decoder-only language model (Llama, Qwen2/3, Mistral, Gemma, GPT-2, Mixtral, Qwen3-MoE,
  DeepSeek-V3 or gpt-oss layout, by config)."""
  config: DecoderOnlyConfig

  def setup(self):
    cfg = self.config
    self.embed_tokens = Embed(cfg.vocab_size, cfg)
    if not cfg.uses_rotary:
      self.embed_positions = Embed(cfg.max_positions, cfg)
    # A list attribute is named layers_0, layers_1, ...
    self.layers = [DecoderLayer(cfg, moe=moe) for moe in cfg.moe_layers]
    self.norm = Norm(cfg)
    if not cfg.tie_word_embeddings:
      self.lm_head = Dense(cfg.vocab_size, cfg, float32_output=True)

  def _hidden(self, tokens: Array, query_positions: Array, cache: Optional[Cache] = None,
              positions: Optional[Array] = None, key_positions: Optional[Array] = None,
              allowed: Optional[Array] = None, taps: Optional[Tuple[int, ...]] = None):
    """Runs the stack up to the final norm.

    Args:
      tokens: [batch, q] int32.
      query_positions: [batch|1, q] int32 absolute positions of the tokens.
      cache: None (the q tokens attend to each other) or a cache whose
        keys/values get the block set at rows' `positions` [batch].
      key_positions: [batch, L] int32 absolute position of each cache index
        (a tree block: `core.token_tree.tree_positions`); None: the index itself.
      allowed: [batch, q, L] bool, ANDed into the masks (a tree block); None:
        the masks by position alone.
      taps: None, or hidden-state indices to return as features (see
        `feature_layers`): i < num_layers is layer i's input (HF's
        `hidden_states[i]`; 0 the embeddings), num_layers the output after
        the final norm. None traces exactly the program without features.
    Returns:
      (hidden [batch, q, emb], list of updated layer caches, or None), and
      with taps a third item: features [batch, q, len(taps) * emb] float32,
      the tapped states concatenated in the order of `taps`.
    """
    cfg = self.config
    x = self.embed_tokens(tokens)
    if cfg.scale_embeddings:
      # HF multiplies by sqrt(hidden) cast to the weights' dtype first.
      x = x * jnp.asarray(cfg.emb_dim ** 0.5, x.dtype)
    if not cfg.uses_rotary:
      x = x + self.embed_positions(query_positions)
    # Masks by absolute positions: exact for any block of any row, whatever the cache
    # holds past a row's length or before its window. A cached block reads the cache
    # in chunks up to its last write (`prefix_attention`).
    if cache is None:
      full = KeyMask(query_positions, jnp.int32(tokens.shape[1]), query_positions, allowed)
    else:
      full = KeyMask(query_positions, jnp.max(positions) + tokens.shape[1], key_positions,
                     allowed)
    types = cfg.attention_types
    masks = {"full_attention": full}
    rotaries = {"full_attention": rotary_tables(query_positions, cfg) if cfg.uses_rotary
                else None}
    if "sliding_attention" in types:
      masks["sliding_attention"] = full.with_window(cfg.sliding_window)
      rotaries["sliding_attention"] = (
          rotary_tables(query_positions, cfg, sliding=True)
          if cfg.uses_rotary and cfg.sliding_rope_theta is not None else
          rotaries["full_attention"])
    x = _axes(x, ("batch", "length", "embed"))
    new_layers = []
    tapped = {}
    for i, layer in enumerate(self.layers):
      if taps is not None and i in taps:
        tapped[i] = x
      layer_cache = None if cache is None else cache["layers"][i]
      x, new_layer = layer(x, masks[types[i]], rotaries[types[i]], layer_cache, positions)
      new_layers.append(new_layer)
    hidden = self.norm(x)
    if taps is None:
      return hidden, (None if cache is None else new_layers)
    tapped[cfg.num_layers] = hidden
    features = jnp.concatenate([tapped[i].astype(jnp.float32) for i in taps], axis=-1)
    return hidden, (None if cache is None else new_layers), features

  def project_logits(self, hidden: Array) -> Array:
    """hidden [..., emb] -> logits [..., vocab] float32 (soft-capped with final_logit_softcap)."""
    cap = self.config.final_logit_softcap
    if self.config.tie_word_embeddings:
      embedding = self.embed_tokens.embedding.astype(hidden.dtype)
      # The table [vocab, emb] is the dot's first operand, contracted on its
      # minor dimension as it lies in memory: as the second operand
      # (hidden @ embedding.T) XLA CPU reads it against its layout, 7.4 vs
      # 4.3 ms per GPT-2 token on the 2-core VM (one row, same results to
      # rounding).
      logits = jnp.einsum("vd,...d->...v", embedding, hidden,
                          preferred_element_type=jnp.float32)
    else:
      logits = self.lm_head(hidden)
    if cap is not None:
      logits = np.float32(cap) * jnp.tanh(logits / np.float32(cap))
    return logits

  def __call__(self, tokens: Array) -> Array:
    """Logits [batch, len, vocab] float32 of tokens [batch, len] at positions 0..len-1, no cache."""
    hidden, _ = self._hidden(tokens, jnp.arange(tokens.shape[1])[None])
    return self.project_logits(hidden)

  def init_cache(self, batch: int, max_len: int) -> Cache:
    return init_cache(self.config, batch, max_len)

  def decode_block(self, tokens: Array, positions: Array, cache: Cache,
                   tree: Optional[TreeAttention] = None) -> Tuple[Array, Cache]:
    """Scores a block of tokens per row from the cache.

    Args:
      tokens: [batch, k] int32.
      positions: [batch] int32, the absolute position of each row's first
        token (without a tree), the cache index where the block is set.
      cache: from `init_cache`.
      tree: None, or the block's `core.token_tree.TreeAttention`: token i then sits
        at absolute position root + tree.depths[i] (root = positions -
        tree.root_offset) and attends as the tree says (module docstring).
    Returns:
      logits [batch, k, vocab] float32 (row b, index j predicts the token
      after token j: at position positions[b] + j + 1 without a tree, a
      child of node j with one), and the cache with the block's keys and
      values set at cache indices positions[b] + 0..k-1.
    """
    if tree is None:
      query_positions = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
      hidden, layers = self._hidden(tokens, query_positions, cache, positions)
    else:
      query_positions, key_positions, allowed = tree_positions(
          tree, positions, cache["layers"][0]["self_key"].shape[1])
      hidden, layers = self._hidden(tokens, query_positions, cache, positions, key_positions,
                                    allowed)
    return self.project_logits(hidden), dict(cache, layers=layers)

  def decode_block_features(self, tokens: Array, positions: Array, cache: Cache,
                            taps: Tuple[int, ...], tree: Optional[TreeAttention] = None
                            ) -> Tuple[Array, Array, Cache]:
    """`decode_block` (a causal or a tree block) that also returns the features `taps`
    names (`_hidden`): (logits [batch, k, vocab] float32, features [batch, k, len(taps) *
    emb] float32, cache). Feature i belongs to block token i (it produced logits i)."""
    if tree is None:
      query_positions = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
      hidden, layers, features = self._hidden(tokens, query_positions, cache, positions,
                                              taps=taps)
    else:
      query_positions, key_positions, allowed = tree_positions(
          tree, positions, cache["layers"][0]["self_key"].shape[1])
      hidden, layers, features = self._hidden(tokens, query_positions, cache, positions,
                                              key_positions, allowed, taps=taps)
    return self.project_logits(hidden), features, dict(cache, layers=layers)

  def prefill_features(self, prompts: Array, cache: Cache, taps: Tuple[int, ...]
                       ) -> Tuple[Array, Cache]:
    """`prefill`'s cache writes, returning the features of every prompt slot
    [batch, P, len(taps) * emb] float32 (padding slots hold junk) instead of logits."""
    positions = jnp.zeros((prompts.shape[0],), jnp.int32)
    _, layers, features = self._hidden(prompts, jnp.arange(prompts.shape[1])[None], cache,
                                       positions, taps=taps)
    return features, dict(cache, layers=layers)

  def prefill(self, prompts: Array, prompt_lengths: Array, cache: Cache) -> Tuple[Array, Cache]:
    """Writes right-padded prompts [batch, P] into the cache at positions 0..P-1.

    Args:
      prompts: [batch, P] int32, row b's prompt in its first prompt_lengths[b] slots.
      prompt_lengths: [batch] int32 in [1, P].
      cache: from `init_cache`, at least P positions.
    Returns:
      logits [batch, vocab] float32 at each row's last prompt token (the
      distribution of its first new token), and the cache.
    """
    batch, length = prompts.shape
    positions = jnp.zeros((batch,), jnp.int32)
    hidden, layers = self._hidden(prompts, jnp.arange(length)[None], cache, positions)
    # Project only the last prompt token per row: [batch, P, vocab] logits
    # would dwarf the cache for long prompts and large vocabularies.
    last = hidden[jnp.arange(batch), prompt_lengths - 1]
    return self.project_logits(last), dict(cache, layers=layers)

  def decode_view(self, tokens: Array, query_positions: Array, write_index: Array,
                  cache: Cache, key_positions: Array) -> Tuple[Array, Cache]:
    """Scores tokens [batch, k] at absolute query_positions [batch, k] from a compact cache
    whose index i holds the key of absolute position key_positions[b, i] ([batch, L]; a
    position past every query hides it), writing the block at cache indices
    write_index [batch] + 0..k-1 (`families/decoder_only/sparse_view.py`). Returns
    (logits [batch, k, vocab] float32, cache)."""
    hidden, layers = self._hidden(tokens, query_positions, cache, write_index, key_positions)
    return self.project_logits(hidden), dict(cache, layers=layers)
