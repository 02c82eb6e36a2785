"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh,
"Block Verification Accelerates Speculative Decoding", arXiv 2403.10444, ICLR 2025).

Token-wise verification (`token.speculative_step`) stops at the first
rejected draft. Block verification decides on the block as a whole: it keeps
the longest prefix x_1..x_tau that passes its own test, where a failure at i
does not stop a later i from passing. Its output law is still the target's,
and its expected number of accepted drafts is at least token-wise
verification's for every p and q (the paper's optimality theorem: maximal
among verifiers that read only the on-path probabilities).

Same contract as `token.speculative_step`, so the decode loop can use
either (`verification.VERIFIERS`).
"""

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling
from specdec_jax.core.verification import token as token_verification

Array = jax.Array


def block_verification_step(rng: Array, draft_tokens: Array, draft_probs: Array,
                            target_probs: Array, num_drafted: Optional[Array] = None,
                            greedy: bool = False) -> Tuple[Array, Array]:
  """Keeps the longest block prefix that passes the block test, then draws one more token.

  With p_i = target_probs[i - 1], q_i = draft_probs[i - 1] (both after the
  same sampling adjustment) and the block length g = num_drafted:
    1. w_0 = 1; w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) for i = 1..g.
    2. h_i = r_i / (r_i + 1 - w_i) with r_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0)
       for i < g; h_g = w_g.
    3. Independent u_i ~ U[0, 1); the number of *accepted* drafts tau is the
       largest i in 1..g with u_i < h_i (0 if none).
    4. The next token is the *bonus* token, drawn from p_{g+1}, when tau = g;
       otherwise the *recovered* token, drawn from the residual
       norm(max(w_tau p_{tau+1} - q_{tau+1}, 0)) (w_0 = 1: at tau = 0 it is
       token-wise verification's residual).
  The emitted tokens x_1..x_tau, next_token are distributed exactly as the
  target's own samples.

  Numerics: tests are products, never divisions where a product does: the
  last test u_g < w_g is u_g q_g(x_g) < w_{g-1} p_g(x_g) (token-wise
  verification's test when w_{g-1} = 1, so gamma = 1 gives the same
  decisions, bit for bit, from the same key), the others u_i (r_i + 1 - w_i)
  < r_i. w_i = 1 wherever w_{i-1} p_i(x_i) >= q_i(x_i), so the one division
  has a positive divisor. A drafted token with q_i(x_i) = 0 cannot be drawn;
  if one comes anyway it counts as ratio infinity, as in the token-wise test,
  unless p_i(x_i) = 0 too (then w_i = 0: never accepted). r_i + 1 - w_i = 0
  happens only at w_i = 1 and r_i = 0 (p_{i+1} = q_{i+1}): h_i is then 1
  (it is r_i / r_i = 1 for every r_i > 0, and the only value that never
  rejects into a residual without mass). A residual that rounding left
  without mass falls back to p, as in the token-wise step. The uniforms and
  the residual draw use the same key split as `token.speculative_step`.

  Greedy (temperature 0, p and q one-hot): the same formulas are exact in
  floats there: w_i is 1 while the drafts match the target's argmax and 0
  after, h_i is 1 (r_i 1 or 0 with the h = 1 rule) where w_i = 1 and 0
  elsewhere, so tau is the matching prefix, and the residual is the one-hot
  target argmax. Outputs are token-wise verification's, whatever the noise.

  Drafts without a spread-out law. A deterministic draft (prompt lookup)
  gives q as a point mass on each proposal: that is its true law, and the
  rule is exact with it (w_i = min(1, w_{i-1} p_i(x_i)), r_i = w_i (1 -
  p_{i+1}(x_{i+1}))). Rows past num_drafted may be zeros (`Draft.propose_fn`
  says they are ignored): they are masked and never reach a test or a
  residual. num_drafted = 0 ("no proposal") gives tau = 0 and a token from
  p_1: a plain target step.

  Adaptive lengths: g = num_drafted may be a stopping time of the draft (its
  stopping rule reads only the draft's own state, as `Draft.propose_fn`
  requires). The rule stays exact. Extend the draft past g with q = p (still
  a draft law: the paper's proof holds for any autoregressive draft): then
  w_j = w_g for j > g and r_j = 0 for j >= g, so h_j = 0 for g <= j < gamma
  (1 if w_g = 1) and h_gamma = w_g. The fixed-gamma rule thus accepts the
  whole block exactly when this one accepts g (probability w_g), its extra
  tokens being the target's own samples, and it agrees with this one below g.

  Args:
    rng: PRNG key.
    draft_tokens: [gamma] int32, x_1..x_gamma.
    draft_probs: [gamma, vocab] float32, q_1..q_gamma (adjusted), x_i ~ q_i.
    target_probs: [gamma + 1, vocab] float32, p_1..p_{gamma+1} (adjusted),
      p_i the target's law at the position of x_i.
    num_drafted: optional int32 scalar in [0, gamma] (may be traced): only
      the first num_drafted drafts count; the block is then g = num_drafted
      long (h_g = w_g, the bonus token from p_{g+1}).
    greedy: static; True when p and q are temperature-0 one-hots (the
      residual's token is then read by argmax, no noise drawn).
  Returns:
    (num_accepted int32 scalar tau in [0, num_drafted], next_token int32
    scalar: the recovered token when tau < num_drafted, else the bonus token).
  """
  gamma, num_drafted = token_verification.check_step(draft_tokens, draft_probs, target_probs,
                                                     num_drafted)
  draft_probs = draft_probs.astype(jnp.float32)
  target_probs = target_probs.astype(jnp.float32)
  accept_rng, residual_rng = jax.random.split(rng)
  index = jnp.arange(gamma)
  drafted = index < num_drafted
  p_x = target_probs[index, draft_tokens]
  q_x = draft_probs[index, draft_tokens]
  u = jax.random.uniform(accept_rng, (gamma,), dtype=jnp.float32)

  # w_0..w_gamma (gamma is static and small: unrolled). weighted[i] = w_i p_{i+1}(x_{i+1}).
  w = [jnp.float32(1.0)]
  weighted = []
  for i in range(gamma):
    wp = w[i] * p_x[i]
    weighted.append(wp)
    # w_{i-1} p / q >= 1 read as a product; below it q > w_{i-1} p >= 0, so
    # the division is safe. p_i(x_i) = 0 gives w_i = 0 even if q_i(x_i) = 0.
    ratio_ok = wp >= q_x[i]
    w.append(jnp.where(wp <= 0, 0.0,
                       jnp.where(ratio_ok, 1.0, wp / jnp.where(ratio_ok, 1.0, q_x[i]))))
  w = jnp.stack(w)                    # [gamma + 1]: w_0..w_gamma
  weighted = jnp.stack(weighted)      # [gamma]: w_{i-1} p_i(x_i), i = 1..gamma

  # Rows past the drafted ones count as q = 0: the residual at tau =
  # num_drafted is then w p, i.e. p: one formula covers recovery and bonus.
  q_padded = jnp.where((jnp.arange(gamma + 1) < num_drafted)[:, None],
                       jnp.pad(draft_probs, ((0, 1), (0, 0))), 0.0)
  # residuals[i] = max(w_i p_{i+1} - q_{i+1}, 0) for i = 0..gamma; r_i its mass.
  residuals = jnp.maximum(w[:, None] * target_probs - q_padded, 0.0)
  r = jnp.sum(residuals, axis=-1)

  # Tests for i = 1..gamma (entry i - 1).
  w_i, r_i = w[1:], r[1:]
  interior = (u * (r_i + (1.0 - w_i)) < r_i) | (w_i >= 1.0)
  last = u * q_x < weighted           # u_g < w_g, as a product (h_g = w_g)
  position = index + 1
  passed = jnp.where(position == num_drafted, last, interior) & drafted
  num_accepted = jnp.max(jnp.where(passed, position, 0)).astype(jnp.int32)

  # Normalised as the token-wise step normalises (same rounding).
  residual = token_verification.normalised_residual(residuals[num_accepted],
                                                    target_probs[num_accepted])
  next_token = sampling.sample(residual_rng, residual, greedy=greedy)
  return num_accepted, next_token


def batched_block_verification_step(rngs: Array, draft_tokens: Array, draft_probs: Array,
                                    target_probs: Array,
                                    num_drafted: Optional[Array] = None,
                                    greedy: bool = False) -> Tuple[Array, Array]:
  """`block_verification_step` vmapped over the batch, with the argument and result
  shapes of `token.batched_speculative_step` (the chain verifiers' one contract)."""
  return token_verification.batch_step(block_verification_step, rngs, draft_tokens,
                                       draft_probs, target_probs, num_drafted, greedy)
