"""Training feature heads: the EAGLE-1 loss, EAGLE-3's training-time test (TTT), and the
resumable head-training entry point's pieces.

The TTT unroll is checked against a brute-force reference that runs the head
the way a proposal does (a fresh cache per anchor: the true pairs up to the
anchor in one block, then one call per drafted position fed the previous
call's output), so the shared-cache shortcut in `feature_loss_fn` cannot hide
a mask or position error.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.decoder_only.batch import lm_batch
from specdec_jax.train import feature_heads as feature_train
from specdec_jax.train import trainer


def _target(vocab=64, seed=0):
  return sj.load_model("llama_tiny", vocab_size=vocab, seed=seed, dtype="float32")


def _sampled_batch(target, rows=16, prompt=4, steps=20, seed=0):
  """Sequences the target itself samples (temperature 1): a head can learn them."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(2, target.config.vocab_size, (rows, prompt)).astype(np.int32)
  samples = sj.generate(target, prompts, max_decode_steps=steps, temperature=1.0, eos_id=-1,
                        rng=jax.random.PRNGKey(seed + 1)).sequences
  sequences = np.concatenate([prompts, np.asarray(samples)], axis=1)
  lengths = np.full(rows, sequences.shape[1])
  lengths[0] -= 5  # a padded row: its tail is not learned
  return feature_train.feature_batch(target, lm_batch(sequences, lengths))


def _eagle1_reference(draft, head_params, batch, ce_weight=0.1):
  """The EAGLE-1 loss written out directly (the pre-TTT implementation)."""
  head, refs = draft.head, draft.target_params
  tokens, features = batch["tokens"], jnp.asarray(batch["features"], jnp.float32)
  weights = jnp.asarray(batch["weights"], jnp.float32)
  b, t, h = features.shape
  fed = jnp.concatenate([jnp.zeros((b, 1, h)), features[:, :-1]], axis=1)
  predicted, _ = head.apply(head_params, refs, tokens, fed, jnp.zeros((b,), jnp.int32),
                            head.init_cache(head_params, b, t, batch.get("memory")))
  predicted = predicted.astype(jnp.float32)
  regression = jnp.mean(feature_train.smooth_l1(predicted, features), axis=-1)
  target_probs = jax.nn.softmax(head.logits(head_params, refs, features), -1)
  log_q = jax.nn.log_softmax(head.logits(head_params, refs, predicted), -1)
  ce = -jnp.sum(target_probs * log_q, -1)
  return jnp.sum(weights * (regression + ce_weight * ce))


@pytest.mark.slow
def test_ttt_with_one_step_is_the_eagle1_loss():
  target = _target()
  batch = _sampled_batch(target)
  draft = sj.FeatureDraft(target, seed=3)
  plain, aux = feature_train.feature_loss_fn(draft)(draft.head_params, batch)
  np.testing.assert_allclose(float(plain), float(_eagle1_reference(draft, draft.head_params,
                                                                   batch)), rtol=1e-6)
  one, _ = feature_train.feature_loss_fn(draft, ttt_steps=1)(draft.head_params, batch)
  assert float(one) == float(plain)
  # Deeper steps at weight 0 add exactly nothing to the loss.
  batch = dict(batch, anchors=feature_train.ttt_anchors(batch["weights"], 5, seed=0))
  deep, deep_aux = feature_train.feature_loss_fn(draft, ttt_steps=3, ttt_decay=0.0)(
      draft.head_params, batch)
  assert float(deep) == float(plain)
  assert float(deep_aux["cross_entropy"]) == float(aux["cross_entropy"])
  assert float(deep_aux["cross_entropy_2"]) > 0


