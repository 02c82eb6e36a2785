"""Atomic result files and the paper's Table 2 row format, shared by experiments.

A crashed or interrupted run must never leave a half-written results file: a
resumable driver treats an existing file as a finished row. So every file is
written to a temporary sibling and moved into place with `os.replace`, which
is atomic on POSIX filesystems.
"""

import contextlib
import json
import math
import os
import tempfile
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np


def _jsonable(value):
  """numpy scalars/arrays and tuples -> plain JSON types; NaN/inf -> None."""
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return _jsonable(value.tolist())
  if isinstance(value, np.generic):
    return _jsonable(value.item())
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


@contextlib.contextmanager
def atomic_writer(path: str):
  """Yields a binary file whose whole content replaces `path` on success (a temporary file
  in the same directory, fsynced, then os.replace); on any error `path` is untouched.

  Readers see the old file or the whole new one, never a partial write; the
  one place in the project that writes files atomically (`write_bytes_atomic`
  and friends build on it; large files stream through it).
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                             suffix=".tmp")
  try:
    # mkstemp creates 0600; a results file reads like any other file (0644 under the
    # usual umask 022), for the group that shares the experiments.
    os.fchmod(fd, 0o666 & ~_umask())
    with os.fdopen(fd, "wb") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_bytes_atomic(path: str, data: bytes) -> None:
  """Writes `data` to `path` atomically (`atomic_writer`)."""
  with atomic_writer(path) as f:
    f.write(data)


def write_text_atomic(path: str, text: str) -> None:
  write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str, obj: Any) -> None:
  """JSON (numpy-aware, NaN -> null) written atomically."""
  write_text_atomic(path, json.dumps(_jsonable(obj), indent=2, sort_keys=True,
                                     allow_nan=False) + "\n")


def read_json(path: str) -> Optional[Dict[str, Any]]:
  """The parsed file, or None if it does not exist."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


TABLE2_HEADER = ("| task | draft | temp | γ | α | speed | predicted | c |\n"
                 "|---|---|---|---|---|---|---|---|")


# What each column of TABLE2_HEADER means (results.md prints it under the table).
TABLE2_LEGEND = (
    "Columns: **temp** the sampling temperature (0: greedy); **γ** draft tokens per "
    "iteration (a token tree: its depth); **α** the estimate of E[Σ min(p, q)] over every "
    "verified position (Corollary 3.6); **speed** the walltime of the fastest exact "
    "target-only decoding (block width W or 1) over the speculative decoding's, on the same "
    "inputs in the same process; **predicted** Theorem 3.8's speedup from α, γ, c and the "
    "measured cost of the verification call relative to a one-token call (results.json's "
    "predicted_speedup assumes free verification, as the paper does); **c** the draft "
    "model's one-token step over the target's (n/a: the draft is not a model and its cost "
    "is taken as 0).")


def _fmt(value, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def auto_gamma_label(phases: Sequence[Dict[str, Any]]) -> str:
  """results.md's γ under GAMMA='auto': what ran, not the gamma the theory is read at:
  "auto → 0 (target-only)" where no phase speculated, else "auto → " and every gamma
  that decoded a phase (0 among them where target-only did too), e.g. "auto → 2, 4"."""
  ran = sorted({int(p["gamma"]) for p in phases})
  if not any(ran):
    return "auto → 0 (target-only)"
  return "auto → " + ", ".join(str(g) for g in ran)


def auto_planning(phases: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
  """results.json's `gamma_auto_planning` from the phases of every GAMMA='auto' call (the
  first phase of each holds its `planning`, `generate_many`'s `SlotStats.planning`, and
  the warm-up's seconds it carries): seconds in all (compiles and timings of plans),
  calls, the plans timed, and those never timed with why (the first reason given for
  each: what kept it untimed when first weighed). None without any."""
  calls = [p["planning"] for p in phases if p.get("planning")]
  if not calls:
    return None
  timed = sorted({g for c in calls for g in c["timed"]})
  untimed = {}
  for call in calls:
    for g, why in call["untimed"].items():
      untimed.setdefault(g, why)
  return dict(seconds=sum(c["seconds"] + c.get("warm_up_seconds", 0.0) for c in calls),
              calls=len(calls), timed=timed,
              untimed={g: why for g, why in untimed.items() if int(g) not in timed})


def table2_row(task: str, draft: str, temperature: float, gamma: Union[int, str],
               alpha: Optional[float], speedup: Optional[float], predicted: Optional[float],
               c: Optional[float]) -> str:
  """One Markdown row in the format of the paper's Table 2 (+ Table 4's columns); `gamma`
  an int, or what GAMMA='auto' ran (`auto_gamma_label`)."""
  return (f"| {task} | {draft} | {temperature:g} | {gamma} | {_fmt(alpha, '.2f')} | "
          f"{_fmt(speedup, '.1f')}X | {_fmt(predicted, '.1f')} | {_fmt(c, '.2f')} |")
