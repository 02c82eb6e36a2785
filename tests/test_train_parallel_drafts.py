"""Training the one-call drafters (issue 32): `train.dflash` (DFlash) and `train.pard` (PARD).

* The losses decrease on tiny models in a few steps.
* Training computes the decoding function: the DFlash loss at an anchor t equals the
  soft cross-entropy of `DFlashDraft.block_laws` after `init_state` / `observe` of the
  target's features at positions < t; the PARD loss's logits (both methods: the cached
  block, the teacher-forced forward) equal `ParallelDraft.block_laws`' for the same
  context, both families.
* The shipped demo pairs' trained drafters (`drafts['dflash']`, `drafts['parallel']`)
  load and decode exactly (greedy equal to target-only) on held-out inputs.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specdec_jax as sj
from specdec_jax.families.decoder_only.batch import lm_batch
from specdec_jax.train import dflash as dflash_train
from specdec_jax.train import pard as pard_train
from specdec_jax.train import trainer as train
from specdec_jax.train.feature_heads import soft_cross_entropy

NAMES = {"t5": "tiny", "decoder_only": "llama_tiny"}
VOCAB, K, T = 24, 3, 12
MASK = VOCAB - 1


def _target(family, seed=3):
  return sj.load_model(NAMES[family], vocab_size=VOCAB, seed=seed, dtype="float32")


def _rows(family, batch=2, seed=0):
  """A family training batch: T5 {'inputs', 'targets'} (row 1's encoder input padded),
  decoder-only `lm_batch` rows of T tokens."""
  rng = np.random.default_rng(seed)
  if family == "t5":
    inputs = rng.integers(2, MASK, (batch, 7)).astype(np.int32)
    inputs[1, 5:] = 0
    return dict(inputs=inputs, targets=rng.integers(2, MASK, (batch, T)).astype(np.int32))
  return lm_batch(rng.integers(2, MASK, (batch, T)).astype(np.int32), [T] * batch)


def _anchors(family):
  """[2, 3] anchors, t + K - 1 < T; T5's row 1 starts at 0 (an empty context: the decode's
  first block), decoder-only rows learn from position 1 (lm_batch's weights)."""
  return jnp.asarray([[1, 4, 9], [0 if family == "t5" else 2, 5, 7]], jnp.int32)


def _cases(family, rows, batch, anchors):
  """Every (row b, anchor t) as one decode row whose last accepted token is the one at t:
  (context, sequences, lengths, rows b): decoder-only, the prefix x_0..x_t as the prompt
  (right-padded) and the loop sequence from x_t; T5, the row's encoder input and its
  decoder inputs with the last token at t."""
  tokens = np.asarray(batch["tokens"])
  b_of = np.repeat(np.arange(anchors.shape[0]), anchors.shape[1])
  t_of = np.asarray(anchors).reshape(-1)
  if family == "t5":
    inputs = rows["inputs"][b_of]
    context = sj.Context(jnp.asarray(inputs), jnp.asarray(np.sum(inputs != 0, 1), jnp.int32),
                         continued=False)
    return context, jnp.asarray(tokens[b_of]), jnp.asarray(t_of, jnp.int32), b_of
  prompts = np.where(np.arange(T)[None] <= t_of[:, None], tokens[b_of], 0).astype(np.int32)
  sequences = np.stack([np.pad(tokens[b, t:], (0, t)) for b, t in zip(b_of, t_of)])
  context = sj.Context(jnp.asarray(prompts), jnp.asarray(t_of + 1, jnp.int32), continued=True)
  return context, jnp.asarray(sequences), jnp.zeros(len(b_of), jnp.int32), b_of


@pytest.mark.parametrize("family", ["decoder_only", "t5"])
def test_dflash_loss_is_block_laws_after_observe(family):
  """Each anchor's logits and its loss term equal what the decode computes: `init_state`
  (decoder-only: the prefix x_0..x_t as the prompt with its features; T5: the encoder
  memory), `observe` of the target's features at positions < t (T5), `block_laws`."""
  target = _target(family)
  draft = sj.DFlashDraft(target, block_size=K + 1, num_layers=2, seed=4, mask_token_id=MASK)
  rows = _rows(family)
  anchors = _anchors(family)
  batch = dflash_train.dflash_batch(draft, target, rows)
  batch["anchors"] = anchors
  got = jax.jit(lambda p, b: dflash_train.dflash_block_logits(draft, p, b, anchors))(
      draft.params, batch)
  loss, aux = jax.jit(dflash_train.dflash_loss_fn(draft, decay=0.5))(draft.head_params, batch)
  context, sequences, lengths, b_of = _cases(family, rows, batch, anchors)
  t_of = np.asarray(anchors).reshape(-1)

  @jax.jit
  def decode_laws(params, context, sequences, lengths):
    features = batch["features"][b_of]
    if family == "t5":
      memory = jax.tree_util.tree_map(lambda x: x[b_of], batch["memory"])
      state = draft.init_state(params, sj.DraftStart(context, 30, K, None, memory))
      # Every position observed, the context advanced to t: later features stay unseen.
      state = draft.observer(params)(state, features, None, jnp.asarray(t_of))
    else:
      state = draft.init_state(params, sj.DraftStart(context, 30, K, features, None))
    return draft.block_laws(params, state, sequences, lengths, K, K + 1)[0]

  laws = decode_laws(draft.params, context, sequences, lengths)
  np.testing.assert_allclose(np.asarray(got).reshape(laws.shape), np.asarray(laws),
                             rtol=2e-5, atol=2e-5)
  # The loss: slot i + 1 against the target's law of token t + i + 1, weighted 0.5**i.
  teacher = _target_logits(target, rows)
  want = sum(0.5 ** i * float(soft_cross_entropy(teacher[b, t + i], laws[n, i]))
             for n, (b, t) in enumerate(zip(b_of, t_of)) for i in range(K))
  assert float(aux["tokens"]) == anchors.size
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)


