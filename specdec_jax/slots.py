"""`generate_many`: any number of inputs through `batch_size` slots (continuous batching).

A fixed batch decodes until its slowest row ends, and its finished rows ride
along. Here a row that ends (EOS or its step limit) gives its slot to the next
input, as serving engines do (Orca, vLLM), so the batch stays full:

    stash      the next S waiting inputs (S = max(batch_size, MIN_STASH)) started
               together: the family's start (T5's encoder, a decoder-only prefill),
               the draft's state, each row's loop carry
    segment    the decode loop (one compiled program: `decoding.LoopParts`
               iterated under a while loop); before each iteration, every free slot
               (its row done, or no input in it yet) takes the next stash row: that
               row written over the slot's rows of every carry leaf (cache rows,
               draft state, sequence, key, counters), in place, the finished row
               kept aside. It runs until the stash is used up and a row ends (or,
               with no input waiting, until every row ends)
    harvest    the host reads the rows swapped out and the finished rows (tokens,
               counters), in the order the swaps were made

and a new stash, until every input is harvested. Outputs come back in input order.

Why a stash: a start reads every weight of the encoder (or the prompt's layers) once
whatever its batch, so inputs started one at a time pay that read each (the T5-base
encoder at batch 1: 57 ms on this CPU, 31 ms per input at batch 16); S at a time they
share it, as fixed batches do. Why swaps inside the loop: the host then syncs once
per stash, not once per finished row (each sync leaves the device idle while the
host reads and dispatches: a large part of a small model's iteration). The next
stash is started before the sync, so its start runs while the host reads: its inputs
are known one stash ahead (under gamma='auto' each decision is made a stash ahead,
except after a plan's first stash or a retry's, measured before anything follows
them). The decode holds batch_size + 2 S rows of state.

Compiled programs: one start program (S rows), one segment program and one blank
program (the first batch_size slots, none held yet), all reused: no recompilation per
refill or call. The host syncs once per segment, reading the swaps and every slot's
flags, tokens and counters in one transfer; a decode of N inputs syncs about N / S +
(rows that end while a stash is used up and inputs wait) times, and starts N / S
stashes (`SlotStats.segments` and `refills` count them).

Exactness. Each row's loop state is its own (its length, positions, cache rows,
draft state), so a row decodes the same tokens whatever shares its batch:
greedy outputs equal `generate` on that input alone at the same block width
where the target's batched kernels round as at batch 1. On XLA CPU they do, in
float32 and bfloat16 (the demo pairs' bf16 held-out inputs bit for bit,
tests/test_generate_many_bf16.py): the families' norms and softmaxes sum as trees
of adds (`core.rows`), because a reduction XLA CPU hands to YNNPACK once it holds
4096 elements sums in another order (the T5 pair's norms crossed it between batch
1 and 2 at block width 8; 2 of 300 bf16 outputs differed), and the dots round each
row alike at every batch tried. Elsewhere (GPU/TPU kernels tiled by batch; MoE
routing sums) it is tested, not built in: `generate`'s `batch_invariant` says why
it may not hold. Sampling: each input i
brings its own key, fold_in(rng, i), split per iteration for its row alone
(`core.sampling.split_keys`), so a sampled output does not depend on the batch
either; verification is the usual exact rule, row by row.
"""

import dataclasses
import functools
import math
import time
from typing import Any, Dict, List, Optional, Tuple, Union

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
# The planner of gamma='auto' (its names re-exported: tests and scripts read them here).
from specdec_jax.auto_gamma import (  # noqa: F401
    REEXPLORE, RETRY_ERRORS, SWITCH_GAIN, _SUMS, Engine, _auto_phases, _deviation,
    _drain_iterations, _max_of_normals, _occupancy, _optimistic_tokens, _own_gamma,
    _own_shape, _residual_tail)

