"""What speculative decoding buys a pair on this machine, measured beside the theory.

For a target and its drafts, at batch 1 (the paper's setting):

* the cost curve C(k): one target call scoring k tokens / one token
  (`measure_costs`), and each draft's c: its per-token proposal cost / one target
  step (a model draft's one-token call; a head's or table's whole proposal / gamma);
* each draft's alpha: the Corollary 3.6 estimate pooled over probe decodes
  (`probe_alpha`; it does not depend on gamma);
* gamma: the theory's optimum for that alpha, c and cost curve (`choose_gamma`);
* the predicted speedup (`theory.predicted_speedup_with_cost_curve` for the decode
  steps; end to end, the measured target-only time with its start (the prompt's
  prefill, T5's encoder: paid once by both sides) kept and the rest divided by it;
  beside it Theorem 3.8's, which assumes free verification) and the measured one: target-only
  decoding at block width 1 (the fastest exact baseline wherever C(k) > 1) and every
  draft at its gamma, timed on the same inputs with the order rotating
  (`profiling.time_generate_sides`), speedup = total target-only time / total
  speculative time;
* identical outputs (greedy): every speculative output compared with the
  baseline's, and where they differ with target-only decoding at the loop's own
  width (the exactness guarantee is bitwise at that width; `identical_outputs`).
  Computed, never assumed: a lossy rule shows "no".

`make demo` (both acts) and `experiments/mini_table2.py` report these rows.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from specdec_jax.core import theory
from specdec_jax.drafts import as_draft
from specdec_jax.families.registry import is_model
from specdec_jax.tools import profiling


@dataclasses.dataclass
class Costs:
  """curve: {k: C(k)} for the measured block sizes (C(1) = 1); step_ms: one target step
  (k = 1) in ms;
  c: {draft: per-token proposal cost / step}; start_ms: the target's start (the prompt's
  prefill, T5's encoder) at batch 1, which target-only and speculative decoding both pay."""
  curve: Dict[int, float]
  step_ms: float
  c: Dict[str, float]
  start_ms: float = 0.0


def measure_costs(target, drafts: Dict[str, Any], inputs, lengths, max_decode_steps: int,
                  ks: Sequence[int], repeats: int = 5, calls: int = 4) -> Costs:
  """The target's cost curve at block sizes `ks` (1 is always measured) and each draft's c,
  timed on the first input (`repeats` samples of `calls` calls in one compiled loop, median).
  Each k is a program of its own to compile: measure the k = gamma + 1 a run may choose."""
  first = None if lengths is None else lengths[:1]
  ks = sorted(set(ks) | {1})
  ms = profiling.time_block_calls({"target": target}, inputs[:1], max_decode_steps, ks, repeats,
                                  calls=calls, lengths=first)["target"]
  models = {n: d for n, d in drafts.items() if is_model(d)}
  others = {n: d for n, d in drafts.items() if not is_model(d)}
  c = {}
  if models:
    draft_ms = profiling.time_block_calls(models, inputs[:1], max_decode_steps, [1], repeats,
                                          calls=calls, lengths=first)
    c.update({n: draft_ms[n][1] / ms[1] for n in models})
  if others:  # Heads and tables: a whole proposal, per token (their own calls and sampling).
    gamma = min([4] + [as_draft(d).max_gamma or 4 for d in others.values()])
    head_ms = profiling.time_proposals(target, others, inputs[:1], max_decode_steps, gamma,
                                       repeats, calls=calls, lengths=first)
    c.update({n: head_ms[n] / gamma / ms[1] for n in others})
  start = profiling.start_ms(target, inputs, max_decode_steps, repeats, lengths)
  return Costs(curve={k: ms[k] / ms[1] for k in ks}, step_ms=ms[1], c=c, start_ms=start)


def pooled_alpha(outputs) -> float:
  """alpha, the Corollary 3.6 estimate pooled over `generate` outputs."""
  beta = sum(float(o.stats.beta_sum.sum()) for o in outputs)
  count = sum(float(o.stats.beta_count.sum()) for o in outputs)
  return beta / max(count, 1.0)


def probe_alpha(target, draft, inputs, lengths, gamma: int = 4, **kwargs) -> float:
  """alpha on `inputs` (decoded together, untimed) from a decode at `gamma`; kwargs:
  `generate`'s (max_decode_steps, temperature, ...)."""
  from specdec_jax.generation import generate
  gamma = min(gamma, as_draft(draft).max_gamma or gamma)
  out = generate(target, inputs, lengths, draft=draft, gamma=gamma, **kwargs)
  return pooled_alpha([out])


def predicted_decode_speedup(alpha: float, gamma: int, c: float, curve: Dict[int, float]
                             ) -> float:
  """Theorem 3.8 with the measured C(gamma + 1): E[tokens per iteration] / (gamma c +
  C(gamma + 1)), per target step."""
  return theory.predicted_speedup_with_verify_cost(min(alpha, 0.999), gamma, c, curve[gamma + 1])


