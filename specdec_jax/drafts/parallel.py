"""Parallel drafters: a whole block of drafts, and their laws, from one call.

A parallel drafter computes, in one forward, K laws q_1..q_K over the next K
positions after a row's accepted tokens (Medusa heads on one hidden state,
PARD's context plus mask tokens, DFlash's block of masks over the target's
features). The engine then needs nothing new:

    law i      q_i = the sampling adjustment of logits_i (the target's
               temperature, top-k, top-p: q and p adjusted alike)
    draft i    x_i ~ q_i, with a key of its own (the argmax at temperature 0;
               sampled, never forced greedy, at temperature > 0)
    verified   by the chain rule (token-wise or block) or, in a tree, by the
               recursive rule, against exactly the q_i x_i was drawn from

Exactness holds because each x_i is drawn from the very q_i that verification
reads, and q_i is a function of accepted tokens (and the target's features at
accepted positions) only: it may ignore x_1..x_{i-1} (the drafts are then
conditionally independent given the context), which lowers acceptance but
never changes the output law (REFERENCE section 8).

Trees (`sj.TreeDraft(parallel_draft, branching)`): the laws after the tree's
root come from one call too. A node at depth d (the root's children at d = 1)
draws its children from q_{d+1}, whatever its parent (Medusa's and DFlash's
top-k-per-position trees): the law a child was drawn from is q_{d+1}, so the
recursive rule stays exact. The root is the chain's end, greedy pending tokens
included (they are accepted tokens: `block_laws` sees them as context).

A subclass defines `num_positions` (K) and `block_laws`; this class gives it
the chain proposer, the tree expander and `calls_per_proposal` = 1.
"""

import abc
from typing import Any, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling
from specdec_jax.core.sampling import Sampling
from specdec_jax.drafts.base import Draft, ProposalPlan, chain_proposer

Array = jax.Array


def with_chain(sequences: Array, lengths: Array, chain: Array,
               chain_len: Array) -> Tuple[Array, Array]:
  """The rows with a tree's greedy pending tokens appended as accepted context.

  sequences [batch, len + 1] (row b's last token at lengths[b]), chain [batch, P],
  chain_len [batch] -> (sequences [batch, len + 1 + P] with chain[b, :chain_len[b]] at
  lengths[b] + 1.., lengths + chain_len).
  """
  batch, width = sequences.shape
  pending = chain.shape[1]
  if pending == 0:
    return sequences, lengths
  out = jnp.concatenate([sequences, jnp.zeros((batch, pending), sequences.dtype)], axis=1)
  rows = jnp.arange(batch)[:, None]
  slots = jnp.arange(pending)[None]
  at = jnp.where(slots < chain_len[:, None], lengths[:, None] + 1 + slots, width + pending)
  out = out.at[rows, at].set(chain.astype(out.dtype), mode="drop")
  return out, lengths + chain_len


