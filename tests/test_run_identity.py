"""Runs that never lie (issue 55): what a rerun resumes is what this very run would
decode, and the launcher's small mistakes fail clearly, before any work.

As a user hits them: two launcher processes into one --output_dir, a draft checkpoint
retrained in place between two runs, a batch another run wrote, an --output_dir that
os.access calls writable, a JSONL with a byte-order mark, the launcher run from outside
the repository, a hub id offline, a draft of a smaller vocabulary, the progress bar's
last count.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import gin
import numpy as np
import pytest

import specdec_jax as sj
from experiments import launch_checks
from experiments import run as run_lib
from experiments import run_identity
from experiments.output_lock import OutputLock
from experiments.run_progress import BatchRecord, RunProgress
from specdec_jax.core.outputs import SpeculativeStats
from specdec_jax import tasks
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS

tokenizers = pytest.importorskip("tokenizers")
from test_launcher import PROMPTS, SMALL, _bpe, _input_file, _launch, _random, _run  # noqa: E402

ROOT = run_lib.REPO_ROOT
FILES = ["configs/pairs/local.gin", "configs/tasks/local_file.gin"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """(target dir, draft dir) of a tiny llama pair with a BPE tokenizer.json."""
  root = tmp_path_factory.mktemp("pair")
  target, draft = root / "target", root / "draft"
  sj.export_hf(_random(DECODER_CONFIGS["llama_tiny"].replace(num_layers=1), 0), str(target))
  sj.export_hf(_random("llama_tiny_draft", 1), str(draft))
  _bpe(target / "tokenizer.json", bos=True)
  return target, draft


def _bindings(llama, tmp_path, prompts=PROMPTS, **more):
  target, draft = llama
  return [f"TARGET_CHECKPOINT = '{target}'", f"DRAFT_CHECKPOINT = '{draft}'",
          f"INPUT_FILE = '{_input_file(tmp_path, prompts)}'"] + [
              f"{k} = {v!r}" for k, v in more.items()]


def _flags(bindings, out, *extra):
  return (["--pair=local", "--gin_file=configs/tasks/local_file.gin", f"--output_dir={out}"]
          + [f"--gin_bindings={b}" for b in SMALL + bindings] + list(extra))


def test_two_launchers_into_one_output_dir_never_mix(llama, tmp_path):
  """Temperature 0 and 1 started at once into one --output_dir: one runs, the other is
  refused with a message naming why (the first holds the directory, or, if the first
  finished before the second started, its record is of another configuration); the
  directory then holds the winner's batches only, and its rerun resumes them all."""
  out = tmp_path / "out"
  commands = {t: _flags(_bindings(llama, tmp_path, TEMPERATURE=float(t)), out) for t in (0, 1)}
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")
  procs = {t: subprocess.Popen([sys.executable, "-m", "experiments.run"] + args, cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for t, args in commands.items()}
  finished = {t: p.communicate(timeout=600) + (p.returncode,) for t, p in procs.items()}
  codes = {t: f[2] for t, f in finished.items()}
  assert sorted(codes.values()) == [0, 1], {t: f[1][-2000:] for t, f in finished.items()}
  [winner] = [t for t, code in codes.items() if code == 0]
  refused = finished[1 - winner][1]
  assert (f"--output_dir={out} is in use by another run (pid {procs[winner].pid}" in refused
          or f"--output_dir={out} holds a run of another configuration" in refused), refused
  result = json.loads((out / "results.json").read_text())
  assert result["temperature"] == float(winner)
  again = _launch(commands[winner])
  assert again.returncode == 0, again.stderr[-2000:]
  assert re.search(r"resuming: (\d+) of \1 batches already decoded", again.stderr)
  resumed = json.loads((out / "results.json").read_text())
  assert resumed["completions"] == result["completions"]


def test_a_run_holding_the_directory_refuses_a_second_before_any_work(llama, tmp_path):
  """A second launcher process while one holds --output_dir: exit 1 at once, naming the
  holder's pid and the way out; nothing written."""
  out = tmp_path / "out"
  with OutputLock(str(out)):
    proc = _launch(_flags(_bindings(llama, tmp_path), out))
  assert proc.returncode == 1
  assert (f"error: --output_dir={out} is in use by another run (pid {os.getpid()} on "
          in proc.stderr), proc.stderr[-2000:]
  assert ("would mix their results. Wait for it to finish, choose another --output_dir, or "
          "pass --wait_for_output_dir to wait for it") in proc.stderr
  assert "compiling" not in proc.stderr and not out.exists()  # The holder made it, and left.


def test_the_lock_waits_when_asked_and_is_free_after_a_run(tmp_path):
  """wait=True blocks until the holder lets go; a released lock (a finished or killed run:
  the kernel drops it with the process) is taken at once."""
  out = str(tmp_path / "out")
  taken = threading.Event()
  holder = OutputLock(out).__enter__()

  def second():
    with OutputLock(out, wait=True):
      taken.set()

  thread = threading.Thread(target=second)
  thread.start()
  assert not taken.wait(0.5)  # Blocked while held.
  holder.__exit__(None, None, None)
  assert taken.wait(10)
  thread.join()
  with OutputLock(out):  # Free again.
    pass


def _finished(bindings, out):
  run_lib.parse_gin(FILES, SMALL + bindings)
  try:
    return run_lib.finished_results(run_lib.Experiment(), str(out))
  finally:
    gin.clear_config()


def test_a_draft_retrained_in_place_is_not_resumed(llama, tmp_path):
  """The same command after the draft checkpoint was rewritten in place: refused, naming
  the checkpoint that changed (its weights' size or time); a config.json rewritten with
  the same contents changes nothing (small files are known by their hash)."""
  target, draft = llama
  copy = tmp_path / "draft"
  shutil.copytree(draft, copy)
  bindings = _bindings((target, copy), tmp_path)
  out = tmp_path / "out"
  first = _run(FILES, bindings, out)
  config = copy / "config.json"
  config.write_text(config.read_text())  # Same bytes, new time: still the same run.
  assert _run(FILES, bindings, out)["completions"] == first["completions"]
  assert _finished(bindings, out) == first  # What reproduce_table2 skips a row by.
  sj.export_hf(_random("llama_tiny_draft", 7), str(copy))  # Retrained in place.
  os.utime(copy / "model.safetensors", ns=(time.time_ns(), time.time_ns() + 10**9))
  with pytest.raises(ValueError) as error:
    _run(FILES, bindings, out)
  message = str(error.value)
  with pytest.raises(ValueError, match="changed since those batches were decoded"):
    _finished(bindings, out)  # A driver of many runs does not skip it either.
  assert message.startswith(f"--output_dir={out} holds a run of another configuration ({copy} "
                            "changed since those batches were decoded (")
  assert "last modified: model.safetensors" in message
  assert f"or delete {out}/progress to start this one afresh" in message


def test_fingerprints_know_small_files_by_content_and_large_ones_by_size_and_time(tmp_path,
                                                                                  monkeypatch):
  monkeypatch.setattr(run_identity, "HASHED_BYTES", 8)
  directory = tmp_path / "ckpt"
  directory.mkdir()
  (directory / "config.json").write_text("{}")
  (directory / "weights.bin").write_bytes(b"0123456789")
  settings = {"target": {"checkpoint": str(directory)}, "name": "model", "gamma": 4}
  before = run_identity.file_fingerprints(settings)
  assert list(before) == [str(directory)] and before[str(directory)]["files"] == 2
  os.utime(directory / "config.json", ns=(1, 1))
  assert run_identity.file_fingerprints(settings) == before  # Hashed: the time is no part.
  (directory / "weights.bin").write_bytes(b"9876543210")  # Same size, a new time.
  os.utime(directory / "weights.bin", ns=(5, 5))
  after = run_identity.file_fingerprints(settings)
  assert after != before
  [line] = run_identity.differences({"files": before}, {"files": after})
  assert line.startswith(f"{directory} changed since those batches were decoded (2 files, 12 "
                         "bytes before; 2 files, 12 bytes now; last modified:")
  # A directory holding the output directory is no identity of the run (its writes).
  assert run_identity.file_fingerprints({"p": str(tmp_path)}, str(tmp_path / "out")) == {}


def _record() -> BatchRecord:
  """A finished batch of one row (what is stored, not what it means)."""
  one = np.ones(1, np.int32)
  stats = SpeculativeStats(gamma=2, iterations=one, drafted=one, accepted=one,
                           accepted_raw=one, position_accepted=np.ones((1, 2), np.int32),
                           position_drafted=np.ones((1, 2), np.int32),
                           beta_sum=np.ones(1, np.float32), beta_count=one, emitted=one)
  sequences = {k: np.ones((1, 4), np.int32) for k in ("baseline", "speculative")}
  return BatchRecord(sequences=sequences, lengths={k: one for k in sequences}, stats=stats,
                     seconds={"baseline": 1.0, "baseline_width_1": 0.0, "speculative": 0.5})


def test_a_batch_another_run_wrote_is_refused(tmp_path):
  """Two runs' batches in one progress directory (written without the lock, e.g. across
  machines on a shared disk): the rerun names the foreign batch instead of resuming."""
  ours = RunProgress.open(str(tmp_path), {"experiment": {"temperature": 0.0}})
  theirs = RunProgress(ours.directory, {"experiment": {"temperature": 1.0}, "format_version": 2})
  ours.save_batch(0, _record())
  theirs.save_batch(1, _record())
  again = RunProgress.open(str(tmp_path), {"experiment": {"temperature": 0.0}})
  with pytest.raises(ValueError, match=r"batch_00001.npz was written by another run \(its "
                     r"identity differs from this one's: were two runs started into .* at "
                     r"once\?\)"):
    again.batches()
  os.remove(os.path.join(ours.directory, "batch_00001.npz"))
  assert list(again.batches()) == [0]


# ---------------------------------------------------------------------------
# The smaller cases: each a clear error naming the flag and the fix, before any work.


def _problems(bindings, out, prompt="hello"):
  try:
    with pytest.raises(launch_checks.LaunchError) as error:
      run_lib.check_launch("local", [], bindings, [ROOT], out, prompt)
  finally:
    gin.clear_config()
  return error.value.problems


def test_an_output_dir_os_access_calls_writable_is_caught_first(llama):
  """Root: os.access says /proc and /sys are writable; a real write says no."""
  target, draft = llama
  good = [f"TARGET_CHECKPOINT = '{target}'", f"DRAFT_CHECKPOINT = '{draft}'"]
  for parent in ("/proc", "/sys"):
    out = f"{parent}/specdec_out"
    [problem] = _problems(good, out)
    assert problem.startswith(f"--output_dir={out}: cannot create it: {parent} refuses new "
                              "directories ("), problem
    assert problem.endswith("); choose another --output_dir")


def test_a_jsonl_with_a_byte_order_mark_reads_as_without(tmp_path):
  for name, line in (("in.jsonl", json.dumps({"inputs": "hello"})), ("in.tsv", "hello\tworld")):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + line.encode("utf-8") + b"\nsecond\n"
                     if name.endswith(".tsv") else
                     b"\xef\xbb\xbf" + line.encode("utf-8") + b"\n")
    examples = tasks.load_local(str(path))
    assert examples[0].inputs == "hello"  # No U+FEFF in the first input's text.


