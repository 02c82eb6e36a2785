"""Training a feature head (`drafts.FeatureDraft`) with the trainer: the EAGLE-1 loss and
EAGLE-3's training-time test.

EAGLE-1 (arXiv 2401.15077) trains the head teacher-forced on the target's
own features: at each position t the head reads the pair (feature_{t-1},
token_t) (the decode-time pairing of `drafts.feature_draft`; feature_{-1} = 0)
and predicts feature_t, attending as it does when drafting (decoder-only
heads: the zero pair at position 0 hidden from later queries, EAGLE's own
pairing). The loss per learned position is

    SmoothL1(predicted feature_t, feature_t)          (mean over its h dims)
  + 0.1 * cross-entropy of lm_head(predicted feature_t)
          against the target's distribution softmax(lm_head(feature_t)).

Training-time test (EAGLE-3, arXiv 2503.01840, `ttt_steps` = k > 1): the
head is also unrolled on its own outputs, as it drafts. From an anchor
position p (the last pair with the target's true feature, as after a
verification), step i = 1..k-1 feeds the pair (step i-1's predicted feature
at p + i - 1, token_{p+i}) at position p + i (the tokens stay the data's:
teacher-forced), attending to the true pairs at positions <= p and to the
chain's own earlier steps, exactly the keys a proposal's i-th call sees.
Its cross-entropy against the target's distribution at p + i is weighted
`ttt_decay`**i (0.8 in EAGLE-3). The loss per learned token is

    regression_weight * SmoothL1_0 + ce_weight * sum_i ttt_decay**i * CE_i

(step 0 is the teacher-forced pass at every position; steps i >= 1 average
over the anchors whose p + i is a learned position, rescaled to the same
per-token scale). With k = 1 it is the EAGLE-1 loss; regression_weight = 0
and ce_weight = 1 give EAGLE-3's cross-entropy-only objective.

How the unroll stays the decode-time program: step 0 runs the head over
the whole sequence once, writing every true pair's key into its cache;
each anchor gets a copy of that cache (rows = batch x anchors), and step i
writes its key at p + i. Keys of the copy past p + i are true pairs the
causal mask hides, and steps overwrite them before anything reads them:
the invariant `FeatureDraft.propose_fn` relies on. So the unroll calls the
head only through its one cached entry point.

Usage with `train.trainer` (the head's params are what trains; the target
is frozen):

    batch = feature_batch(target, lm_batch(...))          # adds 'features'
    batch['anchors'] = ttt_anchors(batch['weights'], 16, seed=step)   # k > 1 only
    state = trainer.create_train_state(draft.head_params, optimizer)
    state, metrics = trainer.train_step(
        state, batch, loss_fn=feature_loss_fn(draft, ttt_steps=3), ...)

`feature_batch` runs the target once per batch (EAGLE's precomputed hidden
states) through the family contract (`Family.teacher_features`), so every
family with features trains here the same way. The loss reads the target's
embedding and LM head from the draft's references as constants of the
compiled step: fine for small targets; a large one should pass them as
arguments instead (not built yet).
"""

import functools
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.registry import family_of

Array = jax.Array


@functools.lru_cache(maxsize=None)
def _teacher_program(family, config):
  """jit: (params, batch) -> `family.teacher_features` of the last layer (one compiled
  program per family and config: a fresh closure per call would recompile)."""
  return jax.jit(functools.partial(family.teacher_features, config))


def feature_batch(target, batch: Dict[str, np.ndarray]) -> Dict[str, Array]:
  """The loss's batch from a family training batch and the (frozen) target:
  `Family.teacher_features` (the target's last-layer features), compiled once per
  target config.

  Returns {'tokens' [batch, T] int32, 'features' [batch, T, emb] float32,
  'weights' [batch, T] float32} and, for families whose heads read one, 'memory'.
  Decoder-only {'tokens', 'weights'} (`lm_batch`): those, and the target's
  features at every position. T5 {'inputs', 'targets'}: 'tokens' = the
  decoder's inputs (the start token, then targets[:-1]), 'features' = the
  decoder's teacher-forced features there (feature t predicts targets[t]),
  'weights' = targets != pad, and 'memory' = the encoder outputs and mask the
  head cross-attends to (`T5Family.start_features`' memory).
  """
  out = dict(_teacher_program(family_of(target), target.config)(target.params, dict(batch)))
  if out.get("memory") is None:
    out.pop("memory", None)
  return out


