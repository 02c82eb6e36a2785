"""Decoder-only (GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 1/2/3, Mixtral, Qwen3-MoE,
DeepSeek-V3, gpt-oss) size configurations as data.

`DecoderOnlyConfig` holds every field that determines a parameter shape or a
numerical convention of `families/decoder_only/network.py`; named configs are plain
instances of it, looked up with `get_decoder_config(name, **overrides)`. Names
use underscores (`qwen2_0_5b`); hyphens and dots are accepted as spellings of
an underscore (`qwen2-0.5b`, `gpt2-medium`).

The named full-size configs copy the shapes and conventions of the public
Hugging Face `config.json` files (so memory plans and benchmarks at those sizes
are realistic); their weights are random unless loaded from a directory.
"""

import dataclasses
import math
import re
from typing import Optional, Tuple

from specdec_jax.families.base import replace_config
from specdec_jax.families.kernel_layout import check_layout

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "mistral", "gemma", "gemma2", "gemma3",
            "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
# Layouts whose MLPs are mixtures of experts (all layers for Mixtral and gpt-oss; by
# decoder_sparse_step / mlp_only_layers for Qwen3-MoE; from first_k_dense_replace on for
# DeepSeek-V3).
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
MOE_DISPATCHES = ("auto", "dense", "gather")
MLA_CACHES = ("latent", "full")  # DecoderOnlyConfig.mla_cache
ACTIVATIONS = ("silu", "gelu_new", "gelu", "relu")
ROPE_SCALINGS = (None, "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")

# The numerical conventions each Hugging Face layout fixes (beyond shapes). The
# HF loader sets them from the family and the exporter checks them, so a config
# that claims a family but differs in one of these cannot be written as it.
_GEMMA = dict(norm_offset=1.0, scale_embeddings=True)
FAMILY_CONVENTIONS = {
    "gemma": dict(_GEMMA, sandwich_norms=False, qk_norm=False),
    "gemma2": dict(_GEMMA, sandwich_norms=True, qk_norm=False),
    "gemma3": dict(_GEMMA, sandwich_norms=True, qk_norm=True),
}
_PLAIN = dict(norm_offset=0.0, scale_embeddings=False, sandwich_norms=False, qk_norm=False)
FAMILY_CONVENTIONS.update({family: dict(_PLAIN) for family in ("llama", "qwen2", "gpt2",
                                                                "mistral", "mixtral",
                                                                "deepseek_v3", "gpt_oss")})
# Qwen3 (and Qwen3-MoE): Llama's plain RMSNorm (x * w), plus per-head q/k norms (also x * w).
FAMILY_CONVENTIONS["qwen3"] = dict(_PLAIN, qk_norm=True)
FAMILY_CONVENTIONS["qwen3_moe"] = dict(_PLAIN, qk_norm=True)


