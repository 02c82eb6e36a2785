"""The §3 formulas against the paper's printed tables."""

import math

import pytest

from experiments.paper_tables import TABLE1, TABLE2
from specdec_jax.core import theory

# Table 4 rounds alpha and c; from the rounded inputs Theorem 3.8 lands on the
# printed digit except in these rows, where it is 0.1 below it:
#   EnDe base T=1 (2.35 vs 2.4), EnDe large T=1 (1.93 vs 2.0),
#   CNNDM large T=1 (1.54 vs 1.6).
TABLE4_OFF_BY_ONE_DIGIT = {"ende_base_t1", "ende_large_t1", "cnndm_large_t1"}


@pytest.mark.parametrize("alpha_gamma", sorted(TABLE1))
def test_table1_exact_to_printed_digits(alpha_gamma):
  alpha, gamma = alpha_gamma
  ops, speed = TABLE1[alpha_gamma]
  assert f"{theory.operations_increase(alpha, gamma, 0.0):.2f}" == f"{ops:.2f}"
  assert f"{theory.walltime_improvement(alpha, gamma, 0.0):.2f}" == f"{speed:.2f}"


@pytest.mark.parametrize("row", TABLE2, ids=lambda r: r.name)
def test_table4_predictions_from_table2(row):
  predicted = theory.walltime_improvement(row.alpha, row.gamma, row.c)
  assert abs(predicted - row.predicted) < 0.1
  if row.name in TABLE4_OFF_BY_ONE_DIGIT:
    assert round(predicted, 1) == pytest.approx(row.predicted - 0.1)
  else:
    assert round(predicted, 1) == pytest.approx(row.predicted)


def test_expected_tokens_is_geometric_sum_and_alpha_one_limit():
  for alpha in (0.0, 0.3, 0.9, 0.999999):
    for gamma in (0, 1, 4, 9):
      direct = sum(alpha**i for i in range(gamma + 1))
      assert theory.expected_tokens_per_iteration(alpha, gamma) == pytest.approx(direct, rel=1e-5)
  assert theory.expected_tokens_per_iteration(1.0, 7) == 8.0
  assert theory.walltime_improvement(1.0, 3, 0.5) == pytest.approx(4 / 2.5)
  assert theory.operations_increase(1.0, 3, 0.0) == pytest.approx(1.0)
  assert theory.expected_tokens_per_iteration(0.0, 5) == 1.0


def test_optimal_gamma_is_the_integer_argmax():
  for alpha, c in [(0.75, 0.02), (0.6, 0.1), (0.9, 0.05), (0.5, 0.3)]:
    best = theory.optimal_gamma(alpha, c, max_gamma=64)
    values = [theory.walltime_improvement(alpha, g, c) for g in range(1, 65)]
    assert values[best - 1] == max(values)
  # With a draft as slow as the target nothing beats gamma = 1.
  assert theory.optimal_gamma(0.5, 1.0) == 1
  assert theory.optimal_gamma(1.0, 0.0, max_gamma=20) == 20


def test_corollary_3_9_bound_is_attained_by_optimal_gamma():
  for alpha, c in [(0.75, 0.02), (0.6, 0.1), (0.3, 0.2), (0.55, 0.5)]:
    g = theory.optimal_gamma(alpha, c)
    assert theory.walltime_improvement(alpha, g, c) >= theory.corollary_3_9_bound(alpha, c) - 1e-12
  with pytest.raises(ValueError, match="alpha > c"):
    theory.corollary_3_9_bound(0.1, 0.2)


def test_cost_curve_generalises_theorem_3_8():
  flat = [1.0] * 8
  assert theory.predicted_speedup_with_cost_curve(0.75, 7, 0.02, flat) == pytest.approx(
      theory.walltime_improvement(0.75, 7, 0.02))
  # Verification that costs 1.9 target steps at k = 8 divides the gain accordingly.
  curve = [1.0, 1.2, 1.4, 1.6, 1.7, 1.8, 1.85, 1.9]
  expected = theory.expected_tokens_per_iteration(0.75, 7) / (7 * 0.02 + 1.9)
  assert theory.predicted_speedup_with_cost_curve(0.75, 7, 0.02, curve) == pytest.approx(expected)
  assert theory.predicted_speedup_with_verify_cost(0.75, 7, 0.02, 1.9) == pytest.approx(expected)
  with pytest.raises(ValueError, match="k = 1..8"):
    theory.predicted_speedup_with_cost_curve(0.75, 7, 0.02, curve[:4])


@pytest.mark.parametrize("bad", [dict(alpha=-0.1), dict(alpha=1.5), dict(alpha=math.nan),
                                 dict(gamma=-1), dict(gamma=2.5), dict(c=-0.1)])
def test_bad_arguments_raise(bad):
  args = dict(alpha=0.5, gamma=3, c=0.1)
  args.update(bad)
  with pytest.raises(ValueError):
    theory.walltime_improvement(**args)
