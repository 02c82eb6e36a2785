"""Row sums and softmax whose bits depend on the row alone, not on how many rows there are.

Why: XLA's CPU backend hands a reduction to YNNPACK only when the reduction (or
one of its operands) holds at least 4096 elements (`IsInstructionPreferredByYnn`
in XLA's backends/cpu/ynn_support.cc, jax 0.10.2), and YNNPACK sums in another
order than XLA's own loop. A decode step's norms reduce [batch * block_width,
emb]: the T5 demo pair's (emb 256, block width 8) ran on XLA's loop at batch 1
(2048 elements) and on YNNPACK from batch 2 (4096), so the same row's 1/rms
differed in its last float32 bit, which bfloat16 projections can round into a
different bf16 value; greedy outputs then left `generate` alone on 2 of the
pair's 300 held-out inputs under `generate_many` (batch_size 4), the decoder-only
pair's on 1 of 128 (its LayerNorms, emb 192, reach 4096 at batch 3).

Here a sum is a tree of elementwise adds (halves added pairwise, an odd last
element added to the first), with no reduce instruction for any library to take:
IEEE addition of two numbers has one answer, so every row's sum is the same bits
at every batch size, on every backend. The tree also rounds less than a
sequential sum (error O(log n), not O(n)).
"""

import jax
import jax.numpy as jnp

Array = jax.Array


def _tree(x: Array, op) -> Array:
  """[..., n] -> [..., 1]: `op` over the last axis as a tree of elementwise ops."""
  while x.shape[-1] > 1:
    n = x.shape[-1]
    half = n // 2
    pairs = op(x[..., :half], x[..., half:2 * half])
    if n % 2:
      pairs = jnp.concatenate([op(pairs[..., :1], x[..., 2 * half:]), pairs[..., 1:]], axis=-1)
    x = pairs
  return x


def row_sum(x: Array) -> Array:
  """[..., n] -> [..., 1] float32: the sum over the last axis, pairwise, batch-invariant."""
  return _tree(x.astype(jnp.float32), jnp.add)


def row_max(x: Array) -> Array:
  """[..., n] -> [..., 1]: the maximum over the last axis, a tree (exact in any order)."""
  return _tree(x, jnp.maximum)


def row_mean(x: Array) -> Array:
  """[..., n] -> [..., 1] float32: `row_sum` / n."""
  return row_sum(x) / x.shape[-1]


def softmax(scores: Array, axis: int = -1) -> Array:
  """Softmax of scores along `axis` in float32 (same shape), max and sum both trees.

  A maximum is exact in any order, but a library's reduction would also compute
  the elementwise ops fused into it (a softcap's tanh, say) with its own kernels:
  as a tree, every op stays in XLA's own loop at every batch size.
  """
  scores = jnp.moveaxis(scores.astype(jnp.float32), axis, -1)
  exp = jnp.exp(scores - jax.lax.stop_gradient(row_max(scores)))
  return jnp.moveaxis(exp / row_sum(exp), -1, axis)
