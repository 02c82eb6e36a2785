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
from specdec_jax.generation import generate
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.network import T5

Array = jax.Array
DIVERGENCES = ("forward_kl", "tv")
SOURCES = ("target", "draft", "data")


def distill_temperature(temperature: float) -> float:
  """The temperature distillation uses for a decode temperature (0 -> 1, see module doc)."""
  return 1.0 if temperature < sampling.MIN_TEMPERATURE else float(temperature)


def divergence_sum(teacher_probs: Array, draft_logits: Array, mask: Array, kind: str,
                   temperature: float, topk: int = 0, topp: float = 0.0) -> Array:
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


def distill_loss_fn(draft_configs: Dict[str, T5Config], divergence: str, temperature: float,
                    topk: int = 0, topp: float = 0.0) -> train.LossFn:
  """Loss over params {name: draft params} on batches {'inputs', 'targets', 'teacher_probs'}.

  Each draft's summed divergence is added (independent gradients, as in
  `train.joint_seq2seq_loss_fn`); aux holds '{name}/loss' (the divergence),
  '{name}/correct' (draft argmax == teacher argmax, i.e. greedy agreement) and 'tokens'.
  """
  if divergence not in DIVERGENCES:
    raise ValueError(f"unknown divergence {divergence!r}; use one of {DIVERGENCES}")
  if temperature < sampling.MIN_TEMPERATURE:
    raise ValueError("distill at temperature > 0; use distill_temperature(t) for greedy decoding")
  modules = {name: T5(config) for name, config in draft_configs.items()}

  def loss_fn(params, batch):
    targets = batch["targets"]
    mask = (targets != 0).astype(jnp.float32)
    teacher = batch["teacher_probs"]
    total, aux = 0.0, dict(tokens=jnp.sum(mask))
    for name, module in modules.items():
      logits = module.apply({"params": params[name]}, batch["inputs"], train.shift_right(targets))
      loss = divergence_sum(teacher, logits, mask, divergence, temperature, topk, topp)
      agree = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
      aux[f"{name}/loss"] = loss
      aux[f"{name}/correct"] = jnp.sum(agree * mask)
      total = total + loss
    return total, aux
  return loss_fn


@functools.lru_cache(maxsize=None)
def _teacher_fn(config: T5Config, temperature: float, topk: int, topp: float):
  module = T5(config)

  def probs(params, inputs, targets):
    logits = module.apply({"params": params}, inputs, train.shift_right(targets))
    return sampling.adjust_probs(logits, temperature, topk, topp)
  return jax.jit(probs)


def teacher_probs(target: Model, inputs, targets, temperature: float, topk: int = 0,
                  topp: float = 0.0) -> Array:
  """The target's adjusted distributions [batch, len, vocab] teacher-forced on `targets`."""
  return _teacher_fn(target.config, float(temperature), int(topk), float(topp))(
      target.params, jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32))


