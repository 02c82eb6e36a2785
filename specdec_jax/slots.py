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

Compiled programs: a start program for the first fill (batch_size rows), one segment
program and one refill program (a batch-1 start written into the slot, one dispatch),
all reused across refills: no recompilation per refill. The host syncs once per segment,
reading every slot's flags, tokens and counters in one transfer; refills are dispatched
without waiting. So a decode of N inputs costs about N host syncs beyond the loop's own
iterations (a segment ends when any row ends), each a few hundred microseconds on CPU
(`SlotStats.segments` counts them).

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
  target-only), with, under gamma='auto', the alpha and predicted speedup it was chosen at.
  """
  batch_size: int
  inputs: int
  segments: int
  refills: int
  iterations: int
  live_iterations: int
  seconds: float
  phases: Tuple[Dict[str, Any], ...] = ()

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
                  gamma: Union[int, str] = 4, verification: str = "token",
                  block_width: Optional[int] = None) -> ManyOutput:
  """Decodes every row of `inputs` through `batch_size` slots, refilling freed slots.

  Args:
    model: the target (any family). inputs: [N, C] int32, any N (T5 encoder tokens;
      decoder-only prompts, right-padded, with `lengths` [N]).
    batch_size: slots decoded together (>= 1; more than N is cut to N).
    max_decode_steps, draft, temperature / topk / topp, eos_id, verification,
      block_width: as `generate`'s (every draft kind, chains and trees).
    gamma: a chain's tokens per proposal, or "auto": chosen for this batch size from the
      target's cost curve C(k) measured at it, the draft's cost and the acceptance
      measured so far (`choose_phase_gamma`), 0 (target-only) where the theory predicts
      speculation loses; re-decided between phases of 4 x batch_size inputs.
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
  if auto and draft_obj is not None and draft_obj.block_slots(1) != 2:
    raise ValueError(f"gamma='auto' chooses a chain's gamma; a {type(draft_obj).__name__} "
                     "has a shape of its own: pass it without gamma")

  def settings_for(g):
    return plan_settings(config, None if g == 0 else draft_obj, max_decode_steps=steps,
                         temperature=temperature, topk=topk, topp=topp, eos_id=eos_id,
                         gamma=max(g, 1), verification=verification if g else "token",
                         block_width=block_width)

  n = tokens.shape[0]
  slots = min(int(batch_size), n)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  run = functools.partial(_decode_slots, model, family, tokens, row_lengths, slots, rng)
  if not auto or draft_obj is None:
    settings = settings_for(4 if auto else gamma)
    results, usage = run(settings, None if draft_obj is None else draft_obj, range(n))
    phases = [dict(inputs=[0, n], gamma=settings.gamma if draft_obj is not None else 0)]
  else:
    results, usage, phases = _auto_phases(model, draft_obj, tokens, row_lengths, slots, steps,
                                          settings_for, run, block_width)
  sequences = jnp.asarray(np.stack([results[i]["sequences"][1:] for i in range(n)]))
  counters = _merged_counters([results[i]["counters"] for i in range(n)])
  gammas = [p["gamma"] for p in phases]
  out = make_output(sequences, counters if draft_obj is not None else None,
                    settings_for(0).eos_id, max(gammas + [1]))
  stats = SlotStats(batch_size=slots, inputs=n, seconds=time.perf_counter() - wall,
                    phases=tuple(phases), **usage)
  return ManyOutput(out.sequences, out.lengths, out.stats, slots=stats)


def _decode_slots(model, family, tokens, row_lengths, slots, rng, settings, draft, rows):
  """Decodes the inputs `rows` (indices into tokens) through `slots` slots at `settings`:
  ({input index: dict(sequences, counters)}, usage counts)."""
  rows = list(rows)
  config = model.config
  key = ("slots", config, None if draft is None else draft.compile_key(), settings)
  # The carry is donated to the segment and refill programs: updated in place, not copied
  # (the cache's every row) at each call.
  start_fn, segment_fn, refill_fn = PROGRAMS.get(key, lambda: _compiled(
      *_programs(family, config, draft, settings)))
  params = model.params
  draft_params = None if draft is None else draft.params
  slots = min(slots, len(rows))

  def inputs_of(indices):
    indices = np.asarray(indices, np.int32)
    lens = None if row_lengths is None else jnp.asarray(row_lengths[indices])
    return jnp.asarray(tokens[indices]), lens, jnp.asarray(indices)

  state = start_fn(params, draft_params, rng, *inputs_of(rows[:slots]))
  owner: List[Optional[int]] = list(rows[:slots])   # the input each slot decodes
  waiting = rows[slots:]
  results: Dict[int, Any] = {}
  usage = dict(segments=0, refills=0, iterations=0, live_iterations=0)
  before = np.zeros((slots,), np.int64)  # each slot's iterations when the segment starts
  while any(o is not None for o in owner):
    live = np.asarray([o is not None for o in owner])
    state = segment_fn(params, draft_params, state, jnp.asarray(live))
    usage["segments"] += 1
    # The host's one sync per segment: every slot's flags, tokens and counters at once.
    carry = state[0]
    done, sequences, counters = jax.device_get(
        (carry.done, carry.sequences, carry.counters.as_dict()))
    delta = (counters["iterations"] - before)[live]
    usage["iterations"] += int(delta.max()) if delta.size else 0
    usage["live_iterations"] += int(delta.sum())
    before = counters["iterations"].astype(np.int64)
    for s, o in enumerate(owner):
      if o is None or not done[s]:
        continue
      results[o] = dict(sequences=sequences[s],
                        counters={name: v[s] for name, v in counters.items()})
      if waiting:
        state = refill_fn(state, params, draft_params, rng, *inputs_of(waiting[:1]), s)
        owner[s] = waiting.pop(0)
        before[s] = 0
        usage["refills"] += 1
      else:
        owner[s] = None
  return results, usage


