import os

import pytest

# Tests run on CPU in float32; keep XLA from grabbing every core for one test.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# JAX's persistent compilation cache, as the launcher and the demo use it (`make test`
# points it at SPECDEC_JAX_CACHE through JAX_COMPILATION_CACHE_DIR, which wins).
from specdec_jax.compile_cache import enable_compile_cache  # noqa: E402

enable_compile_cache()


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long statistical / method suites, run by `make test-slow`")


@pytest.fixture
def record_placements(monkeypatch):
  """`record(family) -> placed`: from then on, `family.load` records in `placed` each
  tensor's (param path, sharding) as its `place` callback puts it on the devices (the
  sharded loaders pass one), so a test sees where every tensor went as it was read."""
  def record(family):
    placed = []
    load = family.load

    def recording_load(path, *, place=None, **kwargs):
      def recording_place(key, array):
        out = place(key, array)
        placed.append((tuple(key), out.sharding))
        return out
      return load(path, place=recording_place, **kwargs)

    monkeypatch.setattr(family, "load", recording_load)
    return placed
  return record


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
  """Drops every compiled decode program after each test module.

  `generate` keeps its programs for the life of the process, and an xdist
  worker lives for the whole suite: without this a worker ends up holding
  every program of every module it ran (hundreds), which is where XLA CPU
  compiles crashed in a full run (twice, in different tree tests that pass
  alone and in every smaller run).
  """
  yield
  import jax
  from specdec_jax.programs import PROGRAMS
  PROGRAMS.clear()
  jax.clear_caches()
