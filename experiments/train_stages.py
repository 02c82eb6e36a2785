"""The stage runner of the pair-training scripts (`train_demo_pair`, `train_decoder_only_pair`)."""

import time
from typing import Callable, Iterable, Mapping, Sequence

from absl import logging


def check_stages(known: Iterable[str], selected: Sequence[str]) -> None:
  """Raises ValueError naming every selected stage that is not a known one."""
  known = tuple(known)
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
