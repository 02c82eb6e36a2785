"""gamma='auto' is visible (issue 55): the console says each plan timed and each phase's
choice, a call that ran target-only says so and why, results.md writes what ran ("auto →
0 (target-only)"), and the plan search's seconds are recorded and bounded: a short
stream times fewer plans than a long one (its compiles could not pay)."""

import logging
import time

import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax import results as results_lib
from test_generate_many import _inputs
from tiny_models import tiny_model


def _fixed_timings(monkeypatch, seconds_per_plan):
  """Replaces the plans' timing with fixed ms (target-only 1 ms an iteration, gamma g
  1 + 0.25 g, refills free) that take `seconds_per_plan` for each plan not timed before
  (a compile's cost, without one), and returns the list of the gammas each call timed."""
  from specdec_jax import slots
  asked, done = [], set()

  def timings(*args):
    gammas = args[-1]
    asked.append(list(gammas))
    time.sleep(seconds_per_plan * len(set(gammas) - done))
    done.update(gammas)
    return {g: (1.0 + 0.25 * g, 0.0) for g in gammas}

  monkeypatch.setattr(slots, "_iteration_ms", timings)
  return asked


def _common():
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=9)
  drafter = tiny_model("decoder_only", seed=11)
  return target, tokens, lengths, dict(batch_size=2, draft=drafter, block_width=9,
                                       max_decode_steps=10)


def test_a_short_stream_times_fewer_plans_and_says_it_ran_target_only(monkeypatch, caplog):
  """The bound on the plan search: each plan's compile and timing costs 0.3 s here, and 9
  inputs of 10 tokens at 1 ms an iteration decode in ~0.05 s target-only, so no
  speculative plan can pay: target-only alone is timed, the call runs target-only, and
  the console says so with why; the planning seconds are recorded. The same call told
  that its stream goes on for 10^6 inputs times the plans that can win, and speculates."""
  asked = _fixed_timings(monkeypatch, 0.3)
  target, tokens, lengths, common = _common()
  with caplog.at_level(logging.INFO, logger="absl"):
    out = sj.generate_many(target, tokens, lengths, **common)
  assert asked == [[0]], asked  # target-only only: speculation could not pay
  assert {p["gamma"] for p in out.slots.phases} == {0}
  planning = out.slots.planning
  assert planning["timed"] == [0] and out.slots.planning_seconds >= 0.3
  assert set(planning["untimed"]) == {"1", "2", "4", "8"}
  assert all("would save at most" in why for why in planning["untimed"].values()), planning
  said = [r.getMessage() for r in caplog.records]
  assert any("timed target-only at batch 2: 1.000 ms an iteration" in m for m in said), said
  assert any(m.startswith("gamma='auto': inputs 0-7 at target-only") for m in said), said
  assert any("gamma='auto' ran target-only throughout: no speculative plan was worth "
             "compiling" in m for m in said), said
  assert any("planning 0." in m and "not timed: gamma 1 would save at most" in m
             for m in said), said
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))

  # A long stream: the plans that can win at alpha = 1 are timed, one at a time, the
  # probe first; once gamma 4 is timed (2 ms: 2.49X at alpha = 1) no other can beat it
  # by 5% even at its best case (gamma 8 no dearer than gamma 4: 2.50X), so none is.
  asked = _fixed_timings(monkeypatch, 0.3)  # nothing timed before: each plan costs 0.3 s
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    out = sj.generate_many(target, tokens, lengths, stream_left=10 ** 6, **common)
  planning = out.slots.planning
  assert asked == [[0], [0, 4]] and planning["timed"] == [0, 4], asked
  assert planning["untimed"]["8"].startswith("could not beat 2.49X at alpha 1.00"), planning
  assert out.slots.phases[0]["gamma"] == 4 and out.slots.phases[0]["alpha"] is None
  said = [r.getMessage() for r in caplog.records]
  assert any("timed gamma 4 at batch 2: 2.000 ms an iteration" in m for m in said), said
  assert any(m.startswith("gamma='auto': inputs 0-7 at gamma 4 (alpha not measured yet; "
                          "predicted over target-only: gamma") for m in said), said
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))
  with pytest.raises(ValueError, match="stream_left must be an int >= 1"):
    sj.generate_many(target, tokens, lengths, stream_left=0, **common)


