"""The launcher's checks before any work (issue 31): every mistake of a first hour gets a
plain message naming the flag that fixes it, all problems of a launch together, and
nothing is loaded or written. No weights, no compiles: each case is a gin parse."""

import json
import os
import stat
import subprocess
import sys

import gin
import pytest

from experiments import launch_checks
from experiments import run as run_lib
from specdec_jax import results as results_lib
from specdec_jax import tasks

ROOT = run_lib.REPO_ROOT


@pytest.fixture
def dirs(tmp_path):
  """(target dir, draft dir, input file, output dir that does not exist yet)."""
  target, draft = tmp_path / "target", tmp_path / "draft"
  target.mkdir()
  draft.mkdir()
  inputs = tmp_path / "inputs.jsonl"
  inputs.write_text(json.dumps({"inputs": "hello"}) + "\n")
  return str(target), str(draft), str(inputs), str(tmp_path / "out")


def check(files, bindings, out, prompt=None, pair="local"):
  try:
    return run_lib.check_launch(pair, files, bindings, [ROOT], out, prompt)
  finally:
    gin.clear_config()


def problems(files, bindings, out, prompt=None, pair="local"):
  with pytest.raises(launch_checks.LaunchError) as error:
    check(files, bindings, out, prompt, pair)
  assert not os.path.exists(out)  # Nothing written.
  return error.value.problems


def quoted(path):
  return f"'{path}'"


def test_a_good_launch_returns_the_experiment(dirs):
  target, draft, inputs, out = dirs
  exp = check(["configs/tasks/local_file.gin"],
              [f"TARGET_CHECKPOINT = {quoted(target)}", f"DRAFT_CHECKPOINT = {quoted(draft)}",
               f"INPUT_FILE = {quoted(inputs)}", "GAMMA = 3"], out)
  assert exp.gamma == 3 and exp.target.checkpoint == target and exp.task.path == inputs
  assert not os.path.exists(out)  # The probe file is gone, and no directory was made.
  exp = check([], [f"TARGET_CHECKPOINT = {quoted(target)}",
                   f"DRAFT_CHECKPOINT = {quoted(draft)}"], out, prompt="def fib(n):")
  assert exp.task.texts == ("def fib(n):",)


def test_required_settings_are_named_with_their_flags(dirs):
  *_, out = dirs
  found = problems([], [], out, prompt="hi")
  assert found == [
      "DRAFT_CHECKPOINT is required: the draft's checkpoint directory: "
      "--gin.DRAFT_CHECKPOINT=\"'/ckpt/draft'\" (or a draft kind without a model: "
      "--gin_file=configs/drafts/prompt_lookup.gin)",
      "TARGET_CHECKPOINT is required: the target's checkpoint directory: "
      "--gin.TARGET_CHECKPOINT=\"'/ckpt/target'\""]


def test_a_tree_needs_its_draft_checkpoint(dirs):
  target, *_, out = dirs
  found = problems(["configs/drafts/tree.gin"], [f"TARGET_CHECKPOINT = {quoted(target)}"], out,
                   prompt="hi")
  assert len(found) == 1 and found[0].startswith("DRAFT_CHECKPOINT is required")


def test_a_draft_kind_needs_no_draft_checkpoint(dirs):
  target, *_, out = dirs
  exp = check(["configs/drafts/prompt_lookup.gin"], [f"TARGET_CHECKPOINT = {quoted(target)}"],
              out, prompt="hi")
  assert exp.draft.kind == "prompt_lookup"


def test_a_task_gin_needs_its_input_file(dirs):
  target, draft, _, out = dirs
  found = problems(["configs/tasks/local_file.gin"],
                   [f"TARGET_CHECKPOINT = {quoted(target)}", f"DRAFT_CHECKPOINT = {quoted(draft)}"],
                   out)
  assert found == ["INPUT_FILE is required: a JSONL or TSV file of inputs: "
                   "--gin.INPUT_FILE=\"'inputs.jsonl'\" (or drop the task gin file and pass "
                   "--prompt=TEXT)"]


def test_input_file_without_the_task_gin(dirs):
  target, draft, inputs, out = dirs
  found = problems([], [f"TARGET_CHECKPOINT = {quoted(target)}",
                        f"DRAFT_CHECKPOINT = {quoted(draft)}", f"INPUT_FILE = {quoted(inputs)}"],
                   out)
  assert found == [run_lib.NO_INPUTS,
                   "--gin.INPUT_FILE: INPUT_FILE is read by configs/tasks/local_file.gin, which "
                   "this run does not load: add --gin_file=configs/tasks/local_file.gin"]


