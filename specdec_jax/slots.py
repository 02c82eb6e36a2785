"""`generate_many`: any number of inputs through `batch_size` slots (continuous batching).

A fixed batch decodes until its slowest row ends, and its finished rows ride
along. Here a row that ends (EOS or its step limit) gives its slot to the next
input, as serving engines do (Orca, vLLM), so the batch stays full:

    start      the first batch_size inputs: the family's start (T5's encoder,
               a decoder-only prefill), the draft's state, the loop's carry
    segment    the decode loop, run until some live row is done (one compiled
               program: `decoding.LoopParts` iterated under a while loop)
    harvest    the host reads the finished rows (tokens, counters)
    refill     the next input's start at batch 1, written into the free slot's
               rows of every carry leaf (its cache rows, its draft state, its
               sequence, key and counters), in place

and again until every input is harvested. Outputs come back in input order.

Compiled programs: one start program at batch 1 (and one at batch_size for the
first fill), one segment program, one refill program; all are reused across
refills (no recompilation per refill). The host syncs once per segment (the
`done` flags) plus once per refilled row.

Exactness. Each row's loop state is its own (its length, positions, cache rows,
draft state), so a row decodes the same tokens whatever shares its batch:
greedy outputs equal `generate` on that input alone at the same block width
where the target's batched kernels round as at batch 1 (checked in the tests;
`generate`'s `batch_invariant` says why they may not). Sampling: each input i
brings its own key, fold_in(rng, i), split per iteration for its row alone
(`core.sampling.split_keys`), so a sampled output does not depend on the batch
either; verification is the usual exact rule, row by row.
"""

import dataclasses
import time
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding
from specdec_jax.core.outputs import GenerateOutput, make_output
from specdec_jax.drafts.base import NOTHING, DraftStart, ProposalPlan
from specdec_jax.families.base import call_block, shift_block_fn
from specdec_jax.families.registry import family_of, is_model
from specdec_jax.programs import PROGRAMS, _start_target
from specdec_jax.settings import check_draft, check_steps, plan_settings, sampled, warn_once

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SlotStats:
  """How the slots were used by one `generate_many` call.

  batch_size: slots; inputs: inputs decoded; segments: compiled loop runs (host syncs);
  refills: inputs started into a freed slot; iterations: loop iterations in all;
  occupancy: live row-iterations / (iterations * batch_size), 1.0 when every slot
  worked every iteration; seconds: the call's wall time.
  """
  batch_size: int
  inputs: int
  segments: int
  refills: int
  iterations: int
  occupancy: float
  seconds: float


@dataclasses.dataclass(frozen=True)
class ManyOutput(GenerateOutput):
  """`GenerateOutput` of every input, in input order (stats: per input; `stats.summary()`
  totals them), and `slots`: a `SlotStats`."""
  slots: Optional[SlotStats] = None


def _batch_axes(small, large):
  """Per leaf, the axis where a batch-1 and a batch-2 structure differ (None: no batch)."""
  def axis(a, b):
    diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    return diff[0] if diff else None
  return jax.tree_util.tree_map(axis, small, large)


def _programs(family, config, draft, settings):
  """(start, segment) for one static plan (see the module docstring)."""
  reads = NOTHING if draft is None else draft.reads
  width = settings.block_width
  target_room = 0 if draft is None else draft.target_room(width)
  plan = ProposalPlan(settings.sampling, settings.gamma, width)
  steps = settings.max_decode_steps

  def target_fns(params, offset):
    """The target's callbacks at loop positions for rows whose loop position 0 sits at
    absolute `offset` [batch] (carried: a refilled row has its own)."""
    if reads.features:
      block = shift_block_fn(family.feature_block_fn(config, params, reads.layers), offset)

      def scored(*args):
        logits, features, cache = call_block(block, *args)
        return decoding.Scored(logits, cache, features)
    else:
      block = shift_block_fn(family.block_fn(config, params), offset)

      def scored(*args):
        return decoding.Scored(*call_block(block, *args))

    def move_cache(cache, positions, sources):
      return family.move_cache(cache, positions + offset, sources)

    return decoding.TargetFns(scored, move_cache)

  def parts(params, draft_params, inputs, offset, cache, state, keys):
    target = target_fns(params, offset)
    if draft is None:
      return decoding.target_parts(inputs, cache, target.block, settings.eos_id, keys,
                                   settings.sampling, width)
    return draft.proposer(draft_params, plan).parts(
        inputs, cache, target, state, settings.eos_id, keys, settings.sampling, width,
        settings.verification)

  def start(params, draft_params, tokens, lengths, keys):
    begun, prompt_features, memory, _ = _start_target(family, config, params, tokens, lengths,
                                                      steps + target_room, reads)
    inputs = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(begun.first_inputs)
    state = None
    if draft is not None:
      state = draft.init_state(draft_params, DraftStart(
          family.context(tokens, lengths), steps + draft.room(width), settings.gamma,
          prompt_features, memory, begun))
    loop = parts(params, draft_params, inputs, begun.offset, begun.cache, state, keys)
    return loop.init, begun.offset

  def segment(params, draft_params, carry, offset, live):
    """The loop from `carry` until some live row is done (or none is live)."""
    inputs = jnp.zeros((live.shape[0], steps), jnp.int32)
    body = parts(params, draft_params, inputs, offset, carry.cache, carry.draft_state,
                 carry.rng).body
    return jax.lax.while_loop(lambda c: ~jnp.any(c.done & live) & jnp.any(live), body, carry)

  return start, segment


