"""What `generate` returns, for every model family: `GenerateOutput` and `SpeculativeStats`."""

import dataclasses
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
  """Acceptance statistics of one speculative `generate` call.

  Per-row arrays ([batch]) count over the iterations in which the row was
  still decoding:
    iterations: target calls; drafted: tokens proposed; accepted: drafts that
    reached the output (so emitted tokens = accepted + iterations);
    accepted_raw: drafts the rejection rule accepted (>= accepted when EOS or
    the length limit cut an iteration short);
    position_accepted / position_drafted: [batch, gamma] per-position counts;
    beta_sum / beta_count: sums of sum_x min(p, q) over positions whose prefix
    was all accepted drafts (Corollary 3.6).
  Token trees (`TreeDraft`) count per depth instead of position (gamma is
  the deepest node) and add:
    depth_histogram: [batch, gamma + 1] iterations by accepted depth;
    rank_tried / rank_accepted: [batch, max children] children of each
    sibling rank that verification tried / accepted.
  """
  gamma: int
  iterations: np.ndarray
  drafted: np.ndarray
  accepted: np.ndarray
  accepted_raw: np.ndarray
  position_accepted: np.ndarray
  position_drafted: np.ndarray
  beta_sum: np.ndarray
  beta_count: np.ndarray
  emitted: np.ndarray
  depth_histogram: Optional[np.ndarray] = None
  rank_tried: Optional[np.ndarray] = None
  rank_accepted: Optional[np.ndarray] = None

  @property
  def acceptance_rate(self) -> float:
    """Accepted drafts / drafted tokens (the rule's decisions), all rows."""
    return float(self.accepted_raw.sum() / max(self.drafted.sum(), 1))

  @property
  def row_acceptance_rate(self) -> np.ndarray:
    return self.accepted_raw / np.maximum(self.drafted, 1)

  @property
  def alpha(self) -> float:
    """Estimate of alpha = E[sum_x min(p, q)] (Corollary 3.6), all rows."""
    return float(self.beta_sum.sum() / max(self.beta_count.sum(), 1))

  @property
  def row_alpha(self) -> np.ndarray:
    return self.beta_sum / np.maximum(self.beta_count, 1)

  @property
  def mean_tokens_per_iteration(self) -> float:
    return float(self.emitted.sum() / max(self.iterations.sum(), 1))

  @property
  def row_tokens_per_iteration(self) -> np.ndarray:
    return self.emitted / np.maximum(self.iterations, 1)

  @property
  def per_position_acceptance(self) -> np.ndarray:
    """[gamma]: fraction of drafts at position i that were accepted (vLLM-style)."""
    return self.position_accepted.sum(0) / np.maximum(self.position_drafted.sum(0), 1)

  @property
  def per_rank_acceptance(self) -> Optional[np.ndarray]:
    """Trees: [max children], P(a child of rank r is accepted | ranks < r were rejected)."""
    if self.rank_tried is None:
      return None
    return self.rank_accepted.sum(0) / np.maximum(self.rank_tried.sum(0), 1)

  def summary(self) -> Dict[str, Any]:
    # A tree's `gamma` field is the loop's deepest node (pending tokens included): named
    # max_depth here, as results.json names it; a tree's gamma is its depth (draft calls).
    depth = dict(gamma=self.gamma) if self.depth_histogram is None else dict(
        max_depth=self.gamma)
    out = dict(**depth, iterations=int(self.iterations.sum()),
               drafted=int(self.drafted.sum()), accepted=int(self.accepted.sum()),
               emitted=int(self.emitted.sum()), acceptance_rate=self.acceptance_rate,
               alpha=self.alpha, mean_tokens_per_iteration=self.mean_tokens_per_iteration,
               per_position_acceptance=self.per_position_acceptance.tolist())
    if self.depth_histogram is not None:
      out.update(depth_histogram=self.depth_histogram.sum(0).tolist(),
                 per_rank_acceptance=self.per_rank_acceptance.tolist())
    return out


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """sequences [batch, max_decode_steps] int32 (no BOS, 0 after EOS);
  lengths [batch] int32 (tokens up to and including EOS); stats (speculative only)."""
  sequences: Array
  lengths: Array
  stats: Optional[SpeculativeStats] = None


def sequence_lengths(sequences: Array, eos_id: int) -> Array:
  """Tokens up to and including the first EOS (the full length when none). A numpy array
  in, numpy out: host code counting a varying number of rows compiles nothing."""
  xp = np if isinstance(sequences, np.ndarray) else jnp
  is_eos = sequences == eos_id
  return xp.where(xp.any(is_eos, axis=1), xp.argmax(is_eos, axis=1) + 1,
                  sequences.shape[1]).astype(xp.int32)


def make_output(sequences: Array, stats: Optional[Dict[str, Array]], eos_id: int,
                gamma: int) -> GenerateOutput:
  """A GenerateOutput from a decode program's (sequences [batch, len], counters or None)."""
  lengths = sequence_lengths(sequences, eos_id)
  if stats is None:
    return GenerateOutput(sequences, lengths)
  stats = {k: np.asarray(v) for k, v in stats.items()}
  return GenerateOutput(sequences, lengths, SpeculativeStats(
      gamma=int(gamma), emitted=np.asarray(lengths), **stats))