def _target_logits(target, rows):
  """The target's teacher-forced logits [batch, T, vocab]: at j, the law of the token after
  decoder input j (T5: targets[j]; decoder-only: tokens[j + 1])."""
  if "targets" in rows:
    from specdec_jax.families.registry import family_of
    logits, _, _ = family_of(target).token_logits(target.config, target.params,
                                                  {k: jnp.asarray(v) for k, v in rows.items()})
    return logits
  return target.logits(jnp.asarray(rows["tokens"]))


@pytest.mark.parametrize("family", ["decoder_only", "t5"])
def test_pard_logits_are_block_laws(family):
  """Both ways of computing the PARD loss's logits (a cached block per anchor; each
  anchor's teacher-forced row) equal `ParallelDraft.block_laws` after `init_state` on
  the same context."""
  target = _target(family)
  draft = sj.ParallelDraft(_target(family, seed=7), mask_token_id=MASK, gamma=K)
  rows = _rows(family)
  anchors = _anchors(family)
  batch = pard_train.pard_batch(target, rows)
  context, sequences, lengths, _ = _cases(family, rows, batch, anchors)
  # T5's drafter starts from its start token alone: one call reads the whole prefix.
  window = T + 1 if family == "t5" else K + 1

  @jax.jit
  def decode_laws(params, context, sequences, lengths):
    state = draft.init_state(params, sj.DraftStart(context, 30 + draft.room(window), K))
    return draft.block_laws(params, state, sequences, lengths, K, window)[0]

  laws = np.asarray(decode_laws(draft.params, context, sequences, lengths))
  for method in ("forward", "cache"):
    got = jax.jit(lambda p, b, method=method: pard_train.pard_block_logits(
        draft, p, b, anchors, method))(draft.params, batch)
    np.testing.assert_allclose(np.asarray(got).reshape(laws.shape), laws, rtol=2e-5,
                               atol=2e-5, err_msg=method)
  # The loss's teacher is the target's logits of the token after each position.
  np.testing.assert_allclose(np.asarray(batch["teacher_logits"]),
                             np.asarray(_target_logits(target, rows)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind,family", [("dflash", "decoder_only"), ("dflash", "t5"),
                                         ("parallel", "decoder_only"), ("parallel", "t5")])
