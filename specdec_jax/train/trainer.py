"""Training with optax for every model family: cross-entropy, accumulation, exact resume.

The pieces are pure functions over a `TrainState` pytree:

  state = create_train_state(params, optimizer)
  state, metrics = train_step(state, batch, loss_fn=loss_fn(config), optimizer=...,
                              num_microbatches=...)

Losses reach a model only through its family's `token_logits` (the family
contract), so one `loss_fn` / `joint_loss_fn` serves T5 and decoder-only.

`fit` is the loop around them: batches come from a function of the step
number (so resuming needs no iterator state), Orbax checkpoints hold the whole
`TrainState`, and a resumed run continues bit-for-bit as if it had never
stopped. Metrics go to a JSONL file (and TensorBoard when `tensorboardX` or
`tensorflow` is installed).
"""

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import optax

from specdec_jax.families.registry import family_of

Array = jax.Array
Batch = Dict[str, Array]
# (params, batch) -> (summed loss, {'tokens': number of target tokens, ...sums}).
LossFn = Callable[[Any, Batch], Tuple[Array, Dict[str, Array]]]


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs: step [] int32, params, optimizer state."""
  step: Array
  params: Any
  opt_state: Any


def create_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


# ----------------------------------------------------------------------------
# Optimizers
# ----------------------------------------------------------------------------

def make_schedule(kind: str, learning_rate: float, warmup_steps: int, total_steps: int):
  """Learning-rate schedule.

  kind: 'constant' (linear warmup, then flat); 'rsqrt' (T5X: lr * rsqrt(max(step, warmup)) *
  sqrt(warmup), i.e. flat for warmup steps then inverse square root); 'cosine' (warmup then
  cosine decay to 0 at total_steps); 'linear' (warmup then linear decay to 0).
  """
  warmup_steps = max(int(warmup_steps), 0)
  warm = lambda step: jnp.minimum(1.0, (step + 1) / max(warmup_steps, 1))
  if kind == "constant":
    return lambda step: learning_rate * warm(step)
  if kind == "rsqrt":
    base = max(warmup_steps, 1)
    return lambda step: learning_rate * jnp.sqrt(base / jnp.maximum(step + 1.0, base))
  if kind in ("cosine", "linear"):
    decay_steps = max(int(total_steps) - warmup_steps, 1)

    def schedule(step):
      frac = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
      decay = 0.5 * (1 + jnp.cos(jnp.pi * frac)) if kind == "cosine" else 1.0 - frac
      return learning_rate * warm(step) * decay
    return schedule
  raise ValueError(f"unknown schedule {kind!r}: use constant, rsqrt, cosine or linear")


def make_optimizer(name: str = "adafactor", learning_rate: float = 1e-2, *,
                   schedule: str = "rsqrt", warmup_steps: int = 100, total_steps: int = 1000,
                   weight_decay: float = 0.0, clip_norm: float = 0.0
                   ) -> optax.GradientTransformation:
  """Adafactor as in T5X (factored second moments, updates scaled by parameter RMS,
  update clipping at 1.0) or AdamW.

  Args:
    name: 'adafactor' or 'adamw'.
    learning_rate: peak rate (T5X: 1e-2 with Adafactor; AdamW wants ~1e-3).
    schedule / warmup_steps / total_steps: see `make_schedule`.
    weight_decay: decoupled weight decay.
    clip_norm: global gradient-norm clipping (0 = off).
  """
  lr = make_schedule(schedule, learning_rate, warmup_steps, total_steps)
  if name == "adafactor":
    opt = optax.adafactor(lr, multiply_by_parameter_scale=True, clipping_threshold=1.0,
                          decay_rate=0.8, weight_decay_rate=weight_decay or None)
  elif name == "adamw":
    opt = optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-9, weight_decay=weight_decay)
  else:
    raise ValueError(f"unknown optimizer {name!r}: use 'adafactor' or 'adamw'")
  if clip_norm:
    opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
  return opt


# ----------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------

def token_cross_entropy(logits: Array, targets: Array, mask: Array) -> Tuple[Array, Array]:
  """Summed cross-entropy and correct-argmax count over unmasked positions.

  Args:
    logits: [batch, len, vocab] float32.
    targets: [batch, len] int32.
    mask: [batch, len] float32 (1 = a real target token).
  Returns:
    (sum of -log p(target), number of positions where argmax == target), both [].
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(correct * mask)


