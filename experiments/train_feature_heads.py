r"""Trains a draft head for a shipped demo pair: a feature head (EAGLE-style,
`sj.FeatureDraft`), Medusa heads (`sj.MedusaDraft`, HeadSettings.kind = 'medusa'), a
DFlash drafter (`sj.DFlashDraft`, kind 'dflash') or a PARD drafter (`sj.ParallelDraft`,
kind 'parallel': the pair's model draft taught to fill K - 1 mask tokens).

The head reads the pair's frozen target (the shipped bf16 weights, computed
in float32) and is trained with `specdec_jax.train.feature_heads`'s loss (EAGLE-1
regression + cross-entropy, and with `ttt_steps` > 1 EAGLE-3's
training-time test) on the corpus the pair was trained on: the Python
standard library, the pair's file-hash split, training files only, cut
exactly as the pair's trainer cuts them (decoder-only: 128-token windows;
T5: the code-completion examples).

Stages (each resumable; a finished stage is a no-op when rerun, except
`evaluate` and `export`, which are cheap and rewrite their outputs atomically):
  data      stdlib files -> the pair's split -> the pair's tokenizer -> training
            rows and held-out rows -> workdir/data.npz.
  train     `train.trainer.fit` on the head's params: Orbax checkpoints of the
            whole TrainState every `checkpoint_every` steps (a killed run resumes
            at the last one, bit for bit), a progress bar (steps, loss,
            accuracy, it/s, ETA), metrics.jsonl.
  evaluate  held-out loss and per-step accuracy; alpha at temperature 0 and 1
            of the head and of the pair's model drafts on the pair's held-out
            prompts; c of each (`profiling.time_proposals`) -> stats.json.
  export    the head in bf16 -> out_dir/feature_head.npz + feature_head.json
            (what `specdec_jax.load_demo_pair` lists as drafts['feature']), and
            the "Feature head" section of out_dir/MODEL_CARD.md.

Usage:
  python -m experiments.train_feature_heads --target_pair=decoder_only \
      --workdir=/tmp/head_do --gin_file=configs/train/feature_head.gin
  (--stages=train to resume training only; --gin.HeadSettings.steps=N to train longer
  in a fresh --workdir; --out_dir defaults to the pair's directory)
  python -m experiments.train_feature_heads --target_pair=decoder_only \
      --workdir=/tmp/medusa_do --gin_file=configs/train/medusa_heads.gin
  (Medusa heads: `train.medusa.medusa_loss_fn`, exported as medusa_heads.npz / .json,
  listed as drafts['medusa'], with a model-card section of their own)
  python -m experiments.train_feature_heads --target_pair=decoder_only \
      --workdir=/tmp/dflash_do --gin_file=configs/train/dflash.gin
  (DFlash: `train.dflash.dflash_loss_fn`, dflash.npz / .json, drafts['dflash'];
  configs/train/dflash_t5.gin for the T5 pair)
  python -m experiments.train_feature_heads --target_pair=decoder_only \
      --workdir=/tmp/parallel_do --gin_file=configs/train/parallel.gin
  (PARD: `train.pard.pard_loss_fn`, parallel.npz / .json, drafts['parallel'];
  configs/train/parallel_t5.gin for the T5 pair)
For 'dflash' and 'parallel' the evaluate stage also measures alpha per drafted position
and tokens per iteration of every draft it compares (the pair's model drafts, its
'feature' and 'medusa' heads, the new drafter).
"""

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict

from absl import app, flags, logging
import gin
import jax
import jax.numpy as jnp
import numpy as np

from experiments import gin_flags
from experiments.train_stages import (check_stages, read_json, run_stages, selected_stages,
                                      write_json)
from specdec_jax import data
from specdec_jax import demo_pair as demo_pair_lib
from specdec_jax.train import dflash as dflash_train
from specdec_jax.train import feature_heads as feature_train
from specdec_jax.train import medusa as medusa_train
from specdec_jax.train import pard as pard_train
from specdec_jax.train import trainer as train

FLAGS = flags.FLAGS
flags.DEFINE_enum("target_pair", "decoder_only", ["decoder_only", "t5"],
                  "Which demo pair's target. (Not --pair or --demo_pair: experiments.run "
                  "and scripts/benchmark.py own those, and tests import all three.)")
# --workdir (required here), --out_dir (default: the pair's directory), --stages:
# experiments/train_stages.py.