@dataclasses.dataclass(frozen=True)
class DecoderOnlyConfig:
  """Shapes and conventions of a decoder-only Transformer.

  Attributes:
    family: 'llama', 'qwen2', 'qwen3', 'mistral', 'gemma', 'gemma2', 'gemma3' (RMSNorm,
      rotary positions, gated MLP gate/up/down), 'mixtral', 'qwen3_moe' (the same, with
      mixture-of-experts MLPs: the fields from num_experts on), 'deepseek_v3' (latent
      attention, grouped sigmoid routing, shared experts), 'gpt_oss' (attention sinks,
      biased experts with a clamped SwiGLU) or 'gpt2' (LayerNorm with bias, learned
      positions, plain MLP up/down). Names the Hugging Face
      layout the loader reads and the exporter writes; the numerical
      differences between the rotary families are the fields below
      (`FAMILY_CONVENTIONS` lists what each family fixes).
    vocab_size: rows of the token embedding (and columns of the logits).
    emb_dim: width of the residual stream (HF hidden_size / n_embd).
    num_layers: decoder layers.
    num_heads: query heads; num_kv_heads: key/value heads (grouped-query
      attention when smaller; must divide num_heads).
    head_dim: width of one head.
    mlp_dim: hidden width of the feed-forward block (HF intermediate_size); for
      Mixtral and gpt-oss the experts' width, for Qwen3-MoE and DeepSeek-V3 the width of
      their dense layers.
    max_positions: GPT-2: rows of the learned position table (HF n_positions).
      Rotary families: HF max_position_embeddings, the context the model was
      trained for. Either way `generate` refuses a decode whose real positions
      (the longest prompt + max_decode_steps - 1) exceed it; the padded prompt
      width does not count. (Rotary positions would extend past it, untrained:
      raise it with `replace` to decode there on purpose.)
    norm_epsilon: RMSNorm / LayerNorm epsilon.
    activation: MLP activation ('silu' for Llama/Qwen2/Qwen3/Mistral, 'gelu_new' =
      tanh GELU for GPT-2 and (gated) Gemma, HF's gelu_pytorch_tanh, 'gelu' =
      exact erf GELU, 'relu').
    rope_theta: rotary base (rotary families only).
    rope_scaling: None, 'linear' (positions divided by rope_factor) or
      'llama3' (Llama 3.1's frequency-dependent scaling with rope_factor,
      rope_low_freq_factor, rope_high_freq_factor, rope_original_max_positions).
    tie_word_embeddings: logits = hidden @ embedding.T (no lm_head kernel).
    qkv_bias / out_bias / mlp_bias: biases on the q/k/v projections (Qwen2,
      GPT-2, Llama / Qwen3 with attention_bias), on the attention output projection
      (GPT-2, Llama / Qwen3 with attention_bias) and on the MLP projections (GPT-2,
      Llama with mlp_bias).
    dtype: compute dtype, and the dtype weights are stored in.
    bos_id / eos_id / pad_id: token conventions; eos_id None means no token
      ends a row early. pad_id only fills right-padded prompts (its value never
      matters, those positions are masked and overwritten).
    norm_offset: RMSNorm multiplies by (norm_offset + scale); Gemma stores its
      scales around 0 and uses 1 + w (and computes the product in float32
      before casting back, as every norm here does). 0 elsewhere.
    scale_embeddings: multiply token embeddings by sqrt(emb_dim), the factor
      first rounded to the compute dtype, as HF does (Gemma; in bf16
      sqrt(3072) = 55.43 becomes 55.5).
    query_pre_attn_scalar: attention scores are scaled by
      query_pre_attn_scalar ** -0.5 (Gemma 2/3); None: head_dim ** -0.5.
    attn_logit_softcap: scores -> cap * tanh(scores / cap) after scaling and
      before the mask (Gemma 2); None: no capping.
    final_logit_softcap: logits -> cap * tanh(logits / cap) (Gemma 2; Gemma 3
      configs may set it); None: no capping.
    sandwich_norms: Gemma 2/3 layer: x + post_attention_layernorm(attn(
      input_layernorm(x))), then x + post_feedforward_layernorm(mlp(
      pre_feedforward_layernorm(x))). False: the pre-norm layer, whose
      post_attention_layernorm is the norm before the MLP.
    qk_norm: RMSNorm (q_norm, k_norm, [head_dim] scales) on each query and key
      head after the projection and before rotary (Gemma 3, whose scales are
      (1 + w) like its other norms, and Qwen3, w).
    sliding_window: W; a layer of type 'sliding_attention' lets the query at
      absolute position i see keys j with i - W < j <= i. None: no window.
    layer_types: per layer 'full_attention' or 'sliding_attention' (len =
      num_layers); None: every layer sliding when sliding_window is set
      (Mistral), else every layer full.
    sliding_rope_theta: rotary base of the sliding layers, which then get no
      rope scaling (Gemma 3: 10k local, rope_theta and rope_scaling on the full
      layers); None: every layer uses rope_theta and rope_scaling.
    kernel_layout: how 2-D projection kernels are stored: 'in_out' ([in, out],
      Flax's convention and every checkpoint reader's) or 'out_in' ([out, in],
      HF's Linear layout), which XLA's CPU dot reads faster, both for one
      token and for a verification block (BENCHMARKS.md, "Issue 30"); see
      `families.kernel_layout`. The function is the same. (Expert weights are 3-D,
      always [experts, in, out]; the router is a 2-D kernel and follows the layout.)
    num_experts: experts per MoE layer (HF num_local_experts / num_experts); 0 for
      the dense families, >= 1 for 'mixtral' and 'qwen3_moe'.
    num_experts_per_tok: k, the experts each token is routed to (1 <= k <= num_experts).
    moe_mlp_dim: each expert's hidden width (HF moe_intermediate_size, Qwen3-MoE);
      None: mlp_dim (Mixtral, whose intermediate_size is the experts').
    norm_topk_prob: the k chosen softmax probabilities are renormalised to sum to
      one (Mixtral always; Qwen3-MoE when its norm_topk_prob is set).
    decoder_sparse_step / mlp_only_layers: layer i is a MoE layer when i is not
      in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF Qwen3-MoE's
      rule); the others have a dense MLP of mlp_dim.
    moe_dispatch: how a MoE layer computes (`network.MoeMlp`): 'dense' (every
      expert on every token, weighted by a [tokens, experts] matrix that is zero
      off the top k), 'gather' (each token gathers its k experts' weights), or
      'auto' (gather when 2 * tokens * k <= num_experts, i.e. a few-token decode
      block; dense otherwise). The routing and the function are the same.
    rope_scaling 'yarn' (DeepSeek-V3, gpt-oss; transformers' `_compute_yarn_parameters`):
      rope_factor, rope_original_max_positions, rope_beta_fast / rope_beta_slow (the
      correction range), rope_truncate (floor / ceil that range; gpt-oss: False),
      rope_mscale / rope_mscale_all_dim (0: absent) and rope_attention_factor (None:
      derived), which multiplies cos and sin (`yarn_attention_factor`). DeepSeek-V3 also
      multiplies its softmax scale by mscale(factor, rope_mscale_all_dim) ** 2.
    q_lora_rank / kv_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim:
      DeepSeek-V3's multi-head latent attention (`network.MlaAttention`): queries through
      a rank-q_lora_rank bottleneck (None: a plain q_proj), keys and values from a
      kv_lora_rank latent plus one shared rotary key of qk_rope_head_dim; head_dim must be
      qk_nope_head_dim + qk_rope_head_dim (the query/key width) and num_kv_heads
      num_heads. 0 / None for every other family.
    rope_interleave: the rotary part of each head holds interleaved pairs (x0, x1), (x2,
      x3), ... (DeepSeek-V3's checkpoints; transformers' `apply_rotary_pos_emb_interleave`).
    n_shared_experts: DeepSeek-V3's always-on shared experts, one SwiGLU MLP of
      n_shared_experts * moe_mlp_dim units added to the routed output.
    n_group / topk_group / routed_scaling_factor: DeepSeek-V3's router (sigmoid scores;
      the choice adds `e_score_correction_bias`; the experts fall in n_group groups, the
      topk_group groups with the largest top-2 sums are kept, k experts chosen among
      them; weights are the plain sigmoid scores, renormalised with norm_topk_prob, then
      times routed_scaling_factor).
    first_k_dense_replace: DeepSeek-V3: layers below it have a dense MLP of mlp_dim.
    swiglu_limit / swiglu_alpha: gpt-oss's clamped SwiGLU experts: gate clamped above
      and up on both sides at the limit, (up + 1) * gate * sigmoid(alpha * gate); gpt-oss
      also has router and expert biases and per-head attention sinks.
    attention_chunk: a cached block's self-attention reads the cache this many keys at
      a time, only up to the block's last write (and, on a sliding-window layer, from
      its lowest query's position - window): a step costs the tokens written, not the
      cache allocated (`prefix_attention`). Caches of at most this many positions are
      read whole; 0 reads every cache whole. The result does not depend on the cache's
      length; against whole-cache reading it differs in float rounding only.
    mla_cache: what a DeepSeek-V3 (multi-head latent attention) cache holds per token and
      layer. 'latent' (default; DeepSeek's and vLLM's): the normed kv latent and the
      rotated shared rotary key, kv_lora_rank + qk_rope_head_dim values, attended
      through the absorbed projections (`network.MlaAttention`); 'full': per-head keys
      and values, num_heads * (head_dim + v_head_dim) values (~71x the latent for
      DeepSeek-V3), the same function to float rounding. Other families ignore it.
  """
  family: str = "llama"
  vocab_size: int = 32000
  emb_dim: int = 2048
  num_layers: int = 16
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 64
  mlp_dim: int = 8192
  max_positions: int = 4096
  norm_epsilon: float = 1e-5
  activation: str = "silu"
  rope_theta: float = 10000.0
  rope_scaling: Optional[str] = None
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  out_bias: bool = False
  mlp_bias: bool = False
  dtype: str = "float32"
  bos_id: Optional[int] = 1
  eos_id: Optional[int] = 2
  pad_id: int = 0
  norm_offset: float = 0.0
  scale_embeddings: bool = False
  query_pre_attn_scalar: Optional[float] = None
  attn_logit_softcap: Optional[float] = None
  final_logit_softcap: Optional[float] = None
  sandwich_norms: bool = False
  qk_norm: bool = False
  sliding_window: Optional[int] = None
  layer_types: Optional[Tuple[str, ...]] = None
  sliding_rope_theta: Optional[float] = None
  kernel_layout: str = "in_out"
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_mlp_dim: Optional[int] = None
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: Tuple[int, ...] = ()
  moe_dispatch: str = "auto"
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_truncate: bool = True
  rope_mscale: float = 0.0
  rope_mscale_all_dim: float = 0.0
  rope_attention_factor: Optional[float] = None
  q_lora_rank: Optional[int] = None
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False
  n_shared_experts: int = 0
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  first_k_dense_replace: int = 0
  swiglu_limit: Optional[float] = None
  swiglu_alpha: float = 1.702
  attention_chunk: int = 256
  mla_cache: str = "latent"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"DecoderOnlyConfig.family must be one of {FAMILIES}, got {self.family!r}")
    if int(self.attention_chunk) != self.attention_chunk or self.attention_chunk < 0:
      raise ValueError(f"DecoderOnlyConfig.attention_chunk must be an int >= 0 (0: read the "
                       f"whole cache), got {self.attention_chunk!r}")
    if self.mla_cache not in MLA_CACHES:
      raise ValueError(f"DecoderOnlyConfig.mla_cache must be one of {MLA_CACHES} ('latent': "
                       f"DeepSeek-V3's compressed cache, 'full': per-head keys and values), "
                       f"got {self.mla_cache!r}")
    for field in ("vocab_size", "emb_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "mlp_dim", "max_positions", "rope_original_max_positions"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DecoderOnlyConfig.{field} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"DecoderOnlyConfig.num_kv_heads ({self.num_kv_heads}) must divide "
                       f"num_heads ({self.num_heads}) for grouped-query attention")
    self._check_mla()
    if self.uses_rotary and self.rotary_dim % 2:
      raise ValueError(f"rotary positions need an even "
                       f"{'qk_rope_head_dim' if self.uses_mla else 'head_dim'}, got "
                       f"{self.rotary_dim}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"DecoderOnlyConfig.activation must be one of {ACTIVATIONS}, "
                       f"got {self.activation!r}")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"DecoderOnlyConfig.rope_scaling must be one of {ROPE_SCALINGS}, "
                       f"got {self.rope_scaling!r}")
    if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
      raise ValueError("llama3 rope scaling needs rope_high_freq_factor > rope_low_freq_factor")
    if not self.rope_theta > 0 or not self.rope_factor > 0:
      raise ValueError("rope_theta and rope_factor must be > 0")
    if self.rope_scaling == "yarn":
      if not self.rope_beta_fast > 0 or not self.rope_beta_slow > 0:
        raise ValueError("yarn rope scaling needs rope_beta_fast and rope_beta_slow > 0")
      if self.rope_attention_factor is not None and not self.rope_attention_factor > 0:
        raise ValueError(f"DecoderOnlyConfig.rope_attention_factor must be None or > 0, got "
                         f"{self.rope_attention_factor!r}")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"DecoderOnlyConfig.dtype must be float32, bfloat16 or float16, "
                       f"got {self.dtype!r}")
    for field in ("bos_id", "eos_id"):
      value = getattr(self, field)
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(f"DecoderOnlyConfig.{field} {value} lies outside the vocabulary "
                         f"[0, {self.vocab_size})")
    for field in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                  "sliding_rope_theta"):
      value = getattr(self, field)
      if value is not None and not value > 0:
        raise ValueError(f"DecoderOnlyConfig.{field} must be None or > 0, got {value!r}")
    if self.sliding_window is not None and (
        not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or
        self.sliding_window < 1):
      raise ValueError(f"DecoderOnlyConfig.sliding_window must be None or a positive int, got "
                       f"{self.sliding_window!r}")
    if self.layer_types is not None:
      if not isinstance(self.layer_types, tuple):
        # A list would make the (hashed, jit-cached) config unhashable.
        raise ValueError(f"DecoderOnlyConfig.layer_types must be a tuple, got "
                         f"{type(self.layer_types).__name__}")
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"DecoderOnlyConfig.layer_types has {len(self.layer_types)} entries "
                         f"but num_layers is {self.num_layers}: give one per layer (or "
                         f"layer_types=None for uniform layers)")
      bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if bad:
        raise ValueError(f"DecoderOnlyConfig.layer_types entries must be in {LAYER_TYPES}, "
                         f"got {bad}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        raise ValueError("DecoderOnlyConfig.layer_types has sliding_attention layers but "
                         "sliding_window is None")
    check_layout(self.kernel_layout)
    if not self.uses_rotary and (self.qk_norm or self.sliding_rope_theta is not None):
      raise ValueError("qk_norm and sliding_rope_theta need a rotary family (not gpt2)")
    self._check_moe()

  def _check_mla(self):
    """DeepSeek-V3's latent-attention fields (ValueError naming the field)."""
    fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if not self.uses_mla:
      set_ = [f for f in fields if getattr(self, f)] + (
          ["q_lora_rank"] if self.q_lora_rank is not None else []) + (
          ["rope_interleave"] if self.rope_interleave else [])
      if set_:
        raise ValueError(f"DecoderOnlyConfig.{', '.join(set_)}: multi-head latent attention "
                         f"is DeepSeek-V3's (family 'deepseek_v3'), not {self.family!r}'s")
      return
    for field in fields:
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DecoderOnlyConfig.{field} must be a positive int for multi-head "
                         f"latent attention, got {value!r}")
    if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or isinstance(
        self.q_lora_rank, bool) or self.q_lora_rank < 1):
      raise ValueError(f"DecoderOnlyConfig.q_lora_rank must be None or a positive int, got "
                       f"{self.q_lora_rank!r}")
    if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
      raise ValueError(f"DecoderOnlyConfig.head_dim ({self.head_dim}) must be qk_nope_head_dim + "
                       f"qk_rope_head_dim ({self.qk_nope_head_dim} + {self.qk_rope_head_dim}) "
                       f"for multi-head latent attention (the query/key width)")
    if self.num_kv_heads != self.num_heads:
      raise ValueError(f"DecoderOnlyConfig.num_kv_heads ({self.num_kv_heads}) must equal "
                       f"num_heads ({self.num_heads}) for multi-head latent attention: every "
                       f"head's key and value come from the shared latent")

  def _check_moe(self):
    """The mixture-of-experts fields (ValueError naming the field)."""
    def positive_int(field, value):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DecoderOnlyConfig.{field} must be a positive int, got {value!r}")

    if self.family != "deepseek_v3":
      wrong = [f for f, default in (("n_shared_experts", 0), ("n_group", 1), ("topk_group", 1),
                                    ("routed_scaling_factor", 1.0),
                                    ("first_k_dense_replace", 0))
               if getattr(self, f) != default]
      if wrong:
        raise ValueError(f"DecoderOnlyConfig.{', '.join(wrong)}: DeepSeek-V3's router and "
                         f"shared experts (family 'deepseek_v3'), not {self.family!r}'s")
    if self.family == "gpt_oss":
      if not isinstance(self.swiglu_limit, (int, float)) or isinstance(
          self.swiglu_limit, bool) or not self.swiglu_limit > 0:
        raise ValueError(f"DecoderOnlyConfig.swiglu_limit must be > 0 for gpt-oss's clamped "
                         f"SwiGLU, got {self.swiglu_limit!r}")
    elif self.swiglu_limit is not None:
      raise ValueError(f"DecoderOnlyConfig.swiglu_limit: the clamped SwiGLU is gpt-oss's "
                       f"(family 'gpt_oss'), not {self.family!r}'s")
    if self.family not in MOE_FAMILIES:
      if self.num_experts != 0:
        raise ValueError(f"DecoderOnlyConfig.num_experts={self.num_experts!r}: mixture-of-experts "
                         f"MLPs need a MoE family ({', '.join(MOE_FAMILIES)}), not "
                         f"{self.family!r}")
      return
    positive_int("num_experts", self.num_experts)
    if not isinstance(self.num_experts_per_tok, int) or isinstance(
        self.num_experts_per_tok, bool) or not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f"DecoderOnlyConfig.num_experts_per_tok must be an int between 1 and "
                       f"num_experts ({self.num_experts}), got {self.num_experts_per_tok!r}")
    if self.moe_mlp_dim is not None:
      positive_int("moe_mlp_dim", self.moe_mlp_dim)
    positive_int("decoder_sparse_step", self.decoder_sparse_step)
    if not isinstance(self.mlp_only_layers, tuple):
      raise ValueError(f"DecoderOnlyConfig.mlp_only_layers must be a tuple, got "
                       f"{type(self.mlp_only_layers).__name__}")
    bad = [i for i in self.mlp_only_layers
           if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"DecoderOnlyConfig.mlp_only_layers entries must be layer indices in "
                       f"[0, {self.num_layers}), got {bad}")
    if self.moe_dispatch not in MOE_DISPATCHES:
      raise ValueError(f"DecoderOnlyConfig.moe_dispatch must be one of {MOE_DISPATCHES}, got "
                       f"{self.moe_dispatch!r}")
    if self.family == "deepseek_v3":
      positive_int("n_group", self.n_group)
      positive_int("topk_group", self.topk_group)
      if self.n_shared_experts != 0:
        positive_int("n_shared_experts", self.n_shared_experts)
      if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
        raise ValueError(f"DecoderOnlyConfig.n_group ({self.n_group}) must divide num_experts "
                         f"({self.num_experts}) into groups of at least 2 experts (a group "
                         f"scores by its top-2 sum)")
      if self.topk_group > self.n_group:
        raise ValueError(f"DecoderOnlyConfig.topk_group ({self.topk_group}) must be at most "
                         f"n_group ({self.n_group})")
      reachable = self.topk_group * (self.num_experts // self.n_group)
      if self.num_experts_per_tok > reachable:
        raise ValueError(f"DecoderOnlyConfig.num_experts_per_tok ({self.num_experts_per_tok}) "
                         f"exceeds the {reachable} experts of the topk_group ({self.topk_group}) "
                         f"groups a token may choose from")
      if not isinstance(self.first_k_dense_replace, int) or isinstance(
          self.first_k_dense_replace, bool) or not (
              0 <= self.first_k_dense_replace <= self.num_layers):
        raise ValueError(f"DecoderOnlyConfig.first_k_dense_replace must be an int in [0, "
                         f"{self.num_layers}], got {self.first_k_dense_replace!r}")
      if not self.routed_scaling_factor > 0:
        raise ValueError(f"DecoderOnlyConfig.routed_scaling_factor must be > 0, got "
                         f"{self.routed_scaling_factor!r}")

  @property
  def uses_rotary(self) -> bool:
    """Rotary positions (Llama, Qwen2) rather than a learned table (GPT-2)."""
    return self.family != "gpt2"

  @property
  def uses_mla(self) -> bool:
    """DeepSeek-V3's multi-head latent attention (`network.MlaAttention`)."""
    return self.family == "deepseek_v3"

  @property
  def rotary_dim(self) -> int:
    """Width of a head's rotated part: qk_rope_head_dim with latent attention, else head_dim."""
    return self.qk_rope_head_dim if self.uses_mla else self.head_dim

  @property
  def value_head_dim(self) -> int:
    """Width of a value head: v_head_dim with latent attention, else head_dim."""
    return self.v_head_dim if self.uses_mla else self.head_dim

  @property
  def attention_sinks(self) -> bool:
    """A learned per-head logit in each softmax denominator (gpt-oss's `sinks`)."""
    return self.family == "gpt_oss"

  @property
  def moe_bias(self) -> bool:
    """Biases on the router and on every expert projection (gpt-oss)."""
    return self.family == "gpt_oss"

  @property
  def yarn_attention_factor(self) -> float:
    """What yarn multiplies cos and sin by (transformers' `attention_factor`); 1 otherwise."""
    if self.rope_scaling != "yarn":
      return 1.0
    if self.rope_attention_factor is not None:
      return float(self.rope_attention_factor)
    if self.rope_mscale and self.rope_mscale_all_dim:
      return float(yarn_get_mscale(self.rope_factor, self.rope_mscale) /
                   yarn_get_mscale(self.rope_factor, self.rope_mscale_all_dim))
    return yarn_get_mscale(self.rope_factor)

  @property
  def attention_scale(self) -> float:
    """The softmax scale: query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5), and for
    latent attention with yarn and rope_mscale_all_dim, times mscale(factor,
    mscale_all_dim) ** 2 (transformers' `yarn_apply_mscale`, DeepSeek only)."""
    scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
    scale = scalar ** -0.5
    if self.uses_mla and self.rope_scaling == "yarn" and self.rope_mscale_all_dim:
      mscale = yarn_get_mscale(self.rope_factor, self.rope_mscale_all_dim)
      scale = scale * mscale * mscale
    return scale

  @property
  def uses_layer_norm(self) -> bool:
    """LayerNorm with a bias (GPT-2) rather than RMSNorm (Llama, Qwen2)."""
    return self.family == "gpt2"

  @property
  def gated_mlp(self) -> bool:
    """SwiGLU-style gate_proj * up_proj (Llama, Qwen2) rather than up_proj alone (GPT-2)."""
    return self.family != "gpt2"

  @property
  def attention_types(self) -> Tuple[str, ...]:
    """'full_attention' / 'sliding_attention' per layer, layer_types resolved."""
    if self.layer_types is not None:
      return self.layer_types
    uniform = "full_attention" if self.sliding_window is None else "sliding_attention"
    return (uniform,) * self.num_layers

  @property
  def moe_layers(self) -> Tuple[bool, ...]:
    """Per layer: a mixture-of-experts MLP (True) or a dense one."""
    if self.family not in MOE_FAMILIES:
      return (False,) * self.num_layers
    return tuple(i >= self.first_k_dense_replace and i not in self.mlp_only_layers and
                 (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_layers))

  @property
  def expert_mlp_dim(self) -> int:
    """Each expert's hidden width (moe_mlp_dim, or mlp_dim when it is None)."""
    return self.mlp_dim if self.moe_mlp_dim is None else self.moe_mlp_dim

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **overrides) -> "DecoderOnlyConfig":
    return replace_config(self, overrides)

  @property
  def num_params(self) -> int:
    """Parameter count, computed from the shapes (no allocation)."""
    e, h, kv, d, m, v = (self.emb_dim, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.mlp_dim, self.vocab_size)
    if self.uses_mla:
      # q (through the LoRA and its norm, or plain), the latent + rope key, its norm, the
      # per-head keys/values from the latent, the output.
      lora, rope = self.q_lora_rank, self.qk_rope_head_dim
      attn = (e * h * d if lora is None else e * lora + lora + lora * h * d +
              (lora if self.qkv_bias else 0))
      attn += e * (self.kv_lora_rank + rope) + self.kv_lora_rank + self.kv_lora_rank * h * (
          self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * e
      if self.qkv_bias:
        attn += self.kv_lora_rank + rope
    else:
      attn = e * h * d + 2 * e * kv * d + h * d * e
      if self.qkv_bias:
        attn += h * d + 2 * kv * d
    if self.out_bias:
      attn += e
    if self.attention_sinks:
      attn += h
    mlp = (3 if self.gated_mlp else 2) * e * m
    if self.mlp_bias:
      mlp += (2 if self.gated_mlp else 1) * m + e
    # A MoE layer: the router [emb, experts] and each expert's gate, up and down (gpt-oss:
    # with biases, and a router bias; DeepSeek-V3: the router's e_score_correction_bias
    # and the shared experts).
    num, width = self.num_experts, self.expert_mlp_dim
    moe = e * num + num * 3 * e * width
    if self.moe_bias:
      moe += num + num * (2 * width + e)
    if self.family == "deepseek_v3":
      moe += num + 3 * e * width * self.n_shared_experts
    if self.qk_norm:
      attn += 2 * d
    norm = 2 * e if self.uses_layer_norm else e  # LayerNorm has a bias.
    norms_per_layer = 4 if self.sandwich_norms else 2
    mlps = sum(moe if sparse else mlp for sparse in self.moe_layers)
    total = v * e + self.num_layers * (attn + norms_per_layer * norm) + mlps + norm
    if not self.uses_rotary:
      total += self.max_positions * e
    if not self.tie_word_embeddings:
      total += e * v
    return total


_LLAMA = dict(family="llama", activation="silu")
_QWEN2 = dict(family="qwen2", activation="silu", qkv_bias=True, norm_epsilon=1e-6,
              rope_theta=1000000.0, bos_id=None, eos_id=151643, pad_id=151643)
# Qwen3: the Qwen/Qwen3-* config.json conventions (no biases, q/k norms, 40k context;
# BOS/EOS of the released post-trained models, <|endoftext|> / <|im_end|>).
_QWEN3 = dict(family="qwen3", activation="silu", norm_epsilon=1e-6, rope_theta=1000000.0,
              max_positions=40960, vocab_size=151936, bos_id=151643, eos_id=151645,
              pad_id=151643, **FAMILY_CONVENTIONS["qwen3"])
_GPT2 = dict(family="gpt2", activation="gelu_new", vocab_size=50257, max_positions=1024,
             qkv_bias=True, out_bias=True, mlp_bias=True, tie_word_embeddings=True,
             bos_id=50256, eos_id=50256, pad_id=50256, norm_epsilon=1e-5)
# Llama 3.1 / 3.2 rotary scaling; rope_factor differs by size (8 for 8B, 32 for 1B).
_LLAMA3_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3",
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_positions=8192, vocab_size=128256, bos_id=128000,
                    eos_id=128001, max_positions=131072)
