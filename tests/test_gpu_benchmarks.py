"""scripts/gpu_benchmarks.sh --dry_run: every code path of the GPU benchmark, on CPU at tiny shapes.

(The numbers of a dry run mean nothing; the test checks that the script runs
end to end, writes its JSON and table, and says what the target is.)
"""

import json
import os
import subprocess
import sys

import pytest

# `make test-slow` (CI runs it beside `make test`): the long statistical and method suites.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_benchmarks_dry_run(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHON=sys.executable)
  result = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_benchmarks.sh"), "--dry_run"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  with open(tmp_path / "gpu_benchmarks.json") as f:
    merged = json.load(f)
  ours, hf = merged["ours"], merged["hf"]
  assert ours["dry_run"] and "EMBEDDED" in ours["target_note"] and "9.7M" in ours["target_note"]
  assert ours["target_only_ms_per_token"] > 0 and ours["bandwidth_floor_ms"] > 0
  assert ours["cost_curve"]["1"] == 1.0 and set(ours["c"]) >= {
      "demo small embedded at t5_1_1_small", "random t5_small shape (cost only)"}
  (pair,) = ours["pairs"].values()
  assert pair["identical_rows"] == pair["rows"] == 2 and 0 < pair["alpha"] <= 1
  assert hf is not None and hf["ms_per_token"] > 0
  # Both attention formulations counted and timed (here bf16 on CPU: the pinned
  # float32 counts are tests/test_decode_ops.py's).
  assert set(ours["formulations"]) == {"in_layout", "dots"} and ours["default_attention"] == "dots"
  for f in ours["formulations"].values():
    assert f["ops_per_layer"]["1"] > 0 and f["step_ms"]["target"]["1"] > 0
  table = (tmp_path / "gpu_benchmarks.md").read_text()
  assert "EMBEDDED" in table and "| C(k)" in table and "transformers" in table
  assert "| in_layout |" in table and "| dots |" in table
  # Issue 22: block-verified chain, static and dynamic tree at W = 8 (the dry run
  # skips the token-wise chain, which `ours` runs).
  (block,) = merged["methods"]["widths"].values()
  assert block["verify_cost"] > 0 and len(block["rows"]) == 3
  for row in block["rows"].values():
    assert row["identical_rows"] == row["rows"] == 2 and row["tokens_per_iteration"] >= 1
  assert "| tree (2, 1, 1) |" in table and "(block)" in table
  # Issue 23: the demo feature head embedded with the target, chain and trees.
  features = merged["features"]
  # Issue 32: the pair's one-call drafters (Medusa, DFlash, PARD) beside them, chain and tree.
  assert set(features["c"]) == {"feature head", "small", "medusa", "dflash", "parallel"} and all(
      v > 0 for v in features["c"].values())
  assert len(features["rows"]) == 4 + 2 * 3
  assert {"dflash chain gamma=4", "parallel tree (2, 1, 1)"} <= set(features["rows"])
  for row in features["rows"].values():
    assert row["identical_rows"] == row["rows"] == 2 and row["tokens_per_iteration"] >= 1
  assert "Feature drafts (issue 23)" in table and "| feature chain gamma=4 |" in table
  # Issues 33 and 34: the throughput rows and the MoE cost curves, each in its own file.
  throughput = json.loads((tmp_path / "throughput.json").read_text())
  assert throughput and (tmp_path / "moe_cost_curve.json").exists()
  # The speculative modes' loop efficiency is the product of its four factors (an
  # identity of counts and walls: a factor mis-measured or mis-divided breaks it), and
  # the round-by-round speedup is the median of its rounds.
  (result,) = throughput["results"]
  for row in result["rows"]:
    modes = row["modes"]
    for mode in ("spec, batches", "spec, slots"):
      factors = modes[mode]["efficiency_loop_factors"]
      assert set(factors) == {"acceptance", "occupancy", "starts", "iteration"}
      product = 1.0
      for value in factors.values():
        product *= value
      assert abs(product / modes[mode]["efficiency_loop"] - 1) < 1e-9, (mode, factors)
      # The theory's E[tokens] is that of outputs cut at their lengths: below eq. 1's.
      assert 1 <= modes[mode]["predicted_tokens_per_iteration"] < modes[mode][
          "predicted_tokens_per_iteration_unbounded"], mode
    for mode, r in modes.items():
      rounds = sorted(r["speedup_rounds"])
      assert r["speedup_paired"] == rounds[len(rounds) // 2], mode  # one round or three
      assert 0 < r["occupancy"] <= 1 and r["live_iterations"] <= r["iterations"] * row[
          "batch_size"], mode
  # The evaluation harness on the T5 pair's mini-benchmark at the grown shape (here the
  # tiny dry-run shapes): every method the pair ships on one question, its own greedy
  # equality check passed, its tables written beside.
  evaluate = json.loads((tmp_path / "evaluate.json").read_text())
  assert evaluate["returncode"] == 0 and evaluate["equality"]["passed"], evaluate
  assert set(evaluate["methods"]) == {
      "vanilla", "model", "block", "tree", "dynamic_tree", "prompt_lookup", "model_tiny",
      "ngram", "eagle", "medusa", "dflash", "pard"}
  assert "demo target embedded at t5_1_1_xxl:" in evaluate["target"]
  assert all(m["equal"] == m["total"] == 1 for m in evaluate["methods"].values())
  assert (tmp_path / "evaluate" / "results.md").exists()
