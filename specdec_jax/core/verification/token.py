"""Token verification: the speculative sampling step (Leviathan et al. 2023, Alg. 1, 3-5).

Written for one sequence and `jax.vmap`ped over the batch, so every row keeps
or rejects its own drafts with its own key. The residual normalisation here
(`normalised_residual`) is the one the block and tree rules use too.
"""

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling

Array = jax.Array


def speculative_step(rng: Array, draft_tokens: Array, draft_probs: Array, target_probs: Array,
                     num_drafted: Optional[Array] = None, greedy: bool = False
                     ) -> Tuple[Array, Array]:
  """Decides how many drafted tokens to keep and draws the next token.

  Accepts x_i while r_i < p_i(x_i) / q_i(x_i) (r_i ~ U[0, 1)); on the first
  rejection draws from norm(max(0, p - q)) at that position; if every draft is
  accepted, draws the bonus token from p_{num_drafted + 1}. The emitted tokens
  are then distributed exactly as the target's own samples.

  Args:
    rng: PRNG key.
    draft_tokens: [gamma] int32, x_1..x_gamma.
    draft_probs: [gamma, vocab] float32, q_i (adjusted), x_i ~ q_i.
    target_probs: [gamma + 1, vocab] float32, p_1..p_{gamma+1} (adjusted).
    num_drafted: optional int32 scalar <= gamma: only the first num_drafted
      drafts count (adaptive draft length); it must depend only on the draft's
      own state for exactness.
    greedy: static; True when p and q are temperature-0 one-hots, so the
      residual is one-hot too and its token is read by argmax (no noise drawn).
  Returns:
    (num_accepted int32 scalar in [0, num_drafted], next_token int32 scalar).
  """
  gamma, num_drafted = check_step(draft_tokens, draft_probs, target_probs, num_drafted)
  accept_rng, residual_rng = jax.random.split(rng)
  index = jnp.arange(gamma)
  p_x = target_probs[index, draft_tokens]
  q_x = draft_probs[index, draft_tokens]
  r = jax.random.uniform(accept_rng, (gamma,), dtype=jnp.float32)
  # r * q < p is r < p / q without dividing; strict so that p(x) = 0 never accepts.
  accepted = (r * q_x < p_x) & (index < num_drafted)
  num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32))).astype(jnp.int32)

  # Rows of q past the drafted ones are zero, so the residual at
  # n = num_drafted is p itself: one formula covers rejection and bonus.
  q_padded = jnp.where((jnp.arange(gamma + 1) < num_drafted)[:, None],
                       jnp.pad(draft_probs, ((0, 1), (0, 0))), 0.0)
  p_n = target_probs[num_accepted]
  residual = normalised_residual(jnp.maximum(p_n - q_padded[num_accepted], 0.0), p_n)
  next_token = sampling.sample(residual_rng, residual, greedy=greedy)
  return num_accepted, next_token


def check_step(draft_tokens: Array, draft_probs: Array, target_probs: Array,
               num_drafted: Optional[Array]) -> Tuple[int, Array]:
  """Checks one row's verification shapes; returns (gamma, num_drafted or gamma).

  Args:
    draft_tokens: [gamma] int32.
    draft_probs: [gamma, vocab] float.
    target_probs: [gamma + 1, vocab] float.
    num_drafted: int32 scalar or None.
  Returns:
    (gamma: Python int, num_drafted: int32 scalar, gamma when None was given).
  """
  gamma, vocab = draft_probs.shape
  if target_probs.shape != (gamma + 1, vocab):
    raise ValueError(f"target_probs must be [gamma + 1, vocab] = {(gamma + 1, vocab)}, "
                     f"got {target_probs.shape}")
  if draft_tokens.shape != (gamma,):
    raise ValueError(f"draft_tokens must be [gamma] = {(gamma,)}, got {draft_tokens.shape}")
  return gamma, jnp.int32(gamma) if num_drafted is None else num_drafted


def normalised_residual(residual: Array, fallback: Array) -> Array:
  """residual [vocab] / its mass; `fallback` [vocab] when it has none. Returns [vocab].

  Only rounding leaves a chosen residual without mass (p == q where a
  rejection has probability zero); the target's p there is then the right
  law. The same formula normalises the renormalised draft law of
  without-replacement siblings (`tree.WithoutReplacement`), with a zero
  fallback.
  """
  mass = jnp.sum(residual)
  return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), fallback)


def batch_step(step, rngs: Array, draft_tokens: Array, draft_probs: Array, target_probs: Array,
               num_drafted: Optional[Array] = None, greedy: bool = False
               ) -> Tuple[Array, Array]:
  """A one-row verification `step` vmapped over the batch.

  Args:
    step: `speculative_step`'s contract (e.g. `block.block_verification_step`).
    rngs: [batch] keys (one per row).
    draft_tokens: [batch, gamma]; draft_probs: [batch, gamma, vocab];
    target_probs: [batch, gamma + 1, vocab]; num_drafted: [batch] or None;
    greedy: see `speculative_step`.
  Returns:
    (num_accepted [batch] int32, next_token [batch] int32).
  """
  if num_drafted is None:
    num_drafted = jnp.full((draft_tokens.shape[0],), draft_tokens.shape[1], jnp.int32)
  return jax.vmap(functools.partial(step, greedy=greedy))(rngs, draft_tokens, draft_probs,
                                                          target_probs, num_drafted)


def batched_speculative_step(rngs: Array, draft_tokens: Array, draft_probs: Array,
                             target_probs: Array, num_drafted: Optional[Array] = None,
                             greedy: bool = False) -> Tuple[Array, Array]:
  """`speculative_step` vmapped over the batch.

  Args:
    rngs: [batch] keys; draft_tokens: [batch, gamma] int32; draft_probs:
    [batch, gamma, vocab]; target_probs: [batch, gamma + 1, vocab];
    num_drafted: [batch] int32 or None; greedy: static.
  Returns:
    (num_accepted [batch] int32, next_token [batch] int32).
  """
  return batch_step(speculative_step, rngs, draft_tokens, draft_probs, target_probs,
                    num_drafted, greedy)


def acceptance_probability(target_probs: Array, draft_probs: Array) -> Array:
  """beta = sum_x min(p(x), q(x)) over the last axis (Corollary 3.6's alpha = E[beta]).

  target_probs, draft_probs: [..., vocab] (same shape). Returns [...].
  """
  return jnp.sum(jnp.minimum(target_probs, draft_probs), axis=-1)