STAGES = ("data", "train", "evaluate", "export")
KINDS = ("eagle1", "medusa", "dflash", "parallel")
# Kinds that draft a whole block from one call, trained at anchors (`train.dflash`,
# `train.pard`): per-slot accuracy, per-position alpha in the evaluate stage.
BLOCK_KINDS = ("dflash", "parallel")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HeadSettings:
  """Everything that determines a head (gin-configurable: HeadSettings.NAME = VALUE)."""
  seed: int = 0
  steps: int = 800
  batch: int = 16             # rows per step (decoder-only: 128-token windows)
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  schedule: str = "cosine"
  clip_norm: float = 1.0
  weight_decay: float = 0.0
  fc_bias: bool = False
  # What is trained: 'eagle1' (a FeatureDraft head), 'medusa' (MedusaDraft heads),
  # 'dflash' (a DFlashDraft) or 'parallel' (a ParallelDraft: PARD).
  kind: str = "eagle1"
  medusa_heads: int = 4
  medusa_layers: int = 1
  medusa_decay: float = 0.8   # head k's loss weight decay**(k-1) (`medusa_loss_fn`)
  # DFlash (`train.dflash`): its layers, block (the last token + K masks: K = block - 1
  # laws per call) and MLP width (0: 4 x the target's width).
  dflash_layers: int = 1
  dflash_block: int = 5
  dflash_intermediate: int = 0
  # PARD (`train.pard`): K, and the pair's model draft it starts from ('': the first).
  parallel_gamma: int = 4
  parallel_init: str = ""
  # Both: the mask token (2, the demo tokenizer's unk, occurs nowhere in the corpus) and
  # slot i's loss weight block_decay**(i-1); anchors per row: num_anchors.
  mask_token_id: int = 2
  block_decay: float = 0.8
  # The loss (`feature_loss_fn`).
  ce_weight: float = 0.1
  regression_weight: float = 1.0
  ttt_steps: int = 3
  ttt_decay: float = 0.8
  num_anchors: int = 16       # TTT anchors per row (dflash / parallel: block anchors)
  # Loop.
  checkpoint_every: int = 100
  eval_every: int = 400
  num_eval_rows: int = 64     # held-out rows for the eval loss
  # evaluate: alpha on the pair's held-out prompts, c by timed proposals.
  num_alpha_prompts: int = 64
  gamma: int = 4
  cost_repeats: int = 7


# ----------------------------------------------------------------------------
# Data: the pair's corpus and cut, per family.

def stage_data(s: HeadSettings, pair, workdir: str):
  path = os.path.join(workdir, "data.npz")
  if os.path.exists(path):
    logging.info("data: already built")
    return
  t0 = time.time()
  settings = pair.info["settings"]
  tokenizer = pair.tokenizer
  train_files, heldout_files = data.split_files(data.stdlib_files(),
                                                int(settings["heldout_percent"]))
  rng = np.random.default_rng([s.seed, 31])
  if pair.family == "decoder_only":
    seq_len = int(settings["seq_len"])
    windows = data.lm_windows([f.text for f in train_files], tokenizer, seq_len, data.EOS_ID)
    eval_windows = data.lm_windows([f.text for f in heldout_files], tokenizer, seq_len,
                                   data.EOS_ID)
    eval_windows = eval_windows[rng.permutation(len(eval_windows))[:s.num_eval_rows]]
    arrays = dict(windows=windows, eval_windows=eval_windows)
    summary = dict(train_rows=len(windows), train_tokens=int(windows.size))
  else:
    task = data.CompletionTask(**{k: int(settings[k]) for k in (
        "input_len", "target_len", "context_lines", "target_lines", "stride")})
    train_data = data.completion_examples(train_files, tokenizer, task)
    heldout = data.completion_examples(heldout_files, tokenizer, task)
    order = rng.permutation(len(heldout))[:s.num_eval_rows]
    arrays = dict(inputs=train_data.inputs, targets=train_data.targets,
                  eval_inputs=heldout.inputs[order], eval_targets=heldout.targets[order])
    summary = dict(train_rows=len(train_data), train_tokens=int((train_data.targets > 0).sum()))
  demo_pair_lib.save_npz_atomic(path, **arrays)
  prov = data.corpus_provenance()
  prov.update(train_files=len(train_files), heldout_files=len(heldout_files),
              seconds=time.time() - t0, **summary)
  _update_stats(workdir, "data", prov)
  logging.info("data: %s", prov)


def _load_data(workdir):
  with np.load(os.path.join(workdir, "data.npz")) as f:
    return {k: f[k] for k in f.files}


def _rows(pair, d, which: str, index) -> Dict[str, np.ndarray]:
  """The family's training batch (without features) of rows `index` of split `which`."""
  if pair.family == "decoder_only":
    rows = d["windows" if which == "train" else "eval_windows"][index]
    from specdec_jax.families.decoder_only.batch import lm_batch
    return lm_batch(rows, [rows.shape[1]] * len(rows))
  prefix = "" if which == "train" else "eval_"
  return dict(inputs=d[prefix + "inputs"][index], targets=d[prefix + "targets"][index])


def _num_rows(pair, d, which: str) -> int:
  key = {"decoder_only": "windows", "t5": "inputs"}[pair.family]
  return len(d[key if which == "train" else "eval_" + key])


def _loss_batch(s: HeadSettings, pair, rows, anchor_seed: int, draft=None):
  """The loss's batch: the target's features (and memory), TTT anchors; for the block
  drafters (`draft`: the draft being trained, for its taps and K) what their losses read
  and their anchors."""
  if s.kind in BLOCK_KINDS:
    if s.kind == "dflash":
      batch = dflash_train.dflash_batch(draft, pair.target, rows)
    else:
      batch = pard_train.pard_batch(pair.target, rows)
    batch["anchors"] = dflash_train.block_anchors(batch["weights"], s.num_anchors,
                                                  draft.num_positions, anchor_seed)
    return batch
  batch = feature_train.feature_batch(pair.target, rows)
  if s.kind == "eagle1" and s.ttt_steps > 1:
    batch["anchors"] = feature_train.ttt_anchors(batch["weights"], s.num_anchors, anchor_seed)
  return batch


# ----------------------------------------------------------------------------
# Train.

def _optimizer(s: HeadSettings):
  return train.make_optimizer("adamw", s.learning_rate, schedule=s.schedule,
                              warmup_steps=s.warmup_steps, total_steps=s.steps,
                              weight_decay=s.weight_decay, clip_norm=s.clip_norm)


def _check_kind(s: HeadSettings):
  if s.kind not in KINDS:
    raise ValueError(f"HeadSettings.kind must be one of {KINDS}, got {s.kind!r}")


