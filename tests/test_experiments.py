"""The experiment launcher, the Table 2 driver and their error handling, on tiny models."""

import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from experiments import reproduce_table2
from experiments import run as run_lib
from experiments.paper_tables import TABLE2
from specdec_jax import tasks
from specdec_jax.core import decoding

ROOT = run_lib.REPO_ROOT
# One layer per stack and short sequences keep each compile to seconds.
SMALL = ["tiny/T5Config.num_encoder_layers = 1", "tiny/T5Config.num_decoder_layers = 1",
         "MAX_INPUT_LENGTH = 32", "MAX_DECODE_STEPS = 12", "Experiment.timing_repeats = 2"]
TINY_FILES = ["configs/pairs/tiny_demo.gin", "configs/tasks/local_file.gin"]


@pytest.fixture
def input_file(tmp_path):
  path = tmp_path / "inputs.jsonl"
  lines = [{"inputs": "hello world"}, {"inputs": "the cat sat on the mat", "targets": "x"},
           {"inputs": "speculative decoding"}, {"inputs": "one more input"}]
  path.write_text("".join(json.dumps(l) + "\n" for l in lines))
  return str(path)


def _launch(args, tmp_path):
  # Cheaper CPU compiles (as tests/test_sharding.py's subprocess): LLVM's
  # optimisation level only, not XLA's HLO passes.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_backend_optimization_level=0 "
                       "--xla_llvm_disable_expensive_passes=true")
  return subprocess.run([sys.executable, "-m", "experiments.run"] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_launcher_end_to_end(tmp_path, input_file):
  out = tmp_path / "out"
  args = [f"--gin_file={f}" for f in TINY_FILES]
  args += [f"--gin_bindings={b}" for b in SMALL]
  args += [f"--gin.INPUT_FILE='{input_file}'", "--gin.GAMMA=3", "--gin.BATCH_SIZE=2",
           f"--output_dir={out}", "--num_examples=3"]
  proc = _launch(args, tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((out / "results.json").read_text())
  assert result["identical_outputs"] is True
  assert result["identical_fraction"] == 1.0
  assert result["num_examples"] == 3 and result["gamma"] == 3 and result["batch_size"] == 2
  assert 0 < result["alpha"] < 1
  assert len(result["per_position_acceptance"]) == 3
  for key in ("walltime_baseline_s", "walltime_speculative_s", "speedup", "c",
              "predicted_speedup", "predicted_speedup_measured_verify_cost", "target_verify_cost"):
    assert result[key] > 0, key
  assert 1 <= result["mean_tokens_per_iteration"] <= 4
  assert result["tokens_baseline"] == result["tokens_speculative"]
  assert "| local | tiny_noisy | 0 | 3 |" in result["markdown_row"]
  assert result["markdown_row"] in (out / "results.md").read_text()
  assert result["markdown_row"] in proc.stdout


def test_launcher_rejects_unknown_binding(tmp_path, input_file):
  out = tmp_path / "out"
  args = [f"--gin_file={f}" for f in TINY_FILES]
  args += [f"--gin.INPUT_FILE='{input_file}'", "--gin.Experiment.no_such_setting=3",
           f"--output_dir={out}"]
  proc = _launch(args, tmp_path)
  assert proc.returncode != 0
  assert "no_such_setting" in proc.stderr
  assert not out.exists()


def _run_in_process(bindings, out):
  run_lib.parse_gin(TINY_FILES, SMALL + bindings)
  try:
    return run_lib.run_experiment(run_lib.Experiment(), str(out))
  finally:
    gin.clear_config()


def test_missing_checkpoint_path(tmp_path, input_file):
  with pytest.raises(FileNotFoundError, match="target checkpoint not found.*no/such/ckpt"):
    _run_in_process([f"INPUT_FILE = '{input_file}'",
                     f"TARGET_CHECKPOINT = '{tmp_path}/no/such/ckpt'"], tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,message", [
    ('{"inputs": "ok"}\n{"inputs": "broken"\n', r"inputs\.jsonl:2: malformed JSON"),
    ('{"inputs": "ok"}\n\n{"text": "x"}\n', r"inputs\.jsonl:3: expected an object with a "
     "string field 'inputs'"),
])
def test_malformed_input_line(tmp_path, content, message):
  path = tmp_path / "inputs.jsonl"
  path.write_text(content)
  with pytest.raises(ValueError, match=message):
    _run_in_process([f"INPUT_FILE = '{path}'"], tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_malformed_tsv_line(tmp_path):
  path = tmp_path / "inputs.tsv"
  path.write_text("a\tb\nc\td\te\n")
  with pytest.raises(ValueError, match=r"inputs\.tsv:2: .* 3 tab-separated columns"):
    _run_in_process([f"INPUT_FILE = '{path}'"], tmp_path / "out")


def test_tokenizer_model_vocab_mismatch(tmp_path, input_file):
  # The byte tokenizer emits ids up to 258; a 128-id model cannot embed them.
  with pytest.raises(ValueError, match="vocabulary mismatch.*258.*128"):
    _run_in_process([f"INPUT_FILE = '{input_file}'", "tiny/T5Config.vocab_size = 128"],
                    tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_sign_test_p_values():
  assert run_lib.sign_test_p_value([1, 1, 1, 1, 1]) == pytest.approx(2 / 32)
  assert run_lib.sign_test_p_value([1, -1, 0, 1, -1]) == 1.0
  assert run_lib.sign_test_p_value([]) == 1.0


def test_table2_row_configs(input_file):
  """Each row's config file, as run_rows binds it, sets the row's gamma, temperature,
  task and draft, and the default block width fits its verification blocks (the
  check run_experiment makes before loading anything). No model is built."""
  for row in TABLE2:
    run_lib.parse_gin([reproduce_table2.row_gin_file(row)],
                      reproduce_table2.row_bindings(row, stand_in=True, input_file=input_file))
    try:
      exp = run_lib.Experiment()
    finally:
      gin.clear_config()
    assert (exp.gamma, exp.temperature, exp.task.name, exp.draft.name) == (
        row.gamma, row.temperature, row.task, row.draft), row.name
    assert exp.draft.perturb_target == reproduce_table2.STAND_IN_NOISE[row.draft], row.name
    assert decoding.resolve_block_width(exp.block_width, exp.gamma) >= exp.gamma + 1
    assert exp.max_decode_steps >= exp.gamma + 1, row.name


@pytest.mark.slow  # long: `make test-slow` (make test stays under 15 minutes)
def test_reproduce_table2_runs_all_rows_and_resumes(tmp_path, input_file, monkeypatch):
  """run_rows runs every row, an interrupted run resumes where it stopped, and the
  table compares every row with the paper's.

  Every row runs end to end on the stand-ins, with its own config file, task,
  draft and temperature, but at one gamma (3): the compiled decoders depend
  only on (gamma, temperature), so 2 compiled sets serve all 12 rows instead
  of 6 (the rows' own gammas: test_table2_row_configs).
  """
  out = str(tmp_path / "table2")
  kwargs = dict(num_examples=2, stand_in=True, input_file=input_file,
                extra=SMALL[:2] + ["MAX_DECODE_STEPS = 10", "Experiment.timing_repeats = 2",
                                   "GAMMA = 3"])
  real_run = run_lib.run_experiment
  calls = []

  def interrupted_run(*args, **kw):
    if len(calls) == 5:
      raise KeyboardInterrupt  # The user presses ^C during the sixth row.
    calls.append(args[1])
    return real_run(*args, **kw)

  monkeypatch.setattr(run_lib, "run_experiment", interrupted_run)
  with pytest.raises(KeyboardInterrupt):
    reproduce_table2.run_rows(out, **kwargs)
  finished = [r.name for r in TABLE2[:5]]
  assert sorted(os.listdir(out)) == sorted(finished)
  stamps = {n: os.stat(os.path.join(out, n, "results.json")).st_mtime_ns for n in finished}

  calls.clear()
  monkeypatch.setattr(run_lib, "run_experiment", lambda *a, **kw: (calls.append(a[1]),
                                                                   real_run(*a, **kw))[1])
  results = reproduce_table2.run_rows(out, **kwargs)
  assert [os.path.basename(c) for c in calls] == [r.name for r in TABLE2[5:]]
  assert {n: os.stat(os.path.join(out, n, "results.json")).st_mtime_ns
          for n in finished} == stamps
  assert set(results) == {r.name for r in TABLE2}
  for row in TABLE2:
    result = results[row.name]
    assert result["gamma"] == 3 and result["temperature"] == row.temperature
    assert result["task"] == row.task and result["draft"] == row.draft
    if row.temperature == 0:
      assert result["identical_outputs"] is True
    else:
      assert "identical_outputs" not in result  # Samples differ by design.
      check = result["distribution_check"]
      assert set(check["p_values"]) == {"length", "mean_log_prob"}
  table = reproduce_table2.comparison_table(results)
  assert len(table.strip().splitlines()) == 2 + 12
  assert "| ende | small | 0 | 7 |" in table and "/ 3.4X" in table


# ---------------------------------------------------------------------------
# Token trees through gin (configs/drafts/tree.gin): T5 here, decoder-only and
# an n-gram tree in tests/test_launcher.py.


def _run_files(files, bindings, out):
  run_lib.parse_gin(files, SMALL + bindings)
  try:
    return run_lib.run_experiment(run_lib.Experiment(), str(out))
  finally:
    gin.clear_config()

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_tree_draft_kind_end_to_end(tmp_path, input_file):
  """configs/drafts/tree.gin around the pair's (T5) model draft: greedy outputs equal
  target-only decoding at the tree's width; the tree's stats reach results.json/md (with
  GAMMA = 4 the tree runs at its shape throughout). Under GAMMA='auto' (the default) it
  is weighed against target-only: the run says which ran, and a tree that never ran
  (its timed iteration losing even with every node accepted) leaves its stats empty."""
  files = TINY_FILES + ["configs/drafts/tree.gin"]
  bindings = [f"INPUT_FILE = '{input_file}'", "Experiment.timing_repeats = 1"]
  auto = _run_files(files, bindings, tmp_path / "auto")
  assert auto["identical_outputs"] is True and auto["gamma_setting"] == "auto"
  ran = any(p["gamma"] for p in auto["gamma_phases"])
  assert (auto["per_rank_acceptance"] is not None) == ran, auto["gamma_phases"]
  assert ran or any("ran target-only throughout" in w for w in auto["warnings"])
  assert ran or "it did not run" in (tmp_path / "auto" / "results.md").read_text()
  out = tmp_path / "out"
  result = _run_files(files, bindings + ["GAMMA = 4"], out)
  assert result == json.loads((out / "results.json").read_text())
  assert result["identical_outputs"] is True and result["identical_fraction"] == 1.0
  assert result["draft"] == "tree2x2x1(tiny_noisy)" and result["block_width"] == 11
  tree = result["tree"]
  assert tree["kind"] == "tree" and tree["branching"] == [2, 2, 1] and tree["num_nodes"] == 11
  assert tree["children"] == "without_replacement" and tree["law"] == "topk"  # greedy
  assert result["gamma"] == 3 and result["verification"] == "token"
  histogram = result["depth_histogram"]
  assert len(histogram) == tree["max_depth"] + 1 and sum(histogram) > 0
  assert len(result["per_rank_acceptance"]) == 2
  assert all(0 <= a <= 1 for a in result["per_rank_acceptance"])
  assert 1 <= result["expected_tokens_per_iteration"] <= 4
  assert result["mean_tokens_per_iteration"] >= 1
  assert sum(result["best_tree_shape"]) >= 1 and result["predicted_speedup"] > 0
  md = (out / "results.md").read_text()
  assert result["markdown_row"] in md and "accepted-depth histogram" in md
  assert "per-rank acceptance" in md


def test_tree_draft_kind_errors(tmp_path, input_file):
  """A block width that cannot hold the tree, block verification, a prompt-lookup tree:
  clear errors before anything compiles, and no results."""
  out = tmp_path / "out"
  files = TINY_FILES + ["configs/drafts/tree.gin"]
  with pytest.raises(ValueError, match=r"11 slots .* pass --gin.BLOCK_WIDTH=11"):
    _run_files(files, [f"INPUT_FILE = '{input_file}'", "BLOCK_WIDTH = 8"], out)
  with pytest.raises(ValueError, match="recursive rejection sampling"):
    _run_files(files, [f"INPUT_FILE = '{input_file}'", "VERIFICATION = 'block'"], out)
  with pytest.raises(ValueError, match="prompt-lookup draft, which gives no distribution"):
    _run_files(files, [f"INPUT_FILE = '{input_file}'", "TreeSpec.inner = @DraftKind()",
                       "DraftKind.kind = 'prompt_lookup'"], out)
  with pytest.raises(ValueError, match="must be >= the block width"):
    _run_files(files, [f"INPUT_FILE = '{input_file}'", "MAX_DECODE_STEPS = 8"], out)
  assert not out.exists()


def test_per_host_rows_of_the_launcher(tmp_path):
  """Per-host input: which examples each process feeds, and a local file read
  for some lines only (the others are counted, not parsed)."""
  layout = run_lib.HostLayout(batch_size=4, processes=2)
  # Batches [0 1 2 3] and [4 5 5 5] (padded with the last example).
  assert layout.example_indices(6, 0) == [0, 1, 4, 5]
  assert layout.example_indices(6, 1) == [2, 3, 5, 5]
  assert run_lib.host_layout(None, 4) is None
  path = tmp_path / "in.jsonl"
  path.write_text('{"inputs": "a"}\n\nnot json\n{"inputs": "c"}\n')
  task = tasks.Task(path=str(path))
  assert task.count() == 3
  assert [e.inputs for e in task.load(indices=[2, 0, 2])] == ["c", "a", "c"]
  with pytest.raises(ValueError, match="malformed JSON"):
    task.load(indices=[1])
  with pytest.raises(ValueError, match="no example 5"):
    task.load(indices=[5])
