"""Adaptive draft length between iterations (HF's `heuristic` schedule).

Each row keeps its own draft length k: if every token it drafted last
iteration was accepted, k grows by `increase` (default 2), otherwise it
shrinks by `decrease` (default 1), within [1, gamma] where gamma (the
`generate` argument) is the static maximum. The wrapper infers last
iteration's acceptance from how far the row's length advanced since its last
proposal (accepted = advance - 1), so it needs nothing from the decode loop.

Exactness: k is a function of the history before this iteration, not of the
target's distributions in it, and speculative decoding is exact for any
draft length fixed before the target is consulted.

The within-iteration counterpart, stopping when the draft is unsure, is
`ModelDraft(model, confidence_threshold=...)`; the two combine.
"""

from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp

from specdec_jax.drafts.base import Draft

Array = jax.Array


def heuristic_draft_length(previous: Array, all_accepted: Array, gamma_max: int,
                           increase: int = 2, decrease: int = 1) -> Array:
  """Next draft lengths [batch] int32 from previous [batch] and all_accepted [batch] bool."""
  grown = jnp.where(all_accepted, previous + increase, previous - decrease)
  return jnp.clip(grown, 1, gamma_max).astype(jnp.int32)


class AdaptiveGammaDraft(Draft):
  """Wraps any draft with the per-row `heuristic` draft-length schedule.

  Args:
    draft: the `Draft` (or `Model`) that proposes; it must honour the
      `max_drafted` argument of its proposer (all drafts here do).
    initial_gamma: first iteration's draft length (default: gamma, the
      maximum given to `generate`).
    increase / decrease: steps of the schedule (HF: 2 and 1).
  """

  def __init__(self, draft, initial_gamma: Optional[int] = None, increase: int = 2,
               decrease: int = 1):
    from specdec_jax.drafts import as_draft  # The package imports this module.
    if initial_gamma is not None and (int(initial_gamma) != initial_gamma or initial_gamma < 1):
      raise ValueError(f"initial_gamma must be an int >= 1, got {initial_gamma!r}")
    for name, value in (("increase", increase), ("decrease", decrease)):
      if int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    from specdec_jax.drafts.tree_draft import TreeDraft  # tree.py imports the package too
    self.draft = as_draft(draft)
    if isinstance(self.draft, TreeDraft):
      raise TypeError("AdaptiveGammaDraft varies a chain's length; a TreeDraft's shape is its "
                      "own (use DynamicTreeDraft for a tree that adapts)")
    # What the wrapped draft reads, it reads through the wrapper.
    self.reads = self.draft.reads
    self.initial_gamma = None if initial_gamma is None else int(initial_gamma)
    self.increase = int(increase)
    self.decrease = int(decrease)
    self.vocab_size = self.draft.vocab_size
    self.eos_id = self.draft.eos_id
    self.pad_id = self.draft.pad_id

  @property
  def params(self) -> Any:
    return self.draft.params

  def static_key(self) -> Hashable:
    return ("adaptive_gamma", self.draft.compile_key(), self.initial_gamma, self.increase,
            self.decrease)

  def check_compatible(self, target_config) -> None:
    self.draft.check_compatible(target_config)

  def check_inputs(self, tokens, lengths, max_decode_steps):
    self.draft.check_inputs(tokens, lengths, max_decode_steps)

  def param_shardings(self, partitioner):
    return self.draft.param_shardings(partitioner)

  def constrain_state(self, state, partitioner):
    return dict(state, draft=self.draft.constrain_state(state["draft"], partitioner))

  def init_state(self, params, start):
    batch = start.context.tokens.shape[0]
    return dict(draft=self.draft.init_state(params, start),
                # -1: no proposal yet.
                last_lengths=jnp.full((batch,), -1, jnp.int32),
                last_drafted=jnp.zeros((batch,), jnp.int32),
                draft_length=jnp.zeros((batch,), jnp.int32))

  def calls_per_proposal(self, gamma: int) -> int:
    return self.draft.calls_per_proposal(gamma)

  @property
  def max_gamma(self):
    return self.draft.max_gamma

  def proposer(self, params, plan):
    inner = self.draft.proposer(params, plan)
    gamma = plan.gamma
    initial = min(gamma if self.initial_gamma is None else self.initial_gamma, gamma)

    def propose(rng, state, sequences, lengths, max_drafted=None, **target):
      accepted = lengths - state["last_lengths"] - 1
      draft_length = jnp.where(
          state["last_lengths"] < 0, initial,
          heuristic_draft_length(state["draft_length"], accepted >= state["last_drafted"], gamma,
                                 self.increase, self.decrease))
      if max_drafted is not None:
        draft_length = jnp.minimum(draft_length, max_drafted)
      tokens, probs, num_drafted, inner_state = inner.propose(
          rng, state["draft"], sequences, lengths, max_drafted=draft_length, **target)
      num_drafted = jnp.minimum(num_drafted, draft_length)
      state = dict(draft=inner_state, last_lengths=lengths, last_drafted=num_drafted,
                   draft_length=draft_length)
      return tokens, probs, num_drafted, state

    return inner._replace(propose=propose, observe=self.observer(params))

  def observer(self, params):
    inner = self.draft.observer(params)
    if inner is None:
      return None

    def observe(state, features, tokens, count):
      return dict(state, draft=inner(state["draft"], features, tokens, count))

    return observe