Array = jax.Array
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class SlotStats:
  """How the slots were used by one `generate_many` call.

  batch_size: slots; inputs: inputs decoded; segments: compiled loop runs (host syncs);
  refills: inputs started into a freed slot; iterations: loop iterations in all;
  live_iterations: row-iterations of live rows; occupancy: live_iterations /
  (iterations * batch_size), 1.0 when every slot worked every iteration; seconds: the
  call's wall time; phases: the inputs [start, stop) decoded at each gamma (0:
  target-only), with, under gamma='auto', the alpha and predicted speedup it was chosen at
  and every plan as rated then (`rated`);
  measured: under gamma='auto', what it learned, the next call's `prior`: alpha,
  batch_size, tokens {gamma: sums over the inputs decoded at it: inputs, tokens,
  iterations and their squares per input} and walls {gamma: [seconds, loop iterations]
  run at it}; started_ahead: stashes started before the host synced on the segment
  before them (their start overlapping it); planning: under gamma='auto', the plan
  search: seconds (this call's compiles and timings of plans: 0 where every plan it
  timed was timed before in this process), timed (the plans it timed or read back) and
  untimed {gamma: why it was not worth timing}.
  """
  batch_size: int
  inputs: int
  segments: int
  refills: int
  iterations: int
  live_iterations: int
  seconds: float
  phases: Tuple[Dict[str, Any], ...] = ()
  measured: Optional[Dict[str, Any]] = None
  started_ahead: int = 0
  planning: Optional[Dict[str, Any]] = None

  @property
  def occupancy(self) -> float:
    return self.live_iterations / max(self.iterations * self.batch_size, 1)

  @property
  def planning_seconds(self) -> float:
    """Seconds gamma='auto' spent compiling and timing plans in this call (0 without)."""
    return 0.0 if self.planning is None else self.planning["seconds"]


@dataclasses.dataclass(frozen=True)
class ManyOutput(GenerateOutput):
  """`GenerateOutput` of every input, in input order (stats: per input; `stats.summary()`
  totals them), and `slots`: a `SlotStats`."""
  slots: Optional[SlotStats] = None


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

  def decode_step(params, draft_params, carry, offset):
    """One loop iteration of every row (rows that are done emit nothing)."""
    inputs = jnp.zeros((carry.done.shape[0], steps), jnp.int32)
    return parts(params, draft_params, inputs, offset, carry.cache, carry.draft_state,
                 carry.rng).body(carry)

  # The loop over slots, around this plan's iteration (a function of its own: see there).
  segment = functools.partial(_segment, decode_step)

  def iterate(params, draft_params, carry, offset, count):
    """`count` (traced: one program for any count) iterations from `carry`, done rows or
    not (each costs what a live one does): what one iteration of this plan costs, timed
    by `_iteration_ms`."""
    return jax.lax.fori_loop(
        0, count, lambda _, c: decode_step(params, draft_params, c, offset), carry)

  return start, segment, iterate


