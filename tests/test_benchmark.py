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

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

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


def test_parse_methods_flags():
  assert benchmark.parse_trees("4,2,2,1; 2,2,1") == [(4, 2, 2, 1), (2, 2, 1)]
  assert benchmark.parse_trees("") == []
  assert benchmark.parse_dynamic_trees("4,4,16") == [(4, 4, 16)]
  with pytest.raises(ValueError):
    benchmark.parse_dynamic_trees("4,4")
  with pytest.raises(ValueError):
    benchmark.parse_trees("2,0")
  # Scenario predictions: tokens / (calls c + C(W)).
  pred = benchmark.accelerator_predictions(3.0, 2, [0.9], [0.05])
  assert pred == {"C=0.9,c=0.05": pytest.approx(3.0 / (2 * 0.05 + 0.9))}


@pytest.mark.slow  # long: `make test-slow` (make test stays under 15 minutes)
def test_methods_side_by_side(tmp_path):
  """--verifications/--trees/--dynamic_trees: every method at one width, tiny models."""
  out = tmp_path / "methods.json"
  try:
    benchmark.FLAGS(["benchmark", "--target=tiny", "--draft=", "--draft_noise=0.1",
                     "--vocab_size=64", "--batch_sizes=1", "--gammas=2", "--temperatures=0",
                     "--max_decode_steps=6", "--encoder_length=5", "--repeats=1",
                     "--cost_calls=2", "--verifications=token,block", "--trees=2,1",
                     "--dynamic_trees=2,2,4", "--block_width=5", f"--output_json={out}"])
    with pytest.raises(ValueError, match="block_width"):
      benchmark.method_width(benchmark.build_methods(
          benchmark.perturbed_model(benchmark.load("tiny", 64, 0), 0.1, 1), 2, ["token"],
          [(2, 2)], []), 4)  # a (2, 2) tree has 7 slots
    benchmark.main(["benchmark"])
  finally:
    benchmark.FLAGS.unparse_flags()
  result = json.loads(out.read_text())
  assert set(result) == {"machine", "method", "settings", "results"}
  assert [r["temperature"] for r in result["results"]] == [0.0]
  for res in result["results"]:
    assert res["block_width"] == 5 and res["baseline"] in ("target W=1", "target W=5")
    assert res["cost_curve"]["1"] == 1.0 and set(res["cost_curve"]) >= {"1", "5"}
    assert res["recompiled"] is False
    kinds = [r["kind"] for r in res["methods"]]
    assert kinds == ["chain", "block", "tree", "dynamic_tree"]
    for r in res["methods"]:
      assert 1.0 <= r["tokens_per_iteration"] <= 5
      assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
      assert r["draft_calls"] == 2  # gamma 2; trees of depth 2
      assert len(r["accelerator_predictions"]) == 2 * 3
      if res["temperature"] == 0:
        assert r["identical_greedy_outputs"] is True
    chain, block, tree, dynamic = res["methods"]
    assert chain["predicted_tokens_per_iteration"] > 0
    assert block["predicted_tokens_per_iteration"] is None
    assert tree["predicted_tokens_per_iteration"] >= 1 and "per_rank_acceptance" in tree["stats"]
    assert dynamic["best_static_expected_tokens"] >= 1
