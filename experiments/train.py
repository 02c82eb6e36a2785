r"""Trains a T5 from a config name on seq2seq data (absl + gin), resumably.

Data (`train_file`, `eval_file`):
  * JSONL with {"input": ..., "target": ...} per line, or TSV (input \t target;
    a literal "\n" in a field means a newline), tokenized with `tokenizer`:
    a SentencePiece model path, or "train:<vocab_size>" to train one on the
    training texts (saved to <workdir>/tokenizer.model);
  * or pre-tokenized .npz with int arrays `inputs` [n, S] and `targets` [n, T]
    (0 = padding, targets end with EOS = 1).

  python -m experiments.train --workdir=/tmp/run \
      --gin_file=configs/train/tiny_copy.gin \
      --gin_bindings="train_experiment.train_file='pairs.jsonl'"

Rerunning the same command resumes from the latest checkpoint in workdir and
continues exactly as an uninterrupted run would. Outputs: checkpoints/
(Orbax TrainState), metrics.jsonl, model_config.json, and params.npz (float32
weights after the last step, flattened 'encoder/layers_0/...' keys).
"""

import json
import os
import sys
from typing import Optional

from absl import app, flags, logging
import gin
import jax
import numpy as np

from experiments import gin_flags
from experiments import train_stages  # noqa: F401  (defines --workdir)
from specdec_jax import data
from specdec_jax.train import trainer as train
from specdec_jax.families.t5.model import init_params
from specdec_jax.families.t5.config import get_config

FLAGS = flags.FLAGS
# --workdir (checkpoints, metrics and outputs; required): experiments/train_stages.py.


def load_examples(path: str, tokenizer: Optional[data.Tokenizer], input_len: int,
                  target_len: int) -> data.Seq2SeqData:
  """Seq2SeqData from a .npz (pre-tokenized) or JSONL/TSV text pairs (needs a tokenizer)."""
  if path.endswith(".npz"):
    return data.Seq2SeqData.load(path)
  if tokenizer is None:
    raise ValueError(f"{path} holds text: set train_experiment.tokenizer")
  return data.encode_pairs(data.read_pairs(path), tokenizer, input_len, target_len)


def get_tokenizer(spec: Optional[str], train_file: str, workdir: str) -> Optional[data.Tokenizer]:
  if spec is None or train_file.endswith(".npz"):
    return None
  if spec.startswith("train:"):
    path = os.path.join(workdir, "tokenizer.model")
    if not os.path.exists(path):  # Resumed runs reuse the tokenizer they trained.
      texts = [t for pair in data.read_pairs(train_file) for t in pair]
      data.Tokenizer(data.train_tokenizer(texts, int(spec.split(":", 1)[1]))).save(path)
    return data.Tokenizer.load(path)
  return data.Tokenizer.load(spec)


@gin.configurable
def train_experiment(workdir: str, *, train_file: str = gin.REQUIRED,
                     eval_file: Optional[str] = None, model: str = "tiny",
                     config_overrides: Optional[dict] = None, tokenizer: Optional[str] = None,
                     input_len: int = 64, target_len: int = 32, optimizer: str = "adafactor",
                     learning_rate: float = 1e-2, schedule: str = "rsqrt",
                     warmup_steps: int = 100, num_steps: int = 1000, batch_size: int = 32,
                     num_microbatches: int = 1, checkpoint_every: int = 200,
                     eval_every: int = 200, seed: int = 0):
  """Trains `model` (a config name from specdec_jax.families.t5.config, with overrides)."""
  tok = get_tokenizer(tokenizer, train_file, workdir)
  config = get_config(model, **dict(config_overrides or {}))
  if tok is not None:
    if tok.vocab_size > config.vocab_size:
      raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary is "
                       f"{config.vocab_size}")
  config = config.replace(dtype="float32")
  train_data = load_examples(train_file, tok, input_len, target_len)
  train_data.check_vocab(config.vocab_size)
  eval_data = None
  if eval_file:
    eval_data = load_examples(eval_file, tok, input_len, target_len)
    eval_data.check_vocab(config.vocab_size)
  logging.info("%d training examples; model %s, %.2fM params", len(train_data), model,
               config.num_params / 1e6)
  opt = train.make_optimizer(optimizer, learning_rate, schedule=schedule,
                             warmup_steps=warmup_steps, total_steps=num_steps)
  state = train.create_train_state(init_params(config, seed), opt)
  loss_fn = train.loss_fn(config)

  def eval_batches():
    for i in range(0, len(eval_data), batch_size):
      yield eval_data.take(np.arange(i, min(i + batch_size, len(eval_data))))

  state, metrics = train.fit(
      state, lambda step: train_data.take(data.batch_indices(len(train_data), batch_size, step,
                                                             seed)),
      loss_fn=loss_fn, optimizer=opt,
      cfg=train.TrainConfig(num_steps=num_steps, checkpoint_every=checkpoint_every,
                            eval_every=eval_every, num_microbatches=num_microbatches),
      workdir=workdir, eval_batches=eval_batches if eval_data is not None else None)
  from flax import traverse_util
  flat = traverse_util.flatten_dict(state.params, sep="/")
  np.savez(os.path.join(workdir, "params.npz"), **{k: np.asarray(v) for k, v in flat.items()})
  import dataclasses
  data.write_bytes_atomic(os.path.join(workdir, "model_config.json"),
                          json.dumps(dataclasses.asdict(config), indent=2).encode())
  logging.info("done at step %d; eval %s", int(state.step), metrics)
  return state, metrics


def main(argv):
  del argv
  gin_flags.parse_flags()
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  train_experiment(FLAGS.workdir)


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  app.run(main, argv=gin_flags.rewrite_gin_args(sys.argv))