def target_features(target, tokens) -> Array:
  """The target's last-layer features after the final norm [batch, T, emb] float32
  of tokens [batch, T] at positions 0..T-1 (uncached), for a family whose training
  batch is {'tokens', 'weights'} (decoder-only)."""
  tokens = np.asarray(tokens, np.int32)
  return feature_batch(target, dict(tokens=tokens,
                                    weights=np.ones(tokens.shape, np.float32)))["features"]


def ttt_anchors(weights, num_anchors: int, seed: int) -> np.ndarray:
  """Anchor positions [batch, num_anchors] int32 for the training-time test: per row,
  `num_anchors` distinct positions drawn uniformly (seeded) among those with weight > 0
  (rows with fewer learned positions repeat them; a row with none gets zeros, which the
  loss masks by their weight). A pure function of its arguments (resumable batches)."""
  weights = np.asarray(weights)
  if num_anchors < 1:
    raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
  return draw_anchors(weights, num_anchors, seed, stream=23)


def draw_anchors(weights: np.ndarray, num_anchors: int, seed: int, stream: int) -> np.ndarray:
  """[batch, num_anchors] int32: per row, `num_anchors` distinct positions with weight > 0
  drawn uniformly by the generator of (seed, stream), sorted; rows with fewer repeat
  theirs, a row with none gets zeros. The one draw behind every anchored loss (each loss
  its own `stream`, so their batches stay what they were)."""
  rng = np.random.default_rng([int(seed), int(stream)])
  out = np.zeros((weights.shape[0], num_anchors), np.int32)
  for b, row in enumerate(weights):
    learned = np.flatnonzero(row > 0)
    if len(learned) == 0:
      continue
    if len(learned) >= num_anchors:
      out[b] = np.sort(rng.choice(learned, num_anchors, replace=False))
    else:
      out[b] = np.resize(learned, num_anchors)
  return out


def smooth_l1(x: Array, y: Array) -> Array:
  """Elementwise SmoothL1 (Huber, beta 1: torch's default)."""
  d = jnp.abs(x - y)
  return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def soft_cross_entropy(target_logits: Array, head_logits: Array) -> Array:
  """-sum softmax(target) * log_softmax(head) over the last axis (target: a constant)."""
  target_probs = jax.nn.softmax(jax.lax.stop_gradient(target_logits), axis=-1)
  return -jnp.sum(target_probs * jax.nn.log_softmax(head_logits, axis=-1), axis=-1)


