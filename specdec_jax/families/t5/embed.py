"""Function-preserving embedding of a trained T5 into a larger T5 shape.

The embedded model computes exactly the function of the small one (up to
float rounding) with the large shape's cost: a trained target's real
acceptance rate meets a real XXL-sized decode step (a cost-realistic
pair). How each part is grown:

* model width emb -> r * emb (r an integer): every residual-stream vector is
  the small one with each dimension repeated r times (`families.widen`). The
  token embedding, norm scales and output kernels (attention `out`, MLP `wo`)
  repeat their emb axis; input kernels (query/key/value, wi, logits) keep the
  small rows on the first copy of each dimension and zeros on the others, so
  x_large . W_large = x_small . W_small with the same products, in any dtype.
  RMS norm is unchanged: the mean of squares of a repeated vector is the
  small one's.
* heads / head_dim: new heads, and new dimensions of old heads, get zero
  query/key/value kernels and zero `out` rows: scores and outputs of the
  small heads are unchanged, new heads add nothing. New position-bias rows
  are zero.
* MLP units: new wi columns and wo rows are zero (act(0) * 0 = 0).
* layers: new encoder and decoder layers come after the trained ones, with
  every kernel zero (so their attention and MLP outputs are zero and the
  residual stream passes through) and unit norm scales.

What cannot be preserved raises `EmbeddingError` naming the field: a
different vocabulary, special ids, relative-position buckets or distance,
norm epsilon, MLP activations, tied logits (their emb**-0.5 rescaling and
the tied embedding do not survive widening: logits would grow by sqrt(r)), a
large shape smaller than the small one in any size, or a width that is not a
multiple.

  large = embed_model(pair.target, "t5_1_1_xxl")   # t5_1_1_xxl sizes, the
                                                   # demo's 2048-token vocabulary
"""

from typing import Any, Dict, Optional, Union

import jax
import jax.numpy as jnp

from specdec_jax.families import widen
from specdec_jax.families.widen import EmbeddingError
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import CONFIGS, T5Config, get_config


# Fields that must be equal for the function to carry over.
_SAME_FIELDS = ("vocab_size", "relative_attention_num_buckets", "relative_attention_max_distance",
                "layer_norm_epsilon", "mlp_activations", "pad_id", "eos_id", "decoder_start_id")
# Sizes the large shape may grow.
_GROWN_FIELDS = ("num_heads", "head_dim", "mlp_dim", "num_encoder_layers", "num_decoder_layers")


def embedded_config(config: T5Config, shape: Union[str, T5Config], dtype: Optional[str] = None
                    ) -> T5Config:
  """The large config: `shape`'s sizes with `config`'s vocabulary and conventions.

  Args:
    config: the small model's config.
    shape: a named config ('t5_1_1_xxl') or a T5Config giving emb_dim,
      num_heads, head_dim, mlp_dim and the layer counts. A named config takes
      the small model's vocabulary, special ids and dtype; a T5Config is used
      as given (and checked).
    dtype: override the result's dtype.
  """
  if isinstance(shape, str):
    if shape not in CONFIGS:
      raise EmbeddingError(f"unknown shape {shape!r}; known: {', '.join(sorted(CONFIGS))}")
    named = get_config(shape)
    if named.relative_attention_num_buckets != config.relative_attention_num_buckets:
      raise EmbeddingError(
          f"relative_attention_num_buckets differ ({config.relative_attention_num_buckets} vs "
          f"{named.relative_attention_num_buckets} in {shape}): position biases cannot carry over")
    large = named.replace(**{f: getattr(config, f) for f in _SAME_FIELDS}, dtype=config.dtype)
  else:
    large = shape
  return widen.checked_config(config, large, dtype, check_embeddable)


def check_embeddable(config: T5Config, large: T5Config) -> int:
  """Raises EmbeddingError naming every problem; returns the width ratio r."""
  problems = widen.layout_problems(config, large, _SAME_FIELDS, _GROWN_FIELDS)
  if config.logits_via_embedding or large.logits_via_embedding:
    problems.append("tied logits (logits_via_embedding): the tied projection and its "
                    "emb_dim**-0.5 rescaling do not survive widening (logits would scale by "
                    "sqrt(r)); only untied (T5 1.1) layouts can be embedded")
  return widen.checked_ratio(config, large, problems)