def loss_fn(config) -> LossFn:
  """Teacher-forced cross-entropy of a model of any family on the family's batches
  (`Family.token_logits`: T5 {'inputs', 'targets'}, decoder-only {'tokens', 'weights'}),
  summed over weighted tokens; aux {'tokens', 'correct'}."""
  family = family_of(config)

  def fn(params, batch):
    logits, targets, weights = family.token_logits(config, params, batch)
    loss, correct = token_cross_entropy(logits, targets, weights)
    return loss, dict(tokens=jnp.sum(weights), correct=correct)
  return fn


def sum_of_models(loss_fns: Dict[str, LossFn]) -> LossFn:
  """One loss over params {name: params}: the sum of each model's summed loss.

  Each model's gradient is then exactly its own, so a per-parameter optimizer
  such as Adafactor updates each model as if it were trained alone. Aux holds
  '{name}/loss', '{name}/correct' and the shared 'tokens'.
  """
  if not loss_fns:
    raise ValueError("a joint loss needs at least one model")

  def fn(params, batch):
    total, aux = 0.0, {}
    for name, model_loss in loss_fns.items():
      loss, model_aux = model_loss(params[name], batch)
      total = total + loss
      aux[f"{name}/loss"] = loss
      aux[f"{name}/correct"] = model_aux["correct"]
      aux["tokens"] = model_aux["tokens"]
    return total, aux
  return fn


def check_joint_configs(configs: Dict[str, Any]) -> None:
  """Raises unless `configs` ({name: config}) can share batches: one family (one batch
  format) and one pad id (so every model learns the same tokens of a batch)."""
  if not configs:
    raise ValueError("joint training needs at least one model config")
  names = {family_of(c).name for c in configs.values()}
  if len(names) != 1:
    raise ValueError(f"models of different families {sorted(names)} cannot share batches")
  pad_ids = {getattr(c, "pad_id", None) for c in configs.values()}
  if len(pad_ids) != 1:
    raise ValueError(f"models disagree on the pad id: {pad_ids}")


def joint_loss_fn(configs: Dict[str, Any]) -> LossFn:
  """Trains several models of one family on the same batches: params = {name: params}.

  Sharing batches lets cheap drafts train in lockstep with their target for a
  fraction of the target's cost (see `sum_of_models`).
  """
  check_joint_configs(configs)
  return sum_of_models({name: loss_fn(config) for name, config in configs.items()})


# ----------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------

