"""The notebooks run top to bottom, and are stored without outputs.

Each notebook executes with nbclient in a kernel started from this test's own
Python (`sys.executable`, through a kernel spec written to a temporary
JUPYTER_PATH), with `SPECDEC_NOTEBOOK_SMALL=1` (small settings), the Agg
matplotlib backend and JAX on CPU, under a per-notebook time limit. Each
notebook's last cell asserts what it demonstrated, so a notebook whose claim
stops holding fails here.
"""

import glob
import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install "
                               "-e '.[notebooks]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install "
                               "-e '.[notebooks]')")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))
KERNEL_NAME = "specdec-notebook-test"
# Seconds per notebook (whole run) and per cell; the small settings take far less
# on an idle 2-core machine.
NOTEBOOK_TIMEOUT = 480
CELL_TIMEOUT = 300


def test_notebooks_exist():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  for expected in ("01_quickstart.ipynb", "02_exactness.ipynb", "03_speedup_theory.ipynb",
                   "04_t5_xxl.ipynb"):
    assert expected in names, f"notebooks/{expected} is missing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_outputs_are_stripped(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type != "code":
      continue
    assert cell.get("outputs") == [], f"{os.path.basename(path)} cell {i} has outputs: strip them"
    assert cell.get("execution_count") is None, (
        f"{os.path.basename(path)} cell {i} has an execution_count: strip it")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_first_cell_installs(path):
  nb = nbformat.read(path, as_version=4)
  first_code = next(c for c in nb.cells if c.cell_type == "code")
  assert 'find_spec("specdec_jax") is None' in first_code.source, (
      "the first code cell must install specdec_jax only when it is missing")


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
  """A kernel spec that starts this very interpreter, found through JUPYTER_PATH."""
  root = tmp_path_factory.mktemp("jupyter")
  spec_dir = root / "kernels" / KERNEL_NAME
  spec_dir.mkdir(parents=True)
  spec = {
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "specdec_jax notebook tests",
      "language": "python",
      "env": {
          "SPECDEC_NOTEBOOK_SMALL": "1",
          "MPLBACKEND": "Agg",
          "JAX_PLATFORMS": "cpu",
          "PYTHONPATH": REPO,
          # Cheaper CPU compiles (as tests/test_sharding.py's subprocess): every
          # cell still runs and every assertion is unchanged; notebook 04 adds
          # its device count to these flags.
          "XLA_FLAGS": "--xla_backend_optimization_level=0 "
                       "--xla_llvm_disable_expensive_passes=true",
      },
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  old = os.environ.get("JUPYTER_PATH")
  os.environ["JUPYTER_PATH"] = str(root) + (os.pathsep + old if old else "")
  yield
  if old is None:
    del os.environ["JUPYTER_PATH"]
  else:
    os.environ["JUPYTER_PATH"] = old


# One xdist worker runs every notebook: kernels started side by side have
# raced for ports on this machine class.
@pytest.mark.xdist_group("notebooks")
@pytest.mark.timeout(NOTEBOOK_TIMEOUT + 60)
# make test-slow runs every notebook (each runs tens of seconds: the make test budget);
# make test checks that they exist, are stripped and install first (above).
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernel_env):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT, allow_errors=False,
      resources={"metadata": {"path": NOTEBOOK_DIR}})
  import time
  start = time.monotonic()
  client.execute()
  elapsed = time.monotonic() - start
  print(f"{os.path.basename(path)}: {elapsed:.1f} s")
  assert elapsed < NOTEBOOK_TIMEOUT, f"{os.path.basename(path)} took {elapsed:.0f} s"