def test_unknown_names_get_the_nearest_known_one(dirs):
  target, draft, _, out = dirs
  good = [f"TARGET_CHECKPOINT = {quoted(target)}", f"DRAFT_CHECKPOINT = {quoted(draft)}"]
  assert problems([], good + ["GAMA = 3"], out, prompt="hi") == [
      "--gin.GAMA: no setting named GAMA; did you mean GAMMA?"]
  found = problems([], good + ["Experiment.gama = 3"], out, prompt="hi")
  assert len(found) == 1 and found[0].startswith(
      "--gin.Experiment.gama: Experiment has no setting 'gama'; did you mean gamma?")
  assert problems([], good + ["Experimnt.gamma = 3"], out, prompt="hi") == [
      "--gin.Experimnt.gamma: no configurable named 'Experimnt'; did you mean Experiment?"]
  # A configurable this configuration never builds: the setting would be ignored.
  found = problems([], good + ["TreeSpec.branching = (4, 2)"], out, prompt="hi")
  assert len(found) == 1 and "builds no TreeSpec" in found[0]


def test_values_gin_cannot_read_get_a_quoting_hint(dirs):
  target, draft, _, out = dirs
  found = problems([], ["TARGET_CHECKPOINT = /ckpt/a", f"DRAFT_CHECKPOINT = {quoted(draft)}",
                        "GAMMA = four"], out, prompt="hi")
  assert found == [
      "--gin.TARGET_CHECKPOINT=/ckpt/a: '/ckpt/a' is not a value gin reads (numbers, True, "
      "False, None, tuples, and strings in quotes); a string needs quotes inside the shell's: "
      "--gin.TARGET_CHECKPOINT=\"'/ckpt/a'\"",
      "--gin.GAMMA=four: 'four' is not a value gin reads (numbers, True, False, None, tuples, "
      "and strings in quotes); a string needs quotes inside the shell's: "
      "--gin.GAMMA=\"'four'\""]  # And no 'TARGET_CHECKPOINT is required' besides.


@pytest.mark.parametrize("binding,message", [
    ("GAMMA = -2", "GAMMA must be an int >= 1 or 'auto', got -2: set --gin.GAMMA"),
    ("GAMMA = 2.5", "GAMMA must be an int >= 1 or 'auto', got 2.5: set --gin.GAMMA"),
    ("GAMMA = 'best'", "GAMMA must be an int >= 1 or 'auto', got 'best': set --gin.GAMMA"),
    ("TEMPERATURE = -1.0", "TEMPERATURE must be a number >= 0, got -1.0: set --gin.TEMPERATURE"),
    ("BATCH_SIZE = 0", "BATCH_SIZE must be an int >= 1, got 0: set --gin.BATCH_SIZE"),
    ("Experiment.topp = 2.0", "Experiment.topp must be None (no top-p filtering) or a mass in "
     "(0, 1], got 2.0: set --gin.Experiment.topp"),
    ("VERIFICATION = 'blok'", "VERIFICATION must be one of ['block', 'token'], got 'blok'"),
    ("MAX_DECODE_STEPS = 3", "MAX_DECODE_STEPS (3) must be >= GAMMA + 1 (5)"),
    ("BLOCK_WIDTH = 0", "BLOCK_WIDTH must be an int >= 1, got 0: set --gin.BLOCK_WIDTH"),
])
def test_types_and_ranges_name_the_setting(dirs, binding, message):
  target, draft, _, out = dirs
  found = problems([], [f"TARGET_CHECKPOINT = {quoted(target)}",
                        f"DRAFT_CHECKPOINT = {quoted(draft)}", binding], out, prompt="hi")
  assert len(found) == 1 and found[0].startswith(message), found


def test_output_dir_under_a_file_is_caught_first(dirs, tmp_path):
  target, draft, *_ = dirs
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  out = str(a_file / "run")
  found = problems([], [f"TARGET_CHECKPOINT = {quoted(target)}",
                        f"DRAFT_CHECKPOINT = {quoted(draft)}"], out, prompt="hi")
  assert found == [f"--output_dir={out}: {a_file} is a file, not a directory; choose another "
                   "--output_dir"]
  assert launch_checks.output_dir_problem(None).startswith("--output_dir is required")