def test_losses_decrease_in_a_few_steps(kind, family):
  target = _target(family)
  rows = _rows(family, batch=4, seed=1)
  if kind == "dflash":
    draft = sj.DFlashDraft(target, block_size=K + 1, seed=4, mask_token_id=MASK)
    batch = dflash_train.dflash_batch(draft, target, rows)
    loss_fn, params = dflash_train.dflash_loss_fn(draft), draft.head_params
  else:
    draft = sj.ParallelDraft(_target(family, seed=7), mask_token_id=MASK, gamma=K)
    batch = pard_train.pard_batch(target, rows)
    loss_fn, params = pard_train.pard_loss_fn(draft), draft.params
  batch["anchors"] = dflash_train.block_anchors(batch["weights"], 4, K, seed=0)
  # The loss per anchor less its floor, the teacher's entropy (a tiny random target's laws
  # are nearly uniform): what training can lower.
  teacher, valid = dflash_train.teacher_slots(_target_logits(target, rows),
                                              jnp.asarray(batch["weights"]),
                                              jnp.asarray(batch["anchors"]), K)
  entropy = soft_cross_entropy(teacher, teacher) * 0.8 ** jnp.arange(K)
  floor = float(jnp.sum(valid * entropy) / jnp.sum(valid[..., 0]))
  optimizer = optax.adam(1e-2)
  state = train.create_train_state(params, optimizer)
  step = jax.jit(lambda s, b: train.train_step(s, b, loss_fn=loss_fn, optimizer=optimizer))
  losses = []
  for _ in range(8):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]) - floor)
  assert losses[-1] < 0.7 * losses[0], losses
  assert set(metrics) >= {"accuracy", "correct_2", "positions_3", "cross_entropy_1"}


def test_block_anchors():
  weights = np.ones((3, 10), np.float32)
  weights[:, 0] = 0
  weights[1, 6:] = 0
  weights[2] = 0
  anchors = dflash_train.block_anchors(weights, 4, 3, seed=5)
  assert anchors.shape == (3, 4) and anchors.dtype == np.int32
  assert len(set(anchors[0])) == 4 and anchors[0].min() >= 1 and anchors[0].max() <= 7
  assert set(anchors[1]) <= {1, 2, 3, 4, 5} and np.all(anchors[2] == 0)
  np.testing.assert_array_equal(anchors, dflash_train.block_anchors(weights, 4, 3, seed=5))
  # Row 2 has no anchor: its blocks weigh nothing.
  _, valid = dflash_train.teacher_slots(jnp.zeros((3, 10, 2)), jnp.asarray(weights),
                                        jnp.asarray(anchors), 3)
  assert float(valid[2].sum()) == 0 and float(valid[0].sum()) == 12


@pytest.mark.parametrize("family", ["decoder_only", "t5"])
@pytest.mark.parametrize("name", ["dflash", "parallel"])
def test_shipped_block_drafters_decode_exactly(family, name):
  """Each pair's trained DFlash and PARD drafters load as drafts['dflash'] (an
  `sj.DFlashDraft`) and drafts['parallel'] (an `sj.ParallelDraft`), listed after the model
  drafts, and decode greedy exactly as the target alone on held-out inputs, accepted far
  above a random drafter."""
  from specdec_jax import demo_pair
  files, kind = {"dflash": (demo_pair.DFLASH_FILES, sj.DFlashDraft),
                 "parallel": (demo_pair.PARALLEL_FILES, sj.ParallelDraft)}[name]
  if not os.path.exists(os.path.join(demo_pair.DIRS[family], files[0])):
    pytest.skip(f"the {family} pair ships no {name} drafter")
  pair = sj.load_demo_pair(family)
  draft = pair.drafts[name]
  names = list(pair.drafts)
  heads = [n for n in names if not isinstance(pair.drafts[n], type(pair.target))]
  assert isinstance(draft, kind) and name in heads and names[-len(heads):] == heads
  assert draft.num_positions == 4
  tokens, lengths = pair.inputs(2)
  kwargs = dict(max_decode_steps=pair.max_decode_steps)
  want = sj.generate(pair.target, tokens, lengths, **kwargs)
  got = sj.generate(pair.target, tokens, lengths, draft=draft, gamma=4, **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.alpha > 0.3, got.stats.summary()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "parallel"])
