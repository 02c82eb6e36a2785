"""Sampled outputs checked for their law: the statistics and the exact test.

Greedy outputs are checked token for token; sampled ones differ by design, so
exactness (Theorem 3.1: speculative sampling draws from the target's law) is
tested on statistics of the samples. Both the launcher (`experiments.run`,
one pair) and the evaluation harness (per category) use these functions.
"""

import math
from typing import Any, Dict, Sequence

import jax.numpy as jnp
import numpy as np

from specdec_jax.core import sampling
from specdec_jax.families.registry import family_of


def mean_log_probs(model, inputs, prompt_lengths, sequences: np.ndarray, lengths: np.ndarray,
                   max_decode_steps: int, temperature: float, topk: int,
                   topp: float) -> np.ndarray:
  """[batch] mean log-probability of each row's generated tokens under the target's
  sampling distribution (teacher forced, through the family's training batch).

  inputs [batch, C] and prompt_lengths [batch] (decoder-only; None for T5) as
  `generate` took them; sequences [batch, N] and lengths [batch] as it returned them.
  """
  family, config = family_of(model), model.config
  tokens, row_lengths = family.check_inputs(config, inputs, prompt_lengths, max_decode_steps)
  batch = family.continuation_batch(config, np.asarray(tokens), np.asarray(row_lengths),
                                    sequences, lengths)
  logits, targets, weights = family.token_logits(config, model.params, batch)
  probs = sampling.adjust_probs(logits, temperature, topk, topp)
  token_probs = jnp.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
  logs = np.log(np.maximum(np.asarray(token_probs), 1e-30))
  weights = np.asarray(weights)
  return (logs * weights).sum(1) / np.maximum(weights.sum(1), 1)


def sign_test_p_value(differences: Sequence[float]) -> float:
  """Exact two-sided sign test of "median difference 0" (zeros dropped)."""
  nonzero = [d for d in differences if d != 0]
  n = len(nonzero)
  if n == 0:
    return 1.0
  tail = min(sum(d > 0 for d in nonzero), sum(d < 0 for d in nonzero))
  return min(1.0, 2 * sum(math.comb(n, i) for i in range(tail + 1)) / 2**n)


def law_check(records: Sequence[Dict[str, Any]], vanilla: Sequence[Dict[str, Any]],
              false_alarm: float, tests: int) -> Dict[str, Any]:
  """Is a method's law vanilla's on one group of inputs (one category)?

  Each input and repeat gives one sample of each decoder, drawn with independent
  keys (`records[i]['law_statistics']`: per repeat, 'length' over every turn and
  'mean_log_prob', the target's mean log-probability of the first turn's tokens).
  When both decoders sample the target's law the two samples are exchangeable, so
  each difference of a statistic is positive or negative with probability 1/2. An
  exact sign test per statistic, Bonferroni-corrected over `tests` tests in all,
  fails with probability at most `false_alarm` under exactness. It detects shifts
  of these statistics, not every difference of law; its power grows with the
  pairs (inputs x repeats): with n pairs it sees a shift that makes one side win
  with probability p once n (p - 1/2)^2 is large (n = 60 at p = 0.75 has
  power ~0.8 at the 0.01 level).
  """
  by_id = {r["question_id"]: r for r in vanilla}
  p_values, pairs = {}, 0
  for name in ("length", "mean_log_prob"):
    differences = [a - b for r in records
                   for a, b in zip(r["law_statistics"][name],
                                   by_id[r["question_id"]]["law_statistics"][name])]
    p_values[name], pairs = sign_test_p_value(differences), len(differences)
  threshold = false_alarm / max(tests, 1)
  return dict(test="paired sign tests (exact, two-sided), Bonferroni", p_values=p_values,
              pairs=pairs, threshold=threshold,
              passed=all(p >= threshold for p in p_values.values()))