def generate_targets(model: Model, inputs: np.ndarray, *, max_decode_steps: int,
                     temperature: float = 0.0, seed: int = 0, batch_size: int = 64
                     ) -> data_lib.Seq2SeqData:
  """Seq2seq data whose targets are `model`'s outputs for `inputs` [n, S] (via `generate`).

  Rows are decoded in batches of `batch_size` (the last batch is padded with
  copies of its first row and trimmed) with keys fold_in(PRNGKey(seed), batch index).
  Returns targets [n, max_decode_steps] int32, 0 after EOS.
  """
  inputs = np.asarray(inputs, np.int32)
  outputs = []
  for b, start in enumerate(range(0, len(inputs), batch_size)):
    chunk = inputs[start:start + batch_size]
    padded = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - len(chunk), 0)])
    out = generate(model, padded, max_decode_steps=max_decode_steps, temperature=temperature,
                   rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    outputs.append(np.asarray(out.sequences)[:len(chunk)])
  return data_lib.Seq2SeqData(inputs, np.concatenate(outputs).astype(np.int32))


def ngram_from_target_samples(model: Model, encoder_tokens, *, max_decode_steps: int,
                              order: int = 2, smoothing: float = 0.0, temperature: float = 1.0,
                              rng: Optional[Array] = None, **fit_kwargs) -> NgramDraft:
  """An n-gram draft fitted on the target's own samples for encoder_tokens [batch, len].

  Lives here, not in drafts/ngram.py: it decodes with the target, and the
  drafts sit below the decode entry point in the import order.
  """
  out = generate(model, encoder_tokens, max_decode_steps=max_decode_steps,
                 temperature=temperature, rng=rng)
  return NgramDraft.fit(np.asarray(out.sequences), model.config.vocab_size, order=order,
                        smoothing=smoothing, eos_id=model.config.eos_id,
                        pad_id=model.config.pad_id, **fit_kwargs)


def measure_alpha(target: Model, draft, prompts: np.ndarray, *, max_decode_steps: int,
                  temperature: float = 0.0, gamma: int = 4, seed: int = 0,
                  batch_size: int = 32) -> float:
  """alpha (Corollary 3.6) of `draft` against `target` on `prompts` [n, S], via
  `generate(..., draft=...)` statistics pooled over all prompts."""
  beta_sum = beta_count = 0.0
  for b, start in enumerate(range(0, len(prompts), batch_size)):
    chunk = np.asarray(prompts[start:start + batch_size], np.int32)
    out = generate(target, chunk, max_decode_steps=max_decode_steps, temperature=temperature,
                   draft=draft, gamma=gamma, rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    beta_sum += float(out.stats.beta_sum.sum())
    beta_count += float(out.stats.beta_count.sum())
  return beta_sum / max(beta_count, 1.0)


@dataclasses.dataclass
class DistillResult:
  """Distilled drafts and what distillation did to them.

  drafts: {name: Model} with the distilled weights.
  alpha_before / alpha_after: {name: {temperature: alpha}} on the eval prompts.
  eval_before / eval_after: per-draft mean divergence and greedy agreement on eval data.
  """
  drafts: Dict[str, Model]
  alpha_before: Dict[str, Dict[float, float]]
  alpha_after: Dict[str, Dict[float, float]]
  eval_before: Dict[str, float]
  eval_after: Dict[str, float]
  steps: int
  seconds: float
  settings: Dict[str, Any]

  def summary(self) -> Dict[str, Any]:
    fmt = lambda d: {n: {str(t): a for t, a in v.items()} for n, v in d.items()}
    return dict(alpha_before=fmt(self.alpha_before), alpha_after=fmt(self.alpha_after),
                eval_before=self.eval_before, eval_after=self.eval_after, steps=self.steps,
                seconds=self.seconds, **self.settings)


def distill_drafts(target: Model, drafts: Dict[str, Model], train_data: data_lib.Seq2SeqData, *,
                   steps: int, batch_size: int = 32, learning_rate: float = 5e-3,
                   optimizer: str = "adafactor", divergence: str = "forward_kl",
                   temperature: float = 0.0, topk: int = 0, topp: float = 0.0,
                   source: str = "target", seed: int = 0, workdir: Optional[str] = None,
                   eval_prompts: Optional[np.ndarray] = None, max_decode_steps: int = 32,
                   alpha_temperatures: Sequence[float] = (0.0, 1.0), gamma: int = 4,
                   eval_data: Optional[data_lib.Seq2SeqData] = None,
                   progress_bar: bool = True) -> DistillResult:
  """Distills every draft in `drafts` from `target` and reports alpha before and after.

  Args:
    target: the teacher `Model`.
    drafts: {name: Model}, trained together on shared batches (one teacher pass per step).
    train_data: inputs (and reference targets for source='data').
    steps / batch_size / learning_rate / optimizer: the optimisation (linear decay).
    divergence: 'forward_kl' or 'tv'.
    temperature / topk / topp: the decode setting to distill for (temperature 0 distills at
      temperature 1, see `distill_temperature`).
    source: 'target' (target outputs, generated once for the inputs used), 'draft'
      (on-policy: the draft's own samples, regenerated each step; needs exactly one draft)
      or 'data' (the reference targets).
    seed: data order and generation keys.
    workdir: checkpoints + metrics (resumable), or None.
    eval_prompts: [n, S] prompts for alpha before/after (skipped when None).
    max_decode_steps: decode length for generated targets and alpha.
    alpha_temperatures / gamma: settings at which alpha is measured.
    eval_data: held-out Seq2SeqData for divergence/agreement before and after (targets are
      replaced by the target model's outputs when source != 'data').
  """
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; use one of {SOURCES}")
  if source == "draft" and len(drafts) != 1:
    raise ValueError("on-policy distillation (source='draft') trains one draft at a time")
  if not drafts:
    raise ValueError("distill_drafts needs at least one draft")
  for name, draft in drafts.items():
    if draft.config.vocab_size != target.config.vocab_size:
      raise ValueError(f"draft {name!r} has vocabulary {draft.config.vocab_size}, the target "
                       f"{target.config.vocab_size}")
  train_data.check_vocab(target.config.vocab_size)
  t_distill = distill_temperature(temperature)
  t0 = time.time()

  def alphas(models):
    if eval_prompts is None:
      return {}
    return {name: {t: measure_alpha(target, m, eval_prompts, max_decode_steps=max_decode_steps,
                                    temperature=t, gamma=gamma, seed=seed)
                   for t in alpha_temperatures} for name, m in models.items()}

  # The examples the run will visit, so 'target' outputs are generated once.
  num_examples = min(len(train_data), steps * batch_size)
  pool = train_data.take(np.random.default_rng([seed, 11]).permutation(len(train_data))
                         [:num_examples])
  pool = data_lib.Seq2SeqData(pool["inputs"], pool["targets"])
  if source == "target":
    pool = generate_targets(target, pool.inputs, max_decode_steps=max_decode_steps,
                            temperature=temperature, seed=seed)
  if eval_data is not None and source != "data":
    eval_data = generate_targets(target, eval_data.inputs, max_decode_steps=max_decode_steps,
                                 temperature=temperature, seed=seed + 1)

  configs = {name: m.config for name, m in drafts.items()}
  loss_fn = distill_loss_fn(configs, divergence, t_distill, topk, topp)

  def with_teacher(batch):
    return dict(batch, teacher_probs=teacher_probs(target, batch["inputs"], batch["targets"],
                                                   t_distill, topk, topp))

  def batch_at(step, params):
    batch = pool.take(data_lib.batch_indices(len(pool), batch_size, step, seed))
    if source == "draft":
      (name,) = drafts
      own = Model(configs[name], params[name])
      out = generate(own, batch["inputs"], max_decode_steps=max_decode_steps,
                     temperature=t_distill, topk=topk, topp=topp,
                     rng=jax.random.fold_in(jax.random.PRNGKey(seed + 1), step))
      batch = dict(batch, targets=np.asarray(out.sequences))
    return with_teacher(batch)

  eval_fn = jax.jit(functools.partial(train.eval_step, loss_fn=loss_fn))

  def evaluate(params):
    if eval_data is None:
      return {}
    batches = [with_teacher(eval_data.take(np.arange(i, min(i + 64, len(eval_data)))))
               for i in range(0, len(eval_data), 64)]
    return train.evaluate(params, batches, eval_fn)

  params = {name: m.params for name, m in drafts.items()}
  alpha_before, eval_before = alphas(drafts), evaluate(params)
  opt = train.make_optimizer(optimizer, learning_rate, schedule="linear",
                             warmup_steps=min(10, steps // 10), total_steps=steps)
  state = train.create_train_state(params, opt)
  state, _ = train.fit(state, batch_at, loss_fn=loss_fn, optimizer=opt,
                       cfg=train.TrainConfig(num_steps=steps, checkpoint_every=max(steps // 4, 1),
                                             log_every=10, progress_bar=progress_bar),
                       workdir=workdir, description="distill", batch_fn_takes_params=True)
  distilled = {name: Model(configs[name], state.params[name]) for name in drafts}
  alpha_after, eval_after = alphas(distilled), evaluate(state.params)
  settings = dict(divergence=divergence, decode_temperature=float(temperature),
                  distill_temperature=t_distill, source=source, batch_size=batch_size,
                  learning_rate=learning_rate, optimizer=optimizer, gamma=gamma)
  return DistillResult(distilled, alpha_before, alpha_after, eval_before, eval_after, steps,
                       time.time() - t0, settings)