def _repeat_rows(tree, times: int):
  """Every leaf [batch, ...] -> [batch * times, ...], row b's copies adjacent."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, times, axis=0), tree)


def feature_loss_fn(draft, ce_weight: float = 0.1, *, regression_weight: float = 1.0,
                    ttt_steps: int = 1, ttt_decay: float = 0.8):
  """The feature-head loss of `draft`'s head params on `feature_batch`es, summed over
  learned positions (the trainer's LossFn).

  Args:
    draft: a `FeatureDraft` (its config, target references and head shape).
    ce_weight: weight of the cross-entropy terms (EAGLE-1: 0.1).
    regression_weight: weight of step 0's SmoothL1 feature regression (EAGLE-1: 1;
      0 for a cross-entropy-only EAGLE-3 objective).
    ttt_steps: k, head calls unrolled per anchor (1: teacher forcing only, the
      EAGLE-1 loss); k > 1 needs batch['anchors'] [batch, A] int32 (`ttt_anchors`).
    ttt_decay: step i's cross-entropy weight ttt_decay**i.
  Returns:
    fn(head_params, batch) -> (summed loss, aux): tokens, correct (step 0's head
    argmax == target argmax), regression, cross_entropy (step 0), and for steps
    i >= 1 cross_entropy_i / correct_i / anchors_i (sums over the valid anchors).
  """
  ttt_steps = int(ttt_steps)
  if ttt_steps < 1:
    raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
  if not 0.0 <= ttt_decay:
    raise ValueError(f"ttt_decay must be >= 0, got {ttt_decay}")
  config, refs, head = draft.config, draft.target_params, draft.head

  def run_head(head_params, tokens, features, positions, cache):
    hidden, cache = head.apply(head_params, refs, tokens, features, positions, cache)
    return hidden.astype(jnp.float32), cache

  def logits_of(head_params, hidden):
    return head.logits(head_params, refs, hidden.astype(config.dtype))

  def fn(head_params, batch):
    tokens, features = batch["tokens"], batch["features"].astype(jnp.float32)
    weights = batch["weights"].astype(jnp.float32)
    b, t, f = features.shape
    if f != head.hidden_dim:
      # The target's distribution is read as head.logits(target features): only
      # EAGLE-1 heads, whose features are the last hidden state, can do that.
      raise ValueError(f"features are {f} wide, the head's hidden width is {head.hidden_dim}: "
                       "this loss trains EAGLE-1 heads (last-layer features); a multi-layer "
                       "(EAGLE-3) head needs the target's logits in the batch (not built yet)")
    # The head's width h: EAGLE-1 heads read the target's features as they are.
    reduced = head.reduce_features(head_params, refs, features).astype(jnp.float32)
    h = reduced.shape[-1]
    fed = jnp.concatenate([jnp.zeros((b, 1, h), jnp.float32), reduced[:, :-1]], axis=1)
    # Room past T for the unrolled steps' keys (anchors near the end: masked out).
    cache = head.init_cache(head_params, b, t + ttt_steps - 1, batch.get("memory"))
    predicted, cache = run_head(head_params, tokens, fed, jnp.zeros((b,), jnp.int32), cache)
    regression = jnp.mean(smooth_l1(predicted, features), axis=-1)
    # An EAGLE-1 head's logits are the target's own LM head: applied to the
    # target's features they are the target's distribution.
    target_logits = jax.lax.stop_gradient(logits_of(head_params, features))
    head_logits = logits_of(head_params, predicted)
    cross_entropy = soft_cross_entropy(target_logits, head_logits)
    loss = jnp.sum(weights * (regression_weight * regression + ce_weight * cross_entropy))
    target_argmax = jnp.argmax(target_logits, -1)
    correct = jnp.sum(weights * (jnp.argmax(head_logits, -1) == target_argmax))
    tokens_total = jnp.sum(weights)
    aux = dict(tokens=tokens_total, correct=correct,
               regression=jnp.sum(weights * regression),
               cross_entropy=jnp.sum(weights * cross_entropy))
    if ttt_steps == 1:
      return loss, aux

    if "anchors" not in batch:
      raise ValueError("ttt_steps > 1 needs batch['anchors'] [batch, A] (see ttt_anchors)")
    anchors = jnp.asarray(batch["anchors"], jnp.int32)
    a = anchors.shape[1]
    rows = jnp.arange(b)[:, None]
    # Row (b, j) is anchor anchors[b, j]'s chain: its cache holds the true pairs.
    chain_cache = _repeat_rows(cache, a)
    previous = predicted[rows, anchors].reshape(b * a, 1, h)
    for i in range(1, ttt_steps):
      at = anchors + i  # [b, A] the position step i writes and predicts
      inside = at < t
      at_clipped = jnp.minimum(at, t - 1)
      hidden, chain_cache = run_head(head_params, tokens[rows, at_clipped].reshape(b * a, 1),
                                     previous, at.reshape(b * a), chain_cache)
      step_logits = logits_of(head_params, hidden[:, 0]).reshape(b, a, -1)
      valid = inside * weights[rows, at_clipped] * (weights[rows, anchors] > 0)
      step_ce = soft_cross_entropy(target_logits[rows, at_clipped], step_logits)
      count = jnp.sum(valid)
      # Mean over valid anchors, on the per-token scale of step 0's sum.
      scale = tokens_total / jnp.maximum(count, 1.0)
      loss = loss + ce_weight * ttt_decay ** i * scale * jnp.sum(valid * step_ce)
      aux[f"cross_entropy_{i}"] = jnp.sum(valid * step_ce)
      aux[f"correct_{i}"] = jnp.sum(
          valid * (jnp.argmax(step_logits, -1) == target_argmax[rows, at_clipped]))
      aux[f"anchors_{i}"] = count
      previous = hidden
    return loss, aux

  return fn


def per_step_accuracy(metrics: Dict[str, float]) -> Dict[int, float]:
  """{step i: rate of head argmax == target argmax} from a `feature_loss_fn` aux of sums
  ('correct', 'tokens') or the trainer's metrics ('accuracy': already a rate; the
  per-step sums all share one divisor, so their ratios are rates either way)."""
  if "accuracy" in metrics:
    out = {0: float(metrics["accuracy"])}
  else:
    out = {0: float(metrics["correct"]) / max(float(metrics["tokens"]), 1e-9)}
  i = 1
  while f"correct_{i}" in metrics:
    out[i] = float(metrics[f"correct_{i}"]) / max(float(metrics[f"anchors_{i}"]), 1e-9)
    i += 1
  return out