def _split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
  def split(x):
    if x.shape[0] % num_microbatches:
      raise ValueError(f"batch of {x.shape[0]} rows is not divisible by {num_microbatches} "
                       "microbatches")
    return x.reshape((num_microbatches, x.shape[0] // num_microbatches) + x.shape[1:])
  return jax.tree_util.tree_map(split, batch)


def loss_and_grads(params, batch: Batch, loss_fn: LossFn, num_microbatches: int = 1):
  """Summed loss, summed aux and summed grads over `num_microbatches` slices of `batch`.

  Gradients of the *sum* are accumulated, then the caller divides by the
  token count, so accumulation gives the same update as one large batch
  (up to float summation order).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if num_microbatches == 1:
    (loss, aux), grads = grad_fn(params, batch)
    return loss, aux, grads
  micro = _split_microbatches(batch, num_microbatches)

  def body(carry, mb):
    (loss, aux), grads = grad_fn(params, mb)
    return jax.tree_util.tree_map(jnp.add, carry, (loss, aux, grads)), None

  first = jax.tree_util.tree_map(lambda x: x[0], micro)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(
      lambda p, b: (lambda la, g: (la[0], la[1], g))(*grad_fn(p, b)), params, first))
  (loss, aux, grads), _ = jax.lax.scan(body, zeros, micro)
  return loss, aux, grads


def train_step(state: TrainState, batch: Batch, *, loss_fn: LossFn,
               optimizer: optax.GradientTransformation, num_microbatches: int = 1
               ) -> Tuple[TrainState, Dict[str, Array]]:
  """One optimizer update on the mean per-token loss of `batch`.

  Args:
    state: the current TrainState.
    batch: arrays with a leading [batch] axis (e.g. inputs [b, S], targets [b, T] int32).
    loss_fn: (params, batch) -> (summed loss, aux with 'tokens').
    optimizer: the optax transformation the state was created with.
    num_microbatches: gradient accumulation factor (divides the batch).
  Returns:
    (new state, metrics {'loss', 'accuracy', 'tokens', 'grad_norm'} float32 []).
  """
  loss, aux, grads = loss_and_grads(state.params, batch, loss_fn, num_microbatches)
  tokens = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {k: v / tokens for k, v in aux.items() if k != "tokens"}
  metrics.update(loss=loss / tokens, tokens=aux["tokens"], grad_norm=optax.tree.norm(grads))
  if "correct" in metrics:
    metrics["accuracy"] = metrics.pop("correct")
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: Batch, *, loss_fn: LossFn) -> Dict[str, Array]:
  """Summed loss and aux of one batch (sum, so eval batches combine exactly)."""
  loss, aux = loss_fn(params, batch)
  return dict(loss=loss, **aux)


def evaluate(params, eval_batches, eval_fn) -> Dict[str, float]:
  """Per-token means over all eval batches; eval_fn = jit(partial(eval_step, loss_fn=...))."""
  totals: Dict[str, float] = {}
  for batch in eval_batches:
    for k, v in eval_fn(params, batch).items():
      totals[k] = totals.get(k, 0.0) + float(v)
  tokens = max(totals.pop("tokens", 0.0), 1.0)
  out = {k: v / tokens for k, v in totals.items()}
  if "correct" in out:
    out["accuracy"] = out.pop("correct")
  return out


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop settings (optimizer settings live in `make_optimizer`'s arguments).

  num_steps: optimizer updates in total (a resumed run stops at the same step).
  checkpoint_every: save every N steps (0 = only at the end); keep_checkpoints: how many to keep.
  eval_every: evaluate every N steps (0 = only at the end); log_every: metrics cadence.
  num_microbatches: gradient accumulation factor.
  """
  num_steps: int
  checkpoint_every: int = 0
  keep_checkpoints: int = 2
  eval_every: int = 0
  log_every: int = 10
  num_microbatches: int = 1
  progress_bar: bool = True


class MetricsWriter:
  """Appends metric dicts as JSON lines (and TensorBoard scalars when available)."""

  def __init__(self, workdir: Optional[str]):
    self.path = None if workdir is None else os.path.join(workdir, "metrics.jsonl")
    self.tb = None
    if workdir is not None:
      os.makedirs(workdir, exist_ok=True)
      try:
        from tensorboardX import SummaryWriter  # Optional dependency.
        self.tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:
        self.tb = None

  def write(self, step: int, kind: str, metrics: Dict[str, float]):
    if self.path is None:
      return
    row = dict(step=int(step), kind=kind, time=time.time(),
               **{k: float(v) for k, v in metrics.items()})
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if self.tb is not None:
      for k, v in metrics.items():
        self.tb.add_scalar(f"{kind}/{k}", float(v), int(step))


def _checkpoint_manager(workdir: str, cfg: TrainConfig):
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, create=True,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=options)


def restore_latest(workdir: str, state: TrainState, cfg: Optional[TrainConfig] = None
                   ) -> TrainState:
  """The newest checkpoint under workdir/checkpoints restored into `state`'s structure
  (or `state` itself when there is none)."""
  import orbax.checkpoint as ocp
  manager = _checkpoint_manager(workdir, cfg or TrainConfig(num_steps=1))
  step = manager.latest_step()
  if step is None:
    return state
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
  return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def fit(state: TrainState, batch_at: Callable[[int], Batch], *, loss_fn: LossFn,
        optimizer: optax.GradientTransformation, cfg: TrainConfig, workdir: Optional[str] = None,
        eval_batches: Optional[Callable[[], Iterator[Batch]]] = None,
        eval_loss_fn: Optional[LossFn] = None, description: str = "train",
        batch_fn_takes_params: bool = False) -> Tuple[TrainState, Dict[str, float]]:
  """Trains until state.step == cfg.num_steps, resuming from workdir's latest checkpoint.

  Args:
    state: the initial state (used when no checkpoint exists, and as the
      restore template).
    batch_at: step -> batch; must be a pure function of the step so resumed
      runs see the same data (see `specdec_jax.data.batch_indices`).
    loss_fn / optimizer: as in `train_step`.
    cfg: loop settings.
    workdir: checkpoints and metrics.jsonl go here (None: no checkpoints, no log).
    eval_batches: a function returning an iterable of eval batches.
    eval_loss_fn: loss for evaluation (default: loss_fn).
    description: progress-bar label.
    batch_fn_takes_params: call batch_at(step, params) instead (on-policy data that
      depends on the current weights, e.g. distillation on the draft's own samples; still
      exact on resume because the restored params are identical).
  Returns:
    (final state, last eval metrics or {}).
  """
  import orbax.checkpoint as ocp
  manager = None
  if workdir is not None:
    manager = _checkpoint_manager(workdir, cfg)
    if manager.latest_step() is not None:
      state = restore_latest(workdir, state, cfg)
  # The step donates its input state; copy so the caller's `state` stays valid.
  state = jax.tree_util.tree_map(jnp.copy, state)
  writer = MetricsWriter(workdir)
  step_fn = jax.jit(functools.partial(train_step, loss_fn=loss_fn, optimizer=optimizer,
                                      num_microbatches=cfg.num_microbatches), donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, loss_fn=eval_loss_fn or loss_fn))

  def run_eval(step):
    if eval_batches is None:
      return {}
    metrics = evaluate(state.params, eval_batches(), eval_fn)
    writer.write(step, "eval", metrics)
    return metrics

  start = int(state.step)
  bar = None
  if cfg.progress_bar:
    from tqdm import tqdm
    bar = tqdm(total=cfg.num_steps, initial=start, desc=description, dynamic_ncols=True)
  eval_metrics: Dict[str, float] = {}
  window_step, window_start = start, time.time()
  for step in range(start, cfg.num_steps):
    batch = batch_at(step, state.params) if batch_fn_takes_params else batch_at(step)
    state, metrics = step_fn(state, batch)
    done = step + 1
    if done % cfg.log_every == 0 or done == cfg.num_steps:
      metrics = {k: float(v) for k, v in metrics.items()}
      elapsed = time.time() - window_start
      metrics["steps_per_s"] = (done - window_step) / max(elapsed, 1e-9)
      metrics["tokens_per_s"] = metrics["tokens"] * metrics["steps_per_s"]
      window_step, window_start = done, time.time()
      writer.write(done, "train", metrics)
      if bar is not None:
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics.get('accuracy', 0):.3f}")
    if bar is not None:
      bar.update(1)
    if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.num_steps:
      eval_metrics = run_eval(done)
    if manager is not None and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
      manager.save(done, args=ocp.args.StandardSave(state))
  if bar is not None:
    bar.close()
  if manager is not None and int(state.step) == cfg.num_steps and start < cfg.num_steps:
    if manager.latest_step() != cfg.num_steps:
      manager.save(cfg.num_steps, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  eval_metrics = run_eval(int(state.step))
  return state, eval_metrics
