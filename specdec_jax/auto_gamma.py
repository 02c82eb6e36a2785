"""gamma='auto': the plan (target-only, or a chain's gamma 1, 2, 4, 8, or a tree's shape)
each stash of `generate_many`'s inputs decodes at, chosen from what each plan measured
where it ran, else from its loop iteration timed at the batch size and the acceptance so
far (`_auto_phases`; generate_many's docstring says the rule).

The slot engine (slots.py) runs the phases; this module decides them. It imports no
engine: what it asks of one (run some inputs at a plan, time plans' iterations, the
stash size) comes in as an `Engine`, so that the planner's arithmetic can be read and
tested on its own and the engine changes without it.
"""

import functools
import math
import time
from typing import Any, Callable, Dict, NamedTuple, Tuple

import numpy as np

from specdec_jax.core import theory
from specdec_jax.core.outputs import sequence_lengths
from specdec_jax.families.registry import family_of
from specdec_jax.programs import PROGRAMS


class Engine(NamedTuple):
  """What the planner asks of the slot engine. run(settings, draft, rows, more=None) ->
  (results, usage): the inputs `rows` decoded at a plan (`slots._decode_slots`);
  time_plans(gammas) -> {gamma: (ms of one loop iteration, ms of one refill)}
  (`slots._iteration_ms`); stash: inputs started together."""
  run: Callable[..., Tuple[Dict[int, Any], Dict[str, int]]]
  time_plans: Callable[[list], Dict[int, Tuple[float, float]]]
  stash: int


def _own_shape(draft) -> bool:
  """Whether a draft decodes at a shape of its own (a tree: its slots do not grow with
  gamma as a chain's gamma + 1 do)."""
  return draft.block_slots(1) != 2 or draft.block_slots(2) != 3


def _own_gamma(draft) -> int:
  """The gamma a draft decodes at under gamma='auto' where auto does not choose gamma (a
  tree's shape ignores it: its plan's key): 4, or the draft's most if fewer."""
  return 4 if draft is None else min(4, draft.max_gamma or 4)


def _auto_phases(model, draft, tokens, row_lengths, slots, steps, settings_for, engine,
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
  timed = engine.time_plans([0] + candidates)
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
    rows = range(start, min(n, start + engine.stash))
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
        after = range(start, min(n, start + engine.stash))
        record(after, gamma, chosen[1])
        start = after.stop
        return after
      results.update(so_far)
      walls[gamma] = (earlier[0] + seconds, earlier[1] + used["iterations"])
      alpha = measured_alpha(alpha)
      chosen, probe = choose(alpha, gamma), False
      if start >= n or chosen[0] != gamma:
        return []
      after = range(start, min(n, start + engine.stash))
      record(after, gamma, chosen[1])
      start = after.stop
      return after

    earlier = walls.get(gamma, (0.0, 0))
    run_start = rows.start
    began = time.perf_counter()
    got, used = engine.run(settings_for(gamma), draft if gamma else None, rows, more=more)
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
