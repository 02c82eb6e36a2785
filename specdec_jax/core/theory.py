"""The paper's analysis (Leviathan et al. 2023, §3) as plain functions.

Notation: alpha is the expected acceptance rate E[beta] (Corollary 3.6),
gamma the number of drafted tokens per iteration, c the cost of one draft
step relative to one target step (Theorem 3.8) and c_hat the ratio of their
arithmetic operations per token (Theorem 3.11).

The closed forms divide by (1 - alpha); at alpha = 1 every draft is accepted
and they take their limits (gamma + 1 tokens per iteration).
"""

import functools
import math
from typing import Optional, Sequence, Tuple

import numpy as np


def _check_alpha(alpha: float) -> float:
  alpha = float(alpha)
  if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
    raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
  return alpha


def _check_gamma(gamma: int) -> int:
  if int(gamma) != gamma or gamma < 0:
    raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
  return int(gamma)


def _check_cost(c: float, name: str = "c") -> float:
  c = float(c)
  if not c >= 0.0 or math.isinf(c):
    raise ValueError(f"{name} must be a finite number >= 0, got {c!r}")
  return c


def expected_tokens_per_iteration(alpha: float, gamma: int, length=None) -> float:
  """E[tokens emitted per iteration] = (1 - alpha^(gamma+1)) / (1 - alpha) (eq. 1).

  Equals 1 + alpha + ... + alpha^gamma, which is gamma + 1 at alpha = 1.

  eq. 1 is an unbounded decode's. An output that stops after `length` tokens (its step
  limit or EOS) cuts its last iteration: given `length` (one output's, a mean, or a
  sequence of every output's), the tokens per iteration of those outputs, sum(length) /
  sum(`expected_iterations`). Fewer than eq. 1 by about one iteration's share of the
  iterations each output needs: 0.97 of it at alpha = 0.86, gamma = 4, 48 tokens.
  """
  alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
  if length is not None:
    lengths = _check_lengths(length)
    return float(np.sum(lengths)) / float(np.sum(_iterations_to_emit(alpha, gamma, lengths)))
  if alpha == 1.0:
    return float(gamma + 1)
  return (1.0 - alpha**(gamma + 1)) / (1.0 - alpha)


def expected_iterations(alpha: float, gamma: int, length: float) -> float:
  """E[iterations to emit `length` tokens], the last iteration's tokens cut at it.

  An iteration emits k tokens with P(k) = alpha^(k - 1) (1 - alpha) for k <= gamma and
  alpha^gamma for gamma + 1 (eq. 1's law), so E[N(l)] = 1 + sum_k P(k) E[N(max(l - k, 0))]
  with N(0) = 0: `length` at gamma 0, ceil(length / (gamma + 1)) at alpha = 1, and
  length / eq. 1 plus less than one iteration otherwise. A fractional length (a mean
  over outputs) interpolates between its integer neighbours.
  """
  alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
  return float(_iterations_to_emit(alpha, gamma, _check_lengths(length))[0])


def _check_lengths(length) -> np.ndarray:
  lengths = np.atleast_1d(np.asarray(length, dtype=np.float64))
  if lengths.ndim != 1 or not lengths.size or not np.all(np.isfinite(lengths)) \
      or np.any(lengths <= 0):
    raise ValueError(f"length must be a number > 0 or a non-empty sequence of them (an "
                     f"output's tokens), got {length!r}")
  return lengths


def _iterations_to_emit(alpha: float, gamma: int, lengths: np.ndarray) -> np.ndarray:
  """`expected_iterations` at each of `lengths` [n] (floats > 0): [n]."""
  most = int(np.ceil(np.max(lengths)))
  # Tables built to the next power of two: gamma='auto' asks at each decision for the
  # mean lengths of its plans, which differ; one table serves them all.
  table = _iterations_table(alpha, gamma, 1 << max(most - 1, 0).bit_length())
  low = np.floor(lengths).astype(np.int64)
  high = np.minimum(low + 1, most)
  frac = lengths - low
  return table[low] * (1 - frac) + table[high] * frac


