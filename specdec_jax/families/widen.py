"""Growing rules shared by the families' function-preserving embeddings.

A trained model of width emb is embedded in a width r * emb by repeating each
residual-stream dimension r times (dimension d of the small stream is
dimensions d*r .. d*r + r - 1 of the large one). Norms see the same
statistics (the mean and the mean of squares of a repeated vector are the
small one's), so every residual vector of the large model is the small one,
repeated. A kernel that *reads* the stream keeps the small rows on the first
copy of each dimension and zeros on the others (`first_copy`): the large dot
product adds exactly the small products, plus zeros, in any dtype and for any
r (no division by r, whose rounding would differ from the small model's in
bfloat16). A kernel that *writes* the stream repeats its output axis
(`repeat`). New units (heads, MLP columns, head dimensions) are zero (`pad`).

The large model reads every weight, zeros included: the cost of a step is the
large shape's, the function the small one's.
"""

from typing import List, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


class EmbeddingError(ValueError):
  """The small model's layout cannot be embedded function-preservingly in that shape."""


def layout_problems(config, large, same_fields, grown_fields) -> List[str]:
  """What stops `config` (small) from being embedded in `large`: fields that must match,
  sizes that shrink, a width that is not a multiple. Both configs have `emb_dim`."""
  problems = [f"{f} differs ({getattr(config, f)!r} vs {getattr(large, f)!r})"
              for f in same_fields if getattr(config, f) != getattr(large, f)]
  problems += [f"{f} shrinks ({getattr(config, f)} -> {getattr(large, f)})"
               for f in grown_fields if getattr(large, f) < getattr(config, f)]
  if large.emb_dim % config.emb_dim:
    problems.append(f"emb_dim {large.emb_dim} is not a multiple of {config.emb_dim}")
  return problems


def checked_ratio(config, large, problems: List[str]) -> int:
  """Raises EmbeddingError naming every problem; else the width ratio r."""
  if problems:
    raise EmbeddingError("cannot embed this model function-preservingly: " + "; ".join(problems))
  return large.emb_dim // config.emb_dim


def checked_config(config, large, dtype: Optional[str], check):
  """`large` in `dtype` (None: as it is), after `check(config, large)` (raises)."""
  large = large if dtype is None else large.replace(dtype=dtype)
  check(config, large)
  return large


def repeat(x, axis: int, r: int) -> Array:
  """x with each index of `axis` repeated r times (a residual-stream axis), float32."""
  return jnp.repeat(jnp.asarray(x, jnp.float32), r, axis=axis)


def first_copy(x, axis: int, r: int) -> Array:
  """x's `axis` grown r-fold: index d's values at d*r, zeros at d*r + 1 .. d*r + r - 1.

  For a kernel reading a repeated stream: repeat(h) . first_copy(W) = h . W, the same
  products in any dtype.
  """
  x = jnp.asarray(x, jnp.float32)
  axis = axis % x.ndim
  grown = jnp.stack([x] + [jnp.zeros_like(x)] * (r - 1), axis=axis + 1)
  return grown.reshape(x.shape[:axis] + (x.shape[axis] * r,) + x.shape[axis + 1:])


def pad(x, axis: int, size: int) -> Array:
  """x zero-padded along `axis` to `size` (new units that add nothing), float32."""
  x = jnp.asarray(x, jnp.float32)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def pad_heads(x, axis: int, heads: int, head_dim: int, new_heads: int, new_head_dim: int
              ) -> Array:
  """A fused [.. heads * head_dim ..] axis grown to new_heads * new_head_dim: new heads and
  new dimensions of old heads are zero."""
  x = jnp.asarray(x, jnp.float32)
  axis = axis % x.ndim
  split = x.reshape(x.shape[:axis] + (heads, head_dim) + x.shape[axis + 1:])
  split = pad(pad(split, axis, new_heads), axis + 1, new_head_dim)
  return split.reshape(x.shape[:axis] + (new_heads * new_head_dim,) + x.shape[axis + 1:])


def medusa_params(params, r: int):
  """Medusa heads (`drafts.medusa`: kernel [layers, K, h, h], bias [layers, K, h], lm_head
  [K, h, vocab]) grown to read and write a stream repeated r times: the same drafts."""
  out = dict(kernel=repeat(first_copy(params["kernel"], 2, r), 3, r),
             bias=repeat(params["bias"], 2, r))
  if "lm_head" in params:
    out["lm_head"] = first_copy(params["lm_head"], 1, r)
  return out
