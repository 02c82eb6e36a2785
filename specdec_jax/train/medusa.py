"""Training Medusa heads (`drafts.MedusaDraft`) with the trainer: the Medusa-1 loss.

Medusa-1 (arXiv 2401.10774) trains the heads on a frozen target, one loss per
head. Head k (1-based) at position t reads the target's feature h_t (the
state that produced token t+1's law) and learns the law of token t+1+k.
Here its target is the target's own distribution there, softmax(lm_head(
h_{t+k})) on the data's prefix (self-distillation, Medusa's recipe where no
teacher text matches the target), so the heads learn what verification
accepts:

    loss = sum_k decay**(k-1) * sum_t w_t w_{t+k} CE(softmax(lm_head(h_{t+k})),
                                                     head_k(h_t))

with the batch's weights w (`train.feature_heads.feature_batch`: w_t = 1 where the
prediction made at t is data, for both families). Medusa weighs head k by
0.8**k; `decay` is that factor.

Usage (the same trainer and batches as the feature heads):

    batch = feature_batch(target, lm_batch(...))
    state = trainer.create_train_state(draft.head_params, optimizer)
    state, metrics = trainer.train_step(state, batch, loss_fn=medusa_loss_fn(draft), ...)
"""

from typing import Dict

import jax
import jax.numpy as jnp

from specdec_jax.train.feature_heads import soft_cross_entropy


def medusa_loss_fn(draft, decay: float = 0.8):
  """The Medusa-1 loss of `draft`'s head params on `feature_batch`es, summed over learned
  positions (the trainer's LossFn).

  Returns:
    fn(head_params, batch) -> (summed loss, aux): tokens (head 1's weighted positions,
    the per-token scale), cross_entropy_k, correct_k (head k's argmax == the target's)
    and positions_k (sums) for k = 1..K, and correct = correct_1.
  """
  if not decay >= 0.0:
    raise ValueError(f"decay must be >= 0, got {decay}")
  k_heads = draft.num_heads
  refs = draft.projection_refs

  def fn(head_params, batch):
    features = batch["features"].astype(jnp.float32)  # [b, T, h]
    weights = batch["weights"].astype(jnp.float32)
    b, t, h = features.shape
    if t <= 1:
      raise ValueError("Medusa heads need sequences of at least 2 positions")
    params = dict(heads=head_params, target=refs if draft.share_lm_head else {})
    # Every position's heads in one call: [b * T, K, vocab].
    logits = draft.head_logits(params, features.reshape(b * t, h), k_heads).reshape(
        b, t, k_heads, -1)
    target_logits = jax.lax.stop_gradient(draft.target_logits(refs, features))  # [b, T, V]
    loss = 0.0
    aux: Dict[str, jax.Array] = {}
    for k in range(1, k_heads + 1):
      if k >= t:
        break
      head = logits[:, :t - k, k - 1]          # at t', predicting token t' + 1 + k
      teacher = target_logits[:, k:]           # the target's law there
      w = weights[:, :t - k] * weights[:, k:]
      ce = soft_cross_entropy(teacher, head)
      correct = jnp.argmax(head, -1) == jnp.argmax(teacher, -1)
      loss = loss + decay ** (k - 1) * jnp.sum(w * ce)
      aux[f"cross_entropy_{k}"] = jnp.sum(w * ce)
      aux[f"correct_{k}"] = jnp.sum(w * correct)
      aux[f"positions_{k}"] = jnp.sum(w)
    aux["tokens"] = jnp.sum(weights[:, :t - 1] * weights[:, 1:])
    aux["correct"] = aux["correct_1"]
    return loss, aux

  return fn


def per_head_accuracy(metrics: Dict[str, float]) -> Dict[int, float]:
  """{head k: rate of head argmax == target argmax} from a `medusa_loss_fn` aux of sums or
  the trainer's metrics (every sum there shares one divisor, so ratios are rates)."""
  out = {}
  k = 1
  while f"correct_{k}" in metrics:
    out[k] = float(metrics[f"correct_{k}"]) / max(float(metrics[f"positions_{k}"]), 1e-9)
    k += 1
  return out