def _segment(decode_step, params, draft_params, state, stash, live, cursor, limit, host_waits,
             axes):
  """The loop from `state` ((carry, offset) of B slots), a free slot (a done row, or one
  no input holds: `live` [B] False) taking the next stash row (rows cursor..limit - 1
  of `stash`, inputs started together) before each iteration, in slot order, each
  iteration `decode_step` (every row's, from `_programs`). Runs
  until no row decodes and none can be swapped in, or, when `host_waits` (inputs
  beyond this stash), until a finished row finds the stash empty.

  Returns (state, live, cursor, swaps, loop iterations): swaps = (finished [R, n]
  (`_packed` of the row each stash row replaced), slot_of [R] int32 (where stash row k
  went), harvested [R] bool (it replaced a finished input, not a free slot)).
  """
  slots = live.shape[0]
  rows = stash[0].done.shape[0]
  width = _packed(state[0]).shape[1]
  swaps = (jnp.zeros((rows, width), jnp.int32), jnp.full((rows,), -1, jnp.int32),
           jnp.zeros((rows,), jnp.bool_))

  def swap_in(loop):
    state, live, cursor, swaps, count = loop
    free = state[0].done | ~live
    n = jnp.minimum(jnp.sum(free), limit - cursor)
    order = jnp.nonzero(free, size=slots, fill_value=0)[0]
    before = _packed(state[0])  # each slot swaps once per call: its row as it ended

    def one(j, inner):
      state, live, (finished, slot_of, harvested) = inner
      slot, k = order[j], cursor + j
      finished = finished.at[k].set(before[slot])
      slot_of = slot_of.at[k].set(slot)
      harvested = harvested.at[k].set(live[slot])
      leaves, tree = jax.tree_util.tree_flatten(state)
      state = tree.unflatten([_swapped(leaf, new, axis, slot, k, slots) for leaf, new, axis
                              in zip(leaves, jax.tree_util.tree_leaves(stash), axes)])
      return state, live.at[slot].set(True), (finished, slot_of, harvested)

    state, live, swaps = jax.lax.fori_loop(0, n, one, (state, live, swaps))
    return state, live, cursor + n, swaps, count

  def body(loop):
    free = loop[0][0].done | ~loop[1]
    loop = jax.lax.cond(jnp.any(free) & (loop[2] < limit), swap_in, lambda x: x, loop)
    (carry, offset), live, cursor, swaps, count = loop
    carry = decode_step(params, draft_params, carry, offset)
    return (carry, offset), live, cursor, swaps, count + 1

  def going(loop):
    (carry, _), live, cursor, _, _ = loop
    left = cursor < limit
    free = carry.done | ~live
    blocked = jnp.any(live & carry.done) & ~left  # a finished row, no row to take its slot
    return (jnp.any(live & ~carry.done) | (left & jnp.any(free))) & ~(host_waits & blocked)

  return jax.lax.while_loop(going, body, (state, live, cursor, swaps, jnp.int32(0)))


