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
where the target's batched kernels round as at batch 1 (checked in the tests;
`generate`'s `batch_invariant` says why they may not). Sampling: each input i
brings its own key, fold_in(rng, i), split per iteration for its row alone
(`core.sampling.split_keys`), so a sampled output does not depend on the batch
either; verification is the usual exact rule, row by row.
"""

import dataclasses
import functools
import math
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding, theory
from specdec_jax.core.outputs import GenerateOutput, make_output, sequence_lengths
from specdec_jax.drafts.base import NOTHING, DraftStart, ProposalPlan
from specdec_jax.families.base import call_block, shift_block_fn
from specdec_jax.families.registry import family_of, is_model
from specdec_jax.programs import PROGRAMS, _start_target
from specdec_jax.settings import check_draft, check_steps, plan_settings, sampled, warn_once

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
  before them (their start overlapping it).
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

  @property
  def occupancy(self) -> float:
    return self.live_iterations / max(self.iterations * self.batch_size, 1)


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

  def segment(params, draft_params, state, stash, live, cursor, limit, host_waits, axes):
    """The loop from `state` ((carry, offset) of B slots), a free slot (a done row, or one
    no input holds: `live` [B] False) taking the next stash row (rows cursor..limit - 1
    of `stash`, inputs started together) before each iteration, in slot order. Runs
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

  def iterate(params, draft_params, carry, offset, count):
    """`count` (traced: one program for any count) iterations from `carry`, done rows or
    not (each costs what a live one does): what one iteration of this plan costs, timed
    by `_iteration_ms`."""
    return jax.lax.fori_loop(
        0, count, lambda _, c: decode_step(params, draft_params, c, offset), carry)

  return start, segment, iterate


