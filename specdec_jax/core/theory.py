"""The paper's analysis (Leviathan et al. 2023, §3) as plain functions.

Notation: alpha is the expected acceptance rate E[beta] (Corollary 3.6),
gamma the number of drafted tokens per iteration, c the cost of one draft
step relative to one target step (Theorem 3.8) and c_hat the ratio of their
arithmetic operations per token (Theorem 3.11).

The closed forms divide by (1 - alpha); at alpha = 1 every draft is accepted
and they take their limits (gamma + 1 tokens per iteration).
"""

import math
from typing import Sequence


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


def expected_tokens_per_iteration(alpha: float, gamma: int) -> float:
  """E[tokens emitted per iteration] = (1 - alpha^(gamma+1)) / (1 - alpha) (eq. 1).

  Equals 1 + alpha + ... + alpha^gamma, which is gamma + 1 at alpha = 1.
  """
  alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
  if alpha == 1.0:
    return float(gamma + 1)
  return (1.0 - alpha**(gamma + 1)) / (1.0 - alpha)


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
                                       verify_cost: float) -> float:
  """As `predicted_speedup_with_cost_curve`, given only the cost of scoring
  gamma + 1 tokens in one target call relative to one token."""
  gamma, c = _check_gamma(gamma), _check_cost(c)
  verify_cost = _check_cost(verify_cost, "verify_cost")
  if verify_cost == 0:
    raise ValueError("verify_cost must be > 0")
  return expected_tokens_per_iteration(alpha, gamma) / (gamma * c + verify_cost)
