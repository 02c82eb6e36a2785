"""The benchmark harness: a smoke run on tiny configs and its arithmetic."""

import importlib.util
import json
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location("benchmark",
                                               os.path.join(_ROOT, "scripts", "benchmark.py"))
benchmark = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(benchmark)

ROW_FIELDS = {
    "ar_ms_per_token", "ar_tokens_per_s", "spec_ms_per_token", "spec_tokens_per_s", "speedup",
    "speedup_min", "speedup_max", "alpha", "mean_tokens_per_iteration", "c", "block_cost",
    "target_step_ms", "draft_step_ms", "prediction_theorem_3_8", "prediction_generalised",
    "efficiency", "outside_share", "compile_count_before", "compile_count_after", "recompiled",
    "batch_size", "gamma", "temperature", "identical_greedy_outputs", "iteration_ms",
    "iteration_model_ms", "loop_iterations", "ar_outside_share"}


def test_efficiency_hand_computed():
  # alpha 0.5, gamma 2: E = (1 - 0.125) / 0.5 = 1.75 tokens per iteration.
  # Cost per iteration = gamma c + C(3) = 2 * 0.1 + 1.5 = 1.7 target steps.
  # Prediction 1.75 / 1.7 = 1.0294...; efficiency 0.9 / 1.0294... = 0.874285...
  assert benchmark.efficiency(0.9, 0.5, 2, 0.1, [1.0, 1.2, 1.5]) == pytest.approx(
      0.9 * 1.7 / 1.75, rel=1e-12)
  # Free verification (C(k) = 1) reduces to Theorem 3.8: 1.75 / 1.2.
  assert benchmark.efficiency(1.75 / 1.2, 0.5, 2, 0.1, [1.0, 1.0, 1.0]) == pytest.approx(1.0)
  with pytest.raises(ValueError):
    benchmark.efficiency(1.0, 0.5, 3, 0.1, [1.0, 1.2])  # cost curve too short


def test_outside_share_and_paired_ratios():
  assert benchmark.outside_share(10.0, 8.0) == pytest.approx(0.2)
  assert benchmark.outside_share(10.0, 12.0) == 0.0  # clipped: models timed slower alone
  with pytest.raises(ValueError):
    benchmark.outside_share(0.0, 1.0)
  r = benchmark.paired_ratios([4.0, 6.0, 9.0], [2.0, 2.0, 3.0])
  assert (r["median"], r["min"], r["max"]) == (3.0, 2.0, 3.0)
  with pytest.raises(ValueError):
    benchmark.paired_ratios([1.0], [])


def test_smoke_run_has_every_field(tmp_path):
  out = tmp_path / "bench.json"
  benchmark.FLAGS(["benchmark", "--target=tiny", "--draft=", "--draft_noise=0.1",
                   "--vocab_size=64", "--batch_sizes=2", "--gammas=2", "--temperatures=0",
                   "--max_decode_steps=6", "--encoder_length=5", "--repeats=2",
                   "--cost_calls=2", f"--output_json={out}"])
  benchmark.main(["benchmark"])
  result = json.loads(out.read_text())
  assert set(result) == {"machine", "method", "settings", "rows"}
  assert len(result["rows"]) == 1  # one draft x one setting
  for row in result["rows"]:
    assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
    assert len(row["block_cost"]) == row["gamma"] + 1 and row["block_cost"][0] == 1.0
    assert row["tokens_ar"] == row["tokens_spec"] == 2 * 6  # EOS disabled: full length
    assert row["identical_greedy_outputs"] is True  # speculative greedy == AR greedy
    assert row["recompiled"] is False
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    assert row["efficiency"] == pytest.approx(row["speedup"] / row["prediction_generalised"])
  assert result["machine"]["nproc"] >= 1