def generate_many(model, inputs, lengths=None, *, batch_size: int, max_decode_steps: int,
                  draft=None, rng: Optional[Array] = None, temperature: float = 0.0,
                  topk: int = 0, topp: Optional[float] = None, eos_id: Optional[int] = None,
                  gamma: Union[int, str] = "auto", verification: str = "token",
                  block_width: Optional[int] = None, prior_alpha: Optional[float] = None,
                  prior: Optional[Dict[str, Any]] = None) -> ManyOutput:
  """Decodes every row of `inputs` through `batch_size` slots, refilling freed slots.

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
  draft_obj = None if draft is None else check_draft(config, draft, inputs, lengths, steps)
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
    width, measured = max(settings.gamma, 1), None
  else:
    results, usage, phases, width, measured = _auto_phases(
        model, draft_obj, tokens, row_lengths, slots, steps, settings_for, run, block_width,
        prior_alpha, prior)
  sequences = jnp.asarray(np.stack([results[i]["sequences"][1:] for i in range(n)]))
  counters = _merged_counters([results[i]["counters"] for i in range(n)],
                              width if chooses else 0)
  out = make_output(sequences, counters if draft_obj is not None else None,
                    settings_for(0).eos_id, width)
  stats = SlotStats(batch_size=slots, inputs=n, seconds=time.perf_counter() - wall,
                    phases=tuple(phases), measured=measured, **usage)
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


def _own_shape(draft) -> bool:
  """Whether a draft decodes at a shape of its own (a tree: its slots do not grow with
  gamma as a chain's gamma + 1 do)."""
  return draft.block_slots(1) != 2 or draft.block_slots(2) != 3


def _own_gamma(draft) -> int:
  """The gamma a draft decodes at under gamma='auto' where auto does not choose gamma (a
  tree's shape ignores it: its plan's key): 4, or the draft's most if fewer."""
  return 4 if draft is None else min(4, draft.max_gamma or 4)


def _auto_phases(model, draft, tokens, row_lengths, slots, steps, settings_for, run,
                 block_width, prior_alpha, prior):
  """gamma='auto': phases of inputs, each at the gamma chosen before it. Without
  `prior_alpha` the first phase (one stash) drafts at min(4, the draft's most) to measure
  alpha, unless the theory says speculation loses even at alpha = 1. `prior`: an earlier
  call's `measured`. Returns (results, usage, phases, the counters' gamma width,
  measured). A chain's plans are target-only and gamma 1, 2, 4, 8; a tree's (a draft of
  its own shape), target-only and that shape.

  What decides is each plan's expected time for the inputs not yet handed out: their
  loop iterations at it (tokens over the tokens a live row emits per iteration, spread
  over the slots, plus the tail where the last slot finishes alone) times the ms one
  iteration takes. A plan that has run (in this call or the prior's, at this batch size)
  is rated by what it measured: the wall time per iteration (refills, syncs and the
  loop's own work included), tokens per row iteration (acceptances that come in runs
  included) and how its inputs' iteration counts spread. A plan that has not is
  predicted: its iteration timed at this batch size, as slow against that timing as the
  slowest measured plan (refills taken out of its wall), plus its refills per token;
  E[tokens] at the acceptance so far for outputs of the inputs' mean length (each
  output's last iteration cut), scaled by what the speculative plans measured against
  that. Target-only counts at the better of its timing and its measurement.
  So a prediction can send a plan to be tried for one stash, and measurement alone keeps
  it: speculation stays only where it measured faster than target-only, the drain that
  leaving it costs counted (`_drain_iterations`). A plan that
  measured slower than its timing predicts, at the top of what its inputs' tokens per
  iteration allow, is tried again once the plan chosen has run REEXPLORE times as many
  iterations (its walls add up: the retries grow rarer). Each decision holds one stash and is made a stash ahead (that
  stash starts while the one before it decodes), except after a plan's first stash or
  a retry's, which are measured before anything follows them.
  """
  from specdec_jax.tools import speedup  # tools time programs; they import no entry point
  n = tokens.shape[0]
  if _own_shape(draft):
    # A tree (or another draft of its own shape): one speculative plan, at that shape,
    # against target-only (keyed by the gamma it decodes at when nothing chooses).
    most = _own_gamma(draft)
    candidates = [most]
  else:
    most = min(8, draft.max_gamma or 8)
    # Every plan's block fits the target-only width: the one given, or the default where
    # defaults are not the narrowest (bfloat16, accelerators: 8, so gamma <= 7 there;
    # float32 on CPU runs each plan at its own gamma + 1).
    fixed = settings_for(0).block_width
    if block_width is not None or fixed > 1:
      most = min(most, fixed - 1)
    # Powers of two: each candidate costs a compile and a timing, once per shape.
    candidates = [g for g in (1, 2, 4, 8) if g <= most]
  # The most drafts a plan's row can keep per iteration: a chain's gamma, a tree's deepest
  # path (greedy pending tokens included). Before a plan has run, its tokens per iteration
  # are the i.i.d. law's along that path (for a tree, the law of its one chain: at alpha
  # = 1 its most, which decides whether it is tried at all).
  path = {g: draft.proposal_depth(settings_for(g).sampling, g, settings_for(g).block_width)
          for g in candidates}
  # Each gamma's iteration costs its proposal and one target call at the block width it
  # runs at (gamma + 1 on CPU float32, else `block_width` or the default), and target-only
  # decoding one call at its own width: both relative to that, so the theory compares what
  # each phase would really run.
  widths = {g: settings_for(g).block_width for g in [0] + candidates}
  # C(k) and the draft's cost, recorded in the phases (a chain's; a tree's proposal is no
  # chain's, and its whole iteration is timed below, which is what decides).
  costs = dict(curve={}, draft={}) if _own_shape(draft) else _phase_costs(
      model, draft, tokens, row_lengths, slots, steps, candidates, sorted(set(widths.values())))
  # Each plan's whole loop iteration timed at this batch size (its proposal, its target
  # call, verification, sampling and bookkeeping) and its refill per input: what a plan
  # that has not run is predicted from (on a small model the loop's own work is a large
  # part of an iteration, and the cost curve's target calls alone would overpredict).
  timed = _iteration_ms(model, draft, tokens, row_lengths, slots, settings_for,
                        [0] + candidates)
  iteration = {g: ms for g, (ms, _) in timed.items()}
  refill = {g: ms for g, (_, ms) in timed.items()}
  eos_id = settings_for(0).eos_id
  results, phases = {}, []
  usage = dict(segments=0, refills=0, iterations=0, live_iterations=0, started_ahead=0)

  prior = prior or {}
  # gamma: sums over the inputs decoded at it (`sums_at`), the prior's at any batch size
  # (what a live row emits per iteration does not depend on the batch)
  earlier_sums = {int(g): dict(v) for g, v in prior.get("tokens", {}).items()}
  # gamma: [seconds, loop iterations] run at it (the prior's at the same batch size)
  walls: Dict[int, Tuple[float, int]] = {
      int(g): tuple(v) for g, v in prior.get("walls", {}).items()
  } if prior.get("batch_size") == slots else {}

  def sums_at():
    """{gamma: {inputs, tokens, tokens_sq, iterations, iterations_sq}}: sums over the
    inputs decoded at each gamma so far and the prior's (their tokens emitted and loop
    iterations, and the squares of each input's)."""
    gamma_of = {i: p["gamma"] for p in phases for i in range(*p["inputs"])}
    done = [i for i in results if i in gamma_of]
    out = {g: dict(v) for g, v in earlier_sums.items()}
    if done:  # numpy in: jnp would compile for each new count of inputs
      emitted = sequence_lengths(np.stack([results[i]["sequences"][1:] for i in done]), eos_id)
      for i, count in zip(done, emitted):
        sums = out.setdefault(int(gamma_of[i]), dict.fromkeys(_SUMS, 0.0))
        iterations = float(results[i]["counters"]["iterations"])
        for name, value in (("inputs", 1.0), ("tokens", float(count)),
                            ("iterations", iterations)):
          sums[name] += value
          if name != "inputs":
            sums[name + "_sq"] += value * value
    return {g: v for g, v in out.items() if v["iterations"]}

  def rates(alpha, remaining, unmeasured=None):
    """{gamma: `_Rate`} of every plan (tokens a live row emits per loop iteration, ms per
    loop iteration, the slots' expected occupancy over the `remaining` inputs, the ms a
    run of it loses when it drains, loop iterations per input): measured
    where it ran, else predicted (see above); gamma `unmeasured`'s time predicted as if
    it had not run and its tokens at the top of what its inputs measured
    (`_optimistic_tokens`): a retry's case."""
    sums = sums_at()
    inputs = sum(v["inputs"] for v in sums.values())
    per_input = spread = 0.0  # tokens per input: mean, standard deviation
    if inputs:
      per_input = sum(v["tokens"] for v in sums.values()) / inputs
      spread = _deviation(sum(v["tokens_sq"] for v in sums.values()) / inputs, per_input)
    per_input = max(per_input, 1.0) if inputs else float(steps)
    ms = {g: 1e3 * s / count for g, (s, count) in walls.items() if count and g != unmeasured}

    def refills_ms(g, tokens):
      """Plan g's refills per loop iteration: an input starts for every per_input / tokens
      row iterations."""
      return refill[g] * slots * tokens / per_input

    # How slow each measured plan ran against its timing, its refills taken out (at most
    # half its wall): the timing holds none, and a prediction adds its own plan's. Left
    # in, they were counted twice: on the scaled pair at B = 16 target-only's wall is 45
    # ms an iteration against 36 timed and 13 of refills, gamma 4's 99 against 74 and 33
    # (both 0.9 of their timing without refills, 1.25 and 1.35 with them).
    slowest = max(((ms[g] - min(refills_ms(g, sums[g]["tokens"] / sums[g]["iterations"]
                                           if g in sums else 1.0), ms[g] / 2)) / iteration[g]
                   for g in ms), default=1.0)
    # What the speculative plans emitted against E[tokens] at alpha for outputs of their
    # inputs' mean length (acceptances in runs give fewer than i.i.d. ones would), at
    # most 1, 1 before any; and how their inputs' iteration counts spread (each count's
    # deviation over its mean). The lengths count: each output's last iteration is cut,
    # which costs a deep plan more (gamma 8 emits 0.94 of eq. 1 at alpha 0.86 over 48
    # tokens, gamma 2 0.98), so a factor measured at one gamma carries over to another
    # only with them taken out.
    got = want = 0.0
    relative = [0.0]
    for g, v in sums.items():
      if g and v["inputs"]:
        got += v["tokens"]
        want += v["iterations"] * theory.expected_tokens_per_iteration(
            min(alpha, 0.999), g, max(v["tokens"] / v["inputs"], 1.0))
        mean = v["iterations"] / v["inputs"]
        relative.append(_deviation(v["iterations_sq"] / v["inputs"], mean) / mean)
    factor = min(1.0, got / want) if want else 1.0
    out = {}
    for g in [0] + candidates:
      if g in sums:
        v = sums[g]
        tokens = (_optimistic_tokens(v, path.get(g, g)) if g == unmeasured
                  else v["tokens"] / v["iterations"])
        each = v["iterations"] / v["inputs"]
        deviation = _deviation(v["iterations_sq"] / v["inputs"], each)
      elif not g:  # target-only: an iteration per token
        tokens, each, deviation = 1.0, per_input, spread
      else:
        tokens = factor * theory.expected_tokens_per_iteration(min(alpha, 0.999), path[g],
                                                               per_input)
        each = per_input / tokens
        deviation = each * max(max(relative), spread / per_input)
      # A plan that has not run at this batch size: target-only as timed, speculation as
      # slow against its timing as the slowest measured plan; plus its refills (each
      # input's start) per iteration, which speculation makes more frequent.
      predicted = iteration[g] * (slowest if g else 1.0) + refills_ms(g, tokens)
      # Target-only at the better of its timing and its measurement: on a shared machine
      # one slow spell must not make speculation look faster than it is (the error is
      # allowed the other way only: speculation kept where it may have won is lost
      # speed, speculation run where it loses breaks auto's promise).
      cost = (min(ms[0], predicted) if 0 in ms else predicted) if not g \
          else ms.get(g, predicted)
      out[g] = _Rate(tokens, cost, _occupancy(remaining, slots, each, deviation),
                     cost * _drain_iterations(slots, each, deviation,
                                              max(1.0, (start - run_start) / slots)), each)
    return out

  def speedups(alpha, remaining, unmeasured=None):
    """`choose_phase_gamma`'s arguments from `rates`: each speculative plan's iteration in
    target-only iterations per occupied slot (the curve; its proposal is inside it) and
    its tokens per row iteration against E[tokens] at alpha."""
    rated = rates(alpha, remaining, unmeasured)
    clamped = min(max(alpha, 0.0), 0.999)
    base = rated[0].ms / rated[0].occupancy
    curve = {g + 1: (r.ms / r.occupancy) / base for g, r in rated.items() if g}
    factors = {g: r.tokens / theory.expected_tokens_per_iteration(clamped, g)
               for g, r in rated.items() if g}
    return {g: 0.0 for g in candidates}, curve, None, factors

  def predicted_at(g, alpha):
    """gamma g's predicted speedup over target-only at `alpha` over the inputs not yet
    handed out (target-only: 1)."""
    if not g or alpha is None:
      return 1.0
    return speedup.phase_speedup(alpha, g, *speedups(alpha, n - start))

  def choose(alpha, current):
    """(gamma, predicted speedup, a retry) of the next stash at `alpha` (None: unmeasured),
    the inputs decoding at gamma `current` (None: none yet). Speculation must be
    predicted SWITCH_GAIN faster than what runs (target-only at least) to start, and
    faster than target-only to stay: the prediction's error is of the order of a shared
    machine's noise, and only speculation can lose against target-only."""
    if alpha is None:
      # Nothing measured: one stash at min(4, most) measures alpha, unless the timed
      # iterations say speculation loses even at alpha = 1.
      best, predicted = speedup.choose_phase_gamma(1.0, *speedups(1.0, n - start))
      if predicted < SWITCH_GAIN:
        return 0, 1.0, False
      return min(4, most), predicted, False
    best, predicted = speedup.choose_phase_gamma(alpha, *speedups(alpha, n - start))
    staying = predicted_at(current, alpha) if current else 1.0
    if best != current and predicted < SWITCH_GAIN * max(staying, 1.0):
      # Not a clear gain over what runs (a switch drains the slots): keep it, unless it
      # is speculation that no longer beats target-only, the drain counted: leaving
      # drains this run's rows (target-only then pays its own tail too), so speculation
      # is left only if target-only, that drain paid first, is still predicted to
      # decode the inputs left sooner. Uncounted, the tail of the last inputs made gamma 4
      # look slower near a stream's end: on the scaled pair at B = 16 auto left it
      # after 6 of 8 stashes and ran 0.92X where gamma 4 throughout ran 1.01X.
      best = current if current and staying >= leaving_below(current, alpha) else 0
      predicted = predicted_at(best, alpha)
    retry = retried(alpha, best)
    if retry is not None:
      return retry
    if best and 0 not in walls and walls:
      # Speculation measured, target-only only timed: one stash of target-only first, so
      # that speculation is kept only against a measured target-only.
      return 0, 1.0, False
    # One stash, then the next decision, from what this run measured by then: a plan not
    # measured yet is tried, not trusted, and a measured one that runs slower than its
    # measurements said is left after a stash, not after many (at batch 64 a stash is
    # 64 inputs). Staying costs nothing: the slots stay full while the gamma does.
    return best, predicted, False

  def leaving_below(current, alpha):
    """The speedup below which running speculation `current` is left for target-only:
    target-only's time for the inputs left against that time plus `current`'s drain."""
    rated = rates(alpha, n - start)
    alone = (n - start) * rated[0].iterations / (slots * rated[0].occupancy) * rated[0].ms
    return alone / (alone + rated[current].drain_ms) if alone > 0 else 1.0

  def retried(alpha, best):
    """(gamma, predicted speedup, True) of a speculative plan to measure again for one
    stash, or None: one that measured slower than its timing predicts, once the plan
    chosen has run REEXPLORE times its loop iterations (see there)."""
    if alpha is None or best not in walls:
      return None
    for g in candidates:
      if g != best and g in walls and walls[best][1] >= REEXPLORE * max(walls[g][1], 1):
        fresh = speedup.phase_speedup(alpha, g, *speedups(alpha, n - start, unmeasured=g))
        if fresh >= SWITCH_GAIN * max(predicted_at(best, alpha), 1.0):
          return g, fresh, True
    return None

  def measured_alpha(alpha):
    """The acceptance pooled over every input decoded so far (else `alpha`, as chosen at:
    a target-only phase measures none; 0 when nothing was ever measured)."""
    beta = [(r["counters"]["beta_sum"], r["counters"]["beta_count"])
            for r in results.values() if "beta_sum" in r["counters"]]
    count = sum(c for _, c in beta)
    if count:
      return float(sum(b for b, _ in beta) / count)
    return 0.0 if alpha is None else alpha

  def record(rows, gamma, predicted):
    """A phase: its inputs, gamma, the alpha and predicted speedup it was chosen at, and
    every plan as rated then (`rates`: tokens a live row emits per loop iteration, ms per
    loop iteration, the occupancy expected over the inputs left)."""
    rated = rates(1.0 if alpha is None else alpha, n - rows.start)
    phases.append(dict(inputs=[rows.start, rows.stop], gamma=gamma, alpha=alpha,
                       predicted_speedup=predicted, rated={
                           str(g): dict(tokens=r.tokens, ms=r.ms, occupancy=r.occupancy,
                                        drain_ms=r.drain_ms)
                           for g, r in rated.items()}))

  start, alpha = 0, prior_alpha if prior_alpha is not None else prior.get("alpha")
  run_start = 0  # the first input of the run decoding now: its slots started in step
  chosen = choose(alpha, None)
  while start < n:
    gamma, predicted, retry = chosen
    rows = range(start, min(n, start + stash_size(slots)))
    record(rows, gamma, predicted)
    start = rows.stop
    # A plan's first stash (or a retry's) is measured before anything follows it: the
    # next stash is not started ahead of that decision.
    probe = retry or gamma not in walls

    def more(so_far, used, seconds, ahead):
      """At a refill point with at most one stash waiting (`ahead`: one does): the next
      stash's inputs if it keeps this run's gamma (the slots stay full), else none (this
      run drains, the next starts), or None (not yet: ask at the next sync)."""
      nonlocal start, alpha, chosen, probe
      if start >= n:
        return []
      if len(so_far) < max(1, slots // 4):
        if ahead and probe:
          return None
        # Too little measured in this run to re-decide: one more stash at this gamma, so
        # that no finished row waits idle for a decision.
        after = range(start, min(n, start + stash_size(slots)))
        record(after, gamma, chosen[1])
        start = after.stop
        return after
      results.update(so_far)
      walls[gamma] = (earlier[0] + seconds, earlier[1] + used["iterations"])
      alpha = measured_alpha(alpha)
      chosen, probe = choose(alpha, gamma), False
      if start >= n or chosen[0] != gamma:
        return []
      after = range(start, min(n, start + stash_size(slots)))
      record(after, gamma, chosen[1])
      start = after.stop
      return after

    earlier = walls.get(gamma, (0.0, 0))
    run_start = rows.start
    began = time.perf_counter()
    got, used = run(settings_for(gamma), draft if gamma else None, rows, more=more)
    walls[gamma] = (earlier[0] + time.perf_counter() - began,
                    earlier[1] + used["iterations"])
    results.update(got)
    for name in usage:
      usage[name] += used[name]
    if start < n and chosen[0] == gamma:  # decided before this run's last inputs ended
      alpha = measured_alpha(alpha)
      chosen = choose(alpha, gamma)
  for phase in phases:
    phase["cost_curve"] = {str(k): v for k, v in costs["curve"].items()}
    phase["draft_cost"] = {str(g): v for g, v in costs["draft"].items()}
    phase["iteration_ms"] = {str(g): v for g, v in iteration.items()}
    phase["refill_ms"] = {str(g): ms for g, ms in refill.items()}
  alpha = measured_alpha(alpha)
  measured = dict(batch_size=slots, alpha=alpha,
                  tokens={str(g): v for g, v in sums_at().items()},
                  walls={str(g): list(v) for g, v in walls.items()})
  return results, usage, phases, max(candidates), measured


# gamma='auto''s sums per plan over the inputs decoded at it (`measured["tokens"]`).
_SUMS = ("inputs", "tokens", "tokens_sq", "iterations", "iterations_sq")


class _Rate(NamedTuple):
  """A plan as gamma='auto' rates it (`_auto_phases`' `rates`): tokens a live row emits
  per loop iteration, ms per loop iteration, the slots' expected occupancy over the
  inputs left, the ms a run of it loses when it drains (its rows finishing while no
  input follows them), and its loop iterations per input."""
  tokens: float
  ms: float
  occupancy: float
  drain_ms: float
  iterations: float


def _drain_iterations(slots: int, each: float, deviation: float,
                      inputs_per_slot: float = 1.0) -> float:
  """The loop iterations each slot loses, on average, when a run drains: `slots` rows in
  flight, each with what its input of `each` iterations (that deviation) has left, and
  no input to follow them, the run having handed `inputs_per_slot` inputs to each slot
  since its slots started together. The slots idle E[max] - E[mean] of their ends (the
  tails of `_occupancy`): in step, E[max of normals] x deviation x sqrt(inputs_per_slot)
  (each slot's counts summed since the run began: the slots drift apart as it goes on),
  out of step a renewal residual, whichever is smaller. 0 for counts that do not
  spread. Within 12% of simulated runs for 4 slots and more (the tests); at 2 slots the
  residual model reads 0.7-0.85 of them. Without the drift (before this was counted) a
  run of counts that hardly spread read 0.3 of its drain after 12 inputs a slot."""
  if slots <= 1 or each <= 0 or deviation <= 0:
    return 0.0
  in_step = _max_of_normals(slots) * deviation * max(inputs_per_slot, 1.0) ** 0.5
  return min(_out_of_step_idle(slots, each, deviation), in_step)


def _optimistic_tokens(sums, most: int) -> float:
  """Tokens per row iteration of a plan from its `sums`, RETRY_ERRORS standard errors
  up (at most `most` + 1: a chain's gamma, a tree's deepest path): what a retry is
  weighed at. A few inputs measure it roughly
  (on the decoder-only demo pair, gamma 4 emits 1.2-4.8 tokens an iteration on one input
  or another, 2.9 on average over the first 8, 3.7 over the rest), so a plan ruled out
  on a stash of hard inputs is measured again where it may be faster. The ratio's error
  by the delta method, its inputs' tokens and iterations taken as fully anticorrelated
  (their covariance is not summed): an upper bound."""
  count, rate = sums["inputs"], sums["tokens"] / sums["iterations"]
  each = sums["iterations"] / count
  spread = (_deviation(sums["tokens_sq"] / count, sums["tokens"] / count)
            + rate * _deviation(sums["iterations_sq"] / count, each))
  return min(rate + RETRY_ERRORS * spread / (each * count ** 0.5), most + 1.0)


def _deviation(mean_square: float, mean: float) -> float:
  """The standard deviation from the mean of the squares and the mean (0 if rounding
  leaves it negative)."""
  return max(mean_square - mean * mean, 0.0) ** 0.5


def _occupancy(remaining: int, slots: int, each: float, deviation: float) -> float:
  """The expected share of slot-iterations that do work while `remaining` inputs of
  `each` loop iterations (that standard deviation) go through `slots` slots, each freed
  slot taking the next input. The better of two models counts, each near exact where
  the other is pessimistic (within 0.015 of a simulation of the slots over normal
  counts, in the tests):

    in step       every used slot decodes k = remaining / used inputs in a row, the slots
                  as in step as they started (counts that hardly spread keep them so):
                  the last slot to finish decides, k * each + E[max of `used` standard
                  normals] * deviation * sqrt(k) iterations (its inputs' counts summed:
                  normal enough), against remaining * each / slots of work per slot
    out of step   when the last input is handed out, every slot is inside an input, the
                  iterations it has left distributed as a renewal process's residual
                  (density P(count > r) / each), independent: each slot then idles
                  E[max of `slots` residuals] - E[residual] on average (more inputs than
                  slots only)

  Speculation spreads the counts (acceptance is random), so a short call loses more of
  its slots to the tail than target-only does. The in-step model alone, taken for a
  stream of many inputs, read gamma 4's occupancy on the decoder-only demo pair at batch
  16 (128 inputs) as 0.74 where it ran 0.93, and ruled out speculation that ran 1.14X."""
  if remaining <= 0 or each <= 0:
    return 1.0
  used = min(slots, remaining)
  k = remaining / used
  in_step = remaining * each / slots / (k * each + _max_of_normals(used) * deviation * k ** 0.5)
  if remaining <= slots or deviation <= 0:
    return in_step
  idle = _out_of_step_idle(slots, each, deviation)
  return max(in_step, remaining * each / (remaining * each + slots * idle))


def _out_of_step_idle(slots: int, each: float, deviation: float) -> float:
  """Loop iterations each of `slots` slots idles, on average, once the slots are out of
  step and no input follows the ones in flight (counts of `each`, that deviation > 0):
  the spread rounded so that the quadrature is cached."""
  return each * _residual_tail(slots, round(deviation / each, 3))


def _normal_cdf(x: np.ndarray) -> np.ndarray:
  """P(N(0, 1) <= x), elementwise."""
  return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@functools.lru_cache(maxsize=None)
def _residual_tail(slots: int, spread: float) -> float:
  """E[max of `slots` residuals] - E[residual], in units of the mean count, for counts
  normal with deviation `spread` x mean (their positive part): a residual's density is
  P(count > r) / E[count]. By quadrature."""
  r = np.linspace(0.0, 1.0 + 8.0 * spread, 2001)
  survival = 1.0 - _normal_cdf((r - 1.0) / spread)
  cdf = np.concatenate([[0.0], np.cumsum((survival[1:] + survival[:-1]) / 2 * np.diff(r))])
  cdf = cdf / cdf[-1]
  return float(np.trapezoid(cdf - cdf ** slots, r))


@functools.lru_cache(maxsize=None)
def _max_of_normals(count: int) -> float:
  """E[max of `count` independent standard normals] (0 for one), by quadrature."""
  if count <= 1:
    return 0.0
  x = np.linspace(-8.0, 8.0, 4001)
  density = np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)
  return float(np.trapezoid(x * count * density * _normal_cdf(x) ** (count - 1), x))


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


# gamma='auto' starts speculating, or switches gamma, only for a predicted gain of this
# factor: a switch drains the slots, and the prediction's error on a shared machine is of
# this order (a switch to target-only needs none: speculation stays only where it wins).
SWITCH_GAIN = 1.05

# A speculative plan that measured slower than its timing predicts is measured again, for
# one stash, once the plan chosen instead has run this many times its loop iterations:
# one slow spell of a shared machine must not rule a plan out for a whole stream. Its
# walls add up, so each retry doubles the iterations the next one waits for: over a
# stream the retries cost at most about a 1 / REEXPLORE share of the time, less as it
# grows.
REEXPLORE = 16

# A retry weighs the plan's tokens per iteration this many standard errors above what its
# inputs measured (about the 98th percentile): exploration is optimistic, exploitation
# is not (a measured plan is chosen at what it measured).
RETRY_ERRORS = 2.0

# Iterations `_iteration_ms` times beyond a call of one (their difference is what they
# cost): at least ITERATIONS_TIMED, more where they last under TIMED_CALL_MS (a small
# model's), up to MAX_ITERATIONS_TIMED; the least of TIMING_ROUNDS rounds counts.
ITERATIONS_TIMED = 8
MAX_ITERATIONS_TIMED = 64
TIMED_CALL_MS = 50.0
TIMING_ROUNDS = 4


def _phase_costs(model, draft, tokens, row_lengths, slots, steps, candidates, widths):
  """C(k) for k = 1, each candidate gamma + 1 and each of `widths`, at batch `slots`, and
  the draft's cost per proposal of each candidate gamma, relative to one target step
  (cached per shape)."""
  from specdec_jax.tools import profiling
  key = ("slot_costs", model.config, draft.compile_key(), slots, tokens.shape[1], steps,
         tuple(candidates), tuple(widths))

  def measure():
    batch = tokens[:slots]
    # The profiling tools take what `generate` takes: prompt lengths only where the family
    # continues its context (T5's encoder lengths are read from the padding).
    continued = family_of(model).context(None, None).continued
    lens = row_lengths[:slots] if continued and row_lengths is not None else None
    ks = sorted({1} | {g + 1 for g in candidates} | set(widths))
    ms = profiling.time_block_calls({"target": model}, batch, max(steps, max(ks)) + 1, ks,
                                    repeats=3, calls=4, lengths=lens)["target"]
    probe = max(candidates)
    try:
      proposal = profiling.time_proposals(model, {"draft": draft}, batch, max(steps, 4) + 1,
                                          probe, repeats=3, calls=4, lengths=lens)["draft"]
    except Exception as e:  # a draft of one's own whose proposer needs more than its state
      raise ValueError(
          f"gamma='auto' times the draft's proposals alone (tools.profiling.time_proposals) "
          f"and could not time this {type(draft).__name__}'s ({type(e).__name__}: {e}); "
          "pass an int gamma instead") from e
    calls = draft.calls_per_proposal(probe)
    if calls:
      each = {g: proposal / calls * draft.calls_per_proposal(g) for g in candidates}
    else:  # lookups (n-gram, prompt lookup), no network call: about one cost at any gamma
      each = dict.fromkeys(candidates, proposal)
    return dict(curve={k: ms[k] / ms[1] for k in ks},
                draft={g: each[g] / ms[1] for g in candidates})

  return PROGRAMS.get(key, measure)


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
