"""The target drafts for itself from a budgeted view of its own cache (MagicDec, TriForce).

At long context a decode step's cost is reading the KV cache. A draft that is the target
itself, reading `budget` positions of the cache instead of all of them, costs about
budget / context of a target step in attention, needs no second model and no training,
and keeps α high because it *is* the target on the positions that matter. Each proposal:

1. choose `budget` cache positions before the row's last token (`policy`):
   * "window" (StreamingLLM, MagicDec): the first `sinks` positions (attention sinks) and
     the most recent budget - sinks;
   * "retrieval" (TriForce): chunks of `chunk` positions: the first chunk (the sinks), the
     most recent chunk, and the budget // chunk - 2 chunks whose mean keys best match the
     last written key (every layer's, one dot product per chunk), chosen on device by
     `lax.top_k`;
2. copy those positions of every layer into a compact cache with room for gamma tokens
   (the family's `SparseView.gather`; the target's cache is read, never written);
3. draft gamma tokens one at a time with the target's own weights over the compact
   cache (`SparseView.step`): true positions, the target's masks and windows.

Exactness: the proposals are drawn from the laws q this draft computed, and every
verification rule (token-wise, block) keeps the target's distribution for any q; the
draft reads only accepted positions of the target's cache (`Reads(cache=True)`: the loop
hands it the cache after verification). A context shorter than the budget is read whole:
the draft then is the target (greedy α = 1, up to rounding), at the budget's cost.
"""

from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling as core_sampling
from specdec_jax.drafts.base import Draft, Reads, chain_proposer
from specdec_jax.families.registry import family_of

Array = jax.Array

POLICIES = ("window", "retrieval")


def _int_at_least(name: str, value, low: int) -> int:
  if isinstance(value, bool) or int(value) != value or value < low:
    raise ValueError(f"SparseCacheDraft {name} must be an int >= {low}, got {value!r}")
  return int(value)


def window_positions(last: Array, budget: int, sinks: int):
  """(index [batch, budget] int32, valid [batch, budget] bool): positions 0..sinks-1 and
  the budget - sinks before `last` [batch] (the row's last token's position; every
  position < last is in the cache); a position counted twice or < 0 is invalid."""
  recent = last[:, None] - (budget - sinks) + jnp.arange(budget - sinks)[None]
  head = jnp.broadcast_to(jnp.arange(sinks)[None], (last.shape[0], sinks))
  index = jnp.concatenate([head, recent], axis=1).astype(jnp.int32)
  valid = jnp.concatenate([head < last[:, None], recent >= sinks], axis=1)
  return index, valid


def retrieval_positions(view, cache, last: Array, budget: int, chunk: int):
  """(index [batch, budget'] int32, valid [batch, budget'] bool), budget' = budget // chunk
  * chunk: chunk 0, the most recent `chunk` positions, and the best-matching whole chunks
  before them (module docstring); a chunk that is not wholly before the recent window
  is invalid (a short context reads the rest through the other two)."""
  picks = budget // chunk - 2
  recent = last[:, None] - chunk + jnp.arange(chunk)[None]
  # Chunk 0's positions from last - chunk on are the recent window's (counted there).
  parts = [jnp.broadcast_to(jnp.arange(chunk)[None], recent.shape), recent]
  valid = [jnp.arange(chunk)[None] < (last - chunk)[:, None], recent >= 0]
  if picks > 0:
    means = view.chunk_keys(cache, chunk)  # [batch, chunks, f]
    probe = view.key_at(cache, jnp.maximum(last - 1, 0))  # [batch, f]
    scores = jnp.einsum("bcf,bf->bc", means, probe)
    ids = jnp.arange(means.shape[1])[None]
    whole = (ids >= 1) & ((ids + 1) * chunk <= (last - chunk)[:, None])
    _, best = jax.lax.top_k(jnp.where(whole, scores, -jnp.inf), min(picks, means.shape[1]))
    chosen = (best[:, :, None] * chunk + jnp.arange(chunk)[None, None]).reshape(
        best.shape[0], -1)
    parts.append(chosen)
    valid.append(jnp.repeat(jnp.take_along_axis(whole, best, axis=1), chunk, axis=1))
  return jnp.concatenate(parts, axis=1).astype(jnp.int32), jnp.concatenate(valid, axis=1)