@functools.lru_cache(maxsize=256)
def _iterations_table(alpha: float, gamma: int, most: int) -> np.ndarray:
  """E[N(l)] for l = 0 .. most ([most + 1]), by the recursion of `expected_iterations`."""
  law = np.array([alpha**(k - 1) * (1 - alpha) for k in range(1, gamma + 1)] + [alpha**gamma])
  table = np.zeros(most + 1 + gamma + 1)  # E[N(l)] at index l + gamma + 1; below: N = 0
  back = gamma + 1 - np.arange(1, gamma + 2)  # index l + back[k - 1]: E[N(max(l - k, 0))]
  for l in range(1, most + 1):
    table[l + gamma + 1] = 1.0 + law @ table[l + back]
  table.setflags(write=False)
  return table[gamma + 1:]


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
  """Theorem 3.8: expected speedup (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)).

  Assumes the target scores gamma + 1 positions in one call as fast as one.
  """
  return expected_tokens_per_iteration(alpha, gamma) / (_check_gamma(gamma) * _check_cost(c) + 1)


def operations_increase(alpha: float, gamma: int, c_hat: float) -> float:
  """Theorem 3.11: factor increase in arithmetic operations,
  (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1))."""
  gamma = _check_gamma(gamma)
  c_hat = _check_cost(c_hat, "c_hat")
  return (gamma * c_hat + gamma + 1) / expected_tokens_per_iteration(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 128) -> int:
  """The integer gamma in [1, max_gamma] maximising Theorem 3.8 (smallest on ties).

  Found by enumeration: the objective is cheap and unimodal enough in practice
  that a closed form buys nothing. At alpha = 1 and c = 0 the speedup grows
  without bound, so the answer is max_gamma.
  """
  _check_alpha(alpha)
  _check_cost(c)
  if int(max_gamma) != max_gamma or max_gamma < 1:
    raise ValueError(f"max_gamma must be an int >= 1, got {max_gamma!r}")
  speedups = [walltime_improvement(alpha, g, c) for g in range(1, int(max_gamma) + 1)]
  return 1 + max(range(len(speedups)), key=lambda i: (speedups[i], -i))


def corollary_3_9_bound(alpha: float, c: float) -> float:
  """Corollary 3.9: if alpha > c, some gamma gives at least (1 + alpha) / (1 + c).

  Raises ValueError when alpha <= c (the corollary promises nothing then).
  """
  alpha, c = _check_alpha(alpha), _check_cost(c)
  if not alpha > c:
    raise ValueError(f"Corollary 3.9 needs alpha > c, got alpha={alpha}, c={c}")
  return (1 + alpha) / (1 + c)


def predicted_speedup_with_cost_curve(alpha: float, gamma: int, c: float,
                                      block_cost: Sequence[float]) -> float:
  """Theorem 3.8 with a measured target block cost instead of "free" verification.

  Args:
    alpha: expected acceptance rate.
    gamma: drafted tokens per iteration.
    c: draft step time / target single-token step time.
    block_cost: block_cost[k - 1] = time of one target call scoring k tokens,
      relative to k = 1, for k = 1 .. at least gamma + 1 (so block_cost[0] = 1).
  Returns:
    E[tokens per iteration] / (gamma c + block_cost[gamma]): each iteration
    costs gamma draft steps plus one target call on gamma + 1 tokens, against
    one target step per token without speculation.
  """
  gamma = _check_gamma(gamma)
  if len(block_cost) < gamma + 1:
    raise ValueError(f"block_cost needs entries for k = 1..{gamma + 1}, got {len(block_cost)}")
  return predicted_speedup_with_verify_cost(alpha, gamma, c, block_cost[gamma])


def predicted_speedup_with_verify_cost(alpha: float, gamma: int, c: float,
                                       verify_cost: float, length=None) -> float:
  """As `predicted_speedup_with_cost_curve`, given only the cost of scoring
  gamma + 1 tokens in one target call relative to one token; `length` as in
  `expected_tokens_per_iteration` (outputs cut at their length)."""
  gamma, c = _check_gamma(gamma), _check_cost(c)
  verify_cost = _check_cost(verify_cost, "verify_cost")
  if verify_cost == 0:
    raise ValueError("verify_cost must be > 0")
  return expected_tokens_per_iteration(alpha, gamma, length) / (gamma * c + verify_cost)


