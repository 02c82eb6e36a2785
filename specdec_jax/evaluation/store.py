"""An evaluation's records on disk, so that an interrupted run resumes per (method, input).

output_dir/
  identity.json            what decides the records (benchmark, methods, settings)
  records/METHOD/ID.json   one method's decode of one question, written atomically

A record is written once its method's repeats of that question are done; a
rerun with the same identity reads it back and decodes only what is missing, so
nothing finished is decoded twice and nothing is lost but the question in
flight. Another identity in the same directory is refused, naming what differs.
"""

import hashlib
import json
import os
import re
from typing import Any, Dict, List, Optional

from specdec_jax import results as results_lib

IDENTITY_FILE = "identity.json"
RECORDS_DIR = "records"


def identity_digest(identity: Dict[str, Any]) -> str:
  """sha256 of the identity's canonical JSON."""
  return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _differences(old: Dict[str, Any], new: Dict[str, Any], limit: int = 4) -> List[str]:
  """Which top-level settings differ, in words."""
  keys = sorted(set(old) | set(new))
  out = [f"{k}: {json.dumps(old.get(k), default=str)[:120]} -> "
         f"{json.dumps(new.get(k), default=str)[:120]}" for k in keys if old.get(k) != new.get(k)]
  return out[:limit]


def _file_name(question_id: str) -> str:
  """A file name for any question id: its safe characters, then a short hash (two ids
  that differ only in unsafe characters stay apart)."""
  safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(question_id))[:60]
  return f"{safe}-{hashlib.sha1(str(question_id).encode()).hexdigest()[:8]}.json"


class RecordStore:
  """The records of one evaluation's output directory."""

  def __init__(self, output_dir: str, identity: Dict[str, Any]):
    self.output_dir = output_dir
    self.digest = identity_digest(identity)
    os.makedirs(os.path.join(output_dir, RECORDS_DIR), exist_ok=True)
    path = os.path.join(output_dir, IDENTITY_FILE)
    old = results_lib.read_json(path)
    if old is not None and identity_digest(old) != self.digest:
      raise ValueError(
          f"{output_dir} holds another evaluation's records ({'; '.join(_differences(old, identity))}): "
          "pass another --output_dir, or delete that directory to start again")
    if old is None:
      results_lib.write_json_atomic(path, identity)

  def _path(self, method: str, question_id: str) -> str:
    return os.path.join(self.output_dir, RECORDS_DIR, method, _file_name(question_id))

  def get(self, method: str, question_id: str) -> Optional[Dict[str, Any]]:
    """The stored record, or None; a record of another identity is a ValueError."""
    record = results_lib.read_json(self._path(method, question_id))
    if record is not None and record.get("identity_sha256") != self.digest:
      raise ValueError(f"{self._path(method, question_id)} was written by another evaluation: "
                       "delete the output directory or pass another --output_dir")
    return record

  def put(self, record: Dict[str, Any]) -> None:
    """Writes one record atomically (its method's directory made first)."""
    path = self._path(record["method"], record["question_id"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    results_lib.write_json_atomic(path, dict(record, identity_sha256=self.digest))

  def count(self) -> int:
    """How many records are stored (every method)."""
    root = os.path.join(self.output_dir, RECORDS_DIR)
    return sum(len([f for f in files if f.endswith(".json")]) for _, _, files in os.walk(root))
