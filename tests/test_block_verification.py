"""Block verification (Sun et al. 2025, arXiv 2403.10444) is exact and accepts more.

* An independent numpy reference enumerates, on a tiny vocabulary, every
  draft block and sums over the accepted length tau with the h_i
  probabilities: the law of the emitted block. Completed by the target's own
  sampling it must equal the target's law (to float64 rounding), and its
  E[tau] must be >= token-wise verification's E[accepted] (the paper's
  optimality), strictly somewhere.
* The jax step is checked against that exact law by chi-square (the law of
  the emitted block itself, which differs from token-wise verification's, so
  the test tells the two rules apart), greedy and gamma = 1 against the
  token-wise step output for output, and whole decodes against target-only
  enumeration (the helpers of tests/test_speculative.py).
"""

import collections
import itertools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdec_jax as sj
from specdec_jax import generation
from specdec_jax.core import decoding
from specdec_jax.core.verification import block as block_verification
from specdec_jax.core.verification import token as speculative
from specdec_jax.perturbation import perturbed_model
from specdec_jax.tools import testing
# Shared with the token-wise tests: chi-square over lumped categories, the exact law of a
# tiny model's samples by enumeration, and the per-test false-alarm rate there (1e-4).
from test_speculative import P_VALUE, _chi_square_ok, _distribution, _exact_sequence_distribution

# `make test-slow` (CI runs it beside `make test`): the long statistical and method suites.
pytestmark = pytest.mark.slow

# Per-test false-alarm rate of the step-level chi-square tests here.
STEP_P_VALUE = 1e-3


# --------------------------------------------------------------------------
# The numpy reference (written from the paper's rule, not from the jax code).

class Case:
  """Target and draft as conditional laws on every prefix of a tiny vocabulary.

  p[prefix] (prefixes of length 0..gamma) and q[prefix] (length 0..gamma - 1)
  are [vocab] float64 laws; `stop(x)` (default gamma) is the draft's block
  length for the drafted tokens x, a stopping time: it may read x[:g] only.
  """

  def __init__(self, vocab, gamma, seed, zeros=0.0, point_mass=False, stop=None,
               concentration=1.0):
    rng = np.random.RandomState(seed)
    self.vocab, self.gamma, self.stop = vocab, gamma, stop
    self.p, self.q = {}, {}
    for length in range(gamma + 1):
      for prefix in itertools.product(range(vocab), repeat=length):
        self.p[prefix] = self._law(rng, zeros, concentration)
        if length < gamma:
          if point_mass:  # A deterministic draft: q is one-hot on its proposal.
            self.q[prefix] = np.eye(vocab)[rng.randint(vocab)]
          else:
            self.q[prefix] = self._law(rng, zeros, concentration)

  def _law(self, rng, zeros, concentration):
    law = rng.dirichlet(np.full(self.vocab, concentration))
    law[rng.rand(self.vocab) < zeros] = 0.0
    if law.sum() == 0:
      law[rng.randint(self.vocab)] = 1.0
    return law / law.sum()

  def drafts(self):
    """(x, probability of x, block length g) for every draft block x in V^gamma."""
    for x in itertools.product(range(self.vocab), repeat=self.gamma):
      prob = np.prod([self.q[x[:i]][x[i]] for i in range(self.gamma)])
      if prob > 0:
        yield x, prob, self.gamma if self.stop is None else self.stop(x)

  def target_law(self, length):
    return {s: np.prod([self.p[s[:i]][s[i]] for i in range(length)])
            for s in itertools.product(range(self.vocab), repeat=length)}

  def arrays(self, x, g):
    """(draft_probs [gamma, V] (zeros past g), target_probs [gamma + 1, V]) on x's path."""
    q = np.stack([self.q[x[:i]] if i < g else np.zeros(self.vocab) for i in range(self.gamma)])
    p = np.stack([self.p[x[:i]] for i in range(self.gamma + 1)])
    return q, p