class ParallelDrafter(Draft):
  """Base class of drafts that give K laws from one call (`block_laws`).

  Subclasses define `num_positions`, `block_laws` and the `Draft` basics
  (`params`, `static_key`, `init_state`, vocab_size / eos_id / pad_id); they
  may override `observer` (drafts that learn the target's features at accepted
  positions) and `real_window` (how many of a row's last tokens one call may
  need to read, for drafts with a cache of their own).
  """

  @property
  @abc.abstractmethod
  def num_positions(self) -> int:
    """K: the most laws one call gives (the longest chain, the deepest tree)."""

  @abc.abstractmethod
  def block_laws(self, params: Any, state: Any, sequences: Array, lengths: Array,
                 num: int, window: int) -> Tuple[Array, Array, Any]:
    """The laws after each row's last token, from one call (traced).

    Args:
      params, state: the draft's params and loop state.
      sequences: [batch, len + 1] int32 accepted tokens in loop positions, row b's
        last token at lengths[b].
      lengths: [batch] int32.
      num: K' <= num_positions, laws wanted (static).
      window: the most tokens a row may have gained since the previous call, the
        new token included (static: the target's block width; a draft with a
        cache re-reads at most this many of a row's last tokens).
    Returns:
      (logits [batch, num, vocab] float32: logits i is x_{i+1}'s before the sampling
      adjustment; ready [batch] bool: rows that can draft now (False: this call
      drafts nothing for the row, a plain target step); the new state).
    """

  @property
  def max_gamma(self) -> int:
    return self.num_positions

  @property
  def max_tree_depth(self) -> int:
    return self.num_positions

  def calls_per_proposal(self, gamma: int) -> int:
    return 1

  def check_gamma(self, gamma: int) -> None:
    """Raises ValueError when one call cannot give gamma laws."""
    if gamma > self.num_positions:
      raise ValueError(f"gamma={gamma} asks one call of this {type(self).__name__} for "
                       f"{gamma} laws; it gives at most {self.num_positions} "
                       f"(gamma <= {self.num_positions}, or build it for more positions)")

  # -- chains -------------------------------------------------------------------

  def proposer(self, params, plan: ProposalPlan):
    gamma, settings = plan.gamma, plan.sampling
    self.check_gamma(gamma)

    def propose(rng, state, sequences, lengths, max_drafted=None):
      batch = sequences.shape[0]
      logits, ready, state = self.block_laws(params, state, sequences, lengths, gamma,
                                             plan.block_width)
      probs = settings.probs(logits)  # [batch, gamma, vocab]
      keys = sampling.split_keys(rng, gamma)
      tokens = jnp.stack([settings.draw(keys[i], probs[:, i]) for i in range(gamma)],
                         axis=1).astype(jnp.int32)
      limit = (jnp.full((batch,), gamma, jnp.int32) if max_drafted is None else
               jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
      num_drafted = jnp.where(ready, limit, 0)
      keep = jnp.arange(gamma)[None] < num_drafted[:, None]
      return (jnp.where(keep, tokens, 0), jnp.where(keep[..., None], probs, 0.0), num_drafted,
              state)

    return chain_proposer(propose, plan, observe=self.observer(params))

  # -- trees --------------------------------------------------------------------

  def tree_expander(self, params, sampling: Sampling, block_width: int = None):
    """Trees from per-position laws (`drafts.tree_draft.TreeExpander`): `start` computes
    q_1..q_K after the chain's end in one call and keeps them in the state; a node at
    depth d gets q_{d+1} for its children, whatever its parent. Before the draft is
    ready (`block_laws`' ready false) the laws are uniform, which is still the law the
    children are drawn from. `block_width` bounds what a row gains per iteration
    (`block_laws`' window; None: the deepest tree plus one)."""
    from specdec_jax.drafts.tree_draft import TreeExpander  # tree_draft imports drafts
    k, vocab = self.num_positions, self.vocab_size
    window = k + 1 if block_width is None else int(block_width)

    def init(state, batch, slots):
      del slots
      return dict(state, tree_scores=jnp.zeros((batch, k, vocab), jnp.float32),
                  tree_probs=jnp.zeros((batch, k, vocab), jnp.float32))

    def law_at(table, depth):  # table [batch, K, vocab], depth [batch, n]: law depth + 1
      return jnp.take_along_axis(table, jnp.clip(depth, 0, k - 1)[:, :, None], axis=1)

    def start(state, sequences, lengths, chain, chain_len):
      sequences, lengths = with_chain(sequences, lengths, chain, chain_len)
      logits, ready, state = self.block_laws(params, state, sequences, lengths, k,
                                             window + chain.shape[1])
      ready = ready[:, None, None]
      scores = jnp.where(ready, jax.nn.log_softmax(logits, axis=-1), -jnp.log(vocab))
      probs = jnp.where(ready, sampling.probs(logits), 1.0 / vocab)
      return scores[:, 0], probs[:, 0], dict(state, tree_scores=scores, tree_probs=probs)

    def expand(state, lengths, chain_len, tokens, attention, block_offset):
      del lengths, chain_len, tokens, block_offset
      return (law_at(state["tree_scores"], attention.depths),
              law_at(state["tree_probs"], attention.depths), state)

    def move(state, lengths, sources):
      return state

    return TreeExpander(start, expand, move, init)

  def tree_expander_for(self, params, plan: ProposalPlan):
    return self.tree_expander(params, plan.sampling, plan.block_width)