def _init_model_name(s: HeadSettings, pair) -> str:
  """The pair's model draft a PARD drafter starts from (`parallel_init`, or the first)."""
  from specdec_jax.families.registry import is_model
  models = [n for n, m in pair.drafts.items() if is_model(m)]
  name = s.parallel_init or (models[0] if models else "")
  if name not in models:
    raise ValueError(f"HeadSettings.parallel_init={s.parallel_init!r}: the pair's model drafts "
                     f"are {models}")
  return name


def _draft(s: HeadSettings, pair, head_params=None):
  """The draft being trained, with `head_params` (its trainable arrays, `_trainable`), or
  freshly initialised (a PARD drafter: the pair's model draft as shipped)."""
  import specdec_jax as sj
  if s.kind == "medusa":
    return sj.MedusaDraft(pair.target, num_heads=s.medusa_heads, num_layers=s.medusa_layers,
                          seed=s.seed, params=head_params)
  if s.kind == "dflash":
    return sj.DFlashDraft(pair.target, block_size=s.dflash_block, num_layers=s.dflash_layers,
                          intermediate=s.dflash_intermediate or None,
                          mask_token_id=s.mask_token_id, seed=s.seed, params=head_params)
  if s.kind == "parallel":
    model = pair.drafts[_init_model_name(s, pair)]
    if head_params is not None:
      model = type(model)(model.config, head_params)
    return sj.ParallelDraft(model, mask_token_id=s.mask_token_id, gamma=s.parallel_gamma)
  return sj.FeatureDraft(pair.target, head_params=head_params, seed=s.seed, fc_bias=s.fc_bias)


def _trainable(s: HeadSettings, draft):
  """The draft's arrays that train: a head's own params, a PARD drafter's whole model."""
  return draft.model.params if s.kind == "parallel" else draft.head_params


def _loss_fn(s: HeadSettings, draft):
  if s.kind == "medusa":
    return medusa_train.medusa_loss_fn(draft, s.medusa_decay)
  if s.kind == "dflash":
    return dflash_train.dflash_loss_fn(draft, s.block_decay)
  if s.kind == "parallel":
    return pard_train.pard_loss_fn(draft, s.block_decay)
  return feature_train.feature_loss_fn(draft, s.ce_weight, regression_weight=s.regression_weight,
                                       ttt_steps=s.ttt_steps, ttt_decay=s.ttt_decay)


def _accuracy_by_step(s: HeadSettings, metrics):
  """Held-out argmax agreement: per unrolled step (feature heads), per head (Medusa) or
  per block slot (DFlash, PARD: slot i drafts the i-th token)."""
  if s.kind in ("medusa",) + BLOCK_KINDS:
    return {str(k): v for k, v in medusa_train.per_head_accuracy(metrics).items()}
  return {str(k): v for k, v in feature_train.per_step_accuracy(metrics).items()}


def _files(s: HeadSettings):
  """(npz, json) names of the exported head, and its draft's name in `pair.drafts`."""
  if s.kind == "medusa":
    return demo_pair_lib.MEDUSA_HEAD_FILES + (demo_pair_lib.MEDUSA_DRAFT_NAME,)
  if s.kind == "dflash":
    return demo_pair_lib.DFLASH_FILES + (demo_pair_lib.DFLASH_DRAFT_NAME,)
  if s.kind == "parallel":
    return demo_pair_lib.PARALLEL_FILES + (demo_pair_lib.PARALLEL_DRAFT_NAME,)
  return demo_pair_lib.FEATURE_HEAD_FILES + (demo_pair_lib.FEATURE_DRAFT_NAME,)


def _eval_batches(s: HeadSettings, pair, d, draft=None):
  n = _num_rows(pair, d, "eval")

  def batches():
    for i in range(0, n, s.batch):
      yield _loss_batch(s, pair, _rows(pair, d, "eval", np.arange(i, min(i + s.batch, n))),
                        anchor_seed=10_000_019 + i, draft=draft)
  return batches


def _restore(s: HeadSettings, pair, workdir: str):
  """The TrainState of the latest checkpoint (or the initial one)."""
  draft = _draft(s, pair)
  state = train.create_train_state(_trainable(s, draft), _optimizer(s))
  return draft, train.restore_latest(os.path.join(workdir, "train"), state)


def stage_train(s: HeadSettings, pair, workdir: str):
  d = _load_data(workdir)
  draft = _draft(s, pair)
  optimizer = _optimizer(s)
  state = train.create_train_state(_trainable(s, draft), optimizer)
  num_params = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(_trainable(s, draft)))
  logging.info("%s head: %.3fM params", s.kind, num_params / 1e6)
  n = _num_rows(pair, d, "train")

  def batch_at(step):  # A pure function of the step: resumed runs see the same batches.
    rows = _rows(pair, d, "train", data.batch_indices(n, s.batch, step, s.seed))
    return _loss_batch(s, pair, rows, anchor_seed=s.seed * 1_000_003 + step, draft=draft)

  cfg = train.TrainConfig(num_steps=s.steps, checkpoint_every=s.checkpoint_every,
                          eval_every=s.eval_every, log_every=10)
  stats = read_json(os.path.join(workdir, "stats.json"), {}).get("train", {})
  t0 = time.time()
  start = int(train.restore_latest(os.path.join(workdir, "train"), state).step)
  if start >= s.steps and "heldout" in stats:
    logging.info("train: already at step %d", start)
    return
  state, eval_metrics = train.fit(
      state, batch_at, loss_fn=_loss_fn(s, draft), optimizer=optimizer, cfg=cfg,
      workdir=os.path.join(workdir, "train"), eval_batches=_eval_batches(s, pair, d, draft),
      description=f"{s.kind} head ({pair.family})")
  seconds = stats.get("seconds", 0.0) + time.time() - t0
  first = _first_train_loss(workdir)
  _update_stats(workdir, "train", dict(
      steps=s.steps, batch=s.batch, rows_seen=s.steps * s.batch, seconds=seconds,
      sessions=stats.get("sessions", 0) + 1, head_params=num_params, first_loss=first,
      heldout={k: float(v) for k, v in eval_metrics.items()},
      heldout_accuracy_by_step=_accuracy_by_step(s, eval_metrics)))
  logging.info("train done: %s", eval_metrics)