def _unrolled_reference(draft, head_params, batch, steps):
  """{i: (sum of CE, number of valid anchors)} for i = 1..steps-1, one anchor at a time
  with a fresh cache and one pair per call (incremental decoding, no shared cache)."""
  head, refs = draft.head, draft.target_params
  tokens = np.asarray(batch["tokens"])
  features = np.asarray(batch["features"], np.float32)
  weights = np.asarray(batch["weights"])
  b, t, h = features.shape
  run = jax.jit(lambda x, f, p, c: head.apply(head_params, refs, x, f, p, c))
  project = jax.jit(lambda x: head.logits(head_params, refs, x))
  totals = {i: [0.0, 0] for i in range(1, steps)}
  for row in range(b):
    for p in np.asarray(batch["anchors"])[row]:
      if weights[row, p] <= 0:
        continue
      fed = np.concatenate([np.zeros((1, h), np.float32), features[row, :p]])[None]
      memory = (None if "memory" not in batch else
                jax.tree_util.tree_map(lambda x: x[row:row + 1], batch["memory"]))
      cache = head.init_cache(head_params, 1, t + steps, memory)
      # The true pairs 0..p one call each (one compiled shape for every anchor).
      for q in range(p + 1):
        hidden, cache = run(tokens[row:row + 1, q:q + 1], fed[:, q:q + 1],
                            jnp.array([q], jnp.int32), cache)
      previous = hidden
      for i in range(1, steps):
        if p + i >= t:
          break
        hidden, cache = run(tokens[row:row + 1, p + i:p + i + 1], previous,
                            jnp.array([p + i], jnp.int32), cache)
        previous = hidden
        if weights[row, p + i] > 0:
          target_probs = jax.nn.softmax(project(features[row, p + i]))
          log_q = jax.nn.log_softmax(project(hidden[0, 0]))
          totals[i][0] += float(-jnp.sum(target_probs * log_q))
          totals[i][1] += 1
  return totals


