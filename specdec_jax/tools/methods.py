"""Speculative methods side by side: what each one is, and how its runs are summarised.

A method is one speculative side of a comparison around one draft: a chain
verified token-wise ('chain') or by block verification ('block'), a static
token tree ('tree', `TreeDraft`) or a dynamic EAGLE-2 tree ('dynamic_tree',
`DynamicTreeDraft`), compared with target-only decoding at the same block
width W. Both benchmark scripts build their methods and summarise their runs
here, so the figures mean the same thing in both: `scripts/benchmark.py`
(--verifications / --trees / --dynamic_trees: rounds over batches) and
`scripts/gpu_benchmarks.py` (--part=methods and --part=features:
`profiling.time_generate_pairs`, input by input).

The summaries: counters pooled over runs (`pooled_stats`: tokens per
iteration, alpha, per-rank acceptance), the paired speedup (`paired_ratios`:
median and range of per-repeat or per-input ratios), the theory's tokens per
iteration from the run's own acceptance (`predicted_tokens`) and speedups
tokens / (draft calls c + C(W)) (`accelerator_predictions`, `paired_row`).
"""

import statistics
from typing import Any, Dict, NamedTuple, Optional, Sequence

import numpy as np

from specdec_jax.core import theory
from specdec_jax.drafts.tree_draft import DynamicTreeDraft, TreeDraft


class Method(NamedTuple):
  """One speculative side of a method comparison."""
  name: str
  kind: str            # 'chain' / 'block' / 'tree' / 'dynamic_tree'
  kwargs: Dict[str, Any]  # generate() keyword arguments (draft, gamma, verification)
  draft_calls: int     # per iteration: gamma for a chain, the depth for a tree
  nodes: int           # target slots the method needs (gamma + 1 for chains)
  spec: Any            # gamma, branching, or (topk, depth, node_budget)


def chain(draft, gamma: int, verification: str = "token", name: Optional[str] = None) -> Method:
  """gamma drafted tokens a proposal, kept by `verification` ('token' or 'block')."""
  kind = "chain" if verification == "token" else "block"
  return Method(name or f"{kind} g={gamma}", kind,
                dict(draft=draft, gamma=gamma, verification=verification), gamma, gamma + 1,
                gamma)


def tree(draft, branching: Sequence[int], children: str = "without_replacement",
         name: Optional[str] = None) -> Method:
  """A static `TreeDraft` of `branching` around `draft`, one draft call a depth."""
  grown = TreeDraft(draft, branching, children=children)
  return Method(name or f"tree {','.join(map(str, branching))}", "tree", dict(draft=grown),
                grown.depth, grown.num_nodes, tuple(branching))


def dynamic_tree(draft, topk: int, depth: int, node_budget: int,
                 name: Optional[str] = None) -> Method:
  """A `DynamicTreeDraft` around `draft`: node_budget slots, one draft call a depth."""
  grown = DynamicTreeDraft(draft, topk=topk, depth=depth, node_budget=node_budget)
  return Method(name or f"dyn k={topk} d={depth} n={node_budget}", "dynamic_tree",
                dict(draft=grown), depth, grown.num_nodes, (topk, depth, grown.num_nodes))


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Dict[str, float]:
  """Median, min and max of numerators[i] / denominators[i]."""
  if len(numerators) != len(denominators) or not numerators:
    raise ValueError("paired_ratios needs two non-empty sequences of equal length")
  ratios = [n / d for n, d in zip(numerators, denominators)]
  return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))


def pooled_stats(stats_list) -> Dict[str, Any]:
  """Counters of several `SpeculativeStats` (one per input batch), pooled."""
  total = lambda name: sum(np.asarray(getattr(s, name)).sum(0) for s in stats_list)  # noqa
  iterations, emitted = float(total("iterations")), float(total("emitted"))
  out = dict(iterations=int(iterations), emitted=int(emitted),
             tokens_per_iteration=emitted / max(iterations, 1),
             alpha=float(total("beta_sum")) / max(float(total("beta_count")), 1),
             acceptance_rate=float(total("accepted_raw")) / max(float(total("drafted")), 1))
  if stats_list[0].rank_tried is not None:
    tried, accepted = total("rank_tried"), total("rank_accepted")
    out["per_rank_acceptance"] = (accepted / np.maximum(tried, 1)).tolist()
    out["rank_tried"] = np.asarray(tried).tolist()
    depth = max(s.depth_histogram.shape[1] for s in stats_list)
    hist = np.zeros(depth, np.int64)
    for s in stats_list:
      h = s.depth_histogram.sum(0)
      hist[:len(h)] += h
    out["depth_histogram"] = hist.tolist()
  else:
    position = [s.position_accepted.sum(0) for s in stats_list]
    drafted = [s.position_drafted.sum(0) for s in stats_list]
    out["per_position_acceptance"] = (sum(position) / np.maximum(sum(drafted), 1)).tolist()
  return out


