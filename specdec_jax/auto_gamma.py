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
from absl import logging

from specdec_jax.core import theory
from specdec_jax.core.outputs import sequence_lengths


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


def _auto_phases(draft, n, slots, steps, settings_for, engine, block_width, prior_alpha,
                 prior, stream_left=None):
  """gamma='auto': phases of the `n` inputs, each at the gamma chosen before it. Without
  `prior_alpha` the first phase (one stash) drafts at the probe (the largest candidate up
  to 4) to measure alpha, unless the theory says speculation loses even at alpha = 1.
  `prior`: an earlier call's `measured`. `stream_left`: inputs the stream has from this
  call's first on (default n), what a plan's compile is weighed against. Returns
  (results, usage, phases, the counters' gamma width, measured, planning). A chain's
  plans are target-only and gamma 1, 2, 4, 8; a tree's (a draft of its own shape),
  target-only and that shape.

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
  leaving it costs counted (`_drain_iterations`). A plan that measured slower than its
  timing predicts, at the top of what its inputs' tokens per iteration allow, is tried
  again once the plan chosen has run REEXPLORE times as many iterations (its walls add
  up: the retries grow rarer). Each decision holds one stash and is made a stash ahead
  (that stash starts while the one before it decodes), except after a plan's first
  stash or a retry's, which are measured before anything follows them.

  The plan search is bounded (`_Planner.search`): timing a plan compiles its programs,
  seconds on a small model whose whole stream decodes in less. Target-only is timed
  first; a speculative plan only where, at its best case (its iteration no dearer than
  the timed plans around it allow, `_Planner.optimistic_ms`), it could beat the best
  timed plan and would save more over the stream left than its compile and timing cost
  (as long as the plans prepared so far took). A cold launcher run on the tiny demo
  pair (8 inputs) spent 48 s more under auto than at gamma 4 timing plans that could
  never pay (each decision is logged, and the planning seconds returned).
  """
  planner = _Planner(draft, n, slots, steps, settings_for, engine, block_width, prior or {},
                     stream_left)
  planner.decode(prior_alpha if prior_alpha is not None else (prior or {}).get("alpha"))
  return planner.outputs()


def _candidates(draft, settings_for, block_width):
  """The speculative plans gamma='auto' chooses among: a tree's own shape (keyed by the
  gamma it decodes at when nothing chooses), or a chain's powers of two up to its most."""
  if _own_shape(draft):
    return [_own_gamma(draft)]
  most = min(8, draft.max_gamma or 8)
  # Every plan's block fits the target-only width: the one given, or the default where
  # defaults are not the narrowest (bfloat16, accelerators: 8, so gamma <= 7 there;
  # float32 on CPU runs each plan at its own gamma + 1).
  fixed = settings_for(0).block_width
  if block_width is not None or fixed > 1:
    most = min(most, fixed - 1)
  # Powers of two: each candidate costs a compile and a timing, once per shape.
  return [g for g in (1, 2, 4, 8) if g <= most]


