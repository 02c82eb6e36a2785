"""One run at a time in an output directory: an advisory lock held while a run writes.

Two launcher runs into one `--output_dir` (say temperature 0 and 1, started from two
shells) would store each other's batches under one record and resume into a mix. The
first run holds `<output_dir>/.lock` (`fcntl.flock`, released by the kernel when the
process ends, even when it is killed: no stale locks); a second one refuses to start,
naming the first (its pid, host, start time and command), or waits for it when asked.

    with OutputLock(output_dir, wait=False):   # ValueError if another run holds it
      ...
"""

import datetime
import errno
import json
import os
import socket
import sys
import time
from typing import Optional

from absl import logging

try:
  import fcntl
except ImportError:  # Not POSIX: no lock (said once when taken).
  fcntl = None

LOCK_FILE = ".lock"


def _holder(handle) -> str:
  """The holder's record in words (pid, host, start, command), or 'another run'."""
  try:
    handle.seek(0)
    record = json.loads(handle.read() or "{}")
  except (OSError, ValueError):
    record = {}
  if not record:
    return "another run"
  command = str(record.get("command"))
  command = command if len(command) <= 160 else command[:157] + "..."
  return (f"another run (pid {record.get('pid')} on {record.get('host')}, started "
          f"{record.get('started')}: {command})")


class OutputLock:
  """The lock of one output directory (see the module docstring).

  wait: block until the run holding it ends, instead of refusing. The directory is
  created if needed.
  """

  def __init__(self, output_dir: str, wait: bool = False, flag: str = "--output_dir"):
    self.output_dir, self.wait, self.flag = output_dir, wait, flag
    self._handle = None
    self._created = False

  def __enter__(self) -> "OutputLock":
    if fcntl is None:
      logging.warning("no file locks on this platform: nothing stops two runs from writing "
                      "into %s at once", self.output_dir)
      return self
    self._created = not os.path.isdir(self.output_dir)
    os.makedirs(self.output_dir, exist_ok=True)
    handle = open(os.path.join(self.output_dir, LOCK_FILE), "a+", encoding="utf-8")
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        # A filesystem without flock (some network mounts): run, but say so.
        logging.warning("could not lock %s (%s): nothing stops two runs from writing into it "
                        "at once", self.output_dir, e.strerror)
        handle.close()
        return self
      holder = _holder(handle)
      if not self.wait:
        handle.close()
        raise ValueError(
            f"{self.flag}={self.output_dir} is in use by {holder}: two runs in one directory "
            f"would mix their results. Wait for it to finish, choose another {self.flag}, "
            "or pass --wait_for_output_dir to wait for it") from None
      print(f"waiting for {holder} to finish with {self.output_dir}", file=sys.stderr)
      started = time.monotonic()
      fcntl.flock(handle, fcntl.LOCK_EX)
      logging.info("lock of %s taken after %.0f s", self.output_dir, time.monotonic() - started)
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(sys.argv)[:400]}))
    handle.flush()
    self._handle = handle
    return self

  def __exit__(self, *exc) -> Optional[bool]:
    if self._handle is not None:
      if self._created and os.listdir(self.output_dir) == [LOCK_FILE]:
        # A run that failed before writing anything leaves no directory behind.
        os.remove(os.path.join(self.output_dir, LOCK_FILE))
        os.rmdir(self.output_dir)
      fcntl.flock(self._handle, fcntl.LOCK_UN)
      self._handle.close()
      self._handle = None
    return None