def _normalise(v):
  return v / v.sum()


def block_law(case, rule="block"):
  """{emitted block (tuple): probability} and E[accepted drafts], exactly.

  rule: "block" (Sun et al.), "token" (Leviathan et al.), and two wrong
  variants for power: "block_first_failure" (tau stops at the first failed
  test) and "block_unweighted" (the residual drops the w_tau weight).
  """
  law = collections.defaultdict(float)
  expected_accepted = 0.0
  for x, prob, g in case.drafts():
    q, p = case.arrays(x, g)
    ratio = [p[i, x[i]] / q[i, x[i]] for i in range(g)]
    if rule == "token":
      accept = [min(1.0, r) for r in ratio]
      tau_law = [np.prod(accept[:k]) * (1 - accept[k]) for k in range(g)] + [np.prod(accept)]
      weights = np.ones(g + 1)
    else:
      w = [1.0]
      for r in ratio:
        w.append(min(1.0, w[-1] * r))
      h = [0.0] * (g + 1)
      for i in range(1, g):
        r_i = np.maximum(w[i] * p[i] - q[i], 0).sum()
        h[i] = 1.0 if r_i + 1 - w[i] == 0 else r_i / (r_i + 1 - w[i])
      if g:
        h[g] = w[g]
      if rule == "block_first_failure":
        tau_law = [np.prod(h[1:k + 1]) * (1 - h[k + 1]) for k in range(g)] + [np.prod(h[1:])]
      else:  # tau = the largest i with u_i < h_i.
        tau_law = [h[k] * np.prod([1 - h[j] for j in range(k + 1, g + 1)]) for k in range(g + 1)]
        tau_law[0] = np.prod([1 - h[j] for j in range(1, g + 1)])
      weights = np.ones(g + 1) if rule == "block_unweighted" else np.array(w)
    for tau, p_tau in enumerate(tau_law):
      if p_tau <= 0:
        continue
      expected_accepted += prob * p_tau * tau
      if tau == g:
        nxt = p[g]
      else:
        nxt = _normalise(np.maximum(weights[tau] * p[tau] - q[tau], 0))
      for y in range(case.vocab):
        if nxt[y] > 0:
          law[x[:tau] + (y,)] += prob * p_tau * nxt[y]
  return dict(law), expected_accepted


def completed_law(case, law):
  """The law of gamma + 1 tokens: each emitted block continued by the target's sampling."""
  length = case.gamma + 1
  out = collections.defaultdict(float)
  for block, prob in law.items():
    for rest in itertools.product(range(case.vocab), repeat=length - len(block)):
      s = block + rest
      out[s] += prob * np.prod([case.p[s[:i]][s[i]] for i in range(len(block), length)])
  return out