def _first_train_loss(workdir):
  path = os.path.join(workdir, "train", "metrics.jsonl")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      if row.get("kind") == "train":
        return row["loss"]
  return None


def _update_stats(workdir, key, value):
  path = os.path.join(workdir, "stats.json")
  stats = read_json(path, {})
  stats[key] = value
  write_json(path, stats)


def _trained_draft(s: HeadSettings, pair, workdir: str):
  """The trained head, bf16-rounded as `export` ships it (measured as shipped)."""
  draft, state = _restore(s, pair, workdir)
  if int(state.step) != s.steps:
    raise ValueError(f"train checkpoint is at step {int(state.step)}, expected {s.steps}: run "
                     "the train stage first")
  rounded = jax.tree_util.tree_map(
      lambda x: jnp.asarray(x, jnp.bfloat16).astype(x.dtype), state.params)
  return _draft(s, pair, rounded)


def _gamma(s: HeadSettings) -> int:
  """The evaluate stage's gamma: `gamma`, at most what one call of the draft gives."""
  if s.kind == "medusa":
    return min(s.gamma, s.medusa_heads)
  if s.kind == "dflash":
    return min(s.gamma, s.dflash_block - 1)
  if s.kind == "parallel":
    return min(s.gamma, s.parallel_gamma)
  return s.gamma


# ----------------------------------------------------------------------------
# Evaluate and export.

def stage_evaluate(s: HeadSettings, pair, workdir: str):
  from specdec_jax.drafts import ModelDraft
  from specdec_jax.families.registry import is_model
  from specdec_jax.tools import profiling
  from specdec_jax.train import distill
  t0 = time.time()
  head = _trained_draft(s, pair, workdir)
  _, _, name = _files(s)
  d = _load_data(workdir)
  eval_fn = jax.jit(lambda p, b: train.eval_step(p, b, loss_fn=_loss_fn(s, head)))
  heldout = train.evaluate(_trainable(s, head), _eval_batches(s, pair, d, head)(), eval_fn)
  if s.kind in BLOCK_KINDS:
    # Beside the pair's model drafts and its feature and Medusa heads (not another block
    # drafter: what this stage measures must not depend on the order runs export in).
    drafts = {n: ModelDraft(m) if is_model(m) else m for n, m in pair.drafts.items()
              if n not in _block_names()}
  else:
    drafts = {n: ModelDraft(m) for n, m in pair.drafts.items() if not _is_head(n)}
  drafts[name] = head
  gamma = _gamma(s)
  inputs, lengths = pair.inputs(s.num_alpha_prompts)
  alpha, per_position = {}, {}
  for n, draft in drafts.items():
    if s.kind in BLOCK_KINDS:
      measured = {str(t): _alpha_and_positions(pair, draft, inputs, lengths, gamma, t, s.seed)
                  for t in (0.0, 1.0)}
      alpha[n] = {t: m.pop("alpha") for t, m in measured.items()}
      per_position[n] = measured
    else:
      alpha[n] = {str(t): distill.measure_alpha(
          pair.target, draft, inputs, lengths, max_decode_steps=pair.max_decode_steps,
          temperature=t, gamma=gamma, seed=s.seed) for t in (0.0, 1.0)}
    logging.info("alpha %s: %s %s", n, alpha[n], per_position.get(n, ""))
  if s.kind == "medusa":
    per_position = {str(t): _per_position(pair, head, inputs, lengths, gamma, t, s.seed)
                    for t in (0.0, 1.0)}
    logging.info("medusa per head: %s", per_position)
  first = None if lengths is None else lengths[:1]
  target_ms = profiling.time_block_calls({"target": pair.target}, inputs[:1],
                                         pair.max_decode_steps, [1], s.cost_repeats,
                                         lengths=first)["target"][1]
  proposal_ms = profiling.time_proposals(pair.target, drafts, inputs[:1], pair.max_decode_steps,
                                         gamma, s.cost_repeats, lengths=first)
  c = {n: ms / gamma / target_ms for n, ms in proposal_ms.items()}
  _update_stats(workdir, "evaluate", dict(
      heldout=heldout, heldout_accuracy_by_step=_accuracy_by_step(s, heldout),
      alpha=alpha, per_position=per_position, alpha_prompts=len(inputs), gamma=gamma,
      max_decode_steps=pair.max_decode_steps, target_step_ms=target_ms,
      proposal_ms=proposal_ms, c=c, load_average=list(os.getloadavg()),
      seconds=time.time() - t0))
  logging.info("evaluate: alpha %s, c %s", alpha, c)