def _t5_batch(target, rows=3, seed=4):
  """A T5 batch {'inputs', 'targets'} (targets 0-padded) through feature_batch."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, target.config.vocab_size, (rows, 7)).astype(np.int32)
  inputs[0, 5:] = 0
  targets = rng.integers(2, target.config.vocab_size, (rows, 11)).astype(np.int32)
  targets[1, 8:] = 0
  return feature_train.feature_batch(target, dict(inputs=inputs, targets=targets))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["decoder_only", "t5"])
def test_ttt_unroll_matches_one_anchor_at_a_time_decoding(family):
  if family == "t5":
    target = sj.load_model("tiny", vocab_size=32, seed=2)
    batch = _t5_batch(target)
    assert set(batch) == {"tokens", "features", "weights", "memory"}
  else:
    target = _target(vocab=32, seed=2)
    batch = _sampled_batch(target, rows=3, steps=10, seed=4)
  batch["anchors"] = feature_train.ttt_anchors(batch["weights"], 4, seed=1)
  batch["anchors"][1, -1] = batch["tokens"].shape[1] - 2  # an anchor near the end
  draft = sj.FeatureDraft(target, seed=7)
  if family == "t5":  # k = 1 is the EAGLE-1 loss for T5 heads too.
    np.testing.assert_allclose(
        float(feature_train.feature_loss_fn(draft)(draft.head_params, batch)[0]),
        float(_eagle1_reference(draft, draft.head_params, batch)), rtol=1e-6)
  steps = 4
  _, aux = jax.jit(feature_train.feature_loss_fn(draft, ttt_steps=steps))(draft.head_params,
                                                                          batch)
  want = _unrolled_reference(draft, draft.head_params, batch, steps)
  for i in range(1, steps):
    assert int(aux[f"anchors_{i}"]) == want[i][1], i
    np.testing.assert_allclose(float(aux[f"cross_entropy_{i}"]), want[i][0], rtol=2e-5)


def test_ttt_anchors_are_learned_positions_and_reproducible():
  weights = np.zeros((3, 10), np.float32)
  weights[0, 1:] = 1
  weights[1, 1:3] = 1
  a = feature_train.ttt_anchors(weights, 4, seed=5)
  np.testing.assert_array_equal(a, feature_train.ttt_anchors(weights, 4, seed=5))
  assert a.shape == (3, 4) and len(set(a[0])) == 4 and set(a[0]) <= set(range(1, 10))
  assert set(a[1]) == {1, 2}
  np.testing.assert_array_equal(a[2], 0)
  with pytest.raises(ValueError, match="num_anchors"):
    feature_train.ttt_anchors(weights, 0, seed=0)
  target = _target(vocab=16)
  draft = sj.FeatureDraft(target)
  with pytest.raises(ValueError, match="ttt_steps"):
    feature_train.feature_loss_fn(draft, ttt_steps=0)
  batch = feature_train.feature_batch(target, lm_batch(np.ones((2, 6), np.int32), [6, 6]))
  with pytest.raises(ValueError, match="anchors"):
    feature_train.feature_loss_fn(draft, ttt_steps=2)(draft.head_params, batch)


@pytest.mark.slow
def test_ttt_training_lowers_the_loss_and_raises_acceptance():
  target = _target(vocab=64, seed=0)
  batch = _sampled_batch(target, rows=96, steps=24, seed=0)
  batch["anchors"] = feature_train.ttt_anchors(batch["weights"], 8, seed=0)
  draft = sj.FeatureDraft(target, seed=3)
  optimizer = trainer.make_optimizer("adamw", 3e-3, schedule="constant", warmup_steps=1)
  state = trainer.create_train_state(draft.head_params, optimizer)
  loss_fn = feature_train.feature_loss_fn(draft, ttt_steps=3)
  step = jax.jit(functools.partial(trainer.train_step, loss_fn=loss_fn, optimizer=optimizer))
  losses = []
  for _ in range(60):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  # The cross-entropy terms include the target's own entropy, a floor no head goes below.
  assert losses[-1] < 0.9 * losses[0], losses[::10]
  accuracy = feature_train.per_step_accuracy(metrics)
  assert set(accuracy) == {0, 1, 2} and all(0 <= v <= 1 for v in accuracy.values())
  trained = sj.FeatureDraft(target, head_params=state.params)
  # Greedy alpha (the expected acceptance, pooled: low variance). A random tiny target
  # is near uniform at temperature 1, where any head is accepted ~94% of the time.
  prompts = np.random.default_rng(9).integers(2, 64, (16, 4)).astype(np.int32)
  kwargs = dict(max_decode_steps=24, gamma=3, eos_id=-1, block_width=8)
  before = sj.generate(target, prompts, draft=draft, **kwargs).stats
  after = sj.generate(target, prompts, draft=trained, **kwargs)
  np.testing.assert_array_equal(np.asarray(after.sequences), np.asarray(
      sj.generate(target, prompts, max_decode_steps=24, eos_id=-1, block_width=8).sequences))
  assert after.stats.alpha > 2 * before.alpha + 0.05, (before.alpha, after.stats.alpha)


# ---------------------------------------------------------------------------
# Shipping a head: the bf16 file round trip, the model card section, the pairs.

def test_feature_head_file_round_trip_and_bad_files(tmp_path):
  import json
  from specdec_jax import demo_pair
  target = sj.load_model("gpt2_tiny", vocab_size=32, seed=0, dtype="float32")  # learned positions
  draft = sj.FeatureDraft(target, seed=4)
  assert demo_pair.load_feature_head(str(tmp_path), target) is None  # ships none
  demo_pair.save_weights_bf16(str(tmp_path / "feature_head.npz"), draft.head_params)
  (tmp_path / "feature_head.json").write_text(json.dumps(dict(kind="eagle1", fc_bias=False)))
  loaded = demo_pair.load_feature_head(str(tmp_path), target)
  assert isinstance(loaded, sj.FeatureDraft)
  for got, want in zip(jax.tree_util.tree_leaves(loaded.head_params),
                       jax.tree_util.tree_leaves(draft.head_params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        jnp.asarray(want, jnp.bfloat16).astype(jnp.float32)))
  other = sj.load_model("gpt2_tiny", vocab_size=32, seed=0, dtype="float32", mlp_dim=96)
  with pytest.raises(ValueError, match="has shape"):
    demo_pair.load_feature_head(str(tmp_path), other)
  (tmp_path / "feature_head.json").write_text(json.dumps(dict(kind="eagle9")))
  with pytest.raises(ValueError, match="unknown feature head kind"):
    demo_pair.load_feature_head(str(tmp_path), target)


def test_model_card_section_is_replaced_not_repeated():
  from specdec_jax import demo_pair
  card = "# A pair\n\ntext\n"
  once = demo_pair.with_feature_head_section(card, "## Feature head\nv1\n")
  twice = demo_pair.with_feature_head_section(once, "## Feature head\nv2\n")
  assert twice.startswith(card.rstrip("\n")) and twice.count(demo_pair.FEATURE_CARD_MARK) == 1
  assert "v2" in twice and "v1" not in twice


def test_card_sections_are_replaced_in_place_not_repeated():
  """Two writers' sections (feature head, Medusa heads) each replace only their own."""
  from specdec_jax import demo_pair
  card = "# A pair\n\ntext\n"
  card = demo_pair.with_feature_head_section(card, "## Feature head\nf1\n")
  card = demo_pair.with_card_section(card, demo_pair.MEDUSA_CARD_MARK, "## Medusa\nm1\n")
  card = demo_pair.with_feature_head_section(card, "## Feature head\nf2\n")
  card = demo_pair.with_card_section(card, demo_pair.MEDUSA_CARD_MARK, "## Medusa\nm2\n")
  assert card.count(demo_pair.FEATURE_CARD_MARK) == 1 == card.count(demo_pair.MEDUSA_CARD_MARK)
  assert "f2" in card and "m2" in card and "f1" not in card and "m1" not in card
  assert card.index("f2") < card.index(demo_pair.MEDUSA_CARD_MARK) < card.index("m2")


