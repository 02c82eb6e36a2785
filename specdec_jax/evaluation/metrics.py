"""An evaluation's figures per method and category, from its stored decode records.

A record is one method's decode of one question, every repeat and every turn
(`runner.decode_question`); everything here is a pure function of records, so
the figures of a resumed run equal those of an uninterrupted one, and a test
with a stubbed clock can compute them by hand.

The figures follow Spec-Bench (REFERENCE.md section 12):

* tokens_per_s: the mean over inputs of each input's tokens / seconds (all its
  turns), each input's figure the mean over repeats;
* speedup: a method's tokens_per_s over vanilla's on the same inputs; its
  spread is that ratio computed repeat by repeat (min, max);
* tau: tokens per target call (Spec-Bench's mean accepted tokens, "#MAT"):
  every emitted token over every target call; 1 for vanilla by definition;
* alpha: the draft's measured E[sum_x min(p, q)] (Corollary 3.6), None where
  no draft proposed;
* equal / total: how many inputs' outputs (every turn, every repeat) equal
  target-only decoding's at the method's block width (greedy; sampled runs
  check the law instead, `law.law_check`).
"""

import statistics
from typing import Any, Dict, List, Optional, Sequence

Record = Dict[str, Any]
OVERALL = "overall"


def input_tokens_per_s(record: Record) -> List[float]:
  """[repeats] tokens / seconds of one input, its turns summed."""
  return [sum(run["new_tokens"]) / max(sum(run["seconds"]), 1e-12) for run in record["runs"]]


def _mean(values: Sequence[float]) -> Optional[float]:
  return float(statistics.fmean(values)) if values else None


def _spread(ratios: Sequence[float]) -> Dict[str, Optional[float]]:
  return dict(min=min(ratios) if ratios else None, max=max(ratios) if ratios else None,
              std=float(statistics.pstdev(ratios)) if len(ratios) > 1 else 0.0)


def pooled_counters(records: Sequence[Record]) -> Dict[str, float]:
  """Sums of every counter over records, repeats and turns."""
  names = ("new_tokens", "target_calls", "drafted", "accepted", "beta_sum", "beta_count",
           "seconds")
  return {name: float(sum(sum(run.get(name) or [0]) for r in records for run in r["runs"]))
          for name in names}


def group_figures(records: Sequence[Record], vanilla: Sequence[Record]) -> Dict[str, Any]:
  """The figures of one method over one group of inputs (a category, or all).

  Args:
    records: the method's records of the group's inputs.
    vanilla: vanilla's records of the same inputs (any order; matched by question_id).
  """
  by_id = {r["question_id"]: r for r in vanilla}
  missing = [r["question_id"] for r in records if r["question_id"] not in by_id]
  if missing:
    raise ValueError(f"vanilla has no record of inputs {missing[:5]}: speedups need both")
  pairs = [(input_tokens_per_s(r), input_tokens_per_s(by_id[r["question_id"]]))
           for r in records]
  speed = [_mean(mine) for mine, _ in pairs]
  base = [_mean(theirs) for _, theirs in pairs]
  repeats = min([len(m) for m, _ in pairs] + [len(t) for _, t in pairs]) if pairs else 0
  per_repeat = [_mean([m[k] for m, _ in pairs]) / _mean([t[k] for _, t in pairs])
                for k in range(repeats)]
  counts = pooled_counters(records)
  tokens_per_s, base_tokens_per_s = _mean(speed), _mean(base)
  equal = [r.get("equal") for r in records]
  return dict(
      speedup=(tokens_per_s / base_tokens_per_s) if records else None,
      speedup_spread=_spread(per_repeat),
      tau=counts["new_tokens"] / counts["target_calls"] if counts["target_calls"] else None,
      alpha=counts["beta_sum"] / counts["beta_count"] if counts["beta_count"] else None,
      tokens_per_s=tokens_per_s,
      seconds_per_input=_mean([statistics.fmean(sum(run["seconds"]) for run in r["runs"])
                               for r in records]),
      prefill_seconds_per_input=_mean([r["prefill_seconds"] for r in vanilla
                                       if r.get("prefill_seconds") is not None]),
      new_tokens=int(counts["new_tokens"]), target_calls=int(counts["target_calls"]),
      equal=sum(bool(e) for e in equal) if None not in equal else None,
      total=len(records))


def method_figures(records: Sequence[Record], vanilla: Sequence[Record],
                   categories: Sequence[str]) -> Dict[str, Any]:
  """{'categories': {category: figures}, 'overall': figures} of one method."""
  out = {}
  for category in categories:
    mine = [r for r in records if r["category"] == category]
    out[category] = group_figures(mine, [r for r in vanilla if r["category"] == category])
  return dict(categories=out, overall=group_figures(records, vanilla))


def differing_outputs(records: Sequence[Record]) -> List[Dict[str, Any]]:
  """[{question_id, category, turn}] of every greedy record unequal to its reference."""
  return [dict(question_id=r["question_id"], category=r["category"],
               turn=r.get("first_differing_turn"))
          for r in records if r.get("equal") is False]