# --------------------------------------------------------------------------
# Token trees (Sequoia, arXiv 2402.12374) under the positional acceptance model.
#
# a_r = P(a child of rank r is accepted | its siblings of lower rank were
# rejected), the same for every node: what `verification.tree.TreeVerdict`'s
# rank_accepted / rank_tried measures. A chain is a_0 = alpha.


def _check_rank_acceptance(rank_acceptance: Sequence[float]) -> Tuple[float, ...]:
  if isinstance(rank_acceptance, (int, float)) or len(rank_acceptance) == 0:
    raise ValueError(f"rank_acceptance must be a non-empty sequence (a_0, a_1, ...), got "
                     f"{rank_acceptance!r}")
  return tuple(_check_alpha(a) for a in rank_acceptance)


def _check_branching(branching) -> Tuple[int, ...]:
  branching = tuple(branching)
  if not branching or any(isinstance(b, bool) or int(b) != b or b < 1 for b in branching):
    raise ValueError(f"branching must be a non-empty sequence of ints >= 1, got {branching!r}")
  return tuple(int(b) for b in branching)


def _any_accepted(rates: Tuple[float, ...], children: int) -> float:
  """P(one of `children` siblings, ranks 0..children - 1, is accepted) = 1 - prod (1 - a_r)."""
  return 1.0 - math.prod(1.0 - a for a in rates[:children])


def tree_expected_tokens(tree, rank_acceptance: Sequence[float]) -> float:
  """E[tokens emitted per tree iteration] under the positional acceptance model.

  E = 1 + sum over non-root nodes u of P(reach u), with
  P(reach u) = P(reach parent(u)) * prod over u's siblings v of lower rank of
  (1 - a_rank(v)) * a_rank(u): the accepted drafts plus the one token every
  iteration draws. For a chain ((1,) * gamma) this is eq. 1's
  (1 - alpha^(gamma+1)) / (1 - alpha) with alpha = a_0.

  Args:
    tree: a static shape (a `TreeShape`, or its branching: children per
      depth, e.g. (4, 2, 1)), or any topology as a pair (parents, ranks) of
      [N] int sequences: node 0 the root (parent -1), other nodes with parent
      -1 unused (as in `core.token_tree.Tree`).
    rank_acceptance: (a_0, a_1, ...), with an entry for every rank the tree uses.
  Returns:
    E[tokens per iteration], between 1 and the tree's depth + 1.
  """
  rates = _check_rank_acceptance(rank_acceptance)
  branching = getattr(tree, "branching", None)
  if branching is None and all(isinstance(b, (int, np.integer)) for b in tree):
    branching = tree
  if branching is not None:
    branching = _check_branching(branching)
    if max(branching) > len(rates):
      raise ValueError(f"branching {branching} uses rank {max(branching) - 1}, but "
                       f"rank_acceptance has {len(rates)} entries")
    # Every node of a depth has the same children: P(the path reaches depth d)
    # is the product of P(some child accepted) over the depths above.
    expected, reach = 1.0, 1.0
    for b in branching:
      reach *= _any_accepted(rates, b)
      expected += reach
    return expected
  parents, ranks = (tuple(int(x) for x in a) for a in tree)
  n = len(parents)
  if len(ranks) != n or n == 0 or parents[0] != -1:
    raise ValueError(f"(parents, ranks) must be two [N] sequences with parents[0] = -1, got "
                     f"{tree!r}")
  for u in range(1, n):
    if parents[u] != -1 and not (0 <= parents[u] < n and parents[u] != u):
      raise ValueError(f"parents[{u}] = {parents[u]} is not a node")
    if parents[u] != -1 and not 0 <= ranks[u] < len(rates):
      raise ValueError(f"ranks[{u}] = {ranks[u]}, but rank_acceptance has {len(rates)} entries")
  reach = {0: 1.0}

  def reach_of(u, seen=()):
    if u not in reach:
      if u in seen or parents[u] == -1:  # a cycle or an unused branch: never reached
        return 0.0
      parent = parents[u]
      lower = [v for v in range(1, n) if parents[v] == parent and ranks[v] < ranks[u]]
      reach[u] = (reach_of(parent, seen + (u,)) * math.prod(1.0 - rates[ranks[v]] for v in lower)
                  * rates[ranks[u]])
    return reach[u]

  return 1.0 + sum(reach_of(u) for u in range(1, n) if parents[u] != -1)