@pytest.mark.parametrize("family", ["decoder_only", "t5"])
@pytest.mark.parametrize("name", ["feature", "medusa"])
def test_shipped_heads_decode_exactly(family, name):
  """Each trained head a pair ships (feature head, Medusa heads) is listed after the model
  drafts, decodes exactly and is accepted far more often than a random one."""
  import os
  from specdec_jax import demo_pair
  files, kind = {"feature": (demo_pair.FEATURE_HEAD_FILES, sj.FeatureDraft),
                 "medusa": (demo_pair.MEDUSA_HEAD_FILES, sj.MedusaDraft)}[name]
  if not os.path.exists(os.path.join(demo_pair.DIRS[family], files[0])):
    pytest.skip(f"the {family} pair ships no {name} head")
  pair = sj.load_demo_pair(family)
  head = pair.drafts[name]
  names = list(pair.drafts)  # the model drafts, then the trained heads
  heads = [n for n in names if not isinstance(pair.drafts[n], type(pair.target))]
  assert isinstance(head, kind) and name in heads and names[-len(heads):] == heads
  tokens, lengths = pair.inputs(4)
  kwargs = dict(max_decode_steps=pair.max_decode_steps, block_width=5)
  want = sj.generate(pair.target, tokens, lengths, **kwargs)
  got = sj.generate(pair.target, tokens, lengths, draft=head, gamma=4, **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.alpha > 0.3, got.stats.summary()  # trained: far above a random head


@pytest.mark.slow
def test_head_training_stages_run_resume_and_export(tmp_path):
  """experiments.train_feature_heads' train / evaluate / export stages on a tiny GPT-2
  "pair" (its data.npz written here): a rerun of a finished train stage is a no-op, the
  export loads back as the pair's drafts['feature'], the card gets its section."""
  import json
  from experiments import train_feature_heads as heads
  from specdec_jax import demo_pair
  target = sj.load_model("gpt2_tiny", vocab_size=32, seed=0, dtype="float32")
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, 32, (2, 6)).astype(np.int32)
  heldout = [dict(path="x.py", input_ids=p.tolist(), target_ids=[3] * 4) for p in prompts]
  pair = demo_pair.DemoPair("decoder_only", None, target, {}, {}, heldout, 6, 4,
                            dict(settings=dict(seq_len=12)))
  workdir = str(tmp_path / "run")
  import os
  os.makedirs(workdir)
  demo_pair.save_npz_atomic(os.path.join(workdir, "data.npz"),
                            windows=rng.integers(2, 32, (20, 12)).astype(np.int32),
                            eval_windows=rng.integers(2, 32, (4, 12)).astype(np.int32))
  s = heads.HeadSettings(steps=4, batch=4, num_anchors=3, checkpoint_every=2, eval_every=0,
                         num_alpha_prompts=2, gamma=2, cost_repeats=1, warmup_steps=1)
  heads.stage_train(s, pair, workdir)
  stats = json.load(open(os.path.join(workdir, "stats.json")))["train"]
  assert stats["steps"] == 4 and set(stats["heldout_accuracy_by_step"]) == {"0", "1", "2"}
  heads.stage_train(s, pair, workdir)  # finished: nothing more
  assert json.load(open(os.path.join(workdir, "stats.json")))["train"] == stats
  heads.stage_evaluate(s, pair, workdir)
  out = tmp_path / "out"
  (out).mkdir()
  (out / "MODEL_CARD.md").write_text("# tiny pair\n")
  heads.stage_export(s, pair, workdir, str(out), "python -m experiments.train_feature_heads")
  card = (out / "MODEL_CARD.md").read_text()
  assert card.startswith("# tiny pair") and "## Feature head" in card and "| feature |" in card
  loaded = demo_pair.load_feature_head(str(out), target)
  shipped = heads._trained_draft(s, pair, workdir)
  for got, want in zip(jax.tree_util.tree_leaves(loaded.head_params),
                       jax.tree_util.tree_leaves(shipped.head_params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
