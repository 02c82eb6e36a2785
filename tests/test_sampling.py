"""The sampling adjustment shared by target and draft."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.core import sampling
from specdec_jax.core.sampling import adjust_probs


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


@pytest.mark.parametrize("n", [300, 2048, 2050, 32128])
def test_argmax_equals_jnp_argmax_with_ties_nans_and_padding(n):
  """sampling.argmax is jnp.argmax exactly: first maximum, first NaN, any length."""
  rng = np.random.default_rng(n)
  rows = rng.standard_normal((8, n)).astype(np.float32)
  rows[1] = np.round(rows[1])                      # many ties for the maximum
  rows[2, [n // 3, n - 1]] = np.nan                # the first NaN wins
  rows[3, -1] = np.nan                             # a NaN in the last (padded) block
  rows[4] = -np.inf                                # all equal: index 0
  rows[5, [7, n - 2]] = np.inf                     # ties at +inf
  rows[6, [5, n // 2]] = [np.inf, np.nan]          # NaN beats an earlier +inf
  rows[7, :] = 0.0; rows[7, -1] = 1.0              # the maximum in the padding's block
  cases = [rows, rows.astype(jnp.bfloat16), (rows[[0, 1, 7]] * 4).astype(np.int32),
           rows[None, :3]]                         # more leading dims
  for x in cases:
    got = jax.jit(sampling.argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)),
                                  err_msg=str(x.dtype))