def generate_many(model, inputs, lengths=None, *, batch_size: int, max_decode_steps: int,
                  draft=None, rng: Optional[Array] = None, temperature: float = 0.0,
                  topk: int = 0, topp: Optional[float] = None, eos_id: Optional[int] = None,
                  gamma: Union[int, str] = "auto", verification: str = "token",
                  block_width: Optional[int] = None, prior_alpha: Optional[float] = None,
                  prior: Optional[Dict[str, Any]] = None,
                  stream_left: Optional[int] = None) -> ManyOutput:
  """Decodes every row of `inputs` through `batch_size` slots, refilling freed slots.

  Greedy outputs equal `generate` on each input alone at the same block width, bit for
  bit, wherever the target's kernels round a row as at batch 1: on XLA CPU in float32
  and bfloat16 (norms and softmaxes summed as trees, `core.rows`; the module
  docstring's "Exactness" says when it may not hold).

  Args:
    model: the target (any family). inputs: [N, C] int32, any N (T5 encoder tokens;
      decoder-only prompts, right-padded, with `lengths` [N]).
    batch_size: slots decoded together (>= 1; more than N is cut to N).
    max_decode_steps, draft, temperature / topk / topp, eos_id, verification,
      block_width: as `generate`'s (every draft kind, chains and trees).
    gamma: a chain's tokens per proposal, or "auto" (the default): the plan (target-only
      or gamma 1, 2, 4, 8) expected to decode the inputs not yet handed out soonest at
      this batch size, from what each plan measured where it ran (its wall time per
      loop iteration, tokens per row iteration, the spread of its inputs' iteration
      counts), else from its loop iteration and refill timed here (once per shape,
      cached) and the acceptance so far (`_auto_phases`); speculation starts only for a
      predicted gain of 5% and stays only while it is predicted faster than
      target-only after the drain leaving it would cost. Re-decided at every stash of
      max(batch_size, 8) inputs, from what the stream measured up to then, a stash
      ahead (so that it starts while the one before it decodes), the slots kept full while the gamma stays the same (a run
      drains only when it changes). A tree or another draft of a shape of its own is
      one plan at that shape, against target-only: tried unless it loses even with
      every node accepted, kept while it measures faster.
    prior_alpha: gamma="auto" only: the acceptance measured before this call (earlier
      inputs of the same stream, as the launcher passes between chunks). The first
      phase is chosen at it; without it, the first stash drafts min(4, the draft's
      most) tokens to measure alpha (unless speculation loses even at alpha = 1).
    prior: gamma="auto" only: `out.slots.measured` of an earlier call of the same stream
      (the launcher passes each chunk the one before): its alpha (unless prior_alpha),
      each plan's tokens per row iteration and, at the same batch size, its wall time
      and loop iterations, so this call chooses from the start with what that one
      learned.
    stream_left: gamma="auto" only: the inputs the stream has from this call's first on,
      this call's included (default: this call's; the launcher passes its whole stream's):
      a speculative plan is compiled and timed only where its best case would save more
      than that costs over them (`auto_gamma._Planner.search`).
    rng: the call's key; input i draws from fold_in(rng, i) alone.
  Returns:
    ManyOutput: sequences [N, max_decode_steps], lengths [N], stats per input (None
    without a draft) and `slots` (`SlotStats`, with the gamma of each phase).
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
  draft_obj = None if draft is None else check_draft(config, draft, inputs, lengths, steps,
                                                     row_keys=True)
  auto = isinstance(gamma, str)
  if auto and gamma != AUTO:
    raise ValueError(f"gamma must be an int >= 1 or 'auto', got {gamma!r}")
  if prior is not None and (not auto or not isinstance(prior, dict)
                            or not {"alpha", "tokens", "walls", "batch_size"} <= set(prior)
                            or not isinstance(prior["tokens"], dict)
                            or not all(isinstance(v, dict) and set(_SUMS) <= set(v)
                                       for v in prior["tokens"].values())
                            or not isinstance(prior["walls"], dict)):
    raise ValueError("prior is gamma='auto''s `out.slots.measured` of an earlier call (a dict "
                     "of alpha, batch_size, tokens and walls, the last two per gamma), got "
                     f"{prior!r}")
  if prior is not None:
    for g, v in prior["tokens"].items():
      # Per-input rates divide by these: a plan with iterations but no inputs (or negative
      # sums) is not something a call measured.
      if min(v[k] for k in _SUMS) < 0 or (v["iterations"] > 0 and v["inputs"] <= 0):
        raise ValueError(f"prior['tokens'][{g!r}] holds sums no call measures ({v!r}): "
                         "inputs, tokens, iterations and their squares are >= 0, and "
                         "iterations come with inputs; pass out.slots.measured unchanged")
  if prior_alpha is not None and (not auto or not 0.0 <= prior_alpha <= 1.0):
    raise ValueError(f"prior_alpha ({prior_alpha!r}) is an acceptance rate in [0, 1] for "
                     "gamma='auto'; with a fixed gamma there is nothing to choose")
  if stream_left is not None and (isinstance(stream_left, bool) or not isinstance(
      stream_left, (int, np.integer)) or stream_left < 1):
    raise ValueError(f"stream_left must be an int >= 1 (the stream's inputs from this call's "
                     f"first on), got {stream_left!r}")
  chooses = auto and draft_obj is not None

  def settings_for(g):
    return plan_settings(config, None if g == 0 else draft_obj, max_decode_steps=steps,
                         temperature=temperature, topk=topk, topp=topp, eos_id=eos_id,
                         gamma=max(g, 1), verification=verification if g else "token",
                         block_width=block_width)

  n = tokens.shape[0]
  slots = min(int(batch_size), n)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  run = functools.partial(_decode_slots, model, family, tokens, row_lengths, slots, rng)
  if not chooses:
    settings = settings_for(_own_gamma(draft_obj) if auto else gamma)
    results, usage = run(settings, None if draft_obj is None else draft_obj, range(n))
    phases = [dict(inputs=[0, n], gamma=settings.gamma if draft_obj is not None else 0)]
    width, measured, planning = max(settings.gamma, 1), None, None
  else:
    # `_iteration_ms` looked up at the call: the tests replace it with fixed timings.
    engine = Engine(run, lambda gammas: _iteration_ms(
        model, draft_obj, tokens, row_lengths, slots, settings_for, gammas), stash_size(slots))
    results, usage, phases, width, measured, planning = _auto_phases(
        draft_obj, n, slots, steps, settings_for, engine, block_width, prior_alpha, prior,
        stream_left)
  sequences = jnp.asarray(np.stack([results[i]["sequences"][1:] for i in range(n)]))
  counters = _merged_counters([results[i]["counters"] for i in range(n)],
                              width if chooses else 0)
  out = make_output(sequences, counters if draft_obj is not None else None,
                    settings_for(0).eos_id, width)
  stats = SlotStats(batch_size=slots, inputs=n, seconds=time.perf_counter() - wall,
                    phases=tuple(phases), measured=measured, planning=planning, **usage)
  return ManyOutput(out.sequences, out.lengths, out.stats, slots=stats)


def _decode_slots(model, family, tokens, row_lengths, slots, rng, settings, draft, rows,
                  more=None):
  """Decodes the inputs `rows` (indices into tokens) through `slots` slots at `settings`,
  and then those `more(results so far, usage so far, seconds so far, ahead)` returns each
  time at most one stash of inputs waits (until it returns none; None: ask again at the
  next sync). `ahead`: a stash still waits, so what it returns is started while that
  one decodes. Returns ({input index: dict(sequences, counters)}, usage counts)."""
  began = time.perf_counter()
  rows = list(rows)
  config = model.config
  start_fn, segment_fn, blank_fn, _ = _slot_programs(family, config, draft, settings)
  params = model.params
  draft_params = None if draft is None else draft.params
  slots = min(slots, len(rows))
  size = stash_size(slots)

  def started(indices):
    """The starts of `indices` at batch `size` (a short group padded with its last
    input, whose copies are never swapped in): one dispatch."""
    indices = np.asarray(list(indices) + [indices[-1]] * (size - len(indices)), np.int32)
    lens = None if row_lengths is None else jnp.asarray(row_lengths[indices])
    return start_fn(params, draft_params, rng, jnp.asarray(tokens[indices]), lens,
                    jnp.asarray(indices))

  axes = _batch_axes(start_fn, params, draft_params, rng, tokens, row_lengths)
  waiting = rows
  stash, stashed = None, []           # the inputs started ahead, in stash row order
  cursor = 0                          # the next stash row to swap in
  owner: List[Optional[int]] = [None] * slots   # the input each slot decodes
  live = np.zeros((slots,), bool)
  state = None
  ahead = None                        # (inputs, their stash) started before they are due
  results: Dict[int, Any] = {}
  usage = dict(segments=0, refills=0, iterations=0, live_iterations=0, started_ahead=0)
  while True:
    while more is not None and cursor == len(stashed) and len(waiting) <= size:
      # Asked until a stash waits beyond the one taken next: that one is started ahead,
      # while the one taken decodes.
      got = more(results, usage, time.perf_counter() - began, bool(waiting))
      if got is None:
        break
      waiting = waiting + list(got)
      more = more if len(got) else None
    if cursor == len(stashed) and waiting:  # the next stash: `size` inputs started together
      group, waiting = waiting[:size], waiting[size:]
      stash = ahead[1] if ahead is not None and ahead[0] == group else started(group)
      stashed, cursor, ahead = group, 0, None
      if state is None:
        state = blank_fn(stash, axes, slots)
    if not live.any() and cursor == len(stashed):
      break
    host_waits = bool(waiting) or more is not None
    state, (live_now, cursor_now, count, packed, swaps) = segment_fn(
        params, draft_params, state, stash, jnp.asarray(live), jnp.int32(cursor),
        jnp.int32(len(stashed)), jnp.bool_(host_waits), axes)
    usage["segments"] += 1
    if waiting and ahead is None:
      # The next stash's start dispatched before the host waits on this segment: it
      # runs while the host reads and harvests (and, on a CPU, on a core the small
      # loop leaves idle). A segment with inputs waiting ends only with its stash used
      # up, so the next one takes exactly these.
      ahead = (waiting[:size], started(waiting[:size]))
      usage["started_ahead"] += 1
    # The host's one sync per segment (per stash at most, or per finished row once the
    # stash is empty and inputs wait): the swaps it made and every slot's rows.
    live_now, cursor_now, count, packed, (finished, slot_of, harvested) = jax.device_get(
        (live_now, cursor_now, count, packed, swaps))
    usage["iterations"] += int(count)
    for k in range(cursor, int(cursor_now)):  # the swaps in the order they were made
      slot = int(slot_of[k])
      if harvested[k]:
        _harvest(results, owner[slot], finished[k], state[0])
      owner[slot] = stashed[k]
      usage["refills"] += 1
    cursor = int(cursor_now)
    live = np.array(live_now, bool)
    done = packed[:, 0].astype(bool)
    for slot in range(slots):
      if live[slot] and done[slot]:
        _harvest(results, owner[slot], packed[slot], state[0])
        owner[slot], live[slot] = None, False
  usage["refills"] -= min(slots, len(rows))  # the first fill is not a refill
  usage["live_iterations"] = int(sum(r["counters"]["iterations"] for r in results.values()))
  return results, usage


def _harvest(results, index, packed_row, carry):
  """results[index] = the sequence and counters of one `_packed` row."""
  _, sequences, counters = _unpacked(packed_row[None], carry)
  results[index] = dict(sequences=sequences[0],
                        counters={name: v[0] for name, v in counters.items()})


def stash_size(slots: int) -> int:
  """Inputs started together for the slots (`MIN_STASH` at least, so that few slots
  still share each start's weight reads and sync once per that many inputs)."""
  return max(int(slots), MIN_STASH)


# The fewest inputs started together: at batch 1-4, starts shared 8 ways and one host sync
# per 8 inputs, for a stash of 8 rows of state.
MIN_STASH = 8


def _batch_axes(start_fn, params, draft_params, rng, tokens, row_lengths):
  """The batch axis of each leaf of the slot state, in `tree_leaves` order (None where a
  leaf has none): a static argument of the put program, found
  from the start's shapes at batch 1 and 2 (traced, not run; once per shape)."""
  def shapes(b):
    index = jax.ShapeDtypeStruct((b,), jnp.int32)
    lens = None if row_lengths is None else index
    return jax.eval_shape(start_fn, params, draft_params, rng,
                          jax.ShapeDtypeStruct((b, tokens.shape[1]), jnp.int32), lens, index)

  def axis(one, two):
    differ = [i for i, (x, y) in enumerate(zip(one.shape, two.shape)) if x != y]
    return differ[0] if differ else None

  key = ("slot_axes", start_fn, tokens.shape[1], row_lengths is None)
  return PROGRAMS.get(key, lambda: tuple(
      axis(a, b) for a, b in zip(jax.tree_util.tree_leaves(shapes(1)),
                                 jax.tree_util.tree_leaves(shapes(2)))))


def _packed(carry) -> Array:
  """[batch, n] int32: each row's done flag, sequence and counters (floats bitcast), what
  the host reads after a segment, as one array (one transfer)."""
  columns = [carry.done.astype(jnp.int32)[:, None], carry.sequences]
  for value in carry.counters.as_dict().values():
    value = value.reshape(value.shape[0], -1)
    if jnp.issubdtype(value.dtype, jnp.floating):
      value = jax.lax.bitcast_convert_type(value.astype(jnp.float32), jnp.int32)
    columns.append(value.astype(jnp.int32))
  return jnp.concatenate(columns, axis=1)


def _unpacked(packed: np.ndarray, carry):
  """`_packed`'s (done [batch] bool, sequences [batch, len + 1], counters {name: [batch,
  ...]}) on the host; shapes and dtypes read from `carry`'s arrays (no transfer)."""
  done = packed[:, 0].astype(bool)
  width = carry.sequences.shape[1]
  sequences = packed[:, 1:1 + width]
  at, counters = 1 + width, {}
  for name, value in carry.counters.as_dict().items():
    size = int(np.prod(value.shape[1:], dtype=np.int64))
    column = packed[:, at:at + size]
    at += size
    if np.issubdtype(value.dtype, np.floating):
      column = column.view(np.float32).astype(value.dtype)
    else:
      column = column.astype(value.dtype)
    counters[name] = column.reshape((packed.shape[0],) + value.shape[1:])
  return done, sequences, counters


def _slot_programs(family, config, draft, settings):
  """(start, segment, refill, iterate) jitted for one static plan, compiled once per
  process (`PROGRAMS`). The carry is donated to the segment and refill programs: updated
  in place, not copied (the cache's every row) at each call."""
  key = ("slots", config, None if draft is None else draft.compile_key(), settings)
  return PROGRAMS.get(key, lambda: _compiled(*_programs(family, config, draft, settings)))


def _compiled(start, segment, iterate):
  """The jitted (start, segment, blank, iterate) of one static plan. Each input's key is
  fold_in(rng, its index), made in the program. Segment swaps stash rows into free slots
  inside its loop and updates the state in place (donated); blank is B slots that no
  input holds yet (copies of a stash row), for the first swaps to fill."""

  def start_rows(params, draft_params, rng, tokens, lengths, indices):
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(indices)
    return start(params, draft_params, tokens, lengths, keys)

  def segment_state(params, draft_params, state, stash, live, cursor, limit, host_waits,
                    axes):
    state, live, cursor, swaps, count = segment(params, draft_params, state, stash, live,
                                                cursor, limit, host_waits, axes)
    return state, (live, cursor, count, _packed(state[0]), swaps)

  def blank(stash, axes, slots):
    leaves, tree = jax.tree_util.tree_flatten(stash)
    return tree.unflatten([
        leaf if axis is None else jnp.take(leaf, jnp.zeros((slots,), jnp.int32), axis=axis)
        for leaf, axis in zip(leaves, axes)])

  return (jax.jit(start_rows), jax.jit(segment_state, donate_argnums=(2,), static_argnums=(8,)),
          jax.jit(blank, static_argnums=(1, 2)), jax.jit(iterate))


def _swapped(leaf, new, axis, slot, k, slots: int):
  """State leaf `leaf` with row `slot` of its batch axis replaced by row k of the stash's
  same leaf `new` (a leaf with no batch axis is kept; with one slot the stash's)."""
  if axis is None:
    return new.astype(leaf.dtype) if slots == 1 else leaf
  row = jax.lax.dynamic_slice_in_dim(new, k, 1, axis).astype(leaf.dtype)
  return jax.lax.dynamic_update_slice_in_dim(leaf, row, slot, axis)


def _iteration_ms(model, draft, tokens, row_lengths, slots, settings_for, gammas):
  """{gamma: (ms of one iteration of the slot loop at batch `slots`, ms of one refill)}
  (gamma 0: target-only): each plan's real loop body on the first `slots` inputs, what
  n more iterations add to a call (a call's own cost is a segment's, not an
  iteration's; n from `ITERATIONS_TIMED` up to `MAX_ITERATIONS_TIMED`, enough for
  `TIMED_CALL_MS` of iterations), and its refill per input (a stash's start shared by
  `stash_size(slots)` inputs; the swap itself is a row copy), the plans timed in turn,
  the least of `TIMING_ROUNDS` rounds (cached per shape)."""
  family = family_of(model)
  key = ("slot_iteration_ms", model.config, draft.compile_key(), slots, tokens.shape[1],
         tuple(gammas), tuple(settings_for(g) for g in gammas))

  def measure():
    size = stash_size(slots)
    rows = np.arange(size, dtype=np.int32) % tokens.shape[0]
    lens = None if row_lengths is None else jnp.asarray(row_lengths[rows])
    batch = (jnp.asarray(tokens[rows]), lens, jnp.asarray(rows))
    plans = {}
    for g in gammas:
      plan_draft = draft if g else None
      start_fn, segment_fn, blank_fn, iterate_fn = _slot_programs(
          family, model.config, plan_draft, settings_for(g))
      params = (model.params, None if plan_draft is None else draft.params)
      axes = _batch_axes(start_fn, *params, jax.random.PRNGKey(0), tokens, row_lengths)
      stash = start_fn(*params, jax.random.PRNGKey(0), *batch)
      # Compiles the segment program too (an empty segment: no row live, no stash row),
      # and the transfer of the host's `live` flags as the decode makes it, so that the
      # decode's first wall times, which gamma='auto' learns from, hold no compile.
      jax.block_until_ready(segment_fn(
          *params, blank_fn(stash, axes, slots), stash, jnp.asarray(np.zeros((slots,), bool)),
          jnp.int32(0), jnp.int32(0), jnp.bool_(True), axes))
      plans[g] = (params, blank_fn(stash, axes, slots), start_fn, iterate_fn)

    def seconds(fn, *args):
      begin = time.perf_counter()
      jax.block_until_ready(fn(*args))
      return time.perf_counter() - begin

    def timed(g, n):
      """(seconds of one call of 1 iteration, of 1 + n, of a start)."""
      params, state, start_fn, iterate_fn = plans[g]
      return (seconds(iterate_fn, *params, *state, 1),
              seconds(iterate_fn, *params, *state, 1 + n),
              seconds(start_fn, *params, jax.random.PRNGKey(0), *batch))

    def per_iteration(one, more, n):
      # An iteration is what n more cost: a call's own cost (its dispatch, the arguments'
      # transfer and return, some ms at batch 1 on this CPU) is paid once per segment in
      # a decode, not per iteration. Counted per iteration it made target-only's 0.26 ms
      # iteration 0.51 on the decoder-only demo pair at batch 1 (gamma 4's 1.6 ms 2.2),
      # so speculation was predicted ~1.4X faster than it runs. Were rounding to make
      # the difference vanish, the whole call counts.
      each = (more - one) / n
      return each if each > 0 else more / (1 + n)

    counts = {}
    for g in gammas:  # compiles (the first call), then sizes the timed calls
      timed(g, ITERATIONS_TIMED)
      one, more, _ = timed(g, ITERATIONS_TIMED)
      # Calls of a few ms read a slow spell of a shared machine as the plan's cost: 9
      # iterations of target-only at batch 16 on the decoder-only demo pair (~20 ms) read
      # 4.6 ms an iteration in one process, 2.0-2.3 in others and in the stream's
      # segments, and gamma='auto' and the benchmarks' loop theory divide by it.
      want = TIMED_CALL_MS / 1e3 / per_iteration(one, more, ITERATIONS_TIMED)
      counts[g] = int(min(max(ITERATIONS_TIMED, math.ceil(want)), MAX_ITERATIONS_TIMED))
    rounds = [{g: timed(g, counts[g]) for g in gammas} for _ in range(TIMING_ROUNDS)]
    out = {}
    for g in gammas:
      one, more, start = (min(r[g][i] for r in rounds) for i in range(3))
      out[g] = (1e3 * per_iteration(one, more, counts[g]), 1e3 * start / size)
    return out

  return PROGRAMS.get(key, measure)


# Iterations `_iteration_ms` times beyond a call of one (their difference is what they
# cost): at least ITERATIONS_TIMED, more where they last under TIMED_CALL_MS (a small
# model's), up to MAX_ITERATIONS_TIMED; the least of TIMING_ROUNDS rounds counts.
ITERATIONS_TIMED = 8
MAX_ITERATIONS_TIMED = 64
TIMED_CALL_MS = 50.0
TIMING_ROUNDS = 4


def _merged_counters(rows, gamma: int):
  """Per-input counter dicts (position arrays of different gammas across phases, or none
  for target-only rows) stacked into [N, ...] arrays, padded with zeros to the widest,
  and under gamma='auto' to its largest candidate `gamma` (0: no such floor), so that
  calls with the same candidates stack alike (the launcher's chunks)."""
  names = sorted({k for r in rows for k in r})
  if not names:
    return None
  out = {}
  for name in names:
    values = [r.get(name) for r in rows]
    shape = max((np.shape(v) for v in values if v is not None), key=len)
    width = max((np.shape(v)[-1] for v in values if v is not None and np.ndim(v)), default=0)
    width = max(width, gamma) if width else 0
    template = np.zeros((width,) if len(shape) else (), np.asarray(
        next(v for v in values if v is not None)).dtype)
    padded = []
    for v in values:
      v = template if v is None else np.asarray(v)
      if v.ndim:
        v = np.pad(v, (0, width - v.shape[-1]))
      padded.append(v)
    out[name] = np.stack(padded)
  return out
