"""A launcher run's finished batches on disk, so that an interrupted run resumes.

`experiments.run` decodes its inputs batch by batch. Each finished batch (both
decoders' outputs, the speculative statistics, the three timings) is written
atomically to `<output_dir>/progress/batch_NNNNN.npz`; the step timings go to
`step_times.json` once measured. A run started again with the same
configuration on the same inputs reads them back and decodes only what is
missing, so Ctrl-C (or a killed job) costs at most the batch in flight. A
different configuration in the same directory is refused, naming what
differs (`experiments.run_identity`: the settings, the inputs, the checkpoints'
contents), and every batch carries the identity's digest, so that a batch another
run wrote is refused too: results of two configurations are never mixed.
`experiments.output_lock` keeps a second run from starting into the directory.

    progress = RunProgress.open(output_dir, identity)   # ValueError on a mismatch
    done = progress.batches()                             # {index: BatchRecord}
    progress.save_batch(index, record)
"""

import dataclasses
import io
import json
import os
from typing import Any, Dict, List, Optional

import numpy as np

from experiments.run_identity import differences, identity_digest
from specdec_jax import results as results_lib
from specdec_jax.core.outputs import SpeculativeStats

PROGRESS_DIR = "progress"
IDENTITY_FILE = "identity.json"
STEP_TIMES_FILE = "step_times.json"
FORMAT_VERSION = 2  # 2: each batch and the step times carry the identity's digest


@dataclasses.dataclass(frozen=True)
class BatchRecord:
  """One finished batch, padding rows dropped.

  sequences / lengths: {'baseline', 'speculative'} -> [real, steps] int32 / [real].
  stats: the speculative decoder's statistics of the real rows.
  seconds: {'baseline', 'baseline_width_1', 'speculative'} walltimes.
  occupancy: {'baseline', 'speculative'} slot occupancy (`sj.generate_many`), or None
    for fixed batches.
  phases: the speculative decoder's phases (`SlotStats.phases`: inputs [start, stop) of
    the run, gamma, and under gamma='auto' the alpha it was chosen at), or None.
  """
  sequences: Dict[str, np.ndarray]
  lengths: Dict[str, np.ndarray]
  stats: SpeculativeStats
  seconds: Dict[str, float]
  occupancy: Optional[Dict[str, float]] = None
  phases: Optional[List[Dict[str, Any]]] = None

  @property
  def rows(self) -> int:
    return int(len(self.lengths["speculative"]))


