"""Training a feature head (`drafts.FeatureDraft`) with the trainer: the EAGLE-1 loss.

EAGLE-1 (arXiv 2401.15077) trains the head teacher-forced on the target's
own features: at each position t the head reads the pair (feature_{t-1},
token_t) (the decode-time pairing of `drafts.feature`; feature_{-1} = 0)
and predicts feature_t. The loss per learned position is

    SmoothL1(predicted feature_t, feature_t)          (mean over its h dims)
  + 0.1 * cross-entropy of lm_head(predicted feature_t)
          against the target's distribution softmax(lm_head(feature_t)).

Usage with `train.trainer` (the head's params are what trains; the target
is frozen):

    batch = feature_batch(target, lm_batch(...))          # adds 'features'
    state = trainer.create_train_state(draft.head_params, optimizer)
    state, metrics = trainer.train_step(state, batch, loss_fn=feature_loss_fn(draft), ...)

`feature_batch` runs the target once per batch (EAGLE's precomputed hidden
states). The loss reads the target's embedding and LM head from the draft's
references as constants of the compiled step: fine for small targets; a
large one should pass them as arguments instead (not built yet).
"""

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.decoder_only.model import feature_layers
from specdec_jax.families.decoder_only.network import DecoderOnly

Array = jax.Array


def target_features(target, tokens) -> Array:
  """The target's last-layer features after the final norm [batch, T, emb] float32
  of tokens [batch, T] at positions 0..T-1 (uncached)."""
  taps = feature_layers(target.config)

  @jax.jit
  def run(params, tokens):
    return DecoderOnly(target.config).apply(
        {"params": params}, tokens, jnp.arange(tokens.shape[1])[None], taps=taps,
        method=DecoderOnly._hidden)[2]

  return run(target.params, jnp.asarray(tokens, jnp.int32))


def feature_batch(target, batch: Dict[str, np.ndarray]) -> Dict[str, Array]:
  """A decoder-only batch {'tokens', 'weights'} with the target's 'features' added."""
  return dict(batch, features=target_features(target, batch["tokens"]))


def smooth_l1(x: Array, y: Array) -> Array:
  """Elementwise SmoothL1 (Huber, beta 1: torch's default)."""
  d = jnp.abs(x - y)
  return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def feature_loss_fn(draft, ce_weight: float = 0.1):
  """The EAGLE-1 loss of `draft`'s head params on `feature_batch`es, summed over
  learned positions (the trainer's LossFn); aux: tokens, correct (head argmax ==
  target argmax), regression and cross_entropy sums."""
  config, refs, head = draft.config, draft.target_params, draft.head

  def fn(head_params, batch):
    tokens, features = batch["tokens"], batch["features"].astype(jnp.float32)
    weights = batch["weights"].astype(jnp.float32)
    b, t, h = features.shape
    fed = jnp.concatenate([jnp.zeros((b, 1, h), jnp.float32), features[:, :-1]], axis=1)
    cache = head.init_cache(head_params, b, t)
    predicted, _ = head.apply(head_params, refs, tokens, fed, jnp.zeros((b,), jnp.int32), cache)
    predicted = predicted.astype(jnp.float32)
    regression = jnp.mean(smooth_l1(predicted, features), axis=-1)
    # An EAGLE-1 head's logits are the target's own LM head: applied to the
    # target's features they are the target's distribution.
    target_logits = jax.lax.stop_gradient(head.logits(head_params, refs, features))
    head_logits = head.logits(head_params, refs, predicted.astype(config.dtype))
    target_probs = jax.nn.softmax(target_logits, axis=-1)
    cross_entropy = -jnp.sum(target_probs * jax.nn.log_softmax(head_logits, axis=-1), axis=-1)
    loss = jnp.sum(weights * (regression + ce_weight * cross_entropy))
    correct = jnp.sum(weights * (jnp.argmax(head_logits, -1) == jnp.argmax(target_logits, -1)))
    return loss, dict(tokens=jnp.sum(weights), correct=correct,
                      regression=jnp.sum(weights * regression),
                      cross_entropy=jnp.sum(weights * cross_entropy))

  return fn