def test_cheap_timings_search_as_before_and_the_prior_carries_the_plan_cost(monkeypatch):
  """Timings that cost nothing (read back, or timings that compile nothing) bound
  nothing: every plan is timed, in the same rounds. What a plan's preparation cost is
  carried to the next call (`measured['plan_seconds']`), which weighs its compiles by it."""
  asked = _fixed_timings(monkeypatch, 0.0)
  target, tokens, lengths, common = _common()
  out = sj.generate_many(target, tokens, lengths, **common)
  assert out.slots.planning["timed"] == [0, 1, 2, 4, 8] and asked[1] == [0, 1, 2, 4, 8], asked
  costly = dict(out.slots.measured, plan_seconds=100.0, walls={}, tokens={})
  out = sj.generate_many(target, tokens, lengths, prior=costly, **common)
  assert out.slots.planning["timed"] == [0], out.slots.planning
  assert {p["gamma"] for p in out.slots.phases} == {0}


def test_results_md_says_what_auto_ran():
  """results.md's γ under GAMMA='auto' is what ran: target-only throughout, one gamma, or
  several; the planning seconds add up every call's and the warm-up's they carry."""
  target_only = [dict(inputs=[0, 8], gamma=0), dict(inputs=[8, 9], gamma=0)]
  assert results_lib.auto_gamma_label(target_only) == "auto → 0 (target-only)"
  assert results_lib.auto_gamma_label([dict(gamma=4), dict(gamma=4)]) == "auto → 4"
  assert results_lib.auto_gamma_label([dict(gamma=4), dict(gamma=2)]) == "auto → 2, 4"
  assert results_lib.auto_gamma_label([dict(gamma=4), dict(gamma=0)]) == "auto → 0, 4"
  row = results_lib.table2_row("local", "d", 0.0, "auto → 0 (target-only)", 0.0, 1.0, 1.0, 1.0)
  assert "| auto → 0 (target-only) | 0.00 |" in row
  phases = [dict(gamma=0, planning=dict(seconds=0.5, warm_up_seconds=2.0, timed=[0],
                                        untimed={"4": "would save at most 0.01 s"})),
            dict(gamma=0), dict(gamma=0, planning=dict(seconds=0.0, timed=[0], untimed={}))]
  planning = results_lib.auto_planning(phases)
  assert planning == dict(seconds=2.5, calls=2, timed=[0],
                          untimed={"4": "would save at most 0.01 s"})
  assert results_lib.auto_planning(target_only) is None


def test_launcher_says_auto_ran_target_only(tmp_path, caplog):
  """The launcher on a tiny pair whose stream (3 prompts, 8 tokens) is far too short for a
  speculative plan's compile to pay: the console says each plan timed, the choice, that
  auto ran target-only (a warning) and the planning seconds; results.md writes "auto → 0
  (target-only)"; results.json records the planning."""
  import test_launcher as tl
  pairs = {}
  llama = tl._write_pair(tmp_path, "llama", tl._random(tl.DECODER_CONFIGS["llama_tiny"].replace(
      num_layers=1), 0), tl._random("llama_tiny_draft", 1))
  tl._bpe(llama[0] / "tokenizer.json", bos=True)
  pairs["llama"] = llama
  target_dir, draft_dir = pairs["llama"]
  files = ["configs/pairs/local.gin", "configs/tasks/local_file.gin"]
  bindings = [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
              f"INPUT_FILE = '{tl._input_file(tmp_path)}'", "GAMMA = 'auto'"]
  with caplog.at_level(logging.INFO, logger="absl"):
    result = tl._run(files, bindings, tmp_path / "out")
  said = [r.getMessage() for r in caplog.records]
  if any(p["gamma"] for p in result["gamma_phases"]):
    pytest.skip("this machine's timings let speculation pay on 3 prompts")
  assert any("gamma='auto': timed target-only at batch" in m for m in said), said
  assert any("GAMMA='auto' ran target-only throughout" in m for m in said), said
  assert any(m.startswith("GAMMA=auto → 0 (target-only); its plan search took")
             for m in said), said
  markdown = (tmp_path / "out" / "results.md").read_text()
  assert "| auto → 0 (target-only) |" in markdown, markdown
  planning = result["gamma_auto_planning"]
  assert planning["seconds"] > 0 and planning["timed"] == [0] and planning["untimed"]
  assert result["identical_outputs"] is True