# Gemma / Mistral conventions shared by every size (hub config.json files).
_GEMMA_COMMON = dict(vocab_size=256000, norm_epsilon=1e-6, tie_word_embeddings=True,
                     rope_theta=10000.0, bos_id=2, eos_id=1, pad_id=0, max_positions=8192)
# Gemma's activation is HF's gelu_pytorch_tanh, the same tanh approximation our
# 'gelu_new' computes.
_GEMMA_COMMON["activation"] = "gelu_new"
_GEMMA1 = dict(_GEMMA_COMMON, family="gemma", **FAMILY_CONVENTIONS["gemma"])
_GEMMA2 = dict(_GEMMA_COMMON, family="gemma2", sliding_window=4096, attn_logit_softcap=50.0,
               final_logit_softcap=30.0, **FAMILY_CONVENTIONS["gemma2"])
_GEMMA3 = dict(_GEMMA_COMMON, family="gemma3", vocab_size=262208, rope_theta=1000000.0,
               sliding_rope_theta=10000.0, sliding_window=1024, max_positions=131072,
               **FAMILY_CONVENTIONS["gemma3"])
_MISTRAL = dict(family="mistral", activation="silu", sliding_window=4096,
                **FAMILY_CONVENTIONS["mistral"])
# Mixtral: mistralai/Mixtral-8x7B-v0.1 config.json (Dec 2023): no window, rope 1M,
# 8 experts, top 2 (renormalised), experts of intermediate_size.
_MIXTRAL = dict(family="mixtral", activation="silu", rope_theta=1000000.0, norm_epsilon=1e-5,
                num_experts=8, num_experts_per_tok=2, **FAMILY_CONVENTIONS["mixtral"])