def choose_gamma(alpha: float, c: float, curve: Dict[int, float], max_gamma: int) -> int:
  """The gamma <= max_gamma whose C(gamma + 1) was measured maximising the cost-curve
  prediction; the smallest on ties."""
  candidates = [k - 1 for k in curve if 1 <= k - 1 <= max_gamma]
  if not candidates:
    raise ValueError(f"no measured block size k = gamma + 1 <= {max_gamma + 1} in {sorted(curve)}")
  return max(candidates, key=lambda g: (predicted_decode_speedup(alpha, g, c, curve), -g))


def choose_phase_gamma(alpha: float, draft_cost: Dict[int, float], curve: Dict[int, float],
                       per_token: Optional[Dict[int, float]] = None,
                       tokens_factor: Union[float, Dict[int, float]] = 1.0
                       ) -> Tuple[int, float]:
  """The gamma for the next inputs of a batch, 0 meaning target-only: (gamma, its predicted
  speedup over target-only decoding at this batch size).

  alpha: the acceptance measured so far (Corollary 3.6's estimate); draft_cost: {gamma:
  one whole proposal's cost / one target step, at this batch size} (gamma times a model
  draft's step; one call for a drafter that fills the block at once); curve: {k: C(k)}
  at this batch size. Each gamma is predicted as E[tokens per iteration] / (draft_cost +
  C(gamma + 1)) (Theorem 3.8 with both costs measured); target-only is 1. per_token:
  {gamma: what each input's own fixed work (its start, written into a slot) adds per
  token it emits, in target steps per row}, 0 (target-only) among them, or None: a cost
  that speculation does not shorten, so it pulls every prediction toward 1.
  tokens_factor: the tokens per iteration measured so far over those E[tokens] predicts
  at the measured alpha (<= 1 where acceptances come in runs, not i.i.d.), applied to
  every gamma's E[tokens], or {gamma: its own factor} (1 where absent). The best
  wins, the smaller on ties, and 0 whenever no gamma is predicted to beat target-only:
  speculation never runs where the theory says it loses.
  """
  best, best_speedup = 0, 1.0
  for gamma in sorted(draft_cost):
    if gamma + 1 not in curve:
      continue
    predicted = phase_speedup(alpha, gamma, draft_cost, curve, per_token, tokens_factor)
    if predicted > best_speedup:
      best, best_speedup = gamma, predicted
  return best, best_speedup


def phase_speedup(alpha: float, gamma: int, draft_cost: Dict[int, float],
                  curve: Dict[int, float], per_token: Optional[Dict[int, float]] = None,
                  tokens_factor: Union[float, Dict[int, float]] = 1.0) -> float:
  """`choose_phase_gamma`'s predicted speedup of one gamma over target-only (arguments as
  there; gamma 0: 1), below 1 where it loses."""
  if not gamma:
    return 1.0
  extra = per_token or {}
  if isinstance(tokens_factor, dict):
    tokens_factor = tokens_factor.get(gamma, 1.0)
  tokens = tokens_factor * theory.expected_tokens_per_iteration(
      min(max(alpha, 0.0), 0.999), gamma)
  return (1.0 + extra.get(0, 0.0)) / ((draft_cost[gamma] + curve[gamma + 1]) / tokens
                                      + extra.get(gamma, 0.0))


def identical_outputs(spec_outputs, base_outputs, reference=None) -> bool:
  """Greedy exactness of speculative outputs, per input.

  spec_outputs / base_outputs: [n] `GenerateOutput`s (base: target-only at width 1).
  reference: i -> target-only output of input i at the speculative loop's width, called
    only where the baseline differs (float rounding between widths), or None.
  """
  same = True
  for i, (spec, base) in enumerate(zip(spec_outputs, base_outputs)):
    got = np.asarray(spec.sequences)
    if np.array_equal(got, np.asarray(base.sequences)):
      continue
    same &= reference is not None and np.array_equal(got, np.asarray(reference(i).sequences))
  return bool(same)


@dataclasses.dataclass
class Row:
  """One draft's measured row (speedups against target-only decoding at width 1)."""
  draft: str
  alpha: float                # measured in the timed decodes (Corollary 3.6, pooled)
  alpha_for_gamma: float      # the alpha gamma was chosen with (given, or probed)
  c: float
  gamma: int
  predicted_free: float       # Theorem 3.8: verification free (an accelerator's regime)
  predicted_decode: float     # with the measured cost curve: the decode steps alone
  predicted: float            # end to end: the measured target-only time, its start
                              # (prefill) kept and its decode divided by predicted_decode
  measured: float             # total target-only time / total speculative time
  per_input: List[float]      # per-input ratios
  identical: Optional[bool]   # greedy only
  tokens_per_iteration: float
  spec_seconds: float
  base_seconds: float