CASES = {
    "dense": dict(vocab=3, gamma=3, seed=0),
    "zeros": dict(vocab=3, gamma=3, seed=1, zeros=0.3),
    "point_mass": dict(vocab=3, gamma=3, seed=2, point_mass=True),
    # The draft stops after drafting token 0 (a stopping time): gamma' varies.
    "stopping": dict(vocab=3, gamma=3, seed=3, zeros=0.2,
                     stop=lambda x: next((i + 1 for i, t in enumerate(x) if t == 0), len(x))),
    "gamma2_v4": dict(vocab=4, gamma=2, seed=4, zeros=0.2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_law_is_the_target_law(name):
  case = Case(**CASES[name])
  target = case.target_law(case.gamma + 1)
  for rule in ("block", "token"):
    law, _ = block_law(case, rule)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    done = completed_law(case, law)
    np.testing.assert_allclose([done.get(s, 0.0) for s in target], list(target.values()),
                               atol=1e-12, err_msg=rule)
  if CASES[name].get("point_mass"):
    # A deterministic draft: P(tau >= i) = prod_j p_j(x_j) under both rules, the most any
    # exact rule can accept (the target emits x_1..x_i that often). Block verification
    # then gains nothing: the two laws are the same.
    block, token = block_law(case, "block")[0], block_law(case, "token")[0]
    assert max(abs(block.get(k, 0.0) - token.get(k, 0.0)) for k in set(block) | set(token)) < 1e-12
  # The first-failure variant is wrong (it serves as an alternative for the power check).
  done = completed_law(case, block_law(case, "block_first_failure")[0])
  assert max(abs(done.get(s, 0.0) - v) for s, v in target.items()) > 1e-6


def test_block_accepts_at_least_as_many_as_token_wise():
  """E[tau] (block) >= E[accepted] (token-wise) on 300 random pairs, strictly on most."""
  strict = 0
  for seed in range(300):
    vocab, gamma = (3, 3) if seed % 2 else (4, 2)
    case = Case(vocab, gamma, seed, zeros=0.2 * (seed % 3 == 0),
                point_mass=seed % 7 == 0, concentration=[0.3, 1.0, 3.0][seed % 3])
    _, block = block_law(case, "block")
    _, token = block_law(case, "token")
    assert block >= token - 1e-12, (seed, block, token)
    strict += block > token + 1e-9
  assert strict >= 200, strict
  # gamma = 1: the two rules coincide.
  for seed in range(20):
    case = Case(4, 1, seed)
    assert block_law(case, "block")[1] == pytest.approx(block_law(case, "token")[1], abs=1e-14)


# --------------------------------------------------------------------------
# The jax step against the reference.

def _sample_blocks(case, n, seed):
  """n emitted blocks from `block_verification_step`, drafts drawn from the joint q."""
  drafts = list(case.drafts())
  probs = np.array([d[1] for d in drafts])
  arrays = [case.arrays(x, g) for x, _, g in drafts]
  tokens = jnp.asarray([d[0] for d in drafts], jnp.int32)
  qs = jnp.asarray(np.stack([a[0] for a in arrays]), jnp.float32)
  ps = jnp.asarray(np.stack([a[1] for a in arrays]), jnp.float32)
  gs = jnp.asarray([d[2] for d in drafts], jnp.int32)
  gamma = case.gamma

  @jax.jit
  def run(key):
    draft_key, step_key = jax.random.split(key)
    which = jax.random.categorical(draft_key, jnp.log(jnp.asarray(probs, jnp.float32)), shape=(n,))
    tau, token = block_verification.batched_block_verification_step(
        jax.random.split(step_key, n), tokens[which], qs[which], ps[which], gs[which])
    return tokens[which], tau, token

  x, tau, token = jax.device_get(run(jax.random.PRNGKey(seed)))
  return collections.Counter(tuple(x[i, :tau[i]].tolist()) + (int(token[i]),) for i in range(n))


@pytest.mark.parametrize("name", ["dense", "zeros", "stopping"])
def test_step_follows_the_exact_block_law(name):
  """Chi-square of the emitted block's law (n = 60,000, level STEP_P_VALUE = 1e-3).

  Power, computed here from the exact laws, against every alternative whose block law
  differs: token-wise verification (exact too, but another block law: it can emit
  blocks this rule never does) and the two wrong block variants. A sample on an
  outcome of probability 0 fails the test outright, so the power is the larger of
  1 - (1 - off-support mass)^n and the chi-square's at noncentrality
  n * sum((P' - P)^2 / P); it must be >= 0.99.
  """
  case = Case(**CASES[name])
  n = 60_000
  expected, _ = block_law(case, "block")
  df = sum(1 for v in expected.values() if v * n >= 5)  # about the test's categories, + 1 lump
  critical = scipy_stats.chi2.isf(STEP_P_VALUE, df)
  alternatives = 0
  for rule in ("token", "block_first_failure", "block_unweighted"):
    wrong, _ = block_law(case, rule)
    if sum(abs(wrong.get(k, 0.0) - v) for k, v in expected.items()) < 1e-9:
      continue  # The same law here (e.g. no residual where the weight w_tau matters).
    alternatives += 1
    lam = n * sum((wrong.get(k, 0.0) - v) ** 2 / v for k, v in expected.items() if v > 0)
    off = sum(v for k, v in wrong.items() if expected.get(k, 0.0) == 0)
    power = max(scipy_stats.ncx2.sf(critical, df, min(lam, 1e6)), 1 - (1 - off) ** n)
    assert power >= 0.99, (rule, lam, off)
  assert alternatives >= 2
  observed = _sample_blocks(case, n, seed=sorted(CASES).index(name))
  assert _chi_square_ok(observed, expected, n) > STEP_P_VALUE


_BLOCK = jax.jit(jax.vmap(block_verification.block_verification_step, in_axes=(0, 0, 0, 0, 0)))
_TOKEN = jax.jit(jax.vmap(speculative.speculative_step, in_axes=(0, 0, 0, 0, 0)))


def _random_laws(rng, shape, zeros):
  law = rng.dirichlet(np.ones(shape[-1]), shape[:-1])
  law[rng.rand(*law.shape) < zeros] = 0.0
  law[law.sum(-1) == 0, 0] = 1.0
  return (law / law.sum(-1, keepdims=True)).astype(np.float32)


def test_gamma_1_is_token_wise_for_the_same_key():
  rng = np.random.RandomState(0)
  n, vocab = 4000, 5
  p = _random_laws(rng, (n, 2, vocab), zeros=0.3)
  q = _random_laws(rng, (n, 1, vocab), zeros=0.3)
  q[: n // 4] = p[: n // 4, :1]  # p = q exactly: the w = 1, r = 0 corner.
  x = np.array([[rng.choice(vocab, p=row[0] / row[0].sum())] for row in q.astype(np.float64)],
               np.int32)
  num_drafted = rng.randint(0, 2, n).astype(np.int32)
  keys = jax.random.split(jax.random.PRNGKey(1), n)
  block = jax.device_get(_BLOCK(keys, x, q, p, num_drafted))
  token = jax.device_get(_TOKEN(keys, x, q, p, num_drafted))
  np.testing.assert_array_equal(block[0], token[0])
  np.testing.assert_array_equal(block[1], token[1])
  assert 0.2 < block[0].mean() < 0.8  # Both outcomes occur.


@pytest.mark.parametrize("greedy", [True, False])
def test_greedy_is_token_wise(greedy):
  """One-hot p and q (temperature 0): the same outputs as token-wise verification, whatever
  the key, through the same formulas (greedy=False: drawn from the one-hot residuals)."""
  rng = np.random.RandomState(2)
  n, gamma, vocab = 4000, 4, 3
  target = rng.randint(vocab, size=(n, gamma + 1))
  x = np.where(rng.rand(n, gamma) < 0.7, target[:, :gamma], rng.randint(vocab, size=(n, gamma)))
  p = np.eye(vocab, dtype=np.float32)[target]
  q = np.eye(vocab, dtype=np.float32)[x]
  num_drafted = rng.randint(0, gamma + 1, n).astype(np.int32)
  q[np.arange(gamma)[None] >= num_drafted[:, None]] = 0.0  # Zeros past num_drafted.
  x = x.astype(np.int32)
  keys = jax.random.split(jax.random.PRNGKey(3), n)
  step = lambda f: jax.jit(jax.vmap(lambda *a: f(*a, greedy=greedy)))  # noqa: E731
  block = jax.device_get(step(block_verification.block_verification_step)(
      keys, x, q, p, num_drafted))
  token = jax.device_get(step(speculative.speculative_step)(keys, x, q, p, num_drafted))
  np.testing.assert_array_equal(block[0], token[0])
  np.testing.assert_array_equal(block[1], token[1])
  assert len(set(block[0].tolist())) == gamma + 1


_STEP = jax.jit(block_verification.block_verification_step)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(p_rows=st.lists(_distribution(4), min_size=4, max_size=4),
                  q_rows=st.lists(_distribution(4), min_size=3, max_size=3),
                  seed=st.integers(0, 2**31 - 1), near_equal=st.booleans(),
                  num_drafted=st.integers(0, 3))
def test_step_never_nan_never_forbidden_token(p_rows, q_rows, seed, near_equal, num_drafted):
  p = np.stack(p_rows)
  q = np.stack(q_rows)
  if near_equal:
    q = p[:3] * (1 + 1e-7)
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  rng = np.random.RandomState(seed % 2**31)
  x = np.array([rng.choice(4, p=row / row.sum()) for row in q.astype(np.float64)], np.int32)
  q[num_drafted:] = 0.0
  tau, token = jax.device_get(_STEP(jax.random.PRNGKey(seed), x, q, p, jnp.int32(num_drafted)))
  assert 0 <= tau <= num_drafted
  assert 0 <= token < 4
  for i in range(tau):
    assert p[i, x[i]] > 0, "accepted a token the target forbids"
  assert p[tau, token] > 0, "emitted a token the target forbids"


def test_step_validates_shapes():
  q = jnp.ones((3, 4)) / 4
  with pytest.raises(ValueError, match="target_probs"):
    block_verification.block_verification_step(jax.random.PRNGKey(0), jnp.zeros(3, jnp.int32),
                                               q, q)
  assert decoding.VERIFIERS["block"] is block_verification.batched_block_verification_step


# --------------------------------------------------------------------------
# Whole decodes.

@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=1.0, topp=0.8)],
                         ids=["t1", "topp0.8"])