def generate_many(model, inputs, lengths=None, *, batch_size: int, max_decode_steps: int,
                  draft=None, rng: Optional[Array] = None, temperature: float = 0.0,
                  topk: int = 0, topp: Optional[float] = None, eos_id: Optional[int] = None,
                  gamma: int = 4, verification: str = "token",
                  block_width: Optional[int] = None) -> ManyOutput:
  """Decodes every row of `inputs` through `batch_size` slots, refilling freed slots.

  Args:
    model: the target (any family). inputs: [N, C] int32, any N (T5 encoder tokens;
      decoder-only prompts, right-padded, with `lengths` [N]).
    batch_size: slots decoded together (>= 1; more than N is cut to N).
    max_decode_steps, draft, temperature / topk / topp, eos_id, gamma, verification,
    block_width: as `generate`'s (every draft kind, chains and trees).
    rng: the call's key; input i draws from fold_in(rng, i) alone.
  Returns:
    ManyOutput: sequences [N, max_decode_steps], lengths [N], stats per input (None
    without a draft) and `slots` (`SlotStats`).
  """
  wall = time.perf_counter()
  family = family_of(model)
  if not is_model(model):
    raise TypeError(f"generate_many takes a model, got {type(model).__name__}")
  if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1 (slots decoded together), got "
                     f"{batch_size!r}")
  if rng is None and sampled(temperature):
    warn_once("generate_many: sampling without rng",
              f"generate_many(temperature={temperature}) without rng samples with "
              "PRNGKey(0): pass rng=jax.random.PRNGKey(seed) for fresh samples")
  config = model.config
  steps = check_steps(max_decode_steps)
  tokens, row_lengths = family.check_inputs(config, inputs, lengths, steps)
  tokens = np.asarray(tokens)
  row_lengths = None if row_lengths is None else np.asarray(row_lengths)
  draft_obj = None if draft is None else check_draft(config, draft, inputs, lengths, steps)
  settings = plan_settings(config, draft_obj, max_decode_steps=steps, temperature=temperature,
                           topk=topk, topp=topp, eos_id=eos_id, gamma=gamma,
                           verification=verification, block_width=block_width)
  n = tokens.shape[0]
  slots = min(int(batch_size), n)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  key = ("slots", config, None if draft_obj is None else draft_obj.static_key(), settings)
  start_fn, segment_fn = PROGRAMS.get(key, lambda: tuple(
      jax.jit(f) for f in _programs(family, config, draft_obj, settings)))
  params = model.params
  draft_params = None if draft_obj is None else draft_obj.params

  def keys_for(rows):
    return jnp.stack([jax.random.fold_in(rng, int(i)) for i in rows])

  def start_rows(rows):
    rows = list(rows)
    lens = None if row_lengths is None else jnp.asarray(row_lengths[rows])
    return start_fn(params, draft_params, jnp.asarray(tokens[rows]), lens, keys_for(rows))

  carry, offset = start_rows(range(slots))
  if slots > 1:
    one = jax.eval_shape(lambda: start_rows([0]))
    two = jax.eval_shape(lambda: start_rows([0, 1]))
    axes = _batch_axes(one, two)
  else:
    axes = jax.tree_util.tree_map(lambda _: 0, (carry, offset))
  refill_fn = PROGRAMS.get(key + ("refill", slots), lambda: jax.jit(_refill(axes)))

  owner: List[Optional[int]] = list(range(slots))   # the input each slot decodes
  next_input = slots
  results: Dict[int, Any] = {}
  segments = refills = iterations = live_iterations = 0
  while any(o is not None for o in owner):
    live = jnp.asarray([o is not None for o in owner])
    before = np.asarray(carry.counters.iterations)
    carry = segment_fn(params, draft_params, carry, offset, live)
    segments += 1
    done = np.asarray(carry.done)
    after = np.asarray(carry.counters.iterations)
    live_np = np.asarray(live)
    delta = (after - before)[live_np]
    iterations += int(delta.max()) if delta.size else 0
    live_iterations += int(delta.sum())
    for s, o in enumerate(owner):
      if o is None or not done[s]:
        continue
      results[o] = jax.tree_util.tree_map(lambda x: np.asarray(x[s]), dict(
          sequences=carry.sequences, counters=carry.counters.as_dict()))
      if next_input < n:
        row_carry, row_offset = start_rows([next_input])
        carry, offset = refill_fn((carry, offset), (row_carry, row_offset), s)
        owner[s] = next_input
        next_input += 1
        refills += 1
      else:
        owner[s] = None
  sequences = jnp.asarray(np.stack([results[i]["sequences"][1:] for i in range(n)]))
  counters = None
  if draft_obj is not None:
    counters = {name: np.stack([results[i]["counters"][name] for i in range(n)])
                for name in results[0]["counters"]}
  out = make_output(sequences, counters, settings.eos_id, settings.gamma)
  stats = SlotStats(batch_size=slots, inputs=n, segments=segments, refills=refills,
                    iterations=iterations,
                    occupancy=live_iterations / max(iterations * slots, 1),
                    seconds=time.perf_counter() - wall)
  return ManyOutput(out.sequences, out.lengths, out.stats, slots=stats)


def _refill(axes):
  """(state, row, slot) -> state with row's batch-1 leaves written at `slot` of each leaf's
  batch axis (leaves without one are kept)."""

  def refill(state, row, slot):
    def put(big, small, axis):
      if axis is None:
        return big
      return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis)
    return jax.tree_util.tree_map(put, state, row, axes)

  return refill