def _alpha_and_positions(pair, draft, inputs, lengths, gamma: int, temperature: float,
                         seed: int, batch_size: int = 32):
  """From one set of decodes: alpha pooled over the prompts (`distill.measure_alpha`'s
  chunks and keys, so the same number), per drafted position i the rate at which its
  token was accepted when the verification reached it, and the tokens per iteration."""
  import specdec_jax as sj
  beta_sum = beta_count = emitted = iterations = 0.0
  accepted = drafted = np.zeros(gamma)
  inputs = np.asarray(inputs, np.int32)
  for b, start in enumerate(range(0, len(inputs), batch_size)):
    stop = min(start + batch_size, len(inputs))
    out = sj.generate(pair.target, inputs[start:stop],
                      None if lengths is None else np.asarray(lengths[start:stop], np.int32),
                      max_decode_steps=pair.max_decode_steps, temperature=temperature,
                      draft=draft, gamma=gamma,
                      rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    st = out.stats
    beta_sum += float(st.beta_sum.sum())
    beta_count += float(st.beta_count.sum())
    accepted = accepted + np.asarray(st.position_accepted).sum(0)
    drafted = drafted + np.asarray(st.position_drafted).sum(0)
    emitted += float(np.asarray(st.emitted).sum())
    iterations += float(np.asarray(st.iterations).sum())
  reached = np.concatenate([drafted[:1], accepted[:-1]])
  return dict(alpha=beta_sum / max(beta_count, 1.0),
              acceptance=(accepted / np.maximum(reached, 1)).tolist(),
              tokens_per_iteration=emitted / max(iterations, 1.0))


def _per_position(pair, draft, inputs, lengths, gamma: int, temperature: float, seed: int):
  """Per drafted position i (Medusa: head i): the rate at which its token was accepted
  when reached, and the tokens per iteration, pooled over the prompts."""
  import specdec_jax as sj
  accepted = drafted = np.zeros(gamma)
  emitted = iterations = 0.0
  for start in range(0, len(inputs), 32):
    stop = min(start + 32, len(inputs))
    out = sj.generate(pair.target, inputs[start:stop],
                      None if lengths is None else lengths[start:stop],
                      max_decode_steps=pair.max_decode_steps, temperature=temperature,
                      draft=draft, gamma=gamma,
                      rng=jax.random.fold_in(jax.random.PRNGKey(seed), start))
    st = out.stats
    accepted = accepted + np.asarray(st.position_accepted).sum(0)
    drafted = drafted + np.asarray(st.position_drafted).sum(0)
    emitted += float(np.asarray(st.emitted).sum())
    iterations += float(np.asarray(st.iterations).sum())
  # Position i is reached when positions < i were all accepted (position 0: drafted).
  reached = np.concatenate([drafted[:1], accepted[:-1]])
  return dict(acceptance=(accepted / np.maximum(reached, 1)).tolist(),
              tokens_per_iteration=emitted / max(iterations, 1.0))


def _is_head(name: str) -> bool:
  """A shipped trained head (not a model draft) in `pair.drafts`."""
  return name in (demo_pair_lib.FEATURE_DRAFT_NAME, demo_pair_lib.MEDUSA_DRAFT_NAME) + \
      _block_names()


def _block_names():
  """The names the pair lists its block drafters under (DFlash, PARD)."""
  return (demo_pair_lib.DFLASH_DRAFT_NAME, demo_pair_lib.PARALLEL_DRAFT_NAME)


def _jsonable(x):
  """Tuples as lists (json), recursively."""
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def stage_export(s: HeadSettings, pair, workdir: str, out_dir: str, command: str):
  head = _trained_draft(s, pair, workdir)
  npz, meta, _ = _files(s)
  os.makedirs(out_dir, exist_ok=True)
  size = demo_pair_lib.save_weights_bf16(os.path.join(out_dir, npz), _trainable(s, head))
  stats = read_json(os.path.join(workdir, "stats.json"), {})
  info = dict(kind=s.kind, settings=dataclasses.asdict(s), stats=stats, command=command,
              params=stats.get("train", {}).get("head_params"), bytes=size)
  if s.kind == "dflash":
    # Every DFlashConfig field: `demo_pair.load_dflash_drafter` rebuilds it exactly.
    info.update(config=_jsonable(dataclasses.asdict(head.config)),
                mask_token_id=head.config.mask_token_id, block_size=head.config.block_size)
    section, mark = dflash_card_section(pair, info), demo_pair_lib.DFLASH_CARD_MARK
  elif s.kind == "parallel":
    info.update(config=_jsonable(dataclasses.asdict(head.model.config)),
                mask_token_id=head.mask_token_id, gamma=head.gamma,
                init=_init_model_name(s, pair))
    section, mark = parallel_card_section(pair, info), demo_pair_lib.PARALLEL_CARD_MARK
  elif s.kind == "medusa":
    info.update(num_heads=s.medusa_heads, num_layers=s.medusa_layers, share_lm_head=False)
    section, mark = medusa_card_section(pair, info), demo_pair_lib.MEDUSA_CARD_MARK
  else:
    info.update(fc_bias=s.fc_bias, feature_layers=None)
    section, mark = model_card_section(pair, info), demo_pair_lib.FEATURE_CARD_MARK
  write_json(os.path.join(out_dir, meta), info)
  card_path = os.path.join(out_dir, "MODEL_CARD.md")
  card = open(card_path).read() if os.path.exists(card_path) else ""
  data.write_bytes_atomic(card_path, demo_pair_lib.with_card_section(card, mark,
                                                                     section).encode())
  logging.info("export: %s (%d bytes)", os.path.join(out_dir, npz), size)


def _alpha_table(ev: Dict[str, Any]):
  """A model card's lines: the evaluate stage's alpha and c of each draft, as a table."""
  lines = ["", f"Acceptance and cost against the pair's model drafts ({ev['alpha_prompts']} "
           f"held-out prompts, {ev['max_decode_steps']} new tokens, gamma {ev['gamma']}, "
           "pooled alpha; c = one whole gamma-token proposal / gamma / one target step, "
           "`profiling.time_proposals`, float32, batch 1, on a shared, loaded CPU):", "",
           "| draft | alpha temp 0 | alpha temp 1 | c |", "|---|---|---|---|"]
  for name, a in ev["alpha"].items():
    lines.append(f"| {name} | {a['0.0']:.2f} | {a['1.0']:.2f} | {ev['c'][name]:.3f} |")
  return lines


def medusa_card_section(pair, info: Dict[str, Any]) -> str:
  """The model card's "Medusa heads" section from medusa_heads.json's contents."""
  st, stats = info["settings"], info["stats"]
  tr, ev, prov = stats.get("train", {}), stats.get("evaluate", {}), stats.get("data", {})
  cfg = pair.target.config
  k, layers = info["num_heads"], info["num_layers"]
  lines = [
      "## Medusa heads (issue 29)", "",
      "`medusa_heads.npz` (bf16 bit patterns, `medusa_heads.json`: settings and stats): "
      f"{k} Medusa-1 heads on the target's last hidden state, listed by "
      "`specdec_jax.load_demo_pair()` as `drafts['medusa']` (an `sj.MedusaDraft`); every "
      "token of a proposal comes from one call, verified exactly.", "",
      f"- Architecture: per head, {layers} residual block(s) x + SiLU(W x + b) "
      f"({cfg.emb_dim} wide), then its own LM head ({cfg.emb_dim} -> {cfg.vocab_size}). "
      f"{info.get('params', 0) / 1e6:.2f}M params ({info.get('bytes', 0) / 1e3:.0f} kB on disk).",
      f"- Data: the pair's corpus and split, training files only ({prov.get('train_files')} "
      f"files); the target frozen, its features computed on the fly.",
      "- Loss (`specdec_jax.train.medusa.medusa_loss_fn`): head k at position t, cross-entropy "
      "against the target's own law of token t+1+k (self-distillation), weighted "
      f"{st['medusa_decay']:g}^(k-1).",
      f"- Training: `{info.get('command')}`; AdamW lr {st['learning_rate']:g} ({st['schedule']}, "
      f"warmup {st['warmup_steps']}, clip {st['clip_norm']:g}), {tr.get('steps')} steps x "
      f"{tr.get('batch')} rows, {tr.get('seconds', 0) / 60:.1f} min wall-clock on a 2-core CPU.",
  ]
  acc = tr.get("heldout_accuracy_by_step", {})
  if acc:
    lines.append("- Held-out agreement of head k's argmax with the target's argmax at its "
                 "position: " + " / ".join(f"head {i} {acc[i]:.2f}"
                                           for i in sorted(acc, key=int)) + ".")
  if ev:
    lines += _alpha_table(ev)
    per = ev.get("per_position", {})
    if per:
      lines += ["", "Per head (the rate at which head k's token is accepted when the "
                "verification reaches it) and tokens per iteration:", "",
                "| temp | " + " | ".join(f"head {i + 1}" for i in range(ev["gamma"]))
                + " | tokens/iter |", "|---" * (ev["gamma"] + 2) + "|"]
      for t, row in per.items():
        lines.append(f"| {t} | " + " | ".join(f"{a:.2f}" for a in row["acceptance"])
                     + f" | {row['tokens_per_iteration']:.2f} |")
  lines += ["", "Speedups: BENCHMARKS.md, \"Issue 29: Medusa heads\"."]
  return "\n".join(lines) + "\n"


def _positions_table(ev: Dict[str, Any]):
  """A model card's lines: alpha per drafted position and tokens per iteration of every
  draft the evaluate stage compared (block kinds' per_position: {draft: {temp: ...}})."""
  per, gamma = ev.get("per_position", {}), ev["gamma"]
  if not per:
    return []
  lines = ["", "Per drafted position i: the rate at which position i's token is accepted when "
           "the verification reaches it (positions < i all accepted); tau: tokens per "
           "iteration (accepted drafts plus the target's own token):", "",
           "| draft | temp | " + " | ".join(f"pos {i + 1}" for i in range(gamma))
           + " | tau |", "|---" * (gamma + 3) + "|"]
  for name, by_temp in per.items():
    for t, row in by_temp.items():
      lines.append(f"| {name} | {t} | " + " | ".join(f"{a:.2f}" for a in row["acceptance"])
                   + f" | {row['tokens_per_iteration']:.2f} |")
  return lines


def _slot_accuracy_line(tr: Dict[str, Any]):
  acc = tr.get("heldout_accuracy_by_step", {})
  if not acc:
    return []
  return ["- Held-out agreement of slot i's argmax with the target's argmax at its position "
          "(teacher-forced anchors): " + " / ".join(f"slot {i} {acc[i]:.2f}"
                                                    for i in sorted(acc, key=int)) + "."]


def _block_training_line(info: Dict[str, Any], tr: Dict[str, Any], st: Dict[str, Any]) -> str:
  return (f"- Training: `{info.get('command')}`; AdamW lr {st['learning_rate']:g} "
          f"({st['schedule']}, warmup {st['warmup_steps']}, clip {st['clip_norm']:g}), "
          f"{tr.get('steps')} steps x {tr.get('batch')} rows x {st['num_anchors']} anchors, "
          f"{tr.get('seconds', 0) / 60:.1f} min wall-clock on a shared 2-core CPU.")


def _rows_line(pair, prov: Dict[str, Any], computed: str = "its features") -> str:
  if pair.family == "decoder_only":
    rows = f"{prov.get('train_rows')} windows of {pair.info['settings']['seq_len']} tokens"
  else:
    rows = f"{prov.get('train_rows')} code-completion examples"
  return (f"- Data: the pair's corpus and split, training files only ({prov.get('train_files')} "
          f"files, {rows}); the target frozen, {computed} computed on the fly.")


def dflash_card_section(pair, info: Dict[str, Any]) -> str:
  """The model card's "DFlash drafter" section from dflash.json's contents."""
  st, stats = info["settings"], info["stats"]
  tr, ev, prov = stats.get("train", {}), stats.get("evaluate", {}), stats.get("data", {})
  c = info["config"]
  k = c["block_size"] - 1
  cross = (" self-attention over [context cache; block] (non-causal), cross-attention to "
           "the target's encoder outputs," if c["cross_attention"] else
           " self-attention over [context cache; block] (non-causal),")
  lines = [
      "## DFlash drafter (issue 32)", "",
      "`dflash.npz` (bf16 bit patterns, `dflash.json`: its DFlashConfig, settings and stats): "
      "a DFlash-style block drafter over the target's features, listed by "
      "`specdec_jax.load_demo_pair()` as `drafts['dflash']` (an `sj.DFlashDraft`); one call "
      f"fills [last token, {k} x mask] with the laws of the next {k} tokens, verified "
      "exactly.", "",
      f"- Architecture: the context c_t = RMSNorm(fc(target features at hidden states "
      f"{tuple(c['taps'])})) gives every layer's keys and values at accepted positions; "
      f"{c['num_layers']} Qwen3-style layer(s) ({c['num_heads']} heads x {c['head_dim']}, "
      f"q/k RMSNorm, rotary positions,{cross} SwiGLU MLP {c['intermediate']}) over the block "
      f"embedded with the target's own table; logits from the target's own output "
      f"projection (referenced, not copied). Mask token id {c['mask_token_id']} (the "
      "tokenizer's unk, absent from the corpus). "
      f"{info.get('params', 0) / 1e6:.2f}M params of its own "
      f"({info.get('bytes', 0) / 1e3:.0f} kB on disk).",
      _rows_line(pair, prov),
      "- Loss (`specdec_jax.train.dflash.dflash_loss_fn`): at anchors t drawn per row, the "
      "block [x_t, mask x K] at positions t..t+K over the context of the target's features "
      "at positions < t (computed once per row, shared by its anchors); slot i learns the "
      "target's own teacher-forced law of token t+i (soft cross-entropy, self-distillation), "
      f"weighted {st['block_decay']:g}^(i-1). The training call is the decoding call "
      "(`DFlashDraft.block_hidden` / `logits`).",
      _block_training_line(info, tr, st),
  ] + _slot_accuracy_line(tr)
  if ev:
    lines += _alpha_table(ev) + _positions_table(ev)
  return "\n".join(lines) + "\n"


def parallel_card_section(pair, info: Dict[str, Any]) -> str:
  """The model card's "PARD drafter" section from parallel.json's contents."""
  st, stats = info["settings"], info["stats"]
  tr, ev, prov = stats.get("train", {}), stats.get("evaluate", {}), stats.get("data", {})
  k = info["gamma"]
  lines = [
      "## PARD drafter (issue 32)", "",
      "`parallel.npz` (bf16 bit patterns, `parallel.json`: the drafter's config, mask id, K, "
      "settings and stats): a PARD-style parallel drafter, listed by "
      "`specdec_jax.load_demo_pair()` as `drafts['parallel']` (an `sj.ParallelDraft`); one "
      f"call over [context, {k - 1} x mask] gives the laws of the next {k} tokens, verified "
      "exactly.", "",
      f"- Architecture: the pair's '{info['init']}' model draft (same shape, "
      f"{info.get('params', 0) / 1e6:.2f}M params, {info.get('bytes', 0) / 1e3:.0f} kB on "
      f"disk), trained further from its shipped weights. Mask token id "
      f"{info['mask_token_id']} (the tokenizer's unk, absent from the corpus).",
      _rows_line(pair, prov, "its teacher-forced laws"),
      "- Loss (`specdec_jax.train.pard.pard_loss_fn`, the PARD objective distilled from the "
      f"target): at anchors t drawn per row, the drafter runs on [x_0..x_t, mask x {k - 1}]"
      " (T5: the decoder's inputs so built, the encoder as is); its logits at slots t..t+K-1 "
      "learn the target's teacher-forced laws of tokens t+1..t+K (soft cross-entropy), slot "
      f"i weighted {st['block_decay']:g}^(i-1). The drafter's whole model trains. The logits "
      "are `ParallelDraft.block_laws`' (`train.pard.pard_block_logits`: decoder-only, the "
      "decode-time program, the row's cache built once and one block per anchor; T5, whose "
      "fused decode softmax has no derivative, each anchor's teacher-forced row).",
      _block_training_line(info, tr, st),
  ] + _slot_accuracy_line(tr)
  if ev:
    lines += _alpha_table(ev) + _positions_table(ev)
  return "\n".join(lines) + "\n"


def model_card_section(pair, info: Dict[str, Any]) -> str:
  """The model card's "Feature head" section from feature_head.json's contents."""
  st, stats = info["settings"], info["stats"]
  tr, ev, prov = stats.get("train", {}), stats.get("evaluate", {}), stats.get("data", {})
  cfg = pair.target.config
  if pair.family == "decoder_only":
    layer = (f"one GPT-2 block of the target's shape (emb {cfg.emb_dim}, {cfg.num_heads} heads x "
             f"{cfg.head_dim}, MLP {cfg.mlp_dim}) without its input LayerNorm; the target's "
             "learned positions added after fc; its attention hides the zero first pair from "
             "later queries, as EAGLE's pairing has none (trained and drafting alike, "
             "`families.feature_head.pair_visible`)")
    rows = f"{prov.get('train_rows')} windows of {pair.info['settings']['seq_len']} tokens"
  else:
    layer = (f"one T5 decoder layer of the target's shape (emb {cfg.emb_dim}, {cfg.num_heads} "
             f"heads x {cfg.head_dim}, MLP {cfg.mlp_dim}) cross-attending to the target's "
             "encoder outputs")
    rows = f"{prov.get('train_rows')} code-completion examples"
  h = tr.get("heldout", {})
  acc = tr.get("heldout_accuracy_by_step", {})
  lines = [
      "## Feature head (EAGLE-style draft, issue 23)", "",
      "`feature_head.npz` (bf16 bit patterns, `feature_head.json`: settings and stats): a "
      "feature draft over the target's own last hidden states, listed by "
      "`specdec_jax.load_demo_pair()` as `drafts['feature']` (an `sj.FeatureDraft`).", "",
      f"- Architecture: fc Linear(2 x {cfg.emb_dim} -> {cfg.emb_dim}) over [embedding(token_t); "
      f"feature_(t-1)], then {layer}; logits from the target's own output projection "
      f"(referenced, not copied). {info.get('params', 0) / 1e6:.2f}M params of its own "
      f"({info.get('bytes', 0) / 1e3:.0f} kB on disk).",
      f"- Data: the pair's corpus and split, training files only ({prov.get('train_files')} "
      f"files, {rows}); the target frozen, its features computed on the fly.",
      f"- Loss (`specdec_jax.train.feature_heads.feature_loss_fn`): SmoothL1 feature regression "
      f"(weight {st['regression_weight']:g}) + {st['ce_weight']:g} x cross-entropy against the "
      f"target's distribution, with EAGLE-3's training-time test: {st['ttt_steps']} steps "
      f"unrolled on the head's own features from {st['num_anchors']} anchors per row, step i "
      f"weighted {st['ttt_decay']:g}^i.",
      f"- Training: `{info.get('command')}`; AdamW lr {st['learning_rate']:g} ({st['schedule']}, "
      f"warmup {st['warmup_steps']}, clip {st['clip_norm']:g}), {tr.get('steps')} steps x "
      f"{tr.get('batch')} rows, {tr.get('seconds', 0) / 60:.1f} min wall-clock on a shared "
      "2-core CPU.",
  ]
  if h:
    first = tr.get("first_loss")
    lines.append(
        f"- Held-out loss per token {h.get('loss', float('nan')):.3f}"
        + (f" (training loss at step 10: {first:.3f})" if first is not None else "")
        + f"; regression {h.get('regression', float('nan')):.3f}, cross-entropy "
        f"{h.get('cross_entropy', float('nan')):.3f} (nats, the target's own entropy included); "
        "agreement of the head's argmax with the "
        "target's at unrolled step 0/1/2 (step 0 teacher-forced, later steps on the head's own "
        "features): "
        + " / ".join(f"{acc[k]:.2f}" for k in sorted(acc, key=int)) + ".")
  if ev:
    lines += _alpha_table(ev)
  lines += ["", "Speedups: BENCHMARKS.md, \"Issue 23: feature heads\"."]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  gin_flags.parse_flags()
  s = HeadSettings()
  _check_kind(s)
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  selected = selected_stages(STAGES)
  check_stages(STAGES, selected)
  workdir = FLAGS.workdir
  os.makedirs(workdir, exist_ok=True)
  recorded = read_json(os.path.join(workdir, "settings.json"))
  current = dict(pair=FLAGS.target_pair, **dataclasses.asdict(s))
  if recorded is not None:
    # Fields added since the run was made read as their defaults (older runs resume).
    defaults = {f.name: f.default for f in dataclasses.fields(HeadSettings)}
    recorded = dict({k: v for k, v in defaults.items() if k not in recorded}, **recorded)
  if recorded is not None and recorded != current:
    raise ValueError(f"{workdir} was made with other settings ({recorded}); use a new --workdir "
                     "to change them")
  write_json(os.path.join(workdir, "settings.json"), current)
  # The block drafters' evaluation compares the pair's trained heads too.
  pair = demo_pair_lib.load_demo_pair(FLAGS.target_pair,
                                      with_feature_head=s.kind in BLOCK_KINDS)
  out_dir = FLAGS.out_dir or demo_pair_lib.DIRS[FLAGS.target_pair]
  command = " ".join([f"python -m experiments.train_feature_heads --target_pair={FLAGS.target_pair}",
                      "--workdir=WORKDIR"] + [f"--gin_file={f}" for f in gin_flags.GIN_FILES.value]
                     + [f"--gin_bindings='{b}'" for b in gin_flags.GIN_BINDINGS.value])
  stages = dict(data=lambda: stage_data(s, pair, workdir),
                train=lambda: stage_train(s, pair, workdir),
                evaluate=lambda: stage_evaluate(s, pair, workdir),
                export=lambda: stage_export(s, pair, workdir, out_dir, command))
  run_stages(stages, selected)


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  app.run(main, argv=gin_flags.rewrite_gin_args(sys.argv))
