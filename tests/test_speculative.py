"""Speculative decoding is exact: greedy token-for-token, sampling in distribution.

Statistical tests use chi-square goodness of fit at a per-test false-alarm
rate of 1e-4 (P_VALUE); with the dozen such checks in this file a correct
implementation fails spuriously with probability about 1e-3. A wrong rule
(e.g. sampling the residual from p instead of max(0, p - q), or accepting
with r < q / p) shifts these distributions by far more than the tests
resolve at these sample sizes.

Power of the whole-decode tests (test_speculative_samples_follow_target_distribution,
10,000 samples each), from the exact output distribution of gamma-2, 3-step
speculative decoding of these very models enumerated under a wrong rule (the
enumeration reproduces the target's distribution exactly under the right
rule): the noncentrality n * sum((p_wrong - p)^2 / p) over the test's own
categories is >= 1614 (residual from p), >= 19516 (accept with r < q / p) and
>= 515 (bonus token from q instead of p) across the four settings, where
power 0.99 at the 1e-4 level needs 75-178 (26-291 degrees of freedom): the
power against each is 1 - 1e-6 or more. More generally, any wrong rule with
chi-square effect sum((p_wrong - p)^2 / p) >= 0.018 is caught with power >= 0.99
(0.0066 at the former 30,000). Small errors in the target's own sampling
distribution (temperature 1.1 for 1: effect 0.011) are the autoregressive
test's to catch: it keeps 30,000 samples (power 1.0 there, 0.62 at 10,000),
and the speculative loop scores the target through the same adjust_probs.
"""

import collections
import itertools

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdec_jax as sj
from specdec_jax.core import sampling
from specdec_jax.core.verification import token as speculative
from specdec_jax.perturbation import perturbed_model
from specdec_jax.tools import testing

P_VALUE = 1e-4


def chi_square_cells(observed: dict, expected_probs: dict, n: int):
  """(observed, expected) counts over categories with expected count >= 5 (the rest lumped)."""
  assert set(observed) <= {k for k, v in expected_probs.items() if v > 0}, (
      "a sample fell on an outcome of probability zero: "
      f"{sorted(set(observed) - {k for k, v in expected_probs.items() if v > 0})[:5]}")
  big = [k for k, v in expected_probs.items() if v * n >= 5]
  obs = [observed.get(k, 0) for k in big]
  exp = [expected_probs[k] * n for k in big]
  rest_exp = n - sum(exp)
  if rest_exp >= 5:
    obs.append(n - sum(obs))
    exp.append(rest_exp)
  return np.array(obs, np.float64), np.array(exp, np.float64)


def _chi_square_ok(observed: dict, expected_probs: dict, n: int):
  """Chi-square p-value over categories with expected count >= 5 (the rest lumped)."""
  obs, exp = chi_square_cells(observed, expected_probs, n)
  return scipy_stats.chisquare(obs, exp / exp.sum() * obs.sum(), sum_check=False).pvalue


# --------------------------------------------------------------------------
# One step, against the analytic distributions.

def _step_case(seed, vocab=6, gamma=3):
  rng = np.random.RandomState(seed)
  p = rng.dirichlet(np.ones(vocab), gamma + 1)
  q = rng.dirichlet(np.ones(vocab), gamma)
  # Zeros both ways: q misses tokens p likes, p forbids tokens q proposes.
  q[0, 1] = 0.0
  p[0, 2] = 0.0
  p[1, 0] = 0.0
  q[2, 3] = 0.0
  p /= p.sum(-1, keepdims=True)
  q /= q.sum(-1, keepdims=True)
  return p.astype(np.float32), q.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_step_first_tokens_and_acceptance_match_analytic(seed):
  p, q = _step_case(seed)
  gamma, vocab = q.shape
  n = 200_000

  @jax.jit
  def run(keys):
    def one(key):
      draft_key, step_key = jax.random.split(key)
      draft_tokens = jax.random.categorical(draft_key, sampling.safe_log(jnp.asarray(q)))
      num_accepted, token = speculative.speculative_step(step_key, draft_tokens, jnp.asarray(q),
                                                         jnp.asarray(p))
      padded = jnp.concatenate([draft_tokens, token[None]])
      emitted = jnp.where(jnp.arange(gamma + 1) < num_accepted, padded,
                          jnp.where(jnp.arange(gamma + 1) == num_accepted, token, -1))
      return num_accepted, emitted
    return jax.vmap(one)(keys)

  num_accepted, emitted = jax.device_get(run(jax.random.split(jax.random.PRNGKey(seed), n)))
  beta = np.minimum(p[:gamma], q).sum(-1)
  expected_n = {k: np.prod(beta[:k]) * (1 - beta[k]) for k in range(gamma)}
  expected_n[gamma] = np.prod(beta)
  assert _chi_square_ok(collections.Counter(num_accepted.tolist()), expected_n, n) > P_VALUE
  # The first emitted token ~ p_1; the second (when there is one) ~ p_2.
  first = collections.Counter(emitted[:, 0].tolist())
  assert _chi_square_ok(first, dict(enumerate(p[0])), n) > P_VALUE
  has_second = emitted[:, 1] >= 0
  second = collections.Counter(emitted[has_second, 1].tolist())
  assert _chi_square_ok(second, dict(enumerate(p[1])), int(has_second.sum())) > P_VALUE


