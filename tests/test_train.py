"""Training: the loss falls on a tiny copy task; resuming is bit-for-bit exact."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import data
from specdec_jax.train import trainer as train
from specdec_jax.families.t5.model import init_params
from specdec_jax.families.t5.config import get_config

VOCAB = 32
CONFIG = get_config("tiny", vocab_size=VOCAB, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                    num_encoder_layers=1, num_decoder_layers=1, dtype="float32")


def copy_task(n=256, length=8, seed=0) -> data.Seq2SeqData:
  """Targets = inputs + EOS: a task a 1-layer model learns in a few dozen steps."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, VOCAB, (n, length)).astype(np.int32)
  targets = np.concatenate([inputs, np.ones((n, 1), np.int32)], axis=1)
  return data.Seq2SeqData(inputs, targets)


def _setup(total_steps=40, lr=3e-2, name="adafactor"):
  task = copy_task()
  optimizer = train.make_optimizer(name, lr, schedule="linear", warmup_steps=5,
                                   total_steps=total_steps)
  state = train.create_train_state(init_params(CONFIG, 0), optimizer)
  batch_at = lambda step: task.take(data.batch_indices(len(task), 32, step, seed=3))
  return task, optimizer, state, batch_at


def test_shift_right():
  from specdec_jax.families.t5.family import shift_right
  targets = jnp.array([[5, 6, 1, 0]])
  np.testing.assert_array_equal(shift_right(targets), [[0, 5, 6, 1]])


@pytest.mark.parametrize("name", ["adafactor", "adamw"])
def test_training_lowers_loss(name):
  task, optimizer, state, batch_at = _setup(lr=3e-2 if name == "adafactor" else 1e-2, name=name)
  loss_fn = train.loss_fn(CONFIG)
  eval_fn = jax.jit(functools.partial(train.eval_step, loss_fn=loss_fn))
  before = train.evaluate(state.params, [task.take(np.arange(128))], eval_fn)
  state, _ = train.fit(state, batch_at, loss_fn=loss_fn, optimizer=optimizer,
                       cfg=train.TrainConfig(num_steps=40, progress_bar=False))
  after = train.evaluate(state.params, [task.take(np.arange(128))], eval_fn)
  assert before["loss"] > 3.0  # ~ln(32) at init.
  assert after["loss"] < 0.75 * before["loss"], (before, after)
  assert after["accuracy"] > before["accuracy"] + 0.2


def test_padding_is_masked():
  """Appending padding to the targets changes neither loss nor token count."""
  task = copy_task(n=4)
  loss_fn = train.loss_fn(CONFIG)
  params = init_params(CONFIG, 0)
  batch = task.take(np.arange(4))
  padded = dict(batch, targets=np.pad(batch["targets"], ((0, 0), (0, 5))))
  loss, aux = jax.jit(loss_fn)(params, batch)  # Jitted: op-by-op dispatch took ~9 s.
  loss_p, aux_p = jax.jit(loss_fn)(params, padded)
  np.testing.assert_allclose(loss, loss_p, rtol=1e-6)
  assert float(aux["tokens"]) == float(aux_p["tokens"]) == 4 * 9


def test_gradient_accumulation_matches_one_batch():
  _, optimizer, state, batch_at = _setup()
  loss_fn = train.loss_fn(CONFIG)
  batch = batch_at(0)
  # Jitted as train.fit runs it (op-by-op dispatch of the two steps took ~15 s).
  step = jax.jit(train.train_step, static_argnames=("loss_fn", "optimizer", "num_microbatches"))
  one, m1 = step(state, batch, loss_fn=loss_fn, optimizer=optimizer)
  four, m4 = step(state, batch, loss_fn=loss_fn, optimizer=optimizer, num_microbatches=4)
  np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                         one.params, four.params)
  with pytest.raises(ValueError, match="not divisible"):
    train.train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer, num_microbatches=5)