def predicted_tokens(method: Method, pooled: Dict[str, Any]) -> Dict[str, Any]:
  """The theory's tokens per iteration for a method, from its own run's acceptance."""
  if method.kind == "chain":
    return dict(predicted_tokens_per_iteration=theory.expected_tokens_per_iteration(
        pooled["alpha"], method.spec), predicted_from="eq. 1 with the run's alpha")
  if method.kind == "block":
    token_wise = theory.expected_tokens_per_iteration(pooled["alpha"], method.spec)
    return dict(predicted_tokens_per_iteration=None,
                predicted_from="measured only (block verification has no closed form here); "
                               f"eq. 1 at the run's alpha would give {token_wise:.3f} for "
                               "token-wise verification")
  rates = pooled["per_rank_acceptance"]
  if method.kind == "tree":
    out = dict(predicted_tokens_per_iteration=theory.tree_expected_tokens(method.spec, rates),
               predicted_from="tree_expected_tokens(branching, the run's per-rank acceptance)")
  else:
    out = dict(predicted_tokens_per_iteration=None,
               predicted_from="measured only (the dynamic tree's topology changes per iteration)")
  depth = method.spec[1] if method.kind == "dynamic_tree" else len(method.spec)
  best = theory.best_tree_shape(rates, method.nodes, max_depth=depth)
  out.update(best_static_shape=list(best),
             best_static_expected_tokens=theory.tree_expected_tokens(best, rates))
  return out


def accelerator_predictions(tokens: float, draft_calls: int, verify_costs: Sequence[float],
                            draft_costs: Sequence[float]) -> Dict[str, float]:
  """{'C=<C(W)>,c=<c>': tokens / (draft_calls c + C(W))} for every scenario pair."""
  return {f"C={C:g},c={c:g}": theory.predicted_tree_speedup(tokens, c, draft_calls, C)
          for C in verify_costs for c in draft_costs}


def paired_speedup(timing) -> Dict[str, Any]:
  """From `profiling.time_generate_pairs`: the speedup over the fastest exact baseline
  (median of the per-input ratios, with their range) and how many rows equal target-only
  decoding's at W."""
  speed = paired_ratios(timing.base_seconds, timing.spec_seconds)
  identical = sum(np.array_equal(np.asarray(r.sequences), np.asarray(s.sequences))
                  for r, s in zip(timing.reference_outputs, timing.spec_outputs))
  return dict(speedup=speed["median"], speedup_min=speed["min"], speedup_max=speed["max"],
              identical_rows=int(identical), rows=len(timing.spec_outputs))


def paired_row(method: Method, timing, c: float, verify_cost: float) -> Dict[str, Any]:
  """A method's row from `profiling.time_generate_pairs`: tokens per iteration and alpha
  pooled over the inputs, `paired_speedup`, the baseline's width, the per-rank
  acceptance (trees), the theory's tokens per iteration where it has them, and the
  predicted speedup tokens / (draft calls c + C(W)) at this machine's c and C(W)."""
  pooled = pooled_stats([o.stats for o in timing.spec_outputs])
  tokens = pooled["tokens_per_iteration"]
  row = dict(tokens_per_iteration=tokens, alpha=pooled["alpha"], **paired_speedup(timing),
             baseline_width=timing.base_width, draft_calls=method.draft_calls,
             predicted=theory.predicted_tree_speedup(tokens, c, method.draft_calls,
                                                     verify_cost))
  if "per_rank_acceptance" in pooled:
    row["per_rank_acceptance"] = pooled["per_rank_acceptance"]
  predicted = predicted_tokens(method, pooled)["predicted_tokens_per_iteration"]
  if predicted is not None:
    row["predicted_tokens_per_iteration"] = predicted
  return row