def _compiled(start, segment):
  """The jitted (start, segment, refill) of one static plan. Each input's key is
  fold_in(rng, its index), made in the program. Refill starts one input at batch 1 and
  writes it into a slot, one dispatch; it and segment update the state (the loop's carry
  and each row's position offset) in place (donated)."""

  def start_rows(params, draft_params, rng, tokens, lengths, indices):
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(indices)
    return start(params, draft_params, tokens, lengths, keys)

  def segment_state(params, draft_params, state, live):
    carry, offset = state
    return segment(params, draft_params, carry, offset, live), offset

  def refill(state, params, draft_params, rng, tokens, lengths, indices, slot):
    row = start_rows(params, draft_params, rng, tokens, lengths, indices)
    slots = jax.tree_util.tree_leaves(state[0].done)[0].shape[0]
    return jax.tree_util.tree_map(functools.partial(_put_row, slot=slot, slots=slots), state,
                                  row)

  return (jax.jit(start_rows), jax.jit(segment_state, donate_argnums=(2,)),
          jax.jit(refill, donate_argnums=(0,)))


def _put_row(big, small, *, slot, slots: int):
  """big (a state leaf of `slots` rows) with small (the same leaf of one fresh row) written
  at `slot` of its batch axis: the one axis where their shapes differ. A leaf of equal
  shapes has no batch axis (kept), unless there is one slot (the fresh row replaces it)."""
  differ = [i for i, (x, y) in enumerate(zip(big.shape, small.shape)) if x != y]
  if not differ:
    return small.astype(big.dtype) if slots == 1 else big
  return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, differ[0])


def _auto_phases(model, draft, tokens, row_lengths, slots, steps, settings_for, run,
                 block_width):
  """gamma='auto': phases of inputs, each at the gamma chosen before it (see
  `choose_phase_gamma`). The first phase (one batch) drafts at min(4, the draft's most)
  to measure alpha, unless the theory says speculation loses even at alpha = 1."""
  from specdec_jax.tools import speedup  # tools time programs; they import no entry point
  n = tokens.shape[0]
  most = min(8, draft.max_gamma or 8)
  if block_width is not None:
    most = min(most, block_width - 1)
  candidates = [g for g in (1, 2, 3, 4, 6, 8) if g <= most]
  costs = _phase_costs(model, draft, tokens, row_lengths, slots, steps, candidates)
  results, phases = {}, []
  usage = dict(segments=0, refills=0, iterations=0, live_iterations=0)
  start, alpha = 0, None
  while start < n:
    if alpha is None:
      best, predicted = speedup.choose_phase_gamma(1.0, costs["draft"], costs["curve"])
      gamma = 0 if best == 0 else min(4, most)
      size = slots
    else:
      gamma, predicted = speedup.choose_phase_gamma(alpha, costs["draft"], costs["curve"])
      size = 4 * slots
    rows = range(start, min(n, start + size))
    got, used = run(settings_for(gamma), draft if gamma else None, rows)
    results.update(got)
    for name in usage:
      usage[name] += used[name]
    phases.append(dict(inputs=[start, rows.stop], gamma=gamma, alpha=alpha,
                       predicted_speedup=predicted))
    start = rows.stop
    beta = [(r["counters"]["beta_sum"], r["counters"]["beta_count"]) for r in results.values()
            if "beta_sum" in r["counters"]]
    if beta:
      alpha = float(sum(b for b, _ in beta) / max(sum(c for _, c in beta), 1))
    elif alpha is None:
      alpha = 0.0  # target-only from the start: nothing measured, nothing to gain
  for phase in phases:
    phase["cost_curve"] = {str(k): v for k, v in costs["curve"].items()}
  return results, usage, phases


def _phase_costs(model, draft, tokens, row_lengths, slots, steps, candidates):
  """C(k) for k = 1 and each candidate gamma + 1, at batch `slots`, and the draft's cost
  per proposal of each candidate gamma, relative to one target step (cached per shape)."""
  from specdec_jax.tools import profiling
  key = ("slot_costs", model.config, draft.compile_key(), slots, tokens.shape[1], steps,
         tuple(candidates))

  def measure():
    batch = tokens[:slots]
    # The profiling tools take what `generate` takes: prompt lengths only where the family
    # continues its context (T5's encoder lengths are read from the padding).
    continued = family_of(model).context(None, None).continued
    lens = row_lengths[:slots] if continued and row_lengths is not None else None
    ks = sorted({1} | {g + 1 for g in candidates})
    ms = profiling.time_block_calls({"target": model}, batch, max(steps, max(ks)) + 1, ks,
                                    repeats=3, calls=4, lengths=lens)["target"]
    probe = max(candidates)
    proposal = profiling.time_proposals(model, {"draft": draft}, batch, max(steps, 4) + 1,
                                        probe, repeats=3, calls=4, lengths=lens)["draft"]
    per_call = proposal / draft.calls_per_proposal(probe) / ms[1]
    return dict(curve={k: ms[k] / ms[1] for k in ks},
                draft={g: per_call * draft.calls_per_proposal(g) for g in candidates})

  return PROGRAMS.get(key, measure)


def _merged_counters(rows):
  """Per-input counter dicts (position arrays of different gammas across phases, or none
  for target-only rows) stacked into [N, ...] arrays, padded with zeros."""
  names = sorted({k for r in rows for k in r})
  if not names:
    return None
  out = {}
  for name in names:
    values = [r.get(name) for r in rows]
    shape = max((np.shape(v) for v in values if v is not None), key=len)
    width = max((np.shape(v)[-1] for v in values if v is not None and np.ndim(v)), default=0)
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