def test_block_decodes_follow_target_distribution(setting):
  """10,000 decodes of 3 tokens at gamma 2 against the enumerated target law (level P_VALUE,
  as tests/test_speculative.py, whose docstring gives the power of this design)."""
  vocab, steps, n = 8, 3, 10_000
  target = sj.load_model("tiny", vocab_size=vocab, seed=11, dtype="float32")
  draft = perturbed_model(target, 0.5, seed=13)
  enc_row = np.array([5, 3, 7, 2], np.int32)
  expected = _exact_sequence_distribution(target, enc_row, steps, eos_id=1, **setting)
  out = sj.generate(target, np.repeat(enc_row[None], n, axis=0), max_decode_steps=steps,
                    draft=draft, gamma=2, verification="block", rng=jax.random.PRNGKey(7),
                    **setting)
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert len(observed) > 10
  assert 0.02 < out.stats.acceptance_rate < 0.98
  assert _chi_square_ok(observed, expected, n) > P_VALUE
  s = out.stats
  np.testing.assert_array_equal(s.emitted, s.accepted + s.iterations)
  assert (s.position_accepted <= s.position_drafted).all()
  assert s.position_accepted.sum() == s.accepted_raw.sum()


@pytest.fixture(scope="module")
def pair():
  return testing.tiny_pair(vocab_size=64, noise=0.12, seed=0, num_encoder_layers=1,
                           num_decoder_layers=1)