def test_the_launcher_runs_from_any_directory(tmp_path):
  """Not only from the repository root: `experiments` is installed with the package."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--pair=local",
                         "--gin_file=configs/drafts/prompt_lookup.gin", "--prompt=hi"],
                        cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)
  assert "No module named" not in proc.stderr, proc.stderr[-2000:]
  assert proc.returncode == 1 and "--output_dir is required" in proc.stderr
  assert "gin file not found" not in proc.stderr and "bad gin" not in proc.stderr


def test_a_hub_id_offline_keeps_the_download_recipe(llama, tmp_path, monkeypatch):
  """TARGET_CHECKPOINT a hub id, no network: the check says what the API's error says
  (the download recipe), with the flag to pass the downloaded directory."""
  pytest.importorskip("huggingface_hub")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  _, draft = llama
  [problem] = _problems(["TARGET_CHECKPOINT = 'nobody-here/tiny-llama'",
                         f"DRAFT_CHECKPOINT = '{draft}'"], str(tmp_path / "out"))
  assert problem.startswith("'nobody-here/tiny-llama' is not a local path and could not be "
                            "fetched from the Hugging Face hub ("), problem
  assert ("`huggingface-cli download nobody-here/tiny-llama config.json model.safetensors "
          "--local-dir DIR`") in problem
  assert problem.endswith("then pass --gin.TARGET_CHECKPOINT=\"'DIR'\" (the downloaded "
                          "directory)")


def test_a_draft_of_a_smaller_vocabulary_is_blamed_on_the_draft(llama, tmp_path):
  """The tokenizer (90 ids) fits the target; a draft of 64 embeddings: the error names the
  draft and the fix, not VOCABULARY (never set), before any weights load."""
  target, _ = llama
  small = tmp_path / "small_draft"
  sj.export_hf(_random(run_lib.named_config("llama_tiny_draft").replace(vocab_size=64), 1),
               str(small))
  bindings = _bindings((target, small), tmp_path)
  loads = []
  original = run_lib.load_spec
  try:
    run_lib.load_spec = lambda *a, **k: loads.append(a) or original(*a, **k)
    with pytest.raises(ValueError) as error:
      _run(FILES, bindings, tmp_path / "out")
  finally:
    run_lib.load_spec = original
  message = str(error.value)
  assert f"but the draft checkpoint {small}/config.json has only 64 embeddings: the launcher " \
         "feeds the draft the target's tokenizer" in message
  assert "VOCABULARY" not in message and loads == []


def test_the_progress_bar_ends_at_every_input(llama, tmp_path, capfd):
  """Fixed batches of 2 over 5 inputs: the bar's last count is 5 (it was the count before
  the last batch)."""
  prompts = PROMPTS + ["the dog sat on the log", "hello again"]
  _run(FILES, _bindings(llama, tmp_path, prompts, SCHEDULING="batches"), tmp_path / "out")
  counts = [int(part.split("=")[1].split(",")[0].split("]")[0])
            for part in capfd.readouterr().err.replace("\r", "\n").split()
            if part.startswith("inputs=")]
  assert counts and counts[-1] == len(prompts), counts
