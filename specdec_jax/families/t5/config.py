"""T5 size configurations as data.

Every field that determines a parameter shape lives in `T5Config`; named
configs are plain instances of it. `get_config(name, **overrides)` is the one
way to look a name up, so an unknown name always fails the same way.
"""

import dataclasses
from typing import Tuple

from specdec_jax.core.dtypes import canonical_dtype
from specdec_jax.families.base import replace_config
from specdec_jax.families.kernel_layout import check_layout

# T5's SentencePiece vocabulary (cc_all.32000) plus 100 extra ids, padded to a
# multiple of 128 as T5X does.
T5_VOCAB_SIZE = 32128


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Shapes and conventions of a T5 encoder-decoder.

  Attributes:
    vocab_size: rows of the token embedding (and columns of the logits).
    emb_dim: width of the residual stream.
    num_heads: attention heads in every attention block.
    head_dim: width of one head; num_heads * head_dim need not equal emb_dim.
    mlp_dim: hidden width of the feed-forward block.
    num_encoder_layers / num_decoder_layers: depth of each stack.
    mlp_activations: ('gelu', 'linear') is T5 1.1's gated GELU (kernels wi_0,
      wi_1); ('relu',) is original T5 (kernel wi).
    logits_via_embedding: original T5 ties the output projection to the token
      embedding and scales the decoder output by emb_dim**-0.5 first.
    dtype: compute dtype, and the dtype weights are stored in after loading:
      'float32', 'bfloat16' or 'float16', spelled any way `dtypes.canonical_dtype`
      accepts (jnp.bfloat16, 'bf16', ...).
    relative_attention_num_buckets / relative_attention_max_distance: T5's
      bucketed relative position bias.
    layer_norm_epsilon: RMS norm epsilon.
    pad_id / eos_id / decoder_start_id: token conventions (T5: 0, 1, 0).
    kernel_layout: 'in_out' (T5X's [in, out] kernels) or 'out_in' ([out, in], the faster
      dot on XLA's CPU backend; `families.kernel_layout`). The function is the same.
  """
  vocab_size: int = T5_VOCAB_SIZE
  emb_dim: int = 512
  num_heads: int = 6
  head_dim: int = 64
  mlp_dim: int = 1024
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  mlp_activations: Tuple[str, ...] = ("gelu", "linear")
  logits_via_embedding: bool = False
  dtype: str = "float32"
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  pad_id: int = 0
  eos_id: int = 1
  decoder_start_id: int = 0
  kernel_layout: str = "in_out"

  def __post_init__(self):
    check_layout(self.kernel_layout)
    for field in ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim",
                  "num_encoder_layers", "num_decoder_layers",
                  "relative_attention_num_buckets"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"T5Config.{field} must be a positive int, got {value!r}")
    if isinstance(self.mlp_activations, list):
      object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    known = {"relu", "gelu", "linear", "silu", "gelu_new"}
    bad = [a for a in self.mlp_activations if a not in known]
    if not self.mlp_activations or bad:
      raise ValueError(f"T5Config.mlp_activations {self.mlp_activations!r}: "
                       f"each must be one of {sorted(known)}")
    # Stored by its canonical name, so configs spelled jnp.bfloat16 or 'bf16'
    # hash and compare equal (they key compiled-program caches).
    object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "T5Config.dtype"))
    if self.relative_attention_num_buckets < 4:
      raise ValueError("relative_attention_num_buckets must be >= 4")

  def replace(self, **overrides) -> "T5Config":
    return replace_config(self, overrides)

  @property
  def num_params(self) -> int:
    """Parameter count, computed from the shapes (no allocation)."""
    e, h, d, m, v = self.emb_dim, self.num_heads, self.head_dim, self.mlp_dim, self.vocab_size
    attn = 4 * e * h * d
    mlp = (len(self.mlp_activations) + 1) * e * m
    enc_layer = attn + mlp + 2 * e
    dec_layer = 2 * attn + mlp + 3 * e
    total = v * e + 2 * h * self.relative_attention_num_buckets
    total += self.num_encoder_layers * enc_layer + e
    total += self.num_decoder_layers * dec_layer + e
    if not self.logits_via_embedding:
      total += e * v
    return total


_GATED = dict(mlp_activations=("gelu", "linear"), logits_via_embedding=False)
_RELU = dict(mlp_activations=("relu",), logits_via_embedding=True)

# (emb, heads, layers, mlp) from T5X's t5_1_1 gin files.
_T5_1_1_SHAPES = {
    "small": (512, 6, 8, 1024),
    "base": (768, 12, 12, 2048),
    "large": (1024, 16, 24, 2816),
    "xl": (2048, 32, 24, 5120),
    "xxl": (4096, 64, 24, 10240),
}
# Original T5 (1.0): (emb, heads, head_dim, layers, mlp); 3B and 11B use
# 128-wide heads.
_T5_SHAPES = {
    "small": (512, 8, 64, 6, 2048),
    "base": (768, 12, 64, 12, 3072),
    "large": (1024, 16, 64, 24, 4096),
    "3b": (1024, 32, 128, 24, 16384),
    "11b": (1024, 128, 128, 24, 65536),
}


def _named_configs():
  configs = {}
  for size, (emb, heads, layers, mlp) in _T5_1_1_SHAPES.items():
    shape = dict(emb_dim=emb, num_heads=heads, head_dim=64, mlp_dim=mlp,
                 num_encoder_layers=layers, num_decoder_layers=layers)
    configs[f"t5_1_1_{size}"] = T5Config(**shape, **_GATED)
    configs[f"flan_t5_{size}"] = T5Config(**shape, **_GATED)
  for size, (emb, heads, head_dim, layers, mlp) in _T5_SHAPES.items():
    configs[f"t5_{size}"] = T5Config(emb_dim=emb, num_heads=heads, head_dim=head_dim, mlp_dim=mlp,
                                     num_encoder_layers=layers, num_decoder_layers=layers,
                                     **_RELU)
  # Test and demo models: T5 1.1 conventions, a small shared vocabulary so the
  # pair can be trained and decoded on a laptop CPU.
  configs["tiny"] = T5Config(vocab_size=512, emb_dim=64, num_heads=4, head_dim=16, mlp_dim=128,
                             num_encoder_layers=2, num_decoder_layers=2, **_GATED)
  configs["tiny_draft"] = T5Config(vocab_size=512, emb_dim=32, num_heads=2, head_dim=16,
                                   mlp_dim=64, num_encoder_layers=1, num_decoder_layers=1,
                                   **_GATED)
  return configs


CONFIGS = _named_configs()


def get_config(name: str, **overrides) -> T5Config:
  """Returns the named config with `overrides` applied.

  Raises:
    ValueError: naming the unknown config and listing the known ones.
  """
  if name not in CONFIGS:
    raise ValueError(f"Unknown model config {name!r}. Known configs: {', '.join(sorted(CONFIGS))}")
  return CONFIGS[name].replace(**overrides) if overrides else CONFIGS[name]
