"""The absl entry points (experiments/, scripts/) compile, and those that tests
import into one process share absl's one flag namespace without a clash.

Why: entry points are run as `python -m ...` one at a time, so a duplicated flag
name or a syntax error in a rarely run trainer shows only when a user launches it,
or when a test process happens to import two modules that define the same flag
(CI once failed on `--demo_pair`, defined by scripts/benchmark.py and by
experiments/train_feature_heads.py).
"""
import os
import pathlib
import py_compile
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ENTRY_FILES = sorted(p for d in ("experiments", "scripts") for p in (REPO / d).glob("*.py"))


@pytest.mark.parametrize("path", ENTRY_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_entry_point_compiles(path, tmp_path):
  py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


# The entry modules that tests import into their processes, read from the
# tests themselves (so a new test that imports one more is covered), plus the
# scripts a test loads by file; the other entry points run in subprocesses.
def _modules_tests_import():
  found = set()
  for test in (REPO / "tests").glob("*.py"):
    for line in test.read_text().splitlines():
      words = line.strip().replace(",", " ").split()
      if words[:1] == ["from"] and len(words) > 3 and words[2] == "import":
        if words[1] == "experiments":
          found.update(w for w in words[3:] if w != "as" and (REPO / "experiments" / f"{w}.py").exists())
        elif words[1].startswith("experiments."):
          found.add(words[1].split(".")[1])
  return sorted(found)


_IMPORT_TOGETHER = r"""
import importlib, importlib.util, pathlib, sys
from absl import flags
repo = pathlib.Path(sys.argv[1])
modules, scripts = sys.argv[2].split(","), sys.argv[3].split(",")
for name in modules:
  importlib.import_module(f"experiments.{name}")
for name in scripts:
  spec = importlib.util.spec_from_file_location(name, repo / "scripts" / f"{name}.py")
  spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("defined", len(list(flags.FLAGS)))
"""
IN_PROCESS_SCRIPTS = ("benchmark",)  # tests/test_benchmark.py


def test_entry_points_imported_together_define_distinct_flags():
  modules = _modules_tests_import()
  assert {"run", "train_feature_heads"} <= set(modules), modules
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-c", _IMPORT_TOGETHER, str(REPO), ",".join(modules), ",".join(IN_PROCESS_SCRIPTS)],
      capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "defined" in result.stdout


def test_staged_trainers_refuse_unknown_and_empty_stage_lists():
  from experiments import train_stages
  train_stages.check_stages(("data", "train"), ["train"])
  with pytest.raises(ValueError, match=r"unknown stages \['evaluate'\]; known: \('data', 'train'\)"):
    train_stages.check_stages(("data", "train"), ["train", "evaluate"])
  with pytest.raises(ValueError, match="no stages selected"):
    train_stages.check_stages(("data", "train"), [])
