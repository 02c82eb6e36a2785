"""What speculative decoding buys a pair on this machine, measured beside the theory.

For a target and its drafts, at batch 1 (the paper's setting):

* the cost curve C(k): one target call scoring k tokens / one token
  (`measure_costs`), and each draft's c: its per-token proposal cost / one target
  step (a model draft's one-token call; a head's or table's whole proposal / gamma);
* each draft's alpha: the Corollary 3.6 estimate pooled over probe decodes
  (`probe_alpha`; it does not depend on gamma);
* gamma: the theory's optimum for that alpha, c and cost curve (`choose_gamma`);
* the predicted speedup (`theory.predicted_speedup_with_cost_curve`; beside it
  Theorem 3.8's, which assumes free verification) and the measured one: target-only
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
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from specdec_jax.core import theory
from specdec_jax.drafts import as_draft
from specdec_jax.families.registry import is_model
from specdec_jax.tools import profiling


@dataclasses.dataclass
class Costs:
  """curve: [C(1) = 1, .., C(max_k)]; step_ms: one target step (k = 1) in ms;
  c: {draft: per-token proposal cost / step}."""
  curve: List[float]
  step_ms: float
  c: Dict[str, float]


def measure_costs(target, drafts: Dict[str, Any], inputs, lengths, max_decode_steps: int,
                  max_k: int, repeats: int = 5, calls: int = 4) -> Costs:
  """The target's cost curve for k = 1..max_k and each draft's c, timed on the first input
  (`repeats` samples of `calls` calls in one compiled loop, median)."""
  first = None if lengths is None else lengths[:1]
  ks = list(range(1, max_k + 1))
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
  return Costs(curve=[ms[k] / ms[1] for k in ks], step_ms=ms[1], c=c)


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


def choose_gamma(alpha: float, c: float, curve: Sequence[float], max_gamma: int) -> int:
  """The gamma in 1..max_gamma (and below len(curve)) maximising the cost-curve prediction;
  the smallest on ties."""
  top = min(max_gamma, len(curve) - 1)
  return max(range(1, top + 1), key=lambda g: (
      theory.predicted_speedup_with_cost_curve(min(alpha, 0.999), g, c, curve), -g))


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
  alpha: float
  c: float
  gamma: int
  predicted_free: float       # Theorem 3.8: verification free (an accelerator's regime)
  predicted: float            # with the measured cost curve
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
                 log=None) -> List[Row]:
  """Every draft's row: alpha, c, gamma, predicted and measured speedup, identical outputs.

  Args:
    target, drafts: the target and {name: draft} (models or `Draft`s).
    inputs, lengths: [n, C] int32 and [n] (or None: T5), each decoded at batch 1.
    costs: `measure_costs` of this target and these drafts.
    repeats: timed rounds per input after one untimed call of each side.
    max_gamma: the largest gamma the theory may choose.
    temperature: 0 (greedy: identity is checked) or sampling (identity n/a).
    gammas: {draft: gamma} fixed instead of chosen; alphas: {draft: alpha} known
      (else probed on all inputs at gamma 4).
    side_kwargs: {draft: extra `generate` kwargs} (e.g. verification='block').
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
  seconds, outputs = profiling.time_generate_sides(target, inputs, repeats, sides, lengths)
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
    predicted = (theory.predicted_speedup_with_cost_curve(min(alpha, 0.999), gamma, c, costs.curve)
                 if gamma < len(costs.curve) else float("nan"))
    rows.append(Row(
        draft=name, alpha=alpha, c=c, gamma=gamma,
        predicted_free=theory.walltime_improvement(min(alpha, 0.999), gamma, c),
        predicted=predicted, measured=sum(base) / sum(spec),
        per_input=[b / s for b, s in zip(base, spec)], identical=identical,
        tokens_per_iteration=float(np.mean([o.stats.mean_tokens_per_iteration
                                            for o in outputs[name]])),
        spec_seconds=sum(spec), base_seconds=sum(base)))
  return rows