class RunProgress:
  """The progress directory of one output directory (see the module docstring)."""

  def __init__(self, directory: str, identity: Dict[str, Any]):
    self.directory = directory
    self.identity = identity
    # Every batch and the step times carry it: what another run wrote (a second run
    # into this directory, whatever its identity.json says) is never read back as ours.
    self.digest = identity_digest(results_lib._jsonable(identity))  # pylint: disable=protected-access

  def _foreign(self, path: str) -> ValueError:
    return ValueError(
        f"{path} was written by another run (its identity differs from this one's: were two "
        f"runs started into {os.path.dirname(self.directory)} at once?): results of two "
        f"configurations are never mixed; delete {self.directory} to decode everything "
        "afresh, or choose another --output_dir")

  def _record_identity(self) -> None:
    path = os.path.join(self.directory, IDENTITY_FILE)
    if not os.path.exists(path):
      results_lib.write_json_atomic(path, self.identity)

  @classmethod
  def open(cls, output_dir: str, identity: Dict[str, Any]) -> "RunProgress":
    """The progress of `output_dir` for a run of `identity`: created when new; resumed
    when it records the same identity; a ValueError naming the differences when it
    records another, or when the directory holds results of a run without a record."""
    directory = os.path.join(output_dir, PROGRESS_DIR)
    identity = dict(identity, format_version=FORMAT_VERSION)
    path = os.path.join(directory, IDENTITY_FILE)
    recorded = results_lib.read_json(path)
    if recorded is None:
      if os.path.exists(os.path.join(output_dir, "results.json")):
        raise ValueError(f"--output_dir={output_dir} holds the results.json of an earlier run "
                         "without its progress record, so this run could not tell whether it "
                         "is the same: choose another --output_dir (or delete that results.json)")
      pass  # Written with the first finished batch: a run that fails before leaves nothing.
    elif results_lib._jsonable(identity) != recorded:  # pylint: disable=protected-access
      raise ValueError(
          f"--output_dir={output_dir} holds a run of another configuration ("
          + "; ".join(differences(recorded, results_lib._jsonable(identity)))  # pylint: disable=protected-access
          + "): results of two configurations are never mixed; choose another --output_dir, "
          f"or delete {directory} to start this one afresh")
    return cls(directory, identity)

  def _batch_path(self, index: int) -> str:
    return os.path.join(self.directory, f"batch_{index:05d}.npz")

  def save_batch(self, index: int, record: BatchRecord) -> None:
    """Writes one finished batch atomically."""
    self._record_identity()
    arrays = {}
    for name in ("baseline", "speculative"):
      arrays[f"sequences_{name}"] = np.asarray(record.sequences[name])
      arrays[f"lengths_{name}"] = np.asarray(record.lengths[name])
    for field in dataclasses.fields(SpeculativeStats):
      value = getattr(record.stats, field.name)
      if value is not None:
        arrays[f"stats_{field.name}"] = np.asarray(value)
    arrays["seconds"] = np.asarray([record.seconds[k] for k in sorted(record.seconds)])
    arrays["seconds_keys"] = np.asarray(sorted(record.seconds))
    if record.occupancy is not None:
      arrays["occupancy"] = np.asarray([record.occupancy[k] for k in sorted(record.occupancy)])
      arrays["occupancy_keys"] = np.asarray(sorted(record.occupancy))
    if record.phases is not None:
      arrays["phases_json"] = np.asarray(json.dumps(results_lib._jsonable(record.phases)))  # pylint: disable=protected-access
    arrays["identity_sha256"] = np.asarray(self.digest)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    results_lib.write_bytes_atomic(self._batch_path(index), buffer.getvalue())

  def batches(self) -> Dict[int, BatchRecord]:
    """{batch index: record} of every finished batch; a ValueError naming a batch that
    another run wrote."""
    out = {}
    if not os.path.isdir(self.directory):
      return out
    for name in sorted(os.listdir(self.directory)):
      if name.startswith("batch_") and name.endswith(".npz"):
        out[int(name[len("batch_"):-len(".npz")])] = self._read_batch(
            os.path.join(self.directory, name))
    return out

  def _read_batch(self, path: str) -> BatchRecord:
    with np.load(path) as data:
      if "identity_sha256" not in data or str(data["identity_sha256"]) != self.digest:
        raise self._foreign(path)
      stats = {f.name: (data[f"stats_{f.name}"] if f"stats_{f.name}" in data else None)
               for f in dataclasses.fields(SpeculativeStats)}
      stats["gamma"] = int(stats["gamma"])
      return BatchRecord(
          sequences={k: data[f"sequences_{k}"] for k in ("baseline", "speculative")},
          lengths={k: data[f"lengths_{k}"] for k in ("baseline", "speculative")},
          stats=SpeculativeStats(**stats),
          seconds=dict(zip([str(k) for k in data["seconds_keys"]],
                           [float(s) for s in data["seconds"]])),
          occupancy=dict(zip([str(k) for k in data["occupancy_keys"]],
                             [float(s) for s in data["occupancy"]]))
          if "occupancy" in data else None,
          phases=json.loads(str(data["phases_json"])) if "phases_json" in data else None)

  def step_times(self) -> Optional[List[Optional[float]]]:
    """[target step, verify cost, draft step] once measured, else None."""
    if not os.path.isdir(self.directory):
      return None
    path = os.path.join(self.directory, STEP_TIMES_FILE)
    recorded = results_lib.read_json(path)
    if recorded is None:
      return None
    if not isinstance(recorded, dict) or recorded.get("identity_sha256") != self.digest:
      raise self._foreign(path)
    return recorded["times"]

  def save_step_times(self, times) -> None:
    self._record_identity()
    results_lib.write_json_atomic(os.path.join(self.directory, STEP_TIMES_FILE),
                                  {"identity_sha256": self.digest, "times": list(times)})