def test_every_problem_is_reported_together(dirs, tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  with pytest.raises(launch_checks.LaunchError) as error:
    check([], ["GAMA = 3", "TARGET_CHECKPOINT = /ckpt/a"], str(a_file / "out"), prompt="hi")
  message = str(error.value)
  assert message.startswith("4 problems (nothing was loaded or written):\n  - --output_dir=")
  for part in ("GAMA", "TARGET_CHECKPOINT=/ckpt/a", "DRAFT_CHECKPOINT is required"):
    assert part in message


def test_bad_input_files_name_the_file_and_line(dirs, tmp_path):
  target, draft, _, out = dirs
  good = [f"TARGET_CHECKPOINT = {quoted(target)}", f"DRAFT_CHECKPOINT = {quoted(draft)}"]
  latin = tmp_path / "latin.tsv"
  latin.write_bytes("fine\ncaf\xe9 au lait\n".encode("latin-1"))
  found = problems(["configs/tasks/local_file.gin"], good + [f"INPUT_FILE = {quoted(latin)}"],
                   out)
  assert found == [f"{latin}:2: not UTF-8 (byte 0xe9 at column 4): input files must be UTF-8; "
                   "convert it, e.g. iconv -f latin1 -t utf-8 latin.tsv > fixed.tsv"]
  fields = tmp_path / "fields.jsonl"
  fields.write_text(json.dumps({"prompt": "hi"}) + "\n")
  found = problems(["configs/tasks/local_file.gin"], good + [f"INPUT_FILE = {quoted(fields)}"],
                   out)
  assert found == [f"{fields}:1: expected an object with a string field 'inputs' (its fields: "
                   "['prompt']); another field name: set Task.input_field"]
  assert problems(["configs/tasks/local_file.gin"], good + ["INPUT_FILE = '/no/such.jsonl'"],
                  out) == ["input file not found: '/no/such.jsonl'"]


def test_missing_checkpoints_are_named(dirs):
  *_, out = dirs
  found = problems([], ["TARGET_CHECKPOINT = '/no/target'", "DRAFT_CHECKPOINT = '/no/draft'"],
                   out, prompt="hi")
  assert found == ["target checkpoint not found: '/no/target'",
                   "draft checkpoint not found: '/no/draft'"]


def test_a_setting_nothing_reads_is_a_warning(dirs, capsys):
  target, draft, _, out = dirs
  exp = check(["configs/drafts/prompt_lookup.gin"], [f"TARGET_CHECKPOINT = {quoted(target)}",
                                                     f"DRAFT_CHECKPOINT = {quoted(draft)}"],
              out, prompt="hi")
  assert exp.draft.kind == "prompt_lookup"
  assert ("warning: --gin.DRAFT_CHECKPOINT is set but nothing in this configuration reads it"
          in capsys.readouterr().err)


def test_the_command_line_prints_every_problem_without_a_traceback(tmp_path):
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--pair=local", "--gin.GAMA=3",
       "--gin.GAMMA=four", "--prompt=hi", f"--output_dir={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" not in proc.stderr
  assert "error: 4 problems (nothing was loaded or written):" in proc.stderr
  for part in ("--gin.GAMMA=four", "did you mean GAMMA?", "TARGET_CHECKPOINT is required",
               "DRAFT_CHECKPOINT is required"):
    assert part in proc.stderr
  assert not out.exists()


def test_result_files_are_readable_by_the_group(tmp_path):
  path = tmp_path / "results.json"
  results_lib.write_json_atomic(str(path), {"a": 1})
  old = os.umask(0o022)
  try:
    results_lib.write_json_atomic(str(path), {"a": 2})
  finally:
    os.umask(old)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_a_local_task_reads_crlf_utf8(tmp_path):
  path = tmp_path / "in.tsv"
  path.write_bytes("naïve\ttarget\r\nsecond\r\n".encode("utf-8"))
  assert [e.inputs for e in tasks.load_local(str(path))] == ["naïve", "second"]
  assert tasks.count_local(str(path)) == 2


def test_tree_statistics_name_the_deepest_node_max_depth():
  """A tree's SpeculativeStats.gamma is the loop's deepest node; summary() calls it
  max_depth (results.json's tree.max_depth), leaving gamma for the tree's depth."""
  import numpy as np
  from specdec_jax.core.outputs import SpeculativeStats
  zeros = np.zeros((1,), np.int32)
  fields = dict(iterations=zeros + 2, drafted=zeros + 6, accepted=zeros + 3,
                accepted_raw=zeros + 3, position_accepted=np.zeros((1, 6)),
                position_drafted=np.ones((1, 6)), beta_sum=np.ones(1), beta_count=zeros + 2,
                emitted=zeros + 5)
  tree = SpeculativeStats(gamma=6, depth_histogram=np.ones((1, 7)),
                          rank_tried=np.ones((1, 2)), rank_accepted=np.ones((1, 2)), **fields)
  assert tree.summary()["max_depth"] == 6 and "gamma" not in tree.summary()
  chain = SpeculativeStats(gamma=4, **fields)
  assert chain.summary()["gamma"] == 4 and "max_depth" not in chain.summary()
