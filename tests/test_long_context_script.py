"""scripts/long_context.py at tiny sizes: every part runs, the JSON has its keys, greedy
outputs are equal, the memory formulas are the hand-computed ones, and a rerun resumes."""

import importlib.util
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

import specdec_jax as sj

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location(
    "long_context", os.path.join(_ROOT, "scripts", "long_context.py"))
long_context = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(long_context)

PREFIX_FIELDS = {"written", "allocated_a", "allocated_b", "ms_per_token_a", "ms_per_token_b",
                 "ratio_b_over_a", "equal", "seconds"}
MEMORY_FIELDS = {"context", "positions", "layout", "plan_bytes", "full_bytes",
                 "layout_bytes", "plan_over_full"}
SPEEDUP_FIELDS = {"context", "batch", "target_s", "start_s", "target_ms_per_step", "drafts"}
DRAFT_FIELDS = {"spec_s", "speedup", "alpha", "acceptance_rate", "tokens_per_iteration",
                "equal"}


def _options(path, **overrides):
  opts = dict(parts=["prefix", "memory", "speedup"], max_context=64, min_context=64,
              allocated=384, decode_steps=4, prefix_timing="loop", attention_chunks=[32, 0],
              memory_contexts=[64, 128],
              memory_configs=["llama_tiny", "mixtral_tiny", "deepseek_v3_tiny"],
              memory_dtype="bfloat16", speedup_contexts=[128], batch_sizes=[2],
              speedup_steps=8, budget=64, gamma=3, repeats=1, speedup_repeats=1, num_layers=1,
              scale_to="", output_json=str(path))
  opts.update(overrides)
  return SimpleNamespace(**opts)


def test_every_part_at_tiny_sizes_then_resumes(tmp_path, monkeypatch, capsys):
  path = tmp_path / "long_context.json"
  long_context.run(_options(path))
  doc = json.loads(path.read_text())
  assert {"settings", "selection", "models", "corpus_tokens", "machine", "prefix", "memory",
          "speedup", "load_average", "date"} <= set(doc)
  assert "random weights" in doc["models"]["target"]
  assert set(doc["prefix"]) == {"chunk32", "chunk0"}
  for by_length in doc["prefix"].values():
    assert set(by_length) == {"64"}
    row = by_length["64"]
    assert PREFIX_FIELDS <= set(row), PREFIX_FIELDS - set(row)
    assert row["equal"] is True  # (a), (b) and sj.generate: the same greedy tokens
    assert row["allocated_a"] == row["written"] + 2 * 4 - 1 and row["allocated_b"] == 384
  for name, by_context in doc["memory"].items():
    assert set(by_context) == {"64", "128"}
    for row in by_context.values():
      assert MEMORY_FIELDS <= set(row)
      assert row["plan_bytes"] <= row["full_bytes"]
      if name == "llama_tiny":  # a full cache stays full
        assert row["plan_bytes"] == row["full_bytes"] == row["layout_bytes"]
  assert set(doc["speedup"]) == {"128x2"}
  for row in doc["speedup"].values():
    assert SPEEDUP_FIELDS <= set(row)
    assert set(row["drafts"]) == {"model draft", "window", "retrieval"}
    for name, draft in row["drafts"].items():
      assert "error" not in draft, (name, draft)
      if "skipped" in draft:
        assert not hasattr(sj, "SparseCacheDraft") and name != "model draft"
        continue
      assert DRAFT_FIELDS <= set(draft)
      assert draft["equal"] is True, name  # greedy: identical to target-only
  out = capsys.readouterr().out
  assert "| written L |" in out and "| config |" in out and "| context | batch |" in out

  # The same settings, a longer max_context: the row held is kept, one is added.
  computed = []
  prefix_row = long_context.prefix_row
  monkeypatch.setattr(long_context, "prefix_row",
                      lambda model, prompt, *a, **k: computed.append(prompt.shape[1]) or
                      prefix_row(model, prompt, *a, **k))
  long_context.run(_options(path, parts=["prefix"], max_context=96, attention_chunks=[32]))
  assert computed == [96]
  prefix = json.loads(path.read_text())["prefix"]
  assert set(prefix["chunk32"]) == {"64", "96"} and set(prefix["chunk0"]) == {"64"}


def test_prefix_through_generate_equals_the_loop():
  pair, target, _, _ = long_context.build_models(256, num_layers=1)
  prompt = long_context.long_rows(long_context.corpus_stream(pair.heldout), 1, 32)
  row = long_context.prefix_row(target, prompt, 96, 2, 1, timing="generate")
  assert row["equal"] is True and row["allocated_b"] == 96


def test_inputs_are_the_corpus_cycled():
  stream = np.arange(10, dtype=np.int32)
  rows = long_context.long_rows(stream, 2, 7)
  np.testing.assert_array_equal(rows, [[0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 0, 1]])
  np.testing.assert_array_equal(long_context.right_padded(rows[:, :2], 4, 9),
                                [[0, 1, 9, 9], [5, 6, 9, 9]])
  heldout = [dict(input_ids=[5, 6], target_ids=[7, 0, 0]), dict(input_ids=[8], target_ids=[9])]
  np.testing.assert_array_equal(long_context.corpus_stream(heldout), [5, 6, 7, 8, 9])
  assert long_context.written_lengths(512, 8192) == [512, 1024, 2048, 4096, 8192]
  assert long_context.written_lengths(64, 160) == [64, 128, 160]


def test_memory_formulas_by_hand():
  get = sj.get_decoder_config
  # Llama-3.1-8B, bfloat16, 32k positions: 2 * 32 layers * 8 kv heads * 128 * 32768 * 2 B.
  assert (long_context.full_cache_bytes(get("llama_3_1_8b"), 32768, 2) ==
          2 * 32 * 8 * 128 * 32768 * 2)
  # DeepSeek-V3: 61 layers * 128 heads * (128 + 64 + 128) per position; latent 512 + 64.
  deepseek = get("deepseek_v3")
  assert long_context.full_cache_bytes(deepseek, 4096, 2) == 61 * 128 * 320 * 4096 * 2
  assert long_context.layout_cache_bytes(deepseek, 4096, 2) == 61 * 576 * 4096 * 2
  assert long_context.layout_name(deepseek) == "latent"
  # Mistral-7B: every layer a 4k window; Gemma-2-9B: every other layer.
  mistral, gemma = get("mistral_7b"), get("gemma2_9b")
  assert long_context.layout_cache_bytes(mistral, 32768, 2) == 2 * 32 * 8 * 128 * 4096 * 2
  assert long_context.layout_cache_bytes(gemma, 32768, 2) == 2 * 8 * 256 * 2 * (
      21 * 4096 + 21 * 32768)
  assert long_context.layout_name(gemma) == "window 4096 (21/42 layers)"
  row = long_context.memory_row(get("llama_tiny"), 100, "bfloat16")
  assert row["positions"] == 100 and row["plan_bytes"] == row["full_bytes"]


def test_fastest_needs_a_timed_round():
  with pytest.raises(ValueError, match="repeats must be >= 1"):
    long_context._fastest({"a": lambda: 1}, 0)
  seconds, outs = long_context._fastest({"a": lambda: 1, "b": lambda: 2}, 2)
  assert set(seconds) == {"a", "b"} and outs == {"a": 1, "b": 2}


def test_unknown_part_is_refused_before_any_work(tmp_path):
  with pytest.raises(ValueError, match=r"unknown parts \['prefixes'\]"):
    long_context.run(_options(tmp_path / "x.json", parts=["prefixes"]))
  assert not (tmp_path / "x.json").exists()
