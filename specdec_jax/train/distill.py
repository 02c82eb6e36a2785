"""DistillSpec-style draft distillation: make the draft's q match the target's p.

Speculative decoding accepts a drafted token with probability
beta = sum_x min(p(x), q(x)) = 1 - TV(p, q) (Corollary 3.6), where p and q are
the target's and the draft's distributions *after* the sampling adjustment
(temperature, top-k, nucleus). So the draft should be trained to match the
target's adjusted distributions on the prefixes it will meet while decoding
(Zhou et al. 2023, "DistillSpec"):

* data (`source`): target outputs ('target': the prefixes speculative decoding
  actually conditions on, since every accepted prefix is a target output),
  the draft's own samples ('draft': on-policy, regenerated every step), or the
  training set's reference targets ('data': plain word-level KD);
* divergence: forward KL(p || q) (`forward_kl`, mode-covering, the usual KD
  loss) or total variation TV(p, q) (`tv`, exactly 1 - beta, so minimising it
  maximises the acceptance rate directly).

Temperature 0. Greedy decoding uses one-hot p and q, whose TV is not
differentiable and whose forward KL is just cross-entropy on the target's
argmax. We distill at temperature 1 instead (`distill_temperature(0) == 1`):
the soft distribution carries the target's ranking of *every* token, so
matching it also aligns the argmax, and it is the distribution that sampling
at temperature 1 uses. Pass temperature > 0 to match another setting.

The loss is computed on teacher probabilities carried in the batch
(`teacher_probs` [batch, len, vocab], computed by a jitted target forward pass
outside the train step), so the target's weights are never differentiated or
baked into the compiled step, and several drafts can share one teacher pass.
"""

import dataclasses
import functools
import time
from typing import Any, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import data as data_lib
from specdec_jax.core import sampling
from specdec_jax.train import trainer as train
from specdec_jax.drafts import NgramDraft
from specdec_jax.families.registry import family_of
from specdec_jax.generation import generate

Array = jax.Array
DIVERGENCES = ("forward_kl", "tv")
SOURCES = ("target", "draft", "data")


def distill_temperature(temperature: float) -> float:
  """The temperature distillation uses for a decode temperature (0 -> 1, see module doc)."""
  return 1.0 if temperature < sampling.MIN_TEMPERATURE else float(temperature)


def divergence_sum(teacher_probs: Array, draft_logits: Array, mask: Array, kind: str,
                   temperature: float, topk: int = 0, topp: Optional[float] = None) -> Array:
  """Summed per-token divergence between the teacher's p and the draft's q.

  Args:
    teacher_probs: [batch, len, vocab] float32, already adjusted (rows sum to 1).
    draft_logits: [batch, len, vocab] raw draft logits.
    mask: [batch, len] float32, 1 on real target positions.
    kind: 'forward_kl' (KL(p || q) with q = softmax(logits / temperature), untruncated so the
      KL stays finite) or 'tv' (0.5 * |p - q|_1 with q adjusted exactly as p was).
    temperature / topk / topp: the adjustment (temperature > 0).
  Returns:
    [] float32: sum over unmasked positions.
  """
  if kind == "forward_kl":
    log_q = jax.nn.log_softmax(draft_logits.astype(jnp.float32) / temperature, axis=-1)
    log_p = jnp.log(jnp.maximum(teacher_probs, 1e-38))
    per_token = jnp.sum(jnp.where(teacher_probs > 0, teacher_probs * (log_p - log_q), 0.0),
                        axis=-1)
  elif kind == "tv":
    q = sampling.adjust_probs(draft_logits, temperature, topk, topp)
    per_token = 0.5 * jnp.sum(jnp.abs(teacher_probs - q), axis=-1)
  else:
    raise ValueError(f"unknown divergence {kind!r}; use one of {DIVERGENCES}")
  return jnp.sum(per_token * mask)


def distill_loss_fn(draft_configs: Dict[str, Any], divergence: str, temperature: float,
                    topk: int = 0, topp: Optional[float] = None) -> train.LossFn:
  """Loss over params {name: draft params} on the family's batches plus 'teacher_probs'.

  The batch is what the drafts' family reads (`Family.token_logits`: T5
  {'inputs', 'targets'}, decoder-only {'tokens', 'weights'}) with
  teacher_probs [batch, L, vocab] float32 aligned with the family's targets
  (`teacher_probs`). Each draft's summed divergence is added (independent
  gradients, as in `train.joint_loss_fn`); aux holds '{name}/loss' (the
  divergence), '{name}/correct' (draft argmax == teacher argmax: greedy
  agreement) and 'tokens'.
  """
  if divergence not in DIVERGENCES:
    raise ValueError(f"unknown divergence {divergence!r}; use one of {DIVERGENCES}")
  if temperature < sampling.MIN_TEMPERATURE:
    raise ValueError("distill at temperature > 0; use distill_temperature(t) for greedy decoding")
  train.check_joint_configs(draft_configs)

  def one_draft(config):
    family = family_of(config)

    def fn(params, batch):
      logits, _, weights = family.token_logits(config, params, batch)
      teacher = batch["teacher_probs"]
      loss = divergence_sum(teacher, logits, weights, divergence, temperature, topk, topp)
      agree = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
      return loss, dict(tokens=jnp.sum(weights), correct=jnp.sum(agree * weights))
    return fn
  return train.sum_of_models({name: one_draft(c) for name, c in draft_configs.items()})