def best_tree_shape(rank_acceptance: Sequence[float], node_budget: int,
                    max_depth: Optional[int] = None) -> Tuple[int, ...]:
  """The static shape (branching per depth) maximising `tree_expected_tokens`.

  Among shapes with num_nodes = 1 + b_1 + b_1 b_2 + ... <= node_budget (the
  target's block width), depth <= max_depth, and b_d <= len(rank_acceptance)
  (ranks without a measured rate are not used). Exact, by dynamic programming
  over (width of the last depth, nodes left, depths left): tens of
  milliseconds for budgets up to 64. Ties go to stopping rather than adding
  nodes that add nothing, then to a narrower first depth; the answer has at
  least one depth (TreeShape needs one). General
  (not per-depth) topologies, as Sequoia's DP builds, can do better at the
  same budget; `tree_expected_tokens` scores those.

  Args:
    rank_acceptance: (a_0, a_1, ...).
    node_budget: int >= 2, nodes including the root.
    max_depth: optional int >= 1.
  Returns:
    branching tuple, e.g. (4, 2, 1); `TreeShape(branching)` builds it.
  """
  rates = _check_rank_acceptance(rank_acceptance)
  if int(node_budget) != node_budget or node_budget < 2:
    raise ValueError(f"node_budget must be an int >= 2 (the root and one draft), got "
                     f"{node_budget!r}")
  node_budget = int(node_budget)
  if max_depth is None:
    max_depth = node_budget - 1
  if int(max_depth) != max_depth or max_depth < 1:
    raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
  any_accepted = [_any_accepted(rates, b) for b in range(len(rates) + 1)]

  @functools.lru_cache(maxsize=None)
  def best_below(width: int, nodes_left: int, depths_left: int, must_grow: bool = False):
    """(expected accepted drafts below a depth of `width` nodes, reached with
    probability 1, and the branching that attains it)."""
    best = (-1.0, ()) if must_grow else (0.0, ())
    if depths_left == 0:
      return best
    for b in range(1, min(len(rates), nodes_left // width) + 1):
      below, shape = best_below(width * b, nodes_left - width * b, depths_left - 1)
      value = any_accepted[b] * (1.0 + below)
      if value > best[0] + 1e-12:
        best = (value, (b,) + shape)
    return best

  return best_below(1, node_budget - 1, int(min(max_depth, node_budget - 1)), True)[1]


def predicted_tree_speedup(expected_tokens: float, c: float, num_draft_calls: int,
                           verify_cost: float) -> float:
  """Theorem 3.8 for a tree iteration: E[tokens] / (num_draft_calls c + C(W)).

  Each iteration costs num_draft_calls draft calls (a tree drafted depth by
  depth: one call per depth, as long as the draft scores a depth's nodes in
  one call for about the price of one) plus one target call scoring the W
  tree nodes, verify_cost = C(W) relative to a one-token target step; without
  speculation every token costs one target step. A chain of gamma drafts
  (num_draft_calls = gamma, W = gamma + 1) is
  `predicted_speedup_with_verify_cost`.

  Args:
    expected_tokens: E[tokens per iteration] (`tree_expected_tokens` or measured), >= 1.
    c: draft call time / target single-token step time.
    num_draft_calls: int >= 0 draft calls per iteration.
    verify_cost: C(W) > 0, e.g. `block_cost[W - 1]` of a measured cost curve.
  """
  expected_tokens = float(expected_tokens)
  if not 1.0 <= expected_tokens < math.inf:
    raise ValueError(f"expected_tokens must be a finite number >= 1, got {expected_tokens!r}")
  if int(num_draft_calls) != num_draft_calls or num_draft_calls < 0:
    raise ValueError(f"num_draft_calls must be an int >= 0, got {num_draft_calls!r}")
  c, verify_cost = _check_cost(c), _check_cost(verify_cost, "verify_cost")
  if verify_cost == 0:
    raise ValueError("verify_cost must be > 0")
  return expected_tokens / (int(num_draft_calls) * c + verify_cost)