class _Planner:
  """One gamma='auto' call's state: what it measured, the phases so far, the plans timed.
  Its methods are `_auto_phases`' steps (see there)."""

  def __init__(self, draft, n, slots, steps, settings_for, engine, block_width, prior,
               stream_left):
    from specdec_jax.tools import speedup  # tools time programs; they import no entry point
    self.speedup = speedup
    self.draft, self.n, self.slots, self.steps = draft, n, slots, steps
    self.settings_for, self.engine = settings_for, engine
    self.candidates = _candidates(draft, settings_for, block_width)
    self.probe = max(g for g in self.candidates if g <= 4) if min(self.candidates) <= 4 \
        else self.candidates[0]
    # The most drafts a plan's row can keep per iteration: a chain's gamma, a tree's
    # deepest path (greedy pending tokens included). Before a plan has run, its tokens per
    # iteration are the i.i.d. law's along that path (for a tree, the law of its one
    # chain: at alpha = 1 its most, which decides whether it is tried at all).
    self.path = {g: draft.proposal_depth(settings_for(g).sampling, g,
                                         settings_for(g).block_width)
                 for g in self.candidates}
    self.eos_id = settings_for(0).eos_id
    self.results, self.phases = {}, []
    self.usage = dict(segments=0, refills=0, iterations=0, live_iterations=0,
                      started_ahead=0)
    # gamma: sums over the inputs decoded at it (`sums_at`), the prior's at any batch size
    # (what a live row emits per iteration does not depend on the batch)
    self.earlier_sums = {int(g): dict(v) for g, v in prior.get("tokens", {}).items()}
    # gamma: [seconds, loop iterations] run at it (the prior's at the same batch size)
    self.walls: Dict[int, Tuple[float, int]] = {
        int(g): tuple(v) for g, v in prior.get("walls", {}).items()
    } if prior.get("batch_size") == slots else {}
    # Each timed plan's loop iteration and refill, ms (`time`); what preparing one plan
    # costs here (the prior's, else what this call's first timings took).
    self.iteration: Dict[int, float] = {}
    self.refill: Dict[int, float] = {}
    self.plan_seconds = float(prior.get("plan_seconds") or 0.0)
    self.planning = dict(seconds=0.0, timed=[], untimed={})
    self.stream_left = max(int(stream_left or n), n)
    self.start = self.run_start = 0  # run_start: the run decoding now's first input
    self.alpha = None
    self.time([0])

  def time(self, gammas):
    """Times plans `gammas` with target-only, in the same rounds (`Engine.time_plans`:
    compiled and timed once per shape in a process, later calls read them back), and
    logs each: target-only is kept at the least of its timings (the error allowed runs
    the safe way: speculation must not look faster for a slow spell)."""
    began = time.perf_counter()
    timed = self.engine.time_plans(sorted({0, *gammas}))
    seconds = time.perf_counter() - began
    fresh = [g for g in timed if g not in self.iteration]
    self.planning["seconds"] += seconds
    if fresh and seconds > 0.05 * len(fresh):  # compiled here, not read back
      self.plan_seconds = max(self.plan_seconds, seconds / len(fresh))
    for g, (ms, refill) in sorted(timed.items()):
      self.iteration[g] = min(ms, self.iteration.get(g, ms))
      self.refill[g] = refill
      if g in fresh:
        self.planning["timed"].append(g)
        self.planning["untimed"].pop(str(g), None)
        logging.info("gamma='auto': timed %s at batch %d: %.3f ms an iteration, %.3f ms a "
                     "refill (planning %.1f s so far: compiles and timings)", _plan_name(g),
                     self.slots, ms, refill, self.planning["seconds"])

  def sums_at(self):
    """{gamma: {inputs, tokens, tokens_sq, iterations, iterations_sq}}: sums over the
    inputs decoded at each gamma so far and the prior's (their tokens emitted and loop
    iterations, and the squares of each input's)."""
    gamma_of = {i: p["gamma"] for p in self.phases for i in range(*p["inputs"])}
    done = [i for i in self.results if i in gamma_of]
    out = {g: dict(v) for g, v in self.earlier_sums.items()}
    if done:  # numpy in: jnp would compile for each new count of inputs
      emitted = sequence_lengths(
          np.stack([self.results[i]["sequences"][1:] for i in done]), self.eos_id)
      for i, count in zip(done, emitted):
        sums = out.setdefault(int(gamma_of[i]), dict.fromkeys(_SUMS, 0.0))
        iterations = float(self.results[i]["counters"]["iterations"])
        for name, value in (("inputs", 1.0), ("tokens", float(count)),
                            ("iterations", iterations)):
          sums[name] += value
          if name != "inputs":
            sums[name + "_sq"] += value * value
    return {g: v for g, v in out.items() if v["iterations"]}

  def optimistic_ms(self, g):
    """An untimed chain plan's iteration at its best: on the line between the timed plans
    around it (a proposal's cost grows with gamma, a target call's jumps from one token
    to a block then grows slowly, so the line is at or under it), else the deepest timed
    plan below it's (deeper never costs less)."""
    below = max(t for t in self.iteration if t < g)
    above = [t for t in self.iteration if t > g]
    if not above:
      return self.iteration[below]
    up = min(above)
    low, high = self.iteration[below], self.iteration[up]
    return low + (high - low) * (g - below) / (up - below)

  def rates(self, alpha, remaining, unmeasured=None, optimistic=False):
    """{gamma: `_Rate`} of every timed plan (tokens a live row emits per loop iteration,
    ms per loop iteration, the slots' expected occupancy over the `remaining` inputs, the
    ms a run of it loses when it drains, loop iterations per input): measured where it
    ran, else predicted (see `_auto_phases`); gamma `unmeasured`'s time predicted as if
    it had not run and its tokens at the top of what its inputs measured
    (`_optimistic_tokens`): a retry's case. `optimistic`: the untimed plans too, each at
    `optimistic_ms`."""
    sums = self.sums_at()
    inputs = sum(v["inputs"] for v in sums.values())
    per_input = spread = 0.0  # tokens per input: mean, standard deviation
    if inputs:
      per_input = sum(v["tokens"] for v in sums.values()) / inputs
      spread = _deviation(sum(v["tokens_sq"] for v in sums.values()) / inputs, per_input)
    per_input = max(per_input, 1.0) if inputs else float(self.steps)
    # The plans rated: those timed, those measured (a prior's walls: what decides them
    # needs no timing) and with `optimistic` the rest, each untimed one at its best case.
    iteration = dict(self.iteration)
    iteration.update({g: self.optimistic_ms(g) for g in self.candidates
                      if g not in iteration and (optimistic or g in self.walls)})
    refill = {g: self.refill.get(g, self.refill[0]) for g in iteration}
    ms = {g: 1e3 * s / count for g, (s, count) in self.walls.items()
          if count and g != unmeasured and g in iteration}
    model = _RateModel(sums, per_input, spread, alpha, self.slots, refill, iteration, ms,
                       set(self.iteration))
    drift = max(1.0, (self.start - self.run_start) / self.slots)
    return {g: model.rate(g, remaining, drift, self.path.get(g, g), g == unmeasured)
            for g in sorted(iteration)}

  def speedups(self, alpha, remaining, unmeasured=None, optimistic=False):
    """`choose_phase_gamma`'s arguments from `rates`: each speculative plan's iteration in
    target-only iterations per occupied slot (the curve; its proposal is inside it) and
    its tokens per row iteration against E[tokens] at alpha."""
    rated = self.rates(alpha, remaining, unmeasured, optimistic)
    clamped = min(max(alpha, 0.0), 0.999)
    base = rated[0].ms / rated[0].occupancy
    curve = {g + 1: (r.ms / r.occupancy) / base for g, r in rated.items() if g}
    factors = {g: r.tokens / theory.expected_tokens_per_iteration(clamped, g)
               for g, r in rated.items() if g}
    return {g: 0.0 for g in rated if g}, curve, None, factors

  def predicted_at(self, g, alpha, optimistic=False):
    """gamma g's predicted speedup over target-only at `alpha` over the inputs not yet
    handed out (target-only: 1)."""
    if not g or alpha is None:
      return 1.0
    return self.speedup.phase_speedup(
        alpha, g, *self.speedups(alpha, self.n - self.start, optimistic=optimistic))

  def alone_seconds(self, alpha):
    """Target-only's expected seconds for the stream's inputs not yet handed out."""
    left = self.stream_left - self.start
    rated = self.rates(alpha, left)[0]
    return left * rated.iterations / (self.slots * rated.occupancy) * rated.ms / 1e3

  def search(self, alpha):
    """Times the untimed plans worth it at `alpha` (None: alpha = 1, nothing measured),
    one at a time (the probe first), each timing tightening the others' best case: a plan
    is worth timing where its best case beats the best timed plan by SWITCH_GAIN and
    saves more over the stream left than a plan's compile and timing cost here. Those
    left out are recorded with why (`planning['untimed']`)."""
    alpha = 1.0 if alpha is None else alpha
    while True:
      missing = [g for g in self.candidates if g not in self.iteration]
      if missing and not self.plan_seconds:
        # Timing costs nothing here (every plan read back, or timings that compile
        # nothing): every plan is timed, in the same rounds, so none is ruled out by
        # another's best case (and a measured plan's timing says how slow it ran).
        self.time(missing)
        return
      # A plan measured (a prior's walls) is rated by them: it needs no timing.
      untimed = [g for g in missing if g not in self.walls]
      if not untimed:
        return
      best = max([1.0] + [self.predicted_at(g, alpha)
                          for g in self.rates(alpha, self.n - self.start) if g])
      alone = self.alone_seconds(alpha)
      worth = []
      for g in untimed:
        could = self.predicted_at(g, alpha, optimistic=True)
        saved = alone / best - alone / could
        if could < SWITCH_GAIN * best:
          why = f"could not beat {best:.2f}X at alpha {alpha:.2f} (at most {could:.2f}X)"
        elif saved <= self.plan_seconds:
          why = (f"would save at most {saved:.2f} s over the {self.stream_left - self.start}"
                 f" inputs left, its compile and timing ~{self.plan_seconds:.1f} s")
        else:
          worth.append(g)
          continue
        # The first reason stands: what kept the plan untimed when it was first weighed.
        self.planning["untimed"].setdefault(str(g), why)
      if not worth:
        return
      self.time([self.probe if self.probe in worth else worth[-1]])

  def choose(self, alpha, current):
    """(gamma, predicted speedup, a retry) of the next stash at `alpha` (None: unmeasured),
    the inputs decoding at gamma `current` (None: none yet), after the plans worth timing
    are timed (`search`). Speculation must be predicted SWITCH_GAIN faster than what runs
    (target-only at least) to start, and faster than target-only to stay: the
    prediction's error is of the order of a shared machine's noise, and only speculation
    can lose against target-only."""
    self.search(alpha)
    remaining = self.n - self.start
    if alpha is None:
      # Nothing measured: one stash at the probe measures alpha, unless the timed
      # iterations say speculation loses even at alpha = 1 (or none could pay for its
      # timing).
      best, predicted = self.speedup.choose_phase_gamma(1.0, *self.speedups(1.0, remaining))
      if predicted < SWITCH_GAIN or self.probe not in self.iteration:
        return 0, 1.0, False
      return self.probe, predicted, False
    best, predicted = self.speedup.choose_phase_gamma(alpha, *self.speedups(alpha, remaining))
    staying = self.predicted_at(current, alpha) if current else 1.0
    if best != current and predicted < SWITCH_GAIN * max(staying, 1.0):
      # Not a clear gain over what runs (a switch drains the slots): keep it, unless it
      # is speculation that no longer beats target-only, the drain counted: leaving
      # drains this run's rows (target-only then pays its own tail too), so speculation
      # is left only if target-only, that drain paid first, is still predicted to
      # decode the inputs left sooner. Uncounted, the tail of the last inputs made gamma 4
      # look slower near a stream's end: on the scaled pair at B = 16 auto left it
      # after 6 of 8 stashes and ran 0.92X where gamma 4 throughout ran 1.01X.
      best = current if current and staying >= self.leaving_below(current, alpha) else 0
      predicted = self.predicted_at(best, alpha)
    retry = self.retried(alpha, best)
    if retry is not None:
      return retry
    if best and 0 not in self.walls and self.walls:
      # Speculation measured, target-only only timed: one stash of target-only first, so
      # that speculation is kept only against a measured target-only.
      return 0, 1.0, False
    # One stash, then the next decision, from what this run measured by then: a plan not
    # measured yet is tried, not trusted, and a measured one that runs slower than its
    # measurements said is left after a stash, not after many (at batch 64 a stash is
    # 64 inputs). Staying costs nothing: the slots stay full while the gamma does.
    return best, predicted, False

  def leaving_below(self, current, alpha):
    """The speedup below which running speculation `current` is left for target-only:
    target-only's time for the inputs left against that time plus `current`'s drain."""
    left = self.n - self.start
    rated = self.rates(alpha, left)
    alone = left * rated[0].iterations / (self.slots * rated[0].occupancy) * rated[0].ms
    return alone / (alone + rated[current].drain_ms) if alone > 0 else 1.0

  def retried(self, alpha, best):
    """(gamma, predicted speedup, True) of a speculative plan to measure again for one
    stash, or None: one that measured slower than its timing predicts, once the plan
    chosen has run REEXPLORE times its loop iterations (see `_auto_phases`)."""
    walls = self.walls
    if alpha is None or best not in walls:
      return None
    for g in self.candidates:
      if g != best and g in walls and walls[best][1] >= REEXPLORE * max(walls[g][1], 1):
        fresh = self.speedup.phase_speedup(
            alpha, g, *self.speedups(alpha, self.n - self.start, unmeasured=g))
        if fresh >= SWITCH_GAIN * max(self.predicted_at(best, alpha), 1.0):
          return g, fresh, True
    return None

  def measured_alpha(self, alpha):
    """The acceptance pooled over every input decoded so far (else `alpha`, as chosen at:
    a target-only phase measures none; 0 when nothing was ever measured)."""
    beta = [(r["counters"]["beta_sum"], r["counters"]["beta_count"])
            for r in self.results.values() if "beta_sum" in r["counters"]]
    count = sum(c for _, c in beta)
    if count:
      return float(sum(b for b, _ in beta) / count)
    return 0.0 if alpha is None else alpha

  def record(self, rows, gamma, predicted):
    """A phase: its inputs, gamma, the alpha and predicted speedup it was chosen at, and
    every plan as rated then (`rates`: tokens a live row emits per loop iteration, ms per
    loop iteration, the occupancy expected over the inputs left). A change of plan is
    logged with every timed plan's predicted speedup (what the choice was made from)."""
    alpha = 1.0 if self.alpha is None else self.alpha
    rated = self.rates(alpha, self.n - rows.start)
    self.phases.append(dict(
        inputs=[rows.start, rows.stop], gamma=gamma, alpha=self.alpha,
        predicted_speedup=predicted, rated={
            str(g): dict(tokens=r.tokens, ms=r.ms, occupancy=r.occupancy, drain_ms=r.drain_ms)
            for g, r in rated.items()}))
    if len(self.phases) == 1 or self.phases[-2]["gamma"] != gamma:
      others = ", ".join(f"{_plan_name(g)} {self.predicted_at(g, alpha):.2f}X"
                         for g in rated if g)
      logging.info("gamma='auto': inputs %d-%d at %s (alpha %s; predicted over target-only: "
                   "%s)", rows.start, rows.stop - 1, _plan_name(gamma),
                   "not measured yet" if self.alpha is None else f"{self.alpha:.2f}",
                   others or "no speculative plan timed")

  def stash(self, gamma, predicted):
    """The next stash's inputs, recorded at `gamma`."""
    rows = range(self.start, min(self.n, self.start + self.engine.stash))
    self.record(rows, gamma, predicted)
    self.start = rows.stop
    return rows

  def decode(self, alpha):
    """Every input, phase by phase, from the acceptance `alpha` (None: unmeasured)."""
    self.alpha = alpha
    chosen = self.choose(alpha, None)
    while self.start < self.n:
      gamma, predicted, retry = chosen
      rows = self.stash(gamma, predicted)
      # A plan's first stash (or a retry's) is measured before anything follows it: the
      # next stash is not started ahead of that decision.
      self.probing = retry or gamma not in self.walls
      self.chosen = chosen
      earlier = self.walls.get(gamma, (0.0, 0))
      self.run_start, began, planned = rows.start, time.perf_counter(), self.planning["seconds"]
      got, used = self.engine.run(self.settings_for(gamma), self.draft if gamma else None,
                                  rows, more=functools.partial(self.more, gamma, earlier, planned))
      # A plan timed while this run decoded is no part of its wall.
      wall = time.perf_counter() - began - (self.planning["seconds"] - planned)
      self.walls[gamma] = (earlier[0] + wall, earlier[1] + used["iterations"])
      self.results.update(got)
      for name in self.usage:
        self.usage[name] += used[name]
      chosen = self.chosen
      if self.start < self.n and chosen[0] == gamma:  # decided before this run's last ended
        self.alpha = self.measured_alpha(self.alpha)
        chosen = self.choose(self.alpha, gamma)

  def more(self, gamma, earlier, planned, so_far, used, seconds, ahead):
    """At a refill point of the run at `gamma` with at most one stash waiting (`ahead`: one
    does): the next stash's inputs if it keeps this run's gamma (the slots stay full),
    else none (this run drains, the next starts), or None (not yet: ask at the next
    sync)."""
    if self.start >= self.n:
      return []
    if len(so_far) < max(1, self.slots // 4):
      if ahead and self.probing:
        return None
      # Too little measured in this run to re-decide: one more stash at this gamma, so
      # that no finished row waits idle for a decision.
      return self.stash(gamma, self.chosen[1])
    self.results.update(so_far)
    seconds -= self.planning["seconds"] - planned  # plans timed meanwhile
    self.walls[gamma] = (earlier[0] + seconds, earlier[1] + used["iterations"])
    self.alpha = self.measured_alpha(self.alpha)
    self.chosen, self.probing = self.choose(self.alpha, gamma), False
    if self.start >= self.n or self.chosen[0] != gamma:
      return []
    return self.stash(gamma, self.chosen[1])

  def outputs(self):
    """(results, usage, phases, the counters' gamma width, measured, planning), the phases
    with every timed plan's iteration and refill ms; the call's plans said on the
    console, and a call that never speculated says why."""
    for phase in self.phases:
      phase["iteration_ms"] = {str(g): v for g, v in self.iteration.items()}
      phase["refill_ms"] = {str(g): ms for g, ms in self.refill.items()}
    self.alpha = self.measured_alpha(self.alpha)
    measured = dict(batch_size=self.slots, alpha=self.alpha,
                    tokens={str(g): v for g, v in self.sums_at().items()},
                    walls={str(g): list(v) for g, v in self.walls.items()},
                    plan_seconds=self.plan_seconds)
    planning = dict(self.planning, timed=sorted(self.planning["timed"]))
    ran = sorted({p["gamma"] for p in self.phases})
    untimed = "; ".join(f"{_plan_name(int(g))} {why}"
                        for g, why in sorted(self.planning["untimed"].items(), key=lambda x: int(x[0])))
    logging.info("gamma='auto': %d inputs at %s; planning %.1f s (plans timed here: %s%s)",
                 self.n, ", ".join(_plan_name(g) for g in ran), planning["seconds"],
                 ", ".join(_plan_name(g) for g in planning["timed"]) or "none, read back",
                 f"; not timed: {untimed}" if untimed else "")
    if ran == [0]:
      logging.info("gamma='auto' ran target-only throughout: %s", _why_target_only(
          self.phases, self.planning["untimed"], self.walls))
    return self.results, self.usage, self.phases, max(self.candidates), measured, planning


def _plan_name(g: int) -> str:
  """A plan as the console names it."""
  return f"gamma {g}" if g else "target-only"


def _why_target_only(phases, untimed, walls) -> str:
  """Why a call ran target-only throughout, in a sentence: no speculative plan timed (none
  could pay), or timed ones predicted slower, or measured slower."""
  speculative = {g for g in walls if g}
  if speculative:
    return (f"{', '.join(_plan_name(g) for g in sorted(speculative))} measured slower "
            "than target-only")
  rated = {g for p in phases for g in p["rated"] if int(g)}
  if not rated:
    return ("no speculative plan was worth compiling for this stream (" +
            "; ".join(f"{_plan_name(int(g))} {why}" for g, why in sorted(untimed.items())) + ")")
  return "every timed speculative plan was predicted slower than target-only"


class _RateModel(NamedTuple):
  """What `_Planner.rates` rates each plan from: the inputs' sums per plan, tokens per
  input (mean, deviation), the acceptance, the slots, and per plan its refill ms, its
  iteration ms (timed, or at its best case) and its measured wall ms per iteration;
  `timed`: the plans whose iteration is a timing."""
  sums: Dict[int, Dict[str, float]]
  per_input: float
  spread: float
  alpha: float
  slots: int
  refill: Dict[int, float]
  iteration: Dict[int, float]
  ms: Dict[int, float]
  timed: set

  def refills_ms(self, g, tokens):
    """Plan g's refills per loop iteration: an input starts for every per_input / tokens
    row iterations."""
    return self.refill[g] * self.slots * tokens / self.per_input

  def slowest(self):
    """How slow each measured plan ran against its timing, its refills taken out (at most
    half its wall): the timing holds none, and a prediction adds its own plan's. Left
    in, they were counted twice: on the scaled pair at B = 16 target-only's wall is 45
    ms an iteration against 36 timed and 13 of refills, gamma 4's 99 against 74 and 33
    (both 0.9 of their timing without refills, 1.25 and 1.35 with them)."""
    sums, ms = self.sums, self.ms
    return max(((ms[g] - min(self.refills_ms(g, sums[g]["tokens"] / sums[g]["iterations"]
                                             if g in sums else 1.0), ms[g] / 2))
                / self.iteration[g] for g in ms if g in self.timed), default=1.0)

  def spread_of_speculation(self):
    """What the speculative plans emitted against E[tokens] at alpha for outputs of their
    inputs' mean length (acceptances in runs give fewer than i.i.d. ones would), at most
    1, 1 before any; and how their inputs' iteration counts spread (the largest of each
    count's deviation over its mean). The lengths count: each output's last iteration is
    cut, which costs a deep plan more (gamma 8 emits 0.94 of eq. 1 at alpha 0.86 over 48
    tokens, gamma 2 0.98), so a factor measured at one gamma carries over to another
    only with them taken out."""
    got = want = 0.0
    relative = [0.0]
    for g, v in self.sums.items():
      if g and v["inputs"]:
        got += v["tokens"]
        want += v["iterations"] * theory.expected_tokens_per_iteration(
            min(self.alpha, 0.999), g, max(v["tokens"] / v["inputs"], 1.0))
        mean = v["iterations"] / v["inputs"]
        relative.append(_deviation(v["iterations_sq"] / v["inputs"], mean) / mean)
    return (min(1.0, got / want) if want else 1.0), max(relative)

  def rate(self, g, remaining, drift, path, retry):
    """Plan g's `_Rate` over `remaining` inputs, its run's slots `drift` inputs each since
    they started together; `path`: its deepest path; `retry`: its tokens at the top of
    what its inputs measured, its time as if it had not run."""
    if g in self.sums:
      v = self.sums[g]
      tokens = _optimistic_tokens(v, path) if retry else v["tokens"] / v["iterations"]
      each = v["iterations"] / v["inputs"]
      deviation = _deviation(v["iterations_sq"] / v["inputs"], each)
    elif not g:  # target-only: an iteration per token
      tokens, each, deviation = 1.0, self.per_input, self.spread
    else:
      factor, relative = self.spread_of_speculation()
      tokens = factor * theory.expected_tokens_per_iteration(min(self.alpha, 0.999), path,
                                                             self.per_input)
      each = self.per_input / tokens
      deviation = each * max(relative, self.spread / self.per_input)
    # A plan that has not run at this batch size: target-only as timed, speculation as
    # slow against its timing as the slowest measured plan; plus its refills (each
    # input's start) per iteration, which speculation makes more frequent.
    predicted = self.iteration[g] * (self.slowest() if g else 1.0) + self.refills_ms(g, tokens)
    # Target-only at the better of its timing and its measurement: on a shared machine
    # one slow spell must not make speculation look faster than it is (the error is
    # allowed the other way only: speculation kept where it may have won is lost
    # speed, speculation run where it loses breaks auto's promise).
    ms = self.ms
    cost = (min(ms[0], predicted) if 0 in ms else predicted) if not g else ms.get(g, predicted)
    return _Rate(tokens, cost, _occupancy(remaining, self.slots, each, deviation),
                 cost * _drain_iterations(self.slots, each, deviation, drift), each)


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