@functools.lru_cache(maxsize=None)
def _teacher_fn(config, temperature: float, topk: int, topp: float):
  family = family_of(config)

  def probs(params, batch):
    logits, _, _ = family.token_logits(config, params, batch)
    return sampling.adjust_probs(logits, temperature, topk, topp)
  return jax.jit(probs)


def teacher_probs(target, batch, temperature: float, topk: int = 0, topp: Optional[float] = None) -> Array:
  """The target's adjusted distributions [batch, L, vocab] float32, teacher-forced on the
  family's `batch` and aligned with the targets `Family.token_logits` returns."""
  batch = {k: jnp.asarray(v) for k, v in batch.items() if k != "teacher_probs"}
  return _teacher_fn(target.config, float(temperature), int(topk), None if topp is None else float(topp))(
      target.params, batch)


def _chunks(n: int, batch_size: int):
  """(index, start, end) of consecutive row chunks of at most batch_size."""
  for b, start in enumerate(range(0, n, batch_size)):
    yield b, start, min(start + batch_size, n)


def _padded(array, batch_size: int):
  """array [k <= batch_size, ...] padded with copies of its first row (one compile)."""
  if array is None:
    return None
  return np.concatenate([array, np.repeat(array[:1], batch_size - len(array), 0)])


def _row(batch: Dict[str, np.ndarray], indices) -> Dict[str, np.ndarray]:
  return {k: np.asarray(v)[indices] for k, v in batch.items()}


