"""Decode programs: one jitted function per static plan, and the cache that keeps them.

`build_program` turns (family, config, draft, settings, placement) into one
compiled decode, `(params, draft_params, tokens, lengths, rng) -> (sequences
[batch, N] int32, counters or None)`:

    start the target     family.start (or start_features, for a draft that reads them)
    start the draft      draft.init_state(params, DraftStart(...))
    propose              draft.proposer(params, ProposalPlan(...))
    decode               decoding.decode: target-only, or the proposer's own loop

The engine reads only the draft's protocol (`drafts.base`): what it reads
from the target, its state, its proposer. `PROGRAMS` keeps each built
program for reuse by later calls with the same static key.
"""

import threading
from typing import Any, Callable, Dict, Hashable

import jax.numpy as jnp

from specdec_jax.core import decoding
from specdec_jax.drafts.base import NOTHING, DraftStart, ProposalPlan
from specdec_jax.families.base import call_block, shift_block_fn


class CompileCache:
  """Built decode programs (and what is planned once beside them) by static key, safe to
  share between threads. Keys are tuples whose first item names the kind of entry."""

  def __init__(self):
    self._programs: Dict[Hashable, Callable] = {}
    self._lock = threading.RLock()  # a build may get the programs it times

  def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
    """The program stored under `key`, built by `build()` the first time."""
    with self._lock:
      if key not in self._programs:
        self._programs[key] = build()
      return self._programs[key]

  def entries(self, kind: str) -> Dict[Hashable, Any]:
    """{key: entry} of one kind (keys whose first item is `kind`)."""
    with self._lock:
      return {key: value for key, value in self._programs.items() if key[0] == kind}

  def count(self, kind: str) -> int:
    return len(self.entries(kind))

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()


# The process's programs (`generate` and the T5X model share them).
PROGRAMS = CompileCache()


def _start_target(family, config, params, tokens, lengths, length: int, reads):
  """(DecodeStart, prompt features or None, memory or None, block callback at loop
  positions returning `decoding.Scored`) for a decode of `length` loop positions."""
  if not reads.features:
    start = family.start(config, params, tokens, lengths, length)
    block = shift_block_fn(family.block_fn(config, params), start.offset)
    return start, None, None, lambda *args: decoding.Scored(*call_block(block, *args))
  start, features, memory = family.start_features(config, params, tokens, lengths, length,
                                                  reads.layers)
  block = shift_block_fn(family.feature_block_fn(config, params, reads.layers), start.offset)

  def scored(*args):
    logits, block_features, cache = call_block(block, *args)
    return decoding.Scored(logits, cache, block_features)

  return start, features, memory, scored


def build_program(family, config, draft, settings, placement) -> Callable:
  """The jitted decode for one static plan (see the module docstring).

  settings: `settings.DecodeSettings`; placement: `placement.Placement`
  (its activation scopes and cache layouts; jit's shardings under a mesh).
  """
  target_scope, constrain_target, draft_scope, constrain_draft = placement.scopes(family, draft)
  reads = NOTHING if draft is None else draft.reads
  width = settings.block_width
  target_room = 0 if draft is None else draft.target_room(width)
  plan = ProposalPlan(settings.sampling, settings.gamma, width)

  def run(params, draft_params, tokens, lengths, rng):
    steps = settings.max_decode_steps
    with target_scope():
      start, prompt_features, memory, block = _start_target(
          family, config, params, tokens, lengths, steps + target_room, reads)

    def target_block(tokens, positions, cache, tree=None):
      family.check_tree(tree)
      with target_scope():
        scored = block(tokens, positions, cache, tree)
      return scored._replace(cache=constrain_target(scored.cache))

    def move_cache(cache, positions, sources):
      return constrain_target(family.move_cache(cache, positions + start.offset, sources))

    target = decoding.TargetFns(target_block, move_cache)
    inputs = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(start.first_inputs)
    cache = constrain_target(start.cache)
    if draft is None:
      return decoding.decode(inputs, cache, target, settings.eos_id, rng,
                             sampling_settings=settings.sampling, block_width=width)
    with draft_scope():
      draft_state = constrain_draft(draft.init_state(draft_params, DraftStart(
          family.context(tokens, lengths), steps + draft.room(width), settings.gamma,
          prompt_features, memory, start)))
      proposer = draft.proposer(draft_params, plan).placed(draft_scope, constrain_draft)
    return decoding.decode(inputs, cache, target, settings.eos_id, rng,
                           sampling_settings=settings.sampling, block_width=width,
                           proposer=proposer, draft_state=draft_state,
                           verification=settings.verification)

  return placement.jit(run)


def program_key(config, draft, settings, precision: Any, placement) -> Hashable:
  """Everything static about one decode: equal keys share a compiled program."""
  return (config, None if draft is None else draft.compile_key(), precision, settings,
          placement.key)