class SparseCacheDraft(Draft):
  """The target drafting for itself from `budget` positions of its own cache.

  Args:
    target: the target model (any family whose `Family.sparse_view` gives a view).
    budget: cache positions each draft step reads (plus the draft's own gamma tokens).
    policy: "window" (sinks + most recent) or "retrieval" (chunks by key similarity).
    sinks: the window policy's first positions always kept (StreamingLLM: 4).
    chunk: the retrieval policy's chunk of positions; budget must hold >= 2 chunks.
  """

  reads = Reads(cache=True)

  def __init__(self, target, budget: int = 256, policy: str = "window", sinks: int = 4,
               chunk: int = 32):
    if policy not in POLICIES:
      raise ValueError(f"SparseCacheDraft policy must be one of {POLICIES}, got {policy!r}")
    self.budget = _int_at_least("budget", budget, 1)
    self.sinks = _int_at_least("sinks", sinks, 0)
    self.chunk = _int_at_least("chunk", chunk, 1)
    if policy == "window" and self.sinks >= self.budget:
      raise ValueError(f"SparseCacheDraft sinks={sinks} leaves no recent positions in a budget "
                       f"of {budget}: lower sinks or raise budget")
    if policy == "retrieval" and self.budget < 2 * self.chunk:
      raise ValueError(f"SparseCacheDraft policy='retrieval' keeps the first and the latest "
                       f"chunk at least: budget={budget} must be >= 2 * chunk = {2 * chunk}")
    self.policy, self.target = policy, target
    self.family = family_of(target)
    config = target.config
    self.family.sparse_view(config, target.params)  # the family names what it lacks, now
    self.family.check_sparse_budget(config, self.budget)
    self.vocab_size, self.eos_id, self.pad_id = config.vocab_size, config.eos_id, config.pad_id

  @property
  def params(self) -> Any:
    return self.target.params

  def static_key(self) -> Hashable:
    return ("sparse_cache", self.target.config, self.budget, self.policy, self.sinks,
            self.chunk)

  def check_inputs(self, tokens, lengths, max_decode_steps: int) -> None:
    width = jnp.shape(tokens)[1] if jnp.ndim(tokens) == 2 else 1
    length = self.family.cache_length(self.target.config, width, max_decode_steps)
    if self.budget >= length:
      raise ValueError(f"SparseCacheDraft budget={self.budget} covers the whole cache this "
                       f"decode allocates ({length} positions: inputs of width {width}, "
                       f"max_decode_steps={max_decode_steps}): the draft would be the target "
                       "at full cost; lower budget below the context, or use a model draft")

  def init_state(self, params, start):
    batch = start.context.tokens.shape[0]
    offset = (jnp.zeros((batch,), jnp.int32) if start.decode is None else
              jnp.asarray(start.decode.offset, jnp.int32))
    return dict(offset=offset)

  def _positions(self, view, cache, last):
    if self.policy == "window":
      return window_positions(last, self.budget, self.sinks)
    return retrieval_positions(view, cache, last, self.budget, self.chunk)

  def proposer(self, params, plan):
    view = self.family.sparse_view(self.target.config, params)
    settings, gamma = plan.sampling, plan.gamma

    def propose(rng, state, sequences, lengths, max_drafted=None, target_cache=None):
      rows = jnp.arange(sequences.shape[0])
      last = lengths + state["offset"]  # the row's last token's absolute position
      index, valid = self._positions(view, target_cache, last)
      compact = view.gather(target_cache, index, valid, gamma)
      token, rngs = sequences[rows, lengths], core_sampling.split_keys(rng, gamma)
      tokens, laws = [], []
      for i in range(gamma):
        logits, compact = view.step(compact, token, last + i, i)
        probs = settings.probs(logits)
        token = settings.draw(rngs[i], probs)
        tokens.append(token)
        laws.append(probs)
      drafted = (jnp.full(rows.shape, gamma, jnp.int32) if max_drafted is None else
                 jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
      return jnp.stack(tokens, axis=1), jnp.stack(laws, axis=1), drafted, state

    return chain_proposer(propose, plan, reads_cache=True)

  def tree_expander(self, params, sampling):
    raise TypeError("a SparseCacheDraft reads the target's cache once per proposal, which a "
                    "TreeDraft's node expansions are not handed: verify it as a chain "
                    "(token-wise or verification='block')")