def generate_targets(model, prompts, *, max_decode_steps: int, temperature: float = 0.0,
                     topk: int = 0, topp: Optional[float] = None, seed: int = 0, batch_size: int = 64
                     ) -> Dict[str, np.ndarray]:
  """The family's training batch of `model`'s own outputs for `prompts`, via `generate`.

  prompts: `data.Prompts` (or Seq2SeqData / an input array [n, C], see
  `data.as_prompts`). Rows are decoded in batches of `batch_size` (the last
  padded with copies of its first row, then trimmed) with keys
  fold_in(PRNGKey(seed), batch index). Returns n rows of what
  `Family.continuation_batch` makes: T5 {'inputs', 'targets' [n,
  max_decode_steps], 0 after EOS}; decoder-only prompt + continuation rows
  (`lm_batch`) learning only the continuation.
  """
  prompts = data_lib.as_prompts(prompts)
  family = family_of(model)
  tokens, lengths = family.check_inputs(model.config, prompts.inputs, prompts.lengths,
                                        max_decode_steps)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  sequences, new_lengths = [], []
  for b, start, end in _chunks(len(tokens), batch_size):
    out = generate(model, _padded(tokens[start:end], batch_size),
                   _padded(None if prompts.lengths is None else lengths[start:end], batch_size),
                   max_decode_steps=max_decode_steps, temperature=temperature, topk=topk,
                   topp=topp, rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    sequences.append(np.asarray(out.sequences)[:end - start])
    new_lengths.append(np.asarray(out.lengths)[:end - start])
  return family.continuation_batch(model.config, tokens, lengths, np.concatenate(sequences),
                                   np.concatenate(new_lengths))


def ngram_from_target_samples(model, prompts, *, max_decode_steps: int, order: int = 2,
                              smoothing: float = 0.0, temperature: float = 1.0,
                              rng: Optional[Array] = None, **fit_kwargs) -> NgramDraft:
  """An n-gram draft fitted on the target's own samples for `prompts` (`data.as_prompts`).

  Lives here, not in drafts/ngram.py: it decodes with the target, and the
  drafts sit below the decode entry point in the import order.
  """
  prompts = data_lib.as_prompts(prompts)
  out = generate(model, prompts.inputs, prompts.lengths, max_decode_steps=max_decode_steps,
                 temperature=temperature, rng=rng)
  return NgramDraft.fit(np.asarray(out.sequences), model.config.vocab_size, order=order,
                        smoothing=smoothing, eos_id=family_of(model).eos_id(model.config),
                        pad_id=model.config.pad_id, **fit_kwargs)


def measure_alpha(target, draft, inputs, lengths=None, *, max_decode_steps: int,
                  temperature: float = 0.0, gamma: int = 4, seed: int = 0,
                  batch_size: int = 32) -> float:
  """alpha (Corollary 3.6) of `draft` against `target` on inputs [n, C] (decoder-only:
  prompt `lengths` [n]; `data.Prompts` also works), via `generate(..., draft=...)`
  statistics pooled over all rows. Chunks are not padded: copies would count."""
  if isinstance(inputs, (data_lib.Prompts, data_lib.Seq2SeqData)):
    prompts = data_lib.as_prompts(inputs)
    inputs, lengths = prompts.inputs, prompts.lengths
  inputs = np.asarray(inputs, np.int32)
  lengths = None if lengths is None else np.asarray(lengths, np.int32)
  beta_sum = beta_count = 0.0
  for b, start, end in _chunks(len(inputs), batch_size):
    out = generate(target, inputs[start:end], None if lengths is None else lengths[start:end],
                   max_decode_steps=max_decode_steps, temperature=temperature, draft=draft,
                   gamma=gamma, rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    beta_sum += float(out.stats.beta_sum.sum())
    beta_count += float(out.stats.beta_count.sum())
  return beta_sum / max(beta_count, 1.0)


@dataclasses.dataclass
class DistillResult:
  """Distilled drafts and what distillation did to them.

  drafts: {name: model} with the distilled weights (the target's family).
  alpha_before / alpha_after: {name: {temperature: alpha}} on the eval prompts.
  eval_before / eval_after: per-draft mean divergence and greedy agreement on eval data.
  loss_first / loss_last: mean divergence per token (all drafts summed) on the
    first training batch under the initial weights / the last under the final ones.
  """
  drafts: Dict[str, Any]
  alpha_before: Dict[str, Dict[float, float]]
  alpha_after: Dict[str, Dict[float, float]]
  eval_before: Dict[str, float]
  eval_after: Dict[str, float]
  loss_first: float
  loss_last: float
  steps: int
  seconds: float
  settings: Dict[str, Any]

  def summary(self) -> Dict[str, Any]:
    fmt = lambda d: {n: {str(t): a for t, a in v.items()} for n, v in d.items()}
    return dict(alpha_before=fmt(self.alpha_before), alpha_after=fmt(self.alpha_after),
                eval_before=self.eval_before, eval_after=self.eval_after,
                loss_first=self.loss_first, loss_last=self.loss_last, steps=self.steps,
                seconds=self.seconds, **self.settings)


def _check_drafts(target, drafts) -> None:
  if not drafts:
    raise ValueError("distill_drafts needs at least one draft")
  family = family_of(target)
  for name, draft in drafts.items():
    if family_of(draft) is not family:
      raise ValueError(f"draft {name!r} is a {family_of(draft).name} model, the target a "
                       f"{family.name} one: distillation needs the target's family")
    try:
      family.check_draft(draft.config, target.config)
    except ValueError as e:
      raise ValueError(f"draft {name!r}: {e}") from None


def distill_drafts(target, drafts: Dict[str, Any], train_data, *, steps: int,
                   batch_size: int = 32, learning_rate: float = 5e-3,
                   optimizer: str = "adafactor", divergence: str = "forward_kl",
                   temperature: float = 0.0, topk: int = 0, topp: Optional[float] = None,
                   source: str = "target", seed: int = 0, workdir: Optional[str] = None,
                   eval_prompts=None, max_decode_steps: int = 32,
                   alpha_temperatures: Sequence[float] = (0.0, 1.0), gamma: int = 4,
                   eval_data=None, progress_bar: bool = True) -> DistillResult:
  """Distills every draft in `drafts` from `target` and reports alpha before and after.

  Long (about 90 lines) because it is the recipe, in order: data, teacher
  decodes, alpha before, one trainer run per draft, alpha after; each step is
  a call into the trainer or the measures.

  Any model family: batches are the family's (`Family.continuation_batch` of
  the decodes, `Family.token_logits` for the losses).

  Args:
    target: the teacher model.
    drafts: {name: model} of the target's family, trained together on shared batches
      (one teacher pass per step).
    train_data: the training prompts: `data.Prompts` (decoder-only: prompts and
      lengths), `data.Seq2SeqData` (T5 inputs, reference targets) or an input array.
    steps / batch_size / learning_rate / optimizer: the optimisation (linear decay).
    divergence: 'forward_kl' or 'tv'.
    temperature / topk / topp: the decode setting to distill for (temperature 0 distills at
      temperature 1, see `distill_temperature`).
    source: 'target' (target outputs, generated once for the prompts used), 'draft'
      (on-policy: the draft's own samples, regenerated each step; needs exactly one draft)
      or 'data' (the reference outputs of `train_data`).
    seed: data order and generation keys.
    workdir: checkpoints + metrics (resumable), or None.
    eval_prompts: prompts for alpha before/after (as `train_data`; skipped when None).
    max_decode_steps: decode length for generated targets and alpha.
    alpha_temperatures / gamma: settings at which alpha is measured.
    eval_data: held-out prompts for divergence/agreement before and after (their
      references when source == 'data', else the target's outputs).
  """
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; use one of {SOURCES}")
  if source == "draft" and len(drafts) != 1:
    raise ValueError("on-policy distillation (source='draft') trains one draft at a time")
  _check_drafts(target, drafts)
  family = family_of(target)
  train_data = data_lib.as_prompts(train_data)
  train_data.check_vocab(target.config.vocab_size)
  if source == "data" and train_data.references is None:
    raise ValueError("source='data' trains on reference outputs: pass train_data with "
                     "references (data.Prompts(..., references=batch) or Seq2SeqData)")
  t_distill = distill_temperature(temperature)
  t0 = time.time()
  eval_prompts = None if eval_prompts is None else data_lib.as_prompts(eval_prompts)

  def alphas(models):
    if eval_prompts is None:
      return {}
    return {name: {t: measure_alpha(target, m, eval_prompts, max_decode_steps=max_decode_steps,
                                    temperature=t, gamma=gamma, seed=seed)
                   for t in alpha_temperatures} for name, m in models.items()}

  # The prompts the run will visit, so 'target' outputs are generated once.
  num_examples = min(len(train_data), steps * batch_size)
  pool = train_data.take(np.random.default_rng([seed, 11]).permutation(len(train_data))
                         [:num_examples])
  pool_batch = pool.references
  if source == "target":
    pool_batch = generate_targets(target, pool, max_decode_steps=max_decode_steps,
                                  temperature=temperature, seed=seed)
  eval_batch = None
  if eval_data is not None:
    eval_data = data_lib.as_prompts(eval_data)
    eval_batch = (eval_data.references if source == "data" else generate_targets(
        target, eval_data, max_decode_steps=max_decode_steps, temperature=temperature,
        seed=seed + 1))

  configs = {name: m.config for name, m in drafts.items()}
  loss_fn = distill_loss_fn(configs, divergence, t_distill, topk, topp)

  def with_teacher(batch):
    return dict(batch, teacher_probs=teacher_probs(target, batch, t_distill, topk, topp))

  def batch_at(step, params):
    rows = data_lib.batch_indices(len(pool), batch_size, step, seed)
    if source != "draft":
      return with_teacher(_row(pool_batch, rows))
    (name,) = drafts
    own = family.model_type(configs[name], params[name])
    return with_teacher(generate_targets(
        own, pool.take(rows), max_decode_steps=max_decode_steps, temperature=t_distill,
        topk=topk, topp=topp, seed=seed + 1 + step, batch_size=batch_size))

  eval_fn = jax.jit(functools.partial(train.eval_step, loss_fn=loss_fn))

  def evaluate(params):
    if eval_batch is None:
      return {}
    n = len(next(iter(eval_batch.values())))
    batches = [with_teacher(_row(eval_batch, np.arange(i, min(i + 64, n))))
               for i in range(0, n, 64)]
    return train.evaluate(params, batches, eval_fn)

  def batch_loss(params, step):
    return train.evaluate(params, [batch_at(step, params)], eval_fn)["loss"]

  params = {name: m.params for name, m in drafts.items()}
  alpha_before, eval_before = alphas(drafts), evaluate(params)
  loss_first = batch_loss(params, 0)
  opt = train.make_optimizer(optimizer, learning_rate, schedule="linear",
                             warmup_steps=min(10, steps // 10), total_steps=steps)
  state = train.create_train_state(params, opt)
  state, _ = train.fit(state, batch_at, loss_fn=loss_fn, optimizer=opt,
                       cfg=train.TrainConfig(num_steps=steps, checkpoint_every=max(steps // 4, 1),
                                             log_every=10, progress_bar=progress_bar),
                       workdir=workdir, description="distill", batch_fn_takes_params=True)
  distilled = {name: family.model_type(configs[name], state.params[name]) for name in drafts}
  alpha_after, eval_after = alphas(distilled), evaluate(state.params)
  loss_last = batch_loss(state.params, max(steps - 1, 0))
  settings = dict(divergence=divergence, decode_temperature=float(temperature),
                  distill_temperature=t_distill, source=source, batch_size=batch_size,
                  learning_rate=learning_rate, optimizer=optimizer, gamma=gamma)
  return DistillResult(distilled, alpha_before, alpha_after, eval_before, eval_after,
                       loss_first, loss_last, steps, time.time() - t0, settings)
