"""Per-row counters of the speculative loops, one type for chains and trees.

Both loops (`decoding.speculative_sample`, `tree_decoding.tree_sample`) carry
a `LoopCounters` through their `lax.while_loop` and add one iteration's
numbers with `add`; `outputs.make_output` turns the final counters into
`SpeculativeStats`. Depth means the draft position in a chain and the node
depth in a tree.
"""

from typing import Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


class LoopCounters(NamedTuple):
  """Counts over the iterations in which each row was still decoding.

  iterations / drafted / accepted / accepted_raw: [batch] int32: target
    calls, drafted tokens (tree nodes), drafts that reached the output
    (emitted = accepted + iterations), drafts the rule accepted.
  position_accepted / position_drafted: [batch, depth] int32, per depth.
  beta_sum [batch] float32 / beta_count [batch] int32: sum_x min(p, q) over
    positions whose prefix was all accepted drafts (Corollary 3.6).
  depth_histogram [batch, depth + 1], rank_tried / rank_accepted [batch,
    max_children]: trees only (None in a chain).
  """
  iterations: Array
  drafted: Array
  accepted: Array
  accepted_raw: Array
  position_accepted: Array
  position_drafted: Array
  beta_sum: Array
  beta_count: Array
  depth_histogram: Optional[Array] = None
  rank_tried: Optional[Array] = None
  rank_accepted: Optional[Array] = None

  @classmethod
  def zeros(cls, batch: int, depth: int, max_children: Optional[int] = None) -> "LoopCounters":
    """Counters at zero; with max_children, the tree counters too."""
    rows = jnp.zeros((batch,), jnp.int32)
    per_depth = jnp.zeros((batch, depth), jnp.int32)
    tree = {}
    if max_children is not None:
      tree = dict(depth_histogram=jnp.zeros((batch, depth + 1), jnp.int32),
                  rank_tried=jnp.zeros((batch, max_children), jnp.int32),
                  rank_accepted=jnp.zeros((batch, max_children), jnp.int32))
    return cls(rows, rows, rows, rows, per_depth, per_depth,
               jnp.zeros((batch,), jnp.float32), rows, **tree)

  def add(self, active: Array, *, drafted: Array, emitted: Array, accepted_raw: Array,
          position_accepted: Array, position_drafted: Array, beta: Array, scored: Array,
          depth_histogram: Optional[Array] = None, rank_tried: Optional[Array] = None,
          rank_accepted: Optional[Array] = None) -> "LoopCounters":
    """One iteration's numbers added for the rows still decoding.

    active: [batch] bool; drafted / emitted / accepted_raw: [batch] int32
    (emitted: tokens written this iteration, drafts and the new token);
    position_*: [batch, depth] int32 or bool, already zero where inactive
    when the caller masks them; beta [batch, depth] float32 with scored
    [batch, depth] bool saying which positions count; tree counters [batch,
    ...] int32, masked here.
    """
    rows = active.astype(jnp.int32)
    out = LoopCounters(
        iterations=self.iterations + active,
        drafted=self.drafted + jnp.where(active, drafted, 0),
        accepted=self.accepted + jnp.maximum(emitted - 1, 0),
        accepted_raw=self.accepted_raw + jnp.where(active, accepted_raw, 0),
        position_accepted=self.position_accepted + position_accepted,
        position_drafted=self.position_drafted + position_drafted,
        beta_sum=self.beta_sum + jnp.sum(jnp.where(scored, beta, 0.0), axis=1),
        beta_count=self.beta_count + jnp.sum(scored, axis=1))
    if depth_histogram is None:
      return out
    return out._replace(
        depth_histogram=self.depth_histogram + depth_histogram * rows[:, None],
        rank_tried=self.rank_tried + rank_tried * rows[:, None],
        rank_accepted=self.rank_accepted + rank_accepted * rows[:, None])

  def as_dict(self) -> Dict[str, Array]:
    """{name: array} of the counters this loop keeps (a chain has no tree counters)."""
    return {k: v for k, v in self._asdict().items() if v is not None}