def test_resume_is_bit_for_bit(tmp_path):
  _, optimizer, state, batch_at = _setup(total_steps=8)
  loss_fn = train.loss_fn(CONFIG)
  cfg = train.TrainConfig(num_steps=8, checkpoint_every=3, progress_bar=False, log_every=2)
  straight, _ = train.fit(state, batch_at, loss_fn=loss_fn, optimizer=optimizer, cfg=cfg,
                          workdir=str(tmp_path / "straight"))
  # Stop after 5 steps (last checkpoint at 3, and the final one at 5), then
  # resume from a *fresh* initial state: everything must come from the checkpoint.
  stopped_cfg = train.TrainConfig(num_steps=5, checkpoint_every=3, progress_bar=False)
  partial_state, _ = train.fit(state, batch_at, loss_fn=loss_fn, optimizer=optimizer,
                               cfg=stopped_cfg, workdir=str(tmp_path / "resumed"))
  assert int(partial_state.step) == 5
  fresh = train.create_train_state(init_params(CONFIG, 123), optimizer)
  resumed, _ = train.fit(fresh, batch_at, loss_fn=loss_fn, optimizer=optimizer, cfg=cfg,
                         workdir=str(tmp_path / "resumed"))
  assert int(resumed.step) == int(straight.step) == 8
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Metrics were logged as JSON lines.
  with open(tmp_path / "straight" / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4, 6, 8]


def test_joint_training_matches_separate():
  """Two models trained on shared batches get exactly their own gradients."""
  other = CONFIG.replace(emb_dim=16, head_dim=8)
  configs = {"a": CONFIG, "b": other}
  task = copy_task(n=32)
  batch = task.take(np.arange(32))
  params = {"a": init_params(CONFIG, 0), "b": init_params(other, 1)}
  # Jitted (as train_step runs it): op-by-op dispatch of the backward passes
  # took ~20 s; the comparison is the same.
  loss_and_grads = jax.jit(train.loss_and_grads, static_argnums=2)
  loss, aux, grads = loss_and_grads(params, batch, train.joint_loss_fn(configs))
  _, _, grads_b = loss_and_grads(params["b"], batch, train.loss_fn(other))
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
                         grads["b"], grads_b)
  np.testing.assert_allclose(loss, aux["a/loss"] + aux["b/loss"], rtol=1e-6)


def test_bad_input():
  with pytest.raises(ValueError, match="outside the vocabulary"):
    data.Seq2SeqData(np.array([[3, 40]]), np.array([[1]])).check_vocab(VOCAB)
  with pytest.raises(ValueError, match="unknown optimizer"):
    train.make_optimizer("sgd")
  with pytest.raises(ValueError, match="exceeds"):
    data.batch_indices(4, 8, 0, 0)


def test_batch_order_is_a_function_of_step():
  a = [data.batch_indices(100, 10, s, seed=1) for s in range(25)]
  b = [data.batch_indices(100, 10, s, seed=1) for s in range(25)]
  assert all((x == y).all() for x, y in zip(a, b))
  # Each epoch (10 batches) is a permutation of all examples.
  np.testing.assert_array_equal(np.sort(np.concatenate(a[:10])), np.arange(100))
  assert not (np.concatenate(a[:10]) == np.concatenate(a[10:20])).all()


def test_train_experiment_on_pretokenized_file(tmp_path):
  """experiments/train.py end to end on a .npz, then a rerun resumes (no extra steps)."""
  from experiments.train import train_experiment
  path = str(tmp_path / "copy.npz")
  copy_task(n=64).save(path)
  kwargs = dict(train_file=path, eval_file=path, model="tiny",
                config_overrides=dict(vocab_size=VOCAB, emb_dim=32, num_heads=2, head_dim=16,
                                      mlp_dim=64, num_encoder_layers=1, num_decoder_layers=1),
                num_steps=4, batch_size=16, checkpoint_every=2, eval_every=2, warmup_steps=1)
  state, metrics = train_experiment(str(tmp_path / "run"), **kwargs)
  assert int(state.step) == 4 and metrics["loss"] > 0
  assert os.path.exists(tmp_path / "run" / "params.npz")
  again, _ = train_experiment(str(tmp_path / "run"), **kwargs)
  for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(again.params)):
    np.testing.assert_array_equal(a, b)