def test_greedy_block_decode_equals_target_only(pair):
  target, draft = pair
  enc = testing.random_encoder_tokens(6, 10, 64, seed=2)
  # One block width in both loops: greedy identity by construction (docs/exactness.md).
  ref = sj.generate(target, enc, max_decode_steps=16, block_width=5)
  for draft_kind in (draft, sj.PromptLookupDraft(64, max_ngram=2)):
    token = sj.generate(target, enc, max_decode_steps=16, draft=draft_kind, gamma=4,
                        block_width=5)
    block = sj.generate(target, enc, max_decode_steps=16, draft=draft_kind, gamma=4,
                        verification="block", block_width=5)
    np.testing.assert_array_equal(np.asarray(block.sequences), np.asarray(ref.sequences))
    np.testing.assert_array_equal(block.stats.accepted, token.stats.accepted)


def test_greedy_block_decode_equals_target_only_bf16_decoder_only():
  # bfloat16 is what accelerators run: the same width in both loops keeps the
  # construction there too, for the other family.
  target, draft = testing.tiny_pair(vocab_size=64, noise=0.12, seed=3, name="llama_tiny")
  cast = lambda m: sj.family_of(m).model_type(  # noqa: E731
      m.config.replace(dtype="bfloat16"),
      jax.tree_util.tree_map(lambda x: x.astype("bfloat16"), m.params))
  target, draft = cast(target), cast(draft)
  prompts = np.random.default_rng(4).integers(2, 64, (6, 7)).astype(np.int32)
  lengths = np.array([7, 3, 5, 1, 6, 2], np.int32)
  ref = sj.generate(target, prompts, lengths, max_decode_steps=16, block_width=8)
  out = sj.generate(target, prompts, lengths, max_decode_steps=16, draft=draft, gamma=4,
                    verification="block", block_width=8)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(ref.sequences))
  assert 0.05 < out.stats.acceptance_rate < 1.0, out.stats.summary()


