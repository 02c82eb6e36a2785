"""The sampling adjustment shared by target and draft."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.sampling import adjust_probs


def _logits(seed=0, shape=(4, 50)):
  return jax.random.normal(jax.random.PRNGKey(seed), shape) * 3


def test_rows_sum_to_one():
  logits = _logits()
  for kw in (dict(temperature=1.0), dict(temperature=0.5, topk=7), dict(temperature=1.3, topp=0.6),
             dict(temperature=0.0)):
    probs = np.asarray(adjust_probs(logits, **kw))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert (probs >= 0).all()


def test_temperature_zero_is_one_hot_on_first_maximum():
  logits = jnp.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
  probs = np.asarray(adjust_probs(logits, temperature=0.0))
  np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_temperature_scales_logits():
  logits = _logits(1)
  np.testing.assert_allclose(adjust_probs(logits, temperature=0.5),
                             jax.nn.softmax(logits / 0.5), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_topk_keeps_exactly_k(k):
  logits = jnp.round(_logits(2)).at[:, :5].set(9.0)  # many ties at the top
  probs = np.asarray(adjust_probs(logits, temperature=1.0, topk=k))
  assert ((probs > 0).sum(-1) == k).all()
  kept_min = np.where(probs > 0, np.asarray(logits), np.inf).min(-1)
  dropped_max = np.where(probs > 0, -np.inf, np.asarray(logits)).max(-1)
  assert (kept_min >= dropped_max).all()
  full = np.asarray(jax.nn.softmax(logits))
  ratio = probs / np.where(probs > 0, full, 1)
  for row_ratio, row in zip(ratio, probs):
    np.testing.assert_allclose(row_ratio[row > 0], row_ratio[row > 0][0], rtol=1e-5)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_topp_keeps_smallest_set_with_mass(p):
  logits = _logits(3)
  full = np.asarray(jax.nn.softmax(logits))
  probs = np.asarray(adjust_probs(logits, temperature=1.0, topp=p))
  for row_full, row in zip(full, probs):
    kept = row > 0
    assert row_full[kept].sum() >= p - 1e-6
    # Dropping the least likely kept token would fall below p: smallest set.
    assert row_full[kept].sum() - row_full[kept].min() < p
    assert row_full[kept].min() >= row_full[~kept].max(initial=0)


def test_bad_settings():
  logits = _logits()
  with pytest.raises(ValueError, match="temperature"):
    adjust_probs(logits, temperature=-1.0)
  with pytest.raises(ValueError, match="exclusive"):
    adjust_probs(logits, temperature=1.0, topk=3, topp=0.5)
  with pytest.raises(ValueError, match="exceeds the vocabulary"):
    adjust_probs(logits, temperature=1.0, topk=51)
  with pytest.raises(ValueError, match="topp"):
    adjust_probs(logits, temperature=1.0, topp=1.5)