def measure_rows(target, drafts: Dict[str, Any], inputs, lengths, max_decode_steps: int,
                 costs: Costs, *, repeats: int, max_gamma: int, temperature: float = 0.0,
                 gammas: Optional[Dict[str, int]] = None, alphas: Optional[Dict[str, float]] = None,
                 side_kwargs: Optional[Dict[str, Dict[str, Any]]] = None, seed: int = 0,
                 warmup: str = "each", log=None) -> List[Row]:
  """Every draft's row: alpha, c, gamma, predicted and measured speedup, identical outputs.

  Args:
    target, drafts: the target and {name: draft} (models or `Draft`s).
    inputs, lengths: [n, C] int32 and [n] (or None: T5), each decoded at batch 1.
    costs: `measure_costs` of this target and these drafts.
    repeats: timed rounds per input after one untimed call of each side.
    max_gamma: the largest gamma the theory may choose.
    temperature: 0 (greedy: identity is checked) or sampling (identity n/a).
    gammas: {draft: gamma} fixed instead of chosen; alphas: {draft: alpha} to choose
      gamma with (a pair's card; else probed on all inputs at gamma 4, one more program).
    side_kwargs: {draft: extra `generate` kwargs} (e.g. verification='block').
    warmup: 'each' input's sides run once untimed first, or only the 'first' input's
      (the compile; later inputs go straight to the timed rounds).
  """
  from specdec_jax.generation import generate
  common = dict(max_decode_steps=max_decode_steps, temperature=temperature,
                rng=jax.random.PRNGKey(seed))
  sides = {"target": dict(common, block_width=1)}
  chosen = {}
  for name, draft in drafts.items():
    extra = dict((side_kwargs or {}).get(name, {}))
    alpha = (alphas or {}).get(name)
    if alpha is None:
      alpha = probe_alpha(target, draft, inputs, lengths, **common, **extra)
    limit = min(max_gamma, as_draft(draft).max_gamma or max_gamma)
    gamma = (gammas or {}).get(name) or choose_gamma(alpha, costs.c[name], costs.curve, limit)
    chosen[name] = (alpha, gamma)
    sides[name] = dict(common, draft=draft, gamma=gamma, block_width=gamma + 1, **extra)
    if log:
      log(f"  {name}: alpha {alpha:.2f}, c {costs.c[name]:.3f} -> gamma {gamma}")
  seconds, outputs = profiling.time_generate_sides(target, inputs, repeats, sides, lengths,
                                                   warmup=warmup)
  base = seconds["target"]
  rows = []
  for name in drafts:
    alpha, gamma = chosen[name]
    spec = seconds[name]
    identical = None
    if temperature == 0.0:
      def reference(i, width=gamma + 1):
        x = (inputs[i:i + 1], None if lengths is None else lengths[i:i + 1])
        return generate(target, *x, **dict(common, block_width=width))
      identical = identical_outputs(outputs[name], outputs["target"], reference)
    c = costs.c[name]
    decode = (predicted_decode_speedup(alpha, gamma, c, costs.curve)
              if gamma + 1 in costs.curve else float("nan"))
    start = min(costs.start_ms / 1e3 * len(base), 0.99 * sum(base))
    predicted = sum(base) / (start + (sum(base) - start) / decode)
    rows.append(Row(
        draft=name, alpha=pooled_alpha(outputs[name]), alpha_for_gamma=alpha, c=c, gamma=gamma,
        predicted_free=theory.walltime_improvement(min(alpha, 0.999), gamma, c),
        predicted_decode=decode, predicted=predicted, measured=sum(base) / sum(spec),
        per_input=[b / s for b, s in zip(base, spec)], identical=identical,
        tokens_per_iteration=float(np.mean([o.stats.mean_tokens_per_iteration
                                            for o in outputs[name]])),
        spec_seconds=sum(spec), base_seconds=sum(base)))
  return rows


def rows_table(rows: Sequence[Row]) -> str:
  """The rows as a fixed-width table (one line per draft)."""
  header = (f"{'draft':>9} {'alpha':>5} {'c':>6} {'gamma':>5} {'tok/it':>6} "
            f"{'pred: Thm 3.8':>13} {'pred: here':>10} {'measured':>8} {'[min, max]':>13} "
            f"{'meas/pred':>9}  identical")
  lines = [header, "-" * len(header)]
  for r in rows:
    same = {True: "yes", False: "NO", None: "n/a (sampling)"}[r.identical]
    lines.append(
        f"{r.draft:>9} {r.alpha:5.2f} {r.c:6.3f} {r.gamma:5d} {r.tokens_per_iteration:6.2f} "
        f"{r.predicted_free:12.2f}X {r.predicted:9.2f}X {r.measured:7.2f}X "
        f"{'[%.2f, %.2f]' % (min(r.per_input), max(r.per_input)):>13} "
        f"{r.measured / r.predicted:9.2f}  {same}")
  return "\n".join(lines)