_STEP = jax.jit(speculative.speculative_step)


def _distribution(vocab):
  """Rows from the awkward corners: zeros, one-hots, near-ties, tiny masses."""
  weights = st.one_of(st.just(0.0), st.just(1e-30), st.floats(1e-8, 1.0), st.just(1.0))
  return hnp.arrays(np.float64, (vocab,), elements=weights).filter(lambda w: w.sum() > 0)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(p_rows=st.lists(_distribution(5), min_size=3, max_size=3),
                  q_rows=st.lists(_distribution(5), min_size=2, max_size=2),
                  seed=st.integers(0, 2**31 - 1), near_equal=st.booleans())
def test_step_property_never_nan_never_forbidden_token(p_rows, q_rows, seed, near_equal):
  p = np.stack(p_rows)
  q = np.stack(q_rows)
  if near_equal:
    q = p[:2] * (1 + 1e-7)
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  rng = np.random.RandomState(seed % 2**31)
  draft_tokens = np.array([rng.choice(5, p=row / row.sum()) for row in q.astype(np.float64)])
  num_accepted, token = jax.device_get(
      _STEP(jax.random.PRNGKey(seed), jnp.asarray(draft_tokens, jnp.int32), q, p))
  assert 0 <= num_accepted <= 2
  assert 0 <= token < 5
  for i in range(num_accepted):
    assert p[i, draft_tokens[i]] > 0, "accepted a token the target forbids"
  assert p[num_accepted, token] > 0, "emitted a token the target forbids"


def test_step_validates_shapes():
  q = jnp.ones((3, 4)) / 4
  with pytest.raises(ValueError, match="target_probs"):
    speculative.speculative_step(jax.random.PRNGKey(0), jnp.zeros(3, jnp.int32), q, q)


# --------------------------------------------------------------------------
# Whole decodes.

@pytest.fixture(scope="module")
def pair():
  return testing.tiny_pair(vocab_size=64, noise=0.12, seed=0)


def test_greedy_speculative_equals_autoregressive(pair):
  target, draft = pair
  enc = testing.random_encoder_tokens(6, 10, 64, seed=2)
  steps = 16
  eos = testing.eos_splitting_rows(sj.generate(target, enc, max_decode_steps=steps).sequences)
  ref = sj.generate(target, enc, max_decode_steps=steps, eos_id=eos)
  lengths = np.asarray(ref.lengths)
  assert (lengths < steps).any() and (lengths == steps).any(), lengths
  # gamma 8 does not fit the default width 8: both loops widen to 9 together.
  wide_ref = sj.generate(target, enc, max_decode_steps=steps, eos_id=eos, block_width=9)
  for gamma in (1, 2, 5, 8):
    width = 9 if gamma == 8 else None
    expected = wide_ref if gamma == 8 else ref
    out = sj.generate(target, enc, max_decode_steps=steps, eos_id=eos, draft=draft, gamma=gamma,
                      block_width=width)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences),
                                  err_msg=f"gamma={gamma}")
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
    s = out.stats
    assert 0.05 < s.acceptance_rate < 0.95, f"degenerate pair: {s.summary()}"
    # Every iteration emits its accepted drafts plus one token.
    np.testing.assert_array_equal(s.emitted, s.accepted + s.iterations)
    np.testing.assert_array_equal(s.emitted, lengths)
    assert (s.accepted <= s.accepted_raw).all()
    assert (s.position_accepted <= s.position_drafted).all()
    assert s.per_position_acceptance.shape == (gamma,)
    assert 0.0 < s.alpha < 1.0
    assert s.mean_tokens_per_iteration == pytest.approx(lengths.sum() / s.iterations.sum())