class _Grower:
  """The growing rules of the module docstring, one method per kind of tensor (T5X trees)."""

  def __init__(self, config: T5Config, large: T5Config):
    self.r = check_embeddable(config, large)
    self.config, self.large = config, large
    self.dtype = jnp.dtype(large.dtype)

  def done(self, x):
    return x.astype(self.dtype)

  def wide(self, x, axis):  # residual-stream axis: repeat each dimension r times
    return widen.repeat(x, axis, self.r)

  def input_kernel(self, kernel, out_size):  # [emb, out] -> [r emb, out_size]
    return self.done(widen.pad(widen.first_copy(kernel, 0, self.r), 1, out_size))

  def _heads(self, kernel, axis):  # the fused heads axis grown to the large heads
    config, large = self.config, self.large
    return widen.pad_heads(kernel, axis, config.num_heads, config.head_dim, large.num_heads,
                           large.head_dim)

  def head_input_kernel(self, kernel):  # [emb, h d] -> [r emb, hl dl]
    return self.done(widen.first_copy(self._heads(kernel, 1), 0, self.r))

  def head_output_kernel(self, kernel):  # [h d, emb] -> [hl dl, r emb]
    return self.done(self.wide(self._heads(kernel, 0), 1))

  def scale(self, tree):
    return {"scale": self.done(self.wide(tree["scale"], 0))}

  def attention(self, tree):
    out = {name: {"kernel": self.head_input_kernel(tree[name]["kernel"])}
           for name in ("query", "key", "value")}
    out["out"] = {"kernel": self.head_output_kernel(tree["out"]["kernel"])}
    return out

  def mlp(self, tree):
    mlp_dim = self.large.mlp_dim
    out = {name: {"kernel": self.input_kernel(k["kernel"], mlp_dim)}
           for name, k in tree.items() if name != "wo"}
    out["wo"] = {"kernel": self.done(self.wide(widen.pad(tree["wo"]["kernel"], 0, mlp_dim), 1))}
    return out

  def layer(self, tree):
    return {name: (self.scale(sub) if name.endswith("layer_norm") else
                   self.mlp(sub) if name == "mlp" else self.attention(sub))
            for name, sub in tree.items()}

  def relpos(self, tree):
    return {"rel_embedding": self.done(widen.pad(tree["rel_embedding"], 0,
                                                 self.large.num_heads))}

  def identity_layer(self, template):
    """A layer shaped like `template` (already large) that adds nothing."""
    dtype = self.dtype
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.ones(x.shape, dtype) if "layer_norm" in jax.tree_util.keystr(path)
                         else jnp.zeros(x.shape, dtype)), template)

  def stack(self, tree, small_layers, large_layers, norm_name):
    out: Dict[str, Any] = {"relpos_bias": self.relpos(tree["relpos_bias"]),
                           norm_name: self.scale(tree[norm_name])}
    for i in range(small_layers):
      out[f"layers_{i}"] = self.layer(tree[f"layers_{i}"])
    for i in range(small_layers, large_layers):
      out[f"layers_{i}"] = self.identity_layer(out[f"layers_{small_layers - 1}"])
    return out


def embed_params(params, config: T5Config, large: T5Config):
  """The large model's T5X parameter tree computing the small model's function.

  Args:
    params: the small model's T5X tree.
    config: its T5Config.
    large: the large T5Config (see `embedded_config`).
  Returns:
    The large tree, arrays in `large.dtype`; built tensor by tensor (each in
    float32, then cast), so peak memory is about the large tree plus its
    largest tensor.
  """
  grow = _Grower(config, large)
  decoder = grow.stack(params["decoder"], config.num_decoder_layers, large.num_decoder_layers,
                       "decoder_norm")
  decoder["logits_dense"] = {"kernel": grow.input_kernel(
      params["decoder"]["logits_dense"]["kernel"], large.vocab_size)}
  return {
      "token_embedder": {"embedding": grow.done(grow.wide(
          params["token_embedder"]["embedding"], 1))},
      "encoder": grow.stack(params["encoder"], config.num_encoder_layers,
                            large.num_encoder_layers, "encoder_norm"),
      "decoder": decoder,
  }


def embed_feature_head_params(head_params, config: T5Config, large: T5Config):
  """A T5 feature head (`families.t5.feature_head`) of the small target, grown to drive the
  embedded target (`embed_params(..., large)`) with the same function.

  The head reads the embedded target's features (the small ones, each
  dimension repeated r times) and embedding; fc's two input halves grow like
  any input kernel and its output like the residual stream, the relative
  position table and the layer like the decoder's own.
  """
  grow = _Grower(config, large)
  emb = config.emb_dim
  fc = jnp.asarray(head_params["fc"]["kernel"], jnp.float32)  # [2 emb, emb]
  halves = [grow.wide(widen.first_copy(fc[i * emb:(i + 1) * emb], 0, grow.r), 1)
            for i in range(2)]
  return {"fc": {"kernel": grow.done(jnp.concatenate(halves, axis=0))},
          "relpos_bias": grow.relpos(head_params["relpos_bias"]),
          "layer": grow.layer(head_params["layer"])}


def embed_model(model: Model, shape: Union[str, T5Config], dtype: Optional[str] = None) -> Model:
  """`model` embedded in a larger shape (see the module docstring); same function, large cost.

  Args:
    model: the trained small `Model` (untied, e.g. T5 1.1 layout).
    shape: a named config ('t5_1_1_base', 't5_1_1_xxl') or a T5Config.
    dtype: the large model's dtype (default: the small model's).
  """
  large = embedded_config(model.config, shape, dtype)
  return Model(large, embed_params(model.params, model.config, large))
