"""SeqIO tasks and gin helpers for running the demo pair through T5X's binaries.

Importing this module (T5X's `DatasetConfig.module`, or `import` in a gin file)
registers `specdec_demo_pair_heldout`: the demo pair's held-out code
completions (demo_pair/heldout.jsonl, or any JSONL file of the same rows),
already tokenized with the demo's SentencePiece model, so T5X feeds the model
exactly the token ids `specdec_jax.generate` sees in `make demo`.

Needs seqio and tensorflow (the `t5x` extra); nothing else in specdec_jax
imports it.
"""

import json
import os
from typing import Optional

import gin
import seqio
import tensorflow as tf

from specdec_jax import demo_pair
from specdec_jax.families.t5.config import T5Config

DEMO_TASK = "specdec_demo_pair_heldout"
DEMO_SPLIT = "validation"


@gin.configurable
def demo_vocabulary(path: Optional[str] = None) -> seqio.SentencePieceVocabulary:
  """The demo pair's SentencePiece vocabulary (ids 0 = pad, 1 = EOS; no extra ids)."""
  return seqio.SentencePieceVocabulary(
      path or os.path.join(demo_pair.DEFAULT_DIR, "tokenizer.model"), extra_ids=0)


@gin.configurable
def demo_config(name: str = "target", path: Optional[str] = None) -> T5Config:
  """The `T5Config` of one demo model ('target', 'small', 'tiny') from its config.json."""
  with open(os.path.join(path or demo_pair.DEFAULT_DIR, "config.json")) as f:
    return demo_pair.config_from_json(json.load(f)["models"][name])


@gin.configurable
def demo_heldout(path: Optional[str] = None, limit: Optional[int] = None):
  """Rows of the held-out JSONL file: dicts with input/target text and ids."""
  path = path or os.path.join(demo_pair.DEFAULT_DIR, "heldout.jsonl")
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        rows.append(json.loads(line))
      if limit is not None and len(rows) >= limit:
        break
  if not rows:
    raise ValueError(f"{path}: no examples")
  return rows


def _heldout_dataset(split: str, shuffle_files: bool = False, seed: Optional[int] = None):
  """tf.data of {'inputs', 'targets'} int32 ids plus their *_pretokenized text."""
  del shuffle_files, seed  # One small file, read in order.
  if split != DEMO_SPLIT:
    raise ValueError(f"{DEMO_TASK} has only the {DEMO_SPLIT!r} split, got {split!r}")
  rows = demo_heldout()
  return tf.data.Dataset.from_generator(
      lambda: ({"inputs": r["input_ids"], "targets": r["target_ids"],
                "inputs_pretokenized": r["input"], "targets_pretokenized": r["target"]}
               for r in rows),
      output_signature={"inputs": tf.TensorSpec([None], tf.int32),
                        "targets": tf.TensorSpec([None], tf.int32),
                        "inputs_pretokenized": tf.TensorSpec([], tf.string),
                        "targets_pretokenized": tf.TensorSpec([], tf.string)})


def exact_match(targets, predictions):
  """seqio metric: percent of predictions equal to their target text."""
  if len(targets) != len(predictions):
    raise ValueError(f"{len(targets)} targets vs {len(predictions)} predictions")
  same = sum(str(t) == str(p) for t, p in zip(targets, predictions))
  return {"exact_match": 100.0 * same / max(1, len(targets))}


def register_demo_task() -> None:
  """Registers DEMO_TASK once (inputs keep no EOS and targets keep theirs, as in the demo)."""
  if DEMO_TASK in seqio.TaskRegistry.names():
    return
  vocabulary = demo_vocabulary()
  seqio.TaskRegistry.add(
      DEMO_TASK,
      source=seqio.FunctionDataSource(_heldout_dataset, splits=[DEMO_SPLIT]),
      preprocessors=[],
      metric_fns=[exact_match],
      output_features={"inputs": seqio.Feature(vocabulary, add_eos=False),
                       "targets": seqio.Feature(vocabulary, add_eos=False)})


register_demo_task()