def test_training_stages_run_resume_and_export(tmp_path, kind):
  """experiments.train_feature_heads' train / evaluate / export stages for the block
  drafters on a tiny GPT-2 "pair": a finished train stage reruns as a no-op, evaluate
  measures alpha per position and tokens per iteration of every draft, the export loads
  back (the bf16-rounded arrays, the config, mask id and K) and writes its card section."""
  import json
  from experiments import train_feature_heads as heads
  from specdec_jax import demo_pair
  target = sj.load_model("gpt2_tiny", vocab_size=32, seed=0, dtype="float32")
  small = sj.load_model("gpt2_tiny", vocab_size=32, seed=1, dtype="float32", num_layers=1)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, 32, (2, 6)).astype(np.int32)
  heldout = [dict(path="x.py", input_ids=p.tolist(), target_ids=[3] * 4) for p in prompts]
  pair = demo_pair.DemoPair("decoder_only", None, target, {"draft": small}, {}, heldout, 6, 4,
                            dict(settings=dict(seq_len=12)))
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  demo_pair.save_npz_atomic(os.path.join(workdir, "data.npz"),
                            windows=rng.integers(3, 32, (20, 12)).astype(np.int32),
                            eval_windows=rng.integers(3, 32, (4, 12)).astype(np.int32))
  s = heads.HeadSettings(kind=kind, steps=4, batch=4, num_anchors=3, checkpoint_every=2,
                         eval_every=0, num_alpha_prompts=2, gamma=3, cost_repeats=1,
                         warmup_steps=1, dflash_block=4, parallel_gamma=3)
  heads.stage_train(s, pair, workdir)
  stats = json.load(open(os.path.join(workdir, "stats.json")))["train"]
  assert stats["steps"] == 4 and set(stats["heldout_accuracy_by_step"]) == {"1", "2", "3"}
  heads.stage_train(s, pair, workdir)  # finished: nothing more
  assert json.load(open(os.path.join(workdir, "stats.json")))["train"] == stats
  heads.stage_evaluate(s, pair, workdir)
  ev = json.load(open(os.path.join(workdir, "stats.json")))["evaluate"]
  assert set(ev["alpha"]) == set(ev["per_position"]) == {"draft", kind}
  assert len(ev["per_position"][kind]["0.0"]["acceptance"]) == 3
  out = tmp_path / "out"
  out.mkdir()
  (out / "MODEL_CARD.md").write_text("# tiny pair\n")
  heads.stage_export(s, pair, workdir, str(out), "python -m experiments.train_feature_heads")
  card = (out / "MODEL_CARD.md").read_text()
  assert card.startswith("# tiny pair") and f"| {kind} | 0.0 |" in card
  load = {"dflash": demo_pair.load_dflash_drafter,
          "parallel": demo_pair.load_parallel_drafter}[kind]
  loaded = load(str(out), target)
  shipped = heads._trained_draft(s, pair, workdir)
  assert loaded.static_key() == shipped.static_key() and loaded.num_positions == 3
  for got, want in zip(jax.tree_util.tree_leaves(heads._trainable(s, loaded)),
                       jax.tree_util.tree_leaves(heads._trainable(s, shipped))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
