"""What the staged trainers (`train_demo_pair`, `train_decoder_only_pair`,
`train_feature_heads`, and `train` for `--workdir`) share: their flags, the stage
runner and the run directory's JSON files."""

import json
import os
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from absl import flags, logging

from specdec_jax import data

# Defined once here, not in each trainer: tests import several trainers into one
# process, and absl refuses a flag name defined twice. Each trainer names its own
# defaults (`or` below).
flags.DEFINE_string("workdir", None, "Run directory: data, checkpoints, metrics, stats "
                    "(default: the trainer's own; required by experiments.train).")
flags.DEFINE_string("out_dir", None, "Where the `export` stage writes (default: the trainer's own).")
flags.DEFINE_list("stages", None, "Stages to run, in pipeline order (default: the trainer's "
                  "whole pipeline).")
FLAGS = flags.FLAGS


def selected_stages(default: Sequence[str]) -> list:
  """--stages, or the trainer's `default` pipeline when the flag is not given."""
  return list(FLAGS.stages) if FLAGS.stages is not None else list(default)


def write_json(path: str, obj) -> None:
  """Writes `obj` as sorted, indented JSON, atomically (a reader never sees half a file)."""
  data.write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str, default=None) -> Any:
  """The JSON in `path`, or `default` when there is no such file."""
  if not os.path.exists(path):
    return default
  with open(path) as f:
    return json.load(f)


def check_stages(known: Iterable[str], selected: Sequence[str]) -> None:
  """Raises ValueError naming every selected stage that is not a known one, and when
  none is selected (`--stages=` would otherwise run nothing without a word)."""
  known = tuple(known)
  if not selected:
    raise ValueError(f"no stages selected (--stages is empty); known: {known}")
  unknown = [name for name in selected if name not in known]
  if unknown:
    raise ValueError(f"unknown stages {unknown}; known: {known}")


def run_stages(stages: Mapping[str, Callable[[], None]], selected: Sequence[str]) -> None:
  """Runs the `selected` stages in the pipeline order of `stages` ({name: run}),
  logging each with its wall-clock time; checks every name before anything runs."""
  check_stages(stages, selected)
  for name, run in stages.items():
    if name not in selected:
      continue
    t0 = time.time()
    logging.info("stage %s", name)
    run()
    logging.info("stage %s: %.1f s", name, time.time() - t0)