def test_t5x_adapter_decodes_like_generate(pair):
  from specdec_jax.t5x.model import SpeculativeEncoderDecoderModel
  target, draft = pair
  enc = testing.random_encoder_tokens(3, 7, 64, seed=3)
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": np.zeros((3, 12), np.int32)}
  rng = jax.random.PRNGKey(7)
  model = SpeculativeEncoderDecoderModel(target.config, draft=draft.config,
                                         decode_fn=decoding.speculative_sample, gamma=3,
                                         temperature=1.0, verification="block")
  decodes, aux = model.predict_batch_with_aux({"target": target.params, "draft": draft.params},
                                              batch, rng=rng)
  expected = generation.generate(target, enc, max_decode_steps=12, temperature=1.0, rng=rng,
                                 draft=draft, gamma=3, verification="block")
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected.sequences))
  np.testing.assert_array_equal(np.asarray(aux["accepted"]), expected.stats.accepted)


def test_bad_verification(pair):
  target, draft = pair
  enc = testing.random_encoder_tokens(2, 5, 64)
  with pytest.raises(ValueError, match=r"verification must be one of \['block', 'token'\]"):
    sj.generate(target, enc, max_decode_steps=4, draft=draft, verification="tree")
  with pytest.raises(ValueError, match="applies to speculative decoding; pass a draft"):
    sj.generate(target, enc, max_decode_steps=4, verification="block")
  with pytest.raises(ValueError, match="verification must be one of"):
    decoding.speculative_sample(jnp.zeros((1, 4), jnp.int32), None, None, None, None, 1,
                                verification="Block")
  from specdec_jax.t5x.model import SpeculativeEncoderDecoderModel
  with pytest.raises(ValueError, match="verification must be one of"):
    SpeculativeEncoderDecoderModel(target.config, draft=draft.config,
                                   decode_fn=decoding.speculative_sample, verification=None)
  with pytest.raises(ValueError, match="applies to speculative decoding"):
    SpeculativeEncoderDecoderModel(target.config, verification="block")
  from experiments import run as run_lib
  with pytest.raises(ValueError, match="verification must be one of"):
    run_lib.run_experiment(run_lib.Experiment(target=None, draft=None, task=None,
                                              verification="blocks"), "/nonexistent")


def test_launcher_records_verification(tmp_path):
  """--gin.VERIFICATION='block' reaches generate; results.json records it; greedy identity."""
  from test_experiments import _run_in_process
  path = tmp_path / "inputs.jsonl"
  path.write_text('{"inputs": "hello world"}\n{"inputs": "the cat sat on the mat"}\n')
  out = tmp_path / "out"
  result = _run_in_process([f"INPUT_FILE = '{path}'", "VERIFICATION = 'block'", "GAMMA = 3"],
                           out)
  assert result["verification"] == "block"
  assert result["identical_outputs"] is True
  assert (out / "results.json").exists()
  assert "Verification: block" in (out / "results.md").read_text()