def test_self_draft_accepts_everything(pair):
  target, _ = pair
  enc = testing.random_encoder_tokens(3, 7, 64, seed=5)
  out = sj.generate(target, enc, max_decode_steps=12, draft=target, gamma=3, temperature=1.0,
                    rng=jax.random.PRNGKey(1))
  ref = sj.generate(target, enc, max_decode_steps=12, temperature=1.0, rng=jax.random.PRNGKey(1))
  assert out.stats.acceptance_rate == 1.0
  assert out.stats.alpha == pytest.approx(1.0, abs=1e-5)
  assert out.sequences.shape == ref.sequences.shape


def _exact_sequence_distribution(model, enc_row, steps, eos_id, **sampling_kw):
  """P(output sequence) by enumerating every token sequence of length `steps`."""
  vocab = model.config.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=steps)), np.int32)
  dec_inputs = np.concatenate([np.zeros((len(seqs), 1), np.int32), seqs[:, :-1]], axis=1)
  enc = np.repeat(enc_row[None], len(seqs), axis=0)
  probs = np.asarray(sampling.adjust_probs(model.logits(enc, dec_inputs), **sampling_kw))
  chain = np.prod(np.take_along_axis(probs, seqs[..., None], axis=-1)[..., 0], axis=1)
  dist = collections.defaultdict(float)
  for seq, prob in zip(seqs.tolist(), chain):
    out = []
    for token in seq:  # T5X output convention: zeros after EOS.
      out.append(0 if out and (eos_id in out) else token)
    dist[tuple(out)] += prob
  return dist


@pytest.mark.parametrize("setting", [
    dict(temperature=1.0), dict(temperature=0.7, topk=3), dict(temperature=1.0, topp=0.8),
    dict(temperature=1.0, bad_draft=True)], ids=["t1", "t0.7_top3", "topp0.8", "bad_draft"])
def test_speculative_samples_follow_target_distribution(setting):
  setting = dict(setting)
  bad_draft = setting.pop("bad_draft", False)
  # 10,000 samples (was 30,000): the module docstring gives the power.
  vocab, steps, n = 8, 3, 10_000
  target = sj.load_model("tiny", vocab_size=vocab, seed=11, dtype="float32")
  if bad_draft:
    draft = sj.load_model("tiny_draft", vocab_size=vocab, seed=12, dtype="float32")
  else:
    draft = perturbed_model(target, 0.5, seed=13)
  enc_row = np.array([5, 3, 7, 2], np.int32)
  expected = _exact_sequence_distribution(target, enc_row, steps, eos_id=1, **setting)
  enc = np.repeat(enc_row[None], n, axis=0)
  out = sj.generate(target, enc, max_decode_steps=steps, draft=draft, gamma=2,
                    rng=jax.random.PRNGKey(7), **setting)
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert len(observed) > 10, "too few distinct outputs to test a distribution"
  assert 0.02 < out.stats.acceptance_rate < 0.98
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def test_autoregressive_samples_follow_target_distribution():
  """The baseline sampler against the same enumeration (checks the reference too)."""
  vocab, steps, n = 8, 3, 30_000
  target = sj.load_model("tiny", vocab_size=vocab, seed=11, dtype="float32")
  enc_row = np.array([5, 3, 7, 2], np.int32)
  expected = _exact_sequence_distribution(target, enc_row, steps, eos_id=1, temperature=1.0)
  out = sj.generate(target, np.repeat(enc_row[None], n, axis=0), max_decode_steps=steps,
                    temperature=1.0, rng=jax.random.PRNGKey(8))
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def test_bad_inputs(pair):
  target, draft = pair
  enc = testing.random_encoder_tokens(2, 5, 64)
  with pytest.raises(ValueError, match="gamma"):
    sj.generate(target, enc, max_decode_steps=4, draft=draft, gamma=0)
  other_vocab = sj.load_model("tiny_draft", vocab_size=65)
  with pytest.raises(ValueError, match="vocabulary"):
    sj.generate(target, enc, max_decode_steps=4, draft=other_vocab)
  other_eos = sj.Model(draft.config.replace(eos_id=2), draft.params)
  with pytest.raises(ValueError, match="eos_id"):
    sj.generate(target, enc, max_decode_steps=4, draft=other_eos)
  other_pad = sj.Model(draft.config.replace(pad_id=3), draft.params)
  with pytest.raises(ValueError, match="pad_id"):
    sj.generate(target, enc, max_decode_steps=4, draft=other_pad)
  with pytest.raises(TypeError, match="draft"):
    sj.generate(target, enc, max_decode_steps=4, draft="tiny")