# Qwen3-MoE: Qwen/Qwen3-30B-A3B config.json (Apr 2025): Qwen3's attention, 128
# experts of 768 units, top 8 renormalised (norm_topk_prob), MoE on every layer.
_QWEN3_MOE = dict(_QWEN3, family="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                  moe_mlp_dim=768, norm_topk_prob=True, **FAMILY_CONVENTIONS["qwen3_moe"])

# DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json (Dec 2024): multi-head latent attention
# (q LoRA 1536, latent 512, 128 + 64 rotary key dims, 128 value dims, interleaved rotary
# pairs), YaRN x40 from 4k (mscale 1 = mscale_all_dim: softmax scale x mscale^2), the first
# 3 layers dense (18432 units), then 256 routed experts of 2048 units (top 8 in the best 4
# of 8 groups, renormalised, x2.5) plus one shared expert. The MTP layer
# (num_nextn_predict_layers) is not part of this config (transformers drops it at load).
_DEEPSEEK_V3 = dict(family="deepseek_v3", activation="silu", norm_epsilon=1e-6,
                    rope_theta=10000.0, rope_scaling="yarn", rope_factor=40.0,
                    rope_original_max_positions=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
                    rope_mscale=1.0, rope_mscale_all_dim=1.0, rope_interleave=True,
                    max_positions=163840, vocab_size=129280, bos_id=0, eos_id=1, pad_id=1,
                    tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
                    moe_mlp_dim=2048, n_shared_experts=1, n_group=8, topk_group=4,
                    routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True,
                    **FAMILY_CONVENTIONS["deepseek_v3"])
# gpt-oss: openai/gpt-oss-20b config.json (Aug 2025): q/k/v/o biases, attention sinks,
# window 128 on every other layer (layer 0 sliding), YaRN x32 from 4k (not truncated),
# experts of intermediate_size with biases and the clamped SwiGLU (limit 7), top 4 of a
# biased router, softmax over the chosen 4.
_GPT_OSS = dict(family="gpt_oss", activation="silu", norm_epsilon=1e-5, rope_theta=150000.0,
                rope_scaling="yarn", rope_factor=32.0, rope_original_max_positions=4096,
                rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False,
                max_positions=131072, vocab_size=201088, qkv_bias=True, out_bias=True,
                swiglu_limit=7.0, swiglu_alpha=1.702, tie_word_embeddings=False,
                bos_id=199998, eos_id=200002, pad_id=199999, sliding_window=128,
                num_experts_per_tok=4, **FAMILY_CONVENTIONS["gpt_oss"])


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's mscale, 0.1 * mscale * log(scale) + 1 (1 when scale <= 1): transformers'
  `yarn_get_mscale`."""
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def sliding_pattern(num_layers: int, every: int) -> Tuple[str, ...]:
  """HF's `sliding_window_pattern`: layer i is full when (i + 1) % every == 0, else sliding.

  Gemma 2 is every=2 (layer 0 sliding), Gemma 3 every=6 (5 sliding : 1 full).
  """
  return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
               for i in range(num_layers))


def _named_configs():
  """{name: DecoderOnlyConfig} of the named shapes: a table (about 90 lines of data), one
  entry per public checkpoint size, grouped by family."""
  configs = {}
  # GPT-2 family: (emb, layers, heads); head_dim 64, mlp 4 * emb.
  for name, (emb, layers, heads) in {"gpt2": (768, 12, 12), "gpt2_medium": (1024, 24, 16),
                                     "gpt2_large": (1280, 36, 20),
                                     "gpt2_xl": (1600, 48, 25)}.items():
    configs[name] = DecoderOnlyConfig(emb_dim=emb, num_layers=layers, num_heads=heads,
                                      num_kv_heads=heads, head_dim=emb // heads,
                                      mlp_dim=4 * emb, **_GPT2)
  # Llama shapes.
  configs["tinyllama_1_1b"] = DecoderOnlyConfig(
      vocab_size=32000, emb_dim=2048, num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64,
      mlp_dim=5632, max_positions=2048, **_LLAMA)
  configs["llama_3_2_1b"] = DecoderOnlyConfig(
      emb_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192,
      tie_word_embeddings=True, rope_factor=32.0, **_LLAMA3_ROPE, **_LLAMA)
  configs["llama_2_7b"] = DecoderOnlyConfig(
      vocab_size=32000, emb_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
      head_dim=128, mlp_dim=11008, max_positions=4096, **_LLAMA)
  configs["llama_3_1_8b"] = DecoderOnlyConfig(
      emb_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
      rope_factor=8.0, **_LLAMA3_ROPE, **_LLAMA)
  # Qwen2 shapes: (emb, layers, heads, kv heads, mlp, vocab, tied).
  for name, (emb, layers, heads, kv, mlp, vocab, tied) in {
      "qwen2_0_5b": (896, 24, 14, 2, 4864, 151936, True),
      "qwen2_1_5b": (1536, 28, 12, 2, 8960, 151936, True),
      "qwen2_7b": (3584, 28, 28, 4, 18944, 152064, False)}.items():
    configs[name] = DecoderOnlyConfig(
        vocab_size=vocab, emb_dim=emb, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=emb // heads, mlp_dim=mlp, max_positions=32768, tie_word_embeddings=tied,
        **_QWEN2)
  # Qwen3: Qwen/Qwen3-{0.6B,1.7B,4B,8B} config.json (Apr 2025 release):
  # (emb, layers, heads, kv heads, mlp, tied); head_dim 128 for all (0.6B: 16 x 128
  # = 2048 query width over a 1024 stream).
  for name, (emb, layers, heads, kv, mlp, tied) in {
      "qwen3_0_6b": (1024, 28, 16, 8, 3072, True),
      "qwen3_1_7b": (2048, 28, 16, 8, 6144, True),
      "qwen3_4b": (2560, 36, 32, 8, 9728, True),
      "qwen3_8b": (4096, 36, 32, 8, 12288, False)}.items():
    configs[name] = DecoderOnlyConfig(
        emb_dim=emb, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=128,
        mlp_dim=mlp, tie_word_embeddings=tied, **_QWEN3)
  # Gemma 1: google/gemma-2b and gemma-7b config.json (Feb 2024 release):
  # (emb, layers, heads, kv heads, mlp); head_dim 256 for both.
  for name, (emb, layers, heads, kv, mlp) in {"gemma_2b": (2048, 18, 8, 1, 16384),
                                              "gemma_7b": (3072, 28, 16, 16, 24576)}.items():
    configs[name] = DecoderOnlyConfig(emb_dim=emb, num_layers=layers, num_heads=heads,
                                      num_kv_heads=kv, head_dim=256, mlp_dim=mlp, **_GEMMA1)
  # Gemma 2: google/gemma-2-{2b,9b,27b} config.json (Jun/Jul 2024 release):
  # (emb, layers, heads, kv heads, head_dim, mlp, query_pre_attn_scalar); 27b
  # scales by (emb / heads) ** -0.5 = 144 ** -0.5, not head_dim 128.
  for name, (emb, layers, heads, kv, hd, mlp, qpas) in {
      "gemma2_2b": (2304, 26, 8, 4, 256, 9216, 256),
      "gemma2_9b": (3584, 42, 16, 8, 256, 14336, 256),
      "gemma2_27b": (4608, 46, 32, 16, 128, 36864, 144)}.items():
    configs[name] = DecoderOnlyConfig(
        emb_dim=emb, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        mlp_dim=mlp, query_pre_attn_scalar=float(qpas),
        layer_types=sliding_pattern(layers, 2), **_GEMMA2)
  # Gemma 3 (text): google/gemma-3-1b-pt config.json and the text_config of
  # google/gemma-3-{4b,12b,27b}-pt (Mar 2025 release): sliding_window_pattern 6,
  # rope_local_base_freq 10k, rope_theta 1M; 1b: window 512, vocab 262144, no
  # rope scaling, 32k context; 4b+: window 1024, linear rope factor 8 on the
  # full layers. (emb, layers, heads, kv, head_dim, mlp, query_pre_attn_scalar).
  configs["gemma3_1b"] = DecoderOnlyConfig(**{
      **_GEMMA3, "vocab_size": 262144, "sliding_window": 512, "max_positions": 32768},
      emb_dim=1152, num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, mlp_dim=6912,
      query_pre_attn_scalar=256.0, layer_types=sliding_pattern(26, 6))
  for name, (emb, layers, heads, kv, hd, mlp, qpas) in {
      "gemma3_4b": (2560, 34, 8, 4, 256, 10240, 256),
      "gemma3_12b": (3840, 48, 16, 8, 256, 15360, 256),
      "gemma3_27b": (5376, 62, 32, 16, 128, 21504, 168)}.items():
    configs[name] = DecoderOnlyConfig(
        emb_dim=emb, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        mlp_dim=mlp, query_pre_attn_scalar=float(qpas), layer_types=sliding_pattern(layers, 6),
        rope_scaling="linear", rope_factor=8.0, **_GEMMA3)
  # Mistral: mistralai/Mistral-7B-v0.1 config.json (Sep 2023): window 4096 on
  # every layer, rope 10k, eps 1e-5, 32k positions.
  configs["mistral_7b"] = DecoderOnlyConfig(
      vocab_size=32000, emb_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
      head_dim=128, mlp_dim=14336, max_positions=32768, norm_epsilon=1e-5, **_MISTRAL)
  # Mixture-of-experts shapes (the public config.json values; `_MIXTRAL`, `_QWEN3_MOE`).
  configs["mixtral_8x7b"] = DecoderOnlyConfig(
      vocab_size=32000, emb_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
      head_dim=128, mlp_dim=14336, max_positions=32768, **_MIXTRAL)
  configs["qwen3_30b_a3b"] = DecoderOnlyConfig(
      emb_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, mlp_dim=6144,
      tie_word_embeddings=False, **_QWEN3_MOE)
  configs["deepseek_v3"] = DecoderOnlyConfig(
      emb_dim=7168, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
      q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
      v_head_dim=128, mlp_dim=18432, **_DEEPSEEK_V3)
  configs["gpt_oss_20b"] = DecoderOnlyConfig(
      emb_dim=2880, num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, mlp_dim=2880,
      num_experts=32, layer_types=sliding_pattern(24, 2), **_GPT_OSS)
  # Test shapes: a small shared vocabulary per family, every layout feature on
  # (GQA, untied head for Llama; biases, tied head for Qwen2; q/k norms and head_dim
  # != emb / heads for Qwen3).
  tiny = dict(vocab_size=97, max_positions=128, bos_id=1, eos_id=2, pad_id=0)
  configs["llama_tiny"] = DecoderOnlyConfig(emb_dim=64, num_layers=2, num_heads=4,
                                            num_kv_heads=2, head_dim=16, mlp_dim=128,
                                            **_LLAMA, **tiny)
  configs["llama_tiny_draft"] = DecoderOnlyConfig(emb_dim=32, num_layers=1, num_heads=2,
                                                  num_kv_heads=1, head_dim=16, mlp_dim=64,
                                                  **_LLAMA, **tiny)
  configs["qwen2_tiny"] = DecoderOnlyConfig(**{**_QWEN2, **tiny}, emb_dim=64, num_layers=2,
                                            num_heads=4, num_kv_heads=2, head_dim=16,
                                            mlp_dim=128, tie_word_embeddings=True)
  configs["qwen3_tiny"] = DecoderOnlyConfig(**{**_QWEN3, **tiny}, emb_dim=64, num_layers=2,
                                            num_heads=4, num_kv_heads=2, head_dim=24,
                                            mlp_dim=128, tie_word_embeddings=True)
  # MoE test shapes: Mixtral with a sliding window; Qwen3-MoE with a dense layer
  # (mlp_only_layers) of another width than its experts'.
  configs["mixtral_tiny"] = DecoderOnlyConfig(**{**_MIXTRAL, **tiny, "num_experts": 4},
                                              emb_dim=64, num_layers=2, num_heads=4,
                                              num_kv_heads=2, head_dim=16, mlp_dim=96,
                                              sliding_window=8)
  configs["qwen3_moe_tiny"] = DecoderOnlyConfig(
      **{**_QWEN3_MOE, **tiny, "num_experts": 8, "num_experts_per_tok": 3, "moe_mlp_dim": 32},
      emb_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24, mlp_dim=128,
      mlp_only_layers=(1,))
  # DeepSeek-V3 with every feature on: a q LoRA, value heads narrower than the keys, one
  # dense layer, 8 experts in 4 groups (the best 2 kept), top 3, a shared expert, YaRN x4.
  configs["deepseek_v3_tiny"] = DecoderOnlyConfig(
      **{**_DEEPSEEK_V3, **tiny, "num_experts": 8, "num_experts_per_tok": 3, "moe_mlp_dim": 16,
         "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "rope_factor": 4.0,
         "rope_original_max_positions": 32},
      emb_dim=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=24, q_lora_rank=32,
      kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, mlp_dim=96)
  # gpt-oss: 4 experts, top 2, a window of 8 on layer 0.
  configs["gpt_oss_tiny"] = DecoderOnlyConfig(
      **{**_GPT_OSS, **tiny, "sliding_window": 8, "num_experts_per_tok": 2},
      emb_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=48,
      num_experts=4, layer_types=sliding_pattern(2, 2))
  configs["gpt2_tiny"] = DecoderOnlyConfig(**{**_GPT2, **tiny}, emb_dim=64, num_layers=2,
                                           num_heads=4, num_kv_heads=4, head_dim=16,
                                           mlp_dim=256)
  configs["gpt2_tiny_draft"] = DecoderOnlyConfig(**{**_GPT2, **tiny}, emb_dim=32, num_layers=1,
                                                 num_heads=2, num_kv_heads=2, head_dim=16,
                                                 mlp_dim=128)
  return configs


DECODER_CONFIGS = _named_configs()


def canonical_name(name: str) -> str:
  """'qwen2-0.5b' -> 'qwen2_0_5b': hyphens and dots spell underscores; the hub's
  'gemma-2-9b' / 'gemma-3-1b' spell gemma2_9b / gemma3_1b."""
  name = name.lower().replace("-", "_").replace(".", "_")
  return re.sub(r"^gemma_([23])_", r"gemma\1_", name)


def get_decoder_config(name: str, **overrides) -> DecoderOnlyConfig:
  """Returns the named decoder-only config with `overrides` applied.

  Raises:
    ValueError: naming the unknown config and listing the known ones.
  """
  key = canonical_name(name)
  if key not in DECODER_CONFIGS:
    raise ValueError(f"Unknown decoder-only config {name!r}. Known configs: "
                     f"{', '.join(sorted(DECODER_CONFIGS))}")
  config = DECODER_CONFIGS[key]
  return config.replace(**overrides) if overrides else config

