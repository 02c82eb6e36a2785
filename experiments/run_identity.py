"""A launcher run's identity: everything that decides its outputs, as JSON.

`experiments.run` keys its stored batches (`experiments.run_progress`) by it, so
that a resumed run reads back only what this very configuration decoded:

  settings     the gin configuration and the Experiment's fields (`describe`)
  inputs       the tokenized rows' sha256 (`rows_digest`): the same text through
               another tokenizer differs
  files        every file or directory the settings name (checkpoints, a
               vocabulary, a draft's tables) by its contents (`file_fingerprints`):
               small files by sha256, large ones (weights) by size and
               modification time; a draft retrained in place is another run

Two identities are compared by `differences`, which names what changed in words.
"""

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

# Files up to this size are read and hashed (configs, tokenizers, index files);
# larger ones (weights) are known by size and modification time: hashing GBs of
# weights at every start would cost more than a short run.
HASHED_BYTES = 1 << 20
# A directory named by a setting is walked to this many files at most (a T5X
# checkpoint holds thousands of tensorstore chunks; stat() is cheap, but not free).
MAX_FILES = 20000


def describe(value) -> Any:
  """A JSON-able description of a configuration value that is stable across processes
  (dataclasses by field, other objects by type: never a memory address)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {"type": type(value).__name__,
            **{f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
  if isinstance(value, (list, tuple)):
    return [describe(v) for v in value]
  if isinstance(value, dict):
    return {str(k): describe(v) for k, v in value.items()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, np.generic):
    return value.item()
  return {"type": type(value).__name__, "source": getattr(value, "source", None)}


def rows_digest(rows: List[List[int]]) -> str:
  """sha256 of the tokenized inputs: the same text through another tokenizer differs."""
  digest = hashlib.sha256()
  for row in rows:
    digest.update(np.asarray(row, np.int64).tobytes())
    digest.update(b"|")
  return digest.hexdigest()


def _strings(value) -> Iterator[str]:
  """Every string leaf of a JSON-able value."""
  if isinstance(value, str):
    yield value
  elif isinstance(value, dict):
    for item in value.values():
      yield from _strings(item)
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _strings(item)


def _file_entry(path: str, stat: os.stat_result) -> str:
  """One file's part of a fingerprint: its content hash when small, else size and
  modification time (ns)."""
  if stat.st_size <= HASHED_BYTES:
    with open(path, "rb") as f:
      return "sha256:" + hashlib.sha256(f.read()).hexdigest()
  return f"size:{stat.st_size}:mtime_ns:{stat.st_mtime_ns}"


def _files(path: str) -> List[Tuple[str, str]]:
  """[(name relative to path, full path)] of a file, or of the files under a directory
  (sorted, at most MAX_FILES)."""
  if os.path.isfile(path):
    return [(os.path.basename(path), path)]
  found = []
  for root, dirs, names in os.walk(path):
    dirs.sort()
    found += [(os.path.relpath(os.path.join(root, n), path), os.path.join(root, n))
              for n in sorted(names)]
    if len(found) >= MAX_FILES:
      break
  return found[:MAX_FILES]


def fingerprint(path: str) -> Dict[str, Any]:
  """{'files', 'bytes', 'sha256'} of a file or of every file under a directory (their
  names, and their contents or sizes and times)."""
  digest, total, found = hashlib.sha256(), 0, _files(path)
  for name, full in found:
    try:
      stat = os.stat(full)
      entry = _file_entry(full, stat)
      total += stat.st_size
    except OSError:  # Removed while walked, or unreadable: part of what it is now.
      entry = "unreadable"
    digest.update(f"{name}\0{entry}\n".encode("utf-8", "surrogateescape"))
  return {"files": len(found), "bytes": total, "sha256": digest.hexdigest()}


def newest_file(path: str) -> Optional[str]:
  """The file last modified under `path`, with its time (what a changed checkpoint's
  message names), or None."""
  newest = None
  for name, full in _files(path):
    try:
      when = os.stat(full).st_mtime_ns
    except OSError:
      continue
    if newest is None or when > newest[0]:
      newest = (when, name)
  if newest is None:
    return None
  when = datetime.datetime.fromtimestamp(newest[0] / 1e9, datetime.timezone.utc)
  return f"{newest[1]} ({when.strftime('%Y-%m-%d %H:%M:%S UTC')})"


def file_fingerprints(settings, output_dir: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
  """{absolute path: fingerprint} of every existing file or directory that a string of
  `settings` (a `describe`d configuration) names; a directory holding `output_dir` is
  left out (the run's own writes would change it)."""
  out = {}
  output = None if output_dir is None else os.path.abspath(output_dir)
  for value in _strings(settings):
    if not value or "\n" in value or len(value) > 4096:
      continue
    path = os.path.abspath(os.path.expanduser(value))
    if path in out or path == os.path.abspath(os.sep):
      continue
    if output is not None and os.path.isdir(path) and (
        output + os.sep).startswith(path.rstrip(os.sep) + os.sep):
      continue
    if os.path.isfile(path) or (os.path.isdir(path) and value not in (".", "..")):
      out[path] = fingerprint(path)
  return out


def identity_digest(identity: Dict[str, Any]) -> str:
  """sha256 of an identity's canonical JSON: what every stored batch carries."""
  return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str)
                        .encode("utf-8")).hexdigest()


def _flat(value, prefix: str = "") -> Dict[str, Any]:
  """Nested dicts as {'a.b.c': leaf}."""
  if not isinstance(value, dict):
    return {prefix: value}
  out = {}
  for key, item in value.items():
    out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
  return out


def _file_differences(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
  """What changed among the files two identities name, in words."""
  out = []
  for path in sorted(set(old) | set(new)):
    before, after = old.get(path), new.get(path)
    if before == after:
      continue
    if before is None or after is None:
      out.append(f"{path} {'is named now' if before is None else 'was named before'}")
    else:
      out.append(f"{path} changed since those batches were decoded ({before['files']} files, "
                 f"{before['bytes']} bytes before; {after['files']} files, {after['bytes']} "
                 f"bytes now; last modified: {newest_file(path)})")
  return out


def differences(old: Dict[str, Any], new: Dict[str, Any], limit: int = 4) -> List[str]:
  """The first `limit` settings, files (or gin lines) in which two identities differ."""
  gin_key, files_key = "gin_config", "files"
  out = _file_differences(old.get(files_key) or {}, new.get(files_key) or {})

  def flat(identity):
    rest = {k: v for k, v in identity.items() if k not in (gin_key, files_key)}
    return {**_flat(rest), gin_key: identity.get(gin_key)}

  old_flat, new_flat = flat(old), flat(new)
  for key in sorted(set(old_flat) | set(new_flat)):
    if old_flat.get(key) == new_flat.get(key):
      continue
    before, after = old_flat.get(key), new_flat.get(key)
    if key == gin_key and isinstance(before, str) and isinstance(after, str):
      lines_before, lines_after = set(before.splitlines()), set(after.splitlines())
      out += [f"gin: {line!r} before" for line in sorted(lines_before - lines_after)]
      out += [f"gin: {line!r} now" for line in sorted(lines_after - lines_before)]
    else:
      out.append(f"{key}: {json.dumps(before)[:120]} before, {json.dumps(after)[:120]} now")
  return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])
