"""A max_decode_steps whose caches cannot fit is an error stating the bytes, before allocation."""

import re
import time

import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.programs import PROGRAMS
from specdec_jax import memory
from specdec_jax.perturbation import perturbed_model


def _bytes_in(message: str) -> int:
  return int(re.search(r"needs (\d+) bytes", message).group(1))


@pytest.mark.parametrize("name", ["tiny", "llama_tiny"])
def test_huge_max_decode_steps_is_an_error_naming_the_bytes(name):
  # Positions past the model's are an error of their own (checked first): allow 10**7.
  room = dict(max_positions=2 * 10**7) if name == "llama_tiny" else {}
  model = sj.load_model(name, vocab_size=64, dtype="float32", **room)
  # Batch 16: ~150 GiB of target cache, more than any CI host holds.
  inputs = np.full((16, 5), 3, np.int32)
  steps = 10**7
  family = sj.family_of(model)
  cache = family.abstract_cache(model.config, 16, 5, steps)
  cache_bytes = memory.tree_bytes(cache)
  draft = perturbed_model(model, 0.1)
  for kwargs, parts in ((dict(), 1), (dict(draft=draft, gamma=3), 2)):
    start = time.perf_counter()
    with pytest.raises(MemoryError, match=r"max_decode_steps=10000000 at batch 16 needs \d+ bytes"
                       r" .*host memory available") as error:
      sj.generate(model, inputs, max_decode_steps=steps, **kwargs)
    # Raised from shapes alone: no compile, no allocation of a 10**7-position cache.
    assert time.perf_counter() - start < 30
    needed = _bytes_in(str(error.value))
    # The target cache (and as much again for a same-shape draft), plus token buffers.
    # (A draft's state also holds a few per-row counters.)
    rest = needed - parts * cache_bytes - 3 * 16 * (steps + 1) * 4
    assert 0 <= rest < 1024, str(error.value)
    assert "target cache" in str(error.value)
    assert ("draft state" in str(error.value)) == bool(kwargs)


def test_memory_check_uses_the_devices_free_memory(monkeypatch):
  model = sj.load_model("tiny", vocab_size=64, dtype="float32")
  inputs = np.full((1, 4), 3, np.int32)
  out = sj.generate(model, inputs, max_decode_steps=6)  # fits: decodes
  assert out.sequences.shape == (1, 6)
  # The same call with less memory than its cache and buffers: an error, and
  # the numbers in it come from the shapes (nothing was allocated for it).
  monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1000)
  with pytest.raises(MemoryError, match=r"only 1000 bytes"):
    sj.generate(model, inputs, max_decode_steps=6)
  planned = PROGRAMS.entries("memory")
  key = [k for k in planned if k[1][0] == model.config and k[-1] == (1, 4)]
  assert key and sum(planned[key[0]].values()) > 1000


def test_available_memory_of_the_host_is_known():
  import jax
  available = memory.available_memory_bytes(jax.devices("cpu")[0])
  assert available is None or available > 0
