"""`sj.generate_many` (`slots.py`): any number of inputs through fixed slots, freed slots
refilled in place.

* Greedy: each output equals `generate` on that input alone, bit for bit, at the same
  block width, with rows that end at very different steps (EOS early in some, the step
  limit in others): both families, target-only, a chain, a tree and a feature draft,
  float32 (bfloat16 in the slow set); the per-input stats equal the lone decode's.
* Sampling: each input draws from its own key, so outputs are the same whatever
  batch_size is.
* Programs are reused across refills and calls; bad input is a clear error.
"""

import jax
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.programs import PROGRAMS

from tiny_models import tiny_model




def _inputs(family, vocab=16, n=7, width=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, (n, width)).astype(np.int32)
  if family == "t5":
    for i in range(n):
      tokens[i, 1 + i % width:] = 0
    return tokens, None
  return tokens, (1 + np.arange(n) % width).astype(np.int32)


def _drafts(family, target, dtype):
  drafter = tiny_model(family, seed=11, dtype=dtype)
  return {"target-only": (None, {}),
          "chain": (drafter, dict(gamma=3)),
          # At its shape throughout (gamma='auto' would weigh it against target-only).
          "tree": (sj.TreeDraft(drafter, (2, 2, 1)), dict(gamma=4)),
          "feature": (sj.FeatureDraft(target, seed=2), dict(gamma=2))}


@pytest.mark.parametrize("family", ["decoder_only", pytest.param("t5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_each_output_equals_generate_alone(family, dtype):
  target = tiny_model(family, dtype=dtype)
  tokens, lengths = _inputs(family)
  # An EOS that input 0 emits at its third step: rows then end at very different steps.
  probe = sj.generate(target, tokens, lengths, max_decode_steps=12, eos_id=-1)
  eos = int(probe.sequences[0, 2])
  for name, (draft, extra) in _drafts(family, target, dtype).items():
    kw = dict(max_decode_steps=12, block_width=11, eos_id=eos, **extra)
    many = sj.generate_many(target, tokens, lengths, batch_size=3, draft=draft, **kw)
    ended = []
    for i in range(len(tokens)):
      one = sj.generate(target, tokens[i:i + 1], None if lengths is None else lengths[i:i + 1],
                        draft=draft, **kw)
      np.testing.assert_array_equal(np.asarray(many.sequences[i]), np.asarray(one.sequences[0]),
                                    err_msg=f"{name}, input {i}")
      ended.append(int(one.lengths[0]))
      if draft is not None:
        for field in ("iterations", "drafted", "accepted_raw"):
          assert getattr(many.stats, field)[i] == getattr(one.stats, field)[0], (name, field)
    assert many.slots.refills == len(tokens) - 3 and many.slots.inputs == len(tokens)
    assert min(ended) <= 3 and len(set(ended)) > 1, ended  # rows end at different steps


def test_sampled_outputs_do_not_depend_on_the_batch():
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=6)
  drafter = tiny_model("decoder_only", seed=11)
  for draft, extra in ((None, {}), (drafter, dict(gamma=3)),
                       (sj.TreeDraft(drafter, (2, 1)), dict(gamma=4, block_width=5))):
    outs = [sj.generate_many(target, tokens, lengths, batch_size=b, draft=draft,
                             max_decode_steps=10, temperature=1.0, rng=jax.random.PRNGKey(7),
                             **extra) for b in (1, 2, 6)]
    for out in outs[1:]:
      np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(outs[0].sequences))
    other = sj.generate_many(target, tokens, lengths, batch_size=2, draft=draft,
                             max_decode_steps=10, temperature=1.0, rng=jax.random.PRNGKey(8),
                             **extra)
    assert not np.array_equal(np.asarray(other.sequences), np.asarray(outs[0].sequences))


def test_programs_are_reused_across_refills_and_calls():
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=7)
  sj.generate_many(target, tokens, lengths, batch_size=2, max_decode_steps=8)
  before = len(PROGRAMS.entries("slots"))
  out = sj.generate_many(target, np.concatenate([tokens, tokens]),
                         np.concatenate([lengths, lengths]), batch_size=2, max_decode_steps=8)
  assert len(PROGRAMS.entries("slots")) == before and out.slots.refills == 12
  # 12 refills from stashes of 8 inputs swapped in inside the loop: the host syncs once
  # per stash (and once more where a row ends with the stash empty), not per refill.
  assert 0 < out.slots.occupancy <= 1 and 2 <= out.slots.segments <= 4


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_stashes_started_ahead_decode_as_alone(dtype):
  """Past the first stash each start is dispatched before the host syncs on the segment
  before it: the later stashes' outputs still equal each input decoded alone."""
  target = tiny_model("decoder_only", dtype=dtype)
  drafter = tiny_model("decoder_only", seed=11, dtype=dtype)
  tokens, lengths = _inputs("decoder_only", n=18)  # 3 stashes of 8 at batch_size 2
  for draft, extra in ((None, {}), (drafter, dict(gamma=3))):
    kw = dict(max_decode_steps=9, block_width=4, **extra)
    many = sj.generate_many(target, tokens, lengths, batch_size=2, draft=draft, **kw)
    assert many.slots.segments >= 3 and many.slots.refills == 16
    assert many.slots.started_ahead == 2  # the second and third stashes
    for i in range(8, 18):
      one = sj.generate(target, tokens[i:i + 1], lengths[i:i + 1], draft=draft, **kw)
      np.testing.assert_array_equal(np.asarray(many.sequences[i]), np.asarray(one.sequences[0]),
                                    err_msg=f"draft {draft is not None}, input {i}")


def test_bad_generate_many_input_gets_clear_errors():
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only")
  with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
    sj.generate_many(target, tokens, lengths, batch_size=0, max_decode_steps=4)
  with pytest.raises(TypeError, match="generate_many takes a model"):
    sj.generate_many(sj.FeatureDraft(target), tokens, lengths, batch_size=2, max_decode_steps=4)
  with pytest.raises(ValueError, match="max_decode_steps"):
    sj.generate_many(target, tokens, lengths, batch_size=2, max_decode_steps=0)
  # Mixed families: a T5 draft for a decoder-only target.
  with pytest.raises((ValueError, TypeError)) as mixed:
    sj.generate_many(target, tokens, lengths, batch_size=2, max_decode_steps=4,
                     draft=tiny_model("t5"))
  assert "t5" in str(mixed.value).lower() or "family" in str(mixed.value).lower()


def test_choose_phase_gamma_never_speculates_where_the_theory_says_it_loses():
  from specdec_jax.tools.speedup import choose_phase_gamma
  curve = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4, 9: 2.0}
  cheap = {1: 0.05, 2: 0.1, 4: 0.2, 8: 0.4}
  # alpha 0.9: gamma 4 gives 4.10 tokens / 1.6 = 2.56, gamma 8 gives 6.13 / 2.4 = 2.55.
  gamma, predicted = choose_phase_gamma(0.9, cheap, curve)
  assert gamma == 4 and abs(predicted - 4.0951 / 1.6) < 1e-3
  # One gamma's prediction alone (what a mid-stream switch is weighed against), below 1
  # where it loses: gamma 1 at alpha 0.05 gives 1.05 tokens / 1.15.
  from specdec_jax.tools.speedup import phase_speedup
  assert phase_speedup(0.9, 4, cheap, curve) == predicted
  assert abs(phase_speedup(0.05, 1, cheap, curve) - 1.05 / 1.15) < 1e-9
  assert phase_speedup(0.5, 0, cheap, curve) == 1.0
  assert choose_phase_gamma(0.99, cheap, curve)[0] == 8
  gamma, predicted = choose_phase_gamma(0.05, cheap, curve)
  assert gamma == 0 and predicted == 1.0  # nothing accepted: target-only
  # A compute-bound batch: verifying k tokens costs k steps; even alpha = 1 loses.
  flat = {k: float(k) for k in (1, 2, 3, 5, 9)}
  assert choose_phase_gamma(1.0, cheap, flat)[0] == 0
  # One call per proposal whatever gamma (a parallel drafter) favours longer blocks.
  one_call = {g: 0.3 for g in (1, 2, 4, 8)}
  assert choose_phase_gamma(0.8, one_call, curve)[0] >= choose_phase_gamma(
      0.8, {g: 0.3 * g for g in (1, 2, 4, 8)}, curve)[0]
  # Each input's own start, per token it emits: speculation does not shorten it. Target
  # only costs 1 + 0.5 per token, gamma 4 1.6 / 4.0951 + 0.5: 1.5 / 0.8907 = 1.684.
  gamma, predicted = choose_phase_gamma(0.9, cheap, curve, {g: 0.5 for g in (0, 1, 2, 4, 8)})
  assert gamma == 4 and abs(predicted - 1.5 / (1.6 / 4.0951 + 0.5)) < 1e-3
  # A start that costs more with a draft (its prefill too) can erase a small gain.
  assert choose_phase_gamma(0.5, cheap, curve)[0] > 0
  assert choose_phase_gamma(0.5, cheap, curve, {0: 0.0, 1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})[0] == 0


def test_auto_gamma_runs_in_phases_and_stays_exact():
  """gamma='auto': the first phase (one batch) probes alpha, later phases use the gamma
  chosen from it; at one block width for every phase, greedy outputs equal target-only."""
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=9)
  drafter = tiny_model("decoder_only", seed=11)
  out = sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, gamma="auto",
                         max_decode_steps=10, block_width=9)
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))
  phases = out.slots.phases
  assert phases[0]["inputs"] == [0, 8] and phases[0]["alpha"] is None  # one stash
  assert phases[-1]["inputs"][1] == 9 and all(p["gamma"] in (0, 1, 2, 3, 4, 6, 8)
                                              for p in phases)
  assert all(p["alpha"] is not None for p in phases[1:]) and "0" in phases[0]["iteration_ms"]
  with pytest.raises(ValueError, match="gamma must be an int >= 1 or 'auto'"):
    sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, gamma="best",
                     max_decode_steps=4)
  with pytest.raises(ValueError, match=r"prior_alpha \(1.5\) is an acceptance rate"):
    sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, prior_alpha=1.5,
                     max_decode_steps=4)
  # A tree decodes at its own shape: with an int gamma, throughout.
  tree = sj.TreeDraft(drafter, (2, 1))
  out = sj.generate_many(target, tokens, lengths, batch_size=2, max_decode_steps=10,
                         draft=tree, block_width=9, gamma=4)
  assert len(out.slots.phases) == 1 and "alpha" not in out.slots.phases[0]
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


def test_auto_gamma_starts_at_the_prior_alpha_and_pads_its_counters():
  """With prior_alpha (the launcher's acceptance of earlier chunks) the first phase is
  chosen, not probed; counters are as wide as the largest candidate gamma whatever was
  chosen, so chunks stack."""
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=6)
  drafter = tiny_model("decoder_only", seed=11)
  out = sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, block_width=9,
                         max_decode_steps=10, prior_alpha=0.0)
  assert {p["gamma"] for p in out.slots.phases} == {0} and out.slots.phases[0]["alpha"] == 0.0
  assert out.slots.phases[0]["inputs"] == [0, 6]  # one stash (8) first, then re-decided
  assert out.stats.gamma == 8 and out.stats.position_drafted.shape == (6, 8)
  assert not np.asarray(out.stats.drafted).any()
  # What a call measured is the next call's prior: its alpha and its plans' wall times.
  first = sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, block_width=9,
                           max_decode_steps=10)
  learned = first.slots.measured
  assert learned["batch_size"] == 2 and 0.0 <= learned["alpha"] <= 1.0
  assert set(learned["walls"]) == {str(p["gamma"]) for p in first.slots.phases}
  again = sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, block_width=9,
                           max_decode_steps=10, prior=learned)
  assert again.slots.phases[0]["alpha"] == learned["alpha"]
  np.testing.assert_array_equal(np.asarray(again.sequences), np.asarray(first.sequences))
  with pytest.raises(ValueError, match="prior is gamma='auto''s `out.slots.measured`"):
    sj.generate_many(target, tokens, lengths, batch_size=2, draft=drafter, max_decode_steps=4,
                     prior={"alpha": 0.5})


def _simulated_occupancy(remaining, slots, each, deviation, trials=400):
  """The slots' occupancy over `remaining` inputs of normal iteration counts (rounded, at
  least 1), each freed slot taking the next input, all starting together: the mean over
  `trials` streams."""
  counts = np.maximum(1.0, np.round(np.random.default_rng(0).normal(
      each, deviation, (trials, remaining))))
  return float(np.mean(counts.sum(1) / (slots * _slot_ends(counts, slots).max(1))))


def _slot_ends(counts, slots):
  """Where each of `slots` slots ends, all starting together, each freed slot taking the
  next of `counts` [trials, inputs] (iterations per input): [trials, slots]."""
  ends = np.zeros((counts.shape[0], slots))
  for j in range(counts.shape[1]):
    ends[np.arange(counts.shape[0]), np.argmin(ends, axis=1)] += counts[:, j]
  return ends


def test_expected_occupancy_counts_the_tail_of_spread_iteration_counts():
  """gamma='auto''s tail model: E[max of 2 standard normals] = 1 / sqrt(pi); inputs of
  equal iteration counts fill every slot to the end; spread counts leave the slots idle
  at the stream's end, less of the call the more inputs each slot decodes; and the model
  is within 0.015 of simulated streams, whether the counts spread little (the slots stay
  in step) or much (they fall out of step: the in-step model alone read 0.76 for 0.90,
  the second case, gamma 4 on the decoder-only demo pair at batch 16)."""
  from specdec_jax.slots import _max_of_normals, _occupancy
  assert abs(_max_of_normals(2) - 1 / np.sqrt(np.pi)) < 1e-6 and _max_of_normals(1) == 0
  assert _occupancy(512, 64, 48.0, 0.0) == 1.0 and _occupancy(8, 16, 10.0, 0.0) == 0.5
  assert abs(_occupancy(8, 16, 10.0, 3.0) - 10 / (2 * (10 + _max_of_normals(8) * 3))) < 1e-9
  short, long = _occupancy(64, 16, 10.0, 3.0), _occupancy(1024, 16, 10.0, 3.0)
  assert short < long < 1.0
  for case in [(128, 16, 13.5, 3.0), (128, 16, 13.5, 7.0), (512, 64, 13.5, 7.0),
               (64, 16, 10.0, 3.0), (32, 4, 13.5, 7.0), (128, 16, 48.0, 0.5),
               (128, 16, 48.0, 3.0), (16, 16, 13.0, 5.0), (24, 8, 20.0, 6.0)]:
    assert abs(_occupancy(*case) - _simulated_occupancy(*case)) < 0.015, case


def _simulated_drain(slots, each, deviation, per_slot, trials=400):
  """Iterations each slot idles, on average, when a run that handed `per_slot` inputs of
  normal iteration counts (rounded, at least 1) to each of `slots` slots, all starting
  together, each freed slot taking the next, gets no more: the mean of max - mean of
  the slots' ends over `trials` runs."""
  counts = np.maximum(1.0, np.round(np.random.default_rng(1).normal(
      each, deviation, (trials, slots * per_slot))))
  ends = _slot_ends(counts, slots)
  return float(np.mean(ends.max(1) - ends.mean(1)))


def test_the_drain_of_a_run_matches_simulated_runs():
  """gamma='auto''s drain model (what leaving a speculative run costs) against simulated
  runs: within 12% for 4 slots and more, whether the slots are still in step (the first
  inputs), have drifted apart (counts that hardly spread, summed over many inputs) or
  are out of step. Without the drift (the in-step term at one input a slot) the case of
  48 +- 3 iterations after 12 inputs a slot reads 5.3 of its 18.3."""
  from specdec_jax.slots import _drain_iterations
  for case in [(16, 13.5, 3.0, 1), (16, 13.5, 3.0, 12), (16, 13.5, 7.0, 4),
               (64, 13.5, 7.0, 2), (4, 13.5, 7.0, 12), (16, 48.0, 3.0, 12),
               (8, 20.0, 6.0, 12), (64, 48.0, 3.0, 4)]:
    model, simulated = _drain_iterations(*case), _simulated_drain(*case)
    assert abs(model / simulated - 1) < 0.12, (case, model, simulated)
  assert _drain_iterations(16, 48.0, 3.0, 1) / _simulated_drain(16, 48.0, 3.0, 12) < 0.3


def _sums(inputs, tokens, iterations):
  """A prior's sums for one plan (`measured["tokens"][gamma]`), every input alike."""
  return dict(inputs=inputs, tokens=inputs * tokens, tokens_sq=inputs * tokens ** 2,
              iterations=inputs * iterations, iterations_sq=inputs * iterations ** 2)


def _auto_setup():
  """(target, tokens, lengths, gamma='auto' options): 12 inputs through 2 slots, a chain
  draft, alpha = 1 given."""
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=12)
  drafter = tiny_model("decoder_only", seed=11)
  return target, tokens, lengths, dict(batch_size=2, draft=drafter, block_width=9,
                                       max_decode_steps=10, prior_alpha=1.0)


def test_auto_gamma_keeps_speculation_only_where_it_measured_faster():
  """What a plan measured decides over what was predicted for it: a prior in which gamma
  4 measured slower than target-only keeps the whole call target-only, even at alpha = 1
  where the theory predicts a gain; one in which it measured far faster runs gamma 4
  from the start. Target-only's tokens per row iteration measure exactly 1."""
  target, tokens, lengths, common = _auto_setup()
  slow = dict(batch_size=2, alpha=1.0, tokens={"4": _sums(50, 10.0, 2.0),
                                               "0": _sums(5, 10.0, 10.0)},
              walls={"4": [10.0, 100], "0": [0.1, 50]})  # 100 ms / iteration against 2
  out = sj.generate_many(target, tokens, lengths, prior=slow, **common)
  assert {p["gamma"] for p in out.slots.phases} == {0}
  # 1 us an iteration over 1000 (what this call measures cannot outweigh it) against 200 ms
  fast = dict(slow, walls={"4": [1e-3, 1000], "0": [10.0, 50]})
  out = sj.generate_many(target, tokens, lengths, prior=fast, **common)
  assert {p["gamma"] for p in out.slots.phases} == {4}
  # A measured plan is re-decided at every stash too (12 inputs: stashes of 8 and 4),
  # a stash ahead: the second is started while the first decodes.
  assert [p["inputs"] for p in out.slots.phases] == [[0, 8], [8, 12]], out.slots.phases
  assert out.slots.started_ahead == 1
  # 5 tokens per row iteration at 1 us: against target-only rated at the better of its
  # timing here (well under 20 ms an iteration) and the 200 ms it measured.
  assert 100 < out.slots.phases[0]["predicted_speedup"] < 5 * 20 / 1e-3
  measured = out.slots.measured
  assert measured["walls"]["4"][1] > 1000 and measured["tokens"]["4"]["inputs"] == 50 + 12
  alone = sj.generate_many(target, tokens, lengths, prior=slow, **common).slots.measured
  got = alone["tokens"]["0"]
  assert got["inputs"] == 5 + 12 and got["tokens"] == got["iterations"] > 50.0
  assert got["tokens_sq"] == got["iterations_sq"]
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


def test_auto_gamma_measures_a_slow_plan_again_once_the_chosen_one_ran_long(monkeypatch):
  """A plan that measured slower than its timing predicts (one slow spell of the machine)
  is not ruled out for good: once the plan chosen has run REEXPLORE times its iterations
  it runs one stash again, and its walls add up (the next retry waits twice as long).
  The plans' timings are fixed here (target-only 1 ms an iteration, gamma 4 2 ms, refills
  free), so that what decides is the rule, not this machine."""
  from specdec_jax import slots
  monkeypatch.setattr(slots, "_iteration_ms", lambda *args: {
      g: (1.0 + 0.25 * g, 0.0) for g in args[-1]})
  target, tokens, lengths, common = _auto_setup()
  tried = 8  # gamma 4 measured 100 ms an iteration over 8; target-only 1 ms, as timed
  ran = slots.REEXPLORE * tried
  slow = dict(batch_size=2, alpha=1.0,
              tokens={"4": _sums(2, 10.0, 2.0), "0": _sums(ran // 10, 10.0, 10.0)},
              walls={"4": [0.1 * tried, tried], "0": [1e-3 * ran, ran]})
  out = sj.generate_many(target, tokens, lengths, prior=slow, **common)
  phases = [(p["inputs"], p["gamma"]) for p in out.slots.phases]
  assert phases[0] == ([0, slots.stash_size(2)], 4), phases
  assert {g for _, g in phases[1:]} == {0}, phases  # its walls still say slow
  assert out.slots.started_ahead == 0  # a retry is measured before anything follows it
  assert out.slots.measured["walls"]["4"][1] > tried  # the retry's iterations added
  # Target-only at half the ratio (this call's iterations, at most 60, do not reach it):
  # the slow measurement stands.
  short = dict(slow, walls=dict(slow["walls"], **{"0": [1e-3 * ran / 2, ran // 2]}))
  out = sj.generate_many(target, tokens, lengths, prior=short, **common)
  assert {p["gamma"] for p in out.slots.phases} == {0}
  # A retry weighs the plan's tokens at the top of what its inputs measured: 1.6 tokens
  # an iteration (0.8X at 2 ms against 1 ms) is retried where its two inputs took 4 and
  # 16 iterations for 16 tokens each (2.96 two standard errors up), not where both took
  # 10.
  alike = dict(slow, tokens=dict(slow["tokens"], **{"4": _sums(2, 16.0, 10.0)}))
  out = sj.generate_many(target, tokens, lengths, prior=alike, **common)
  assert {p["gamma"] for p in out.slots.phases} == {0}
  spread = dict(inputs=2, tokens=32.0, tokens_sq=512.0, iterations=20.0, iterations_sq=272.0)
  assert abs(slots._optimistic_tokens(spread, 4) - (1.6 + 2 * 9.6 / (10 * 2 ** 0.5))) < 1e-9
  out = sj.generate_many(target, tokens, lengths,
                         prior=dict(slow, tokens=dict(slow["tokens"], **{"4": spread})), **common)
  assert [p["gamma"] for p in out.slots.phases][0] == 4, out.slots.phases
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


def test_auto_gamma_weighs_the_drain_of_leaving_speculation(monkeypatch):
  """Leaving a speculative run for target-only drains its rows (target-only then pays its
  own tail too), so speculation is left only when it is predicted slower than
  target-only by more than that drain. The retry of the test above, measured slow again,
  is left after its stash; were draining it to cost more than every input left takes
  target-only, it would be kept. A run's drain: nothing without spread, more with it,
  never above the in-step model's E[max of normals] x deviation."""
  from specdec_jax import slots
  assert slots._drain_iterations(16, 13.5, 0.0) == 0.0 == slots._drain_iterations(1, 13.5, 7)
  low, high = slots._drain_iterations(16, 13.5, 3.0), slots._drain_iterations(16, 13.5, 7.0)
  assert 0 < low < high <= slots._max_of_normals(16) * 7.0
  monkeypatch.setattr(slots, "_iteration_ms", lambda *args: {
      g: (1.0 + 0.25 * g, 0.0) for g in args[-1]})
  target, tokens, lengths, common = _auto_setup()
  tried, ran = 8, slots.REEXPLORE * 8
  slow = dict(batch_size=2, alpha=1.0,
              tokens={"4": _sums(2, 10.0, 2.0), "0": _sums(ran // 10, 10.0, 10.0)},
              walls={"4": [0.1 * tried, tried], "0": [1e-3 * ran, ran]})
  gammas = [p["gamma"] for p in sj.generate_many(target, tokens, lengths, prior=slow,
                                                 **common).slots.phases]
  assert gammas[0] == 4 and set(gammas[1:]) == {0}, gammas
  assert all("drain_ms" in r for r in sj.generate_many(
      target, tokens, lengths, prior=slow, **common).slots.phases[0]["rated"].values())
  from specdec_jax import auto_gamma  # the planner reads its own module's drain
  monkeypatch.setattr(auto_gamma, "_drain_iterations", lambda *args: 1e12)
  out = sj.generate_many(target, tokens, lengths, prior=slow, **common)
  assert {p["gamma"] for p in out.slots.phases} == {4}, out.slots.phases
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


def test_auto_gamma_predicts_a_plan_from_measured_walls_without_their_refills(monkeypatch):
  """A plan that has not run is predicted from its timing, as slow against it as the
  measured plans ran, plus its own refills. A measured wall holds that plan's refills
  and a timing none, so they are taken out before the comparison (they were counted
  twice). Its tokens per iteration: E[tokens] for outputs of the inputs' length. Timings
  fixed here: target-only 1 ms an iteration, gamma 4 2 ms, every input's start 2 ms;
  target-only measured exactly its timing plus its refills."""
  from specdec_jax import slots
  monkeypatch.setattr(slots, "_iteration_ms", lambda *args: {
      g: (1.0 + 0.25 * g, 2.0) for g in args[-1]})
  target, tokens, lengths, common = _auto_setup()
  per_input, ran = 10.0, 400  # tokens (= iterations) per target-only input; iterations
  wall = 1.0 + 2.0 * 2 / per_input  # ms an iteration: 2 slots start an input every 10
  prior = dict(batch_size=2, alpha=1.0, tokens={"0": _sums(40, per_input, per_input)},
               walls={"0": [1e-3 * wall * ran, ran]})
  out = sj.generate_many(target, tokens, lengths, prior=prior, **common)
  rated = out.slots.phases[0]["rated"]
  assert abs(rated["0"]["ms"] - wall) < 1e-9 and rated["0"]["tokens"] == 1.0
  drafted = rated["4"]["tokens"]  # E[tokens] at alpha = 1 (0.999): its refills per token
  assert 4.9 < drafted <= 5.0
  assert abs(rated["4"]["ms"] - (2.0 + 2.0 * 2 * drafted / per_input)) < 1e-9, rated
  # Its tokens are those of outputs of the inputs' length, each one's last iteration cut:
  # gamma 8 emits 10 tokens in 2 iterations at alpha = 1 (eq. 1, unbounded: 8.96).
  from specdec_jax.core import theory
  for g in (1, 2, 4, 8):
    assert abs(rated[str(g)]["tokens"]
               - theory.expected_tokens_per_iteration(0.999, g, per_input)) < 1e-9, rated
  assert rated["8"]["tokens"] < 5.01
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


@pytest.mark.slow
def test_auto_gamma_in_bfloat16_equals_target_only_alone_and_refuses_an_old_prior():
  """gamma='auto' in bfloat16 (what GPUs and TPUs run): a call that runs gamma 4 from a
  prior and one that runs target-only both give, row by row, target-only `generate` on
  that input alone at the same block width, bit for bit. A prior in an older format
  (tokens as one [got, want] pair) is a clear error, before any work."""
  target = tiny_model("decoder_only", dtype="bfloat16")
  tokens, lengths = _inputs("decoder_only", n=10)
  drafter = tiny_model("decoder_only", seed=11, dtype="bfloat16")
  common = dict(batch_size=3, draft=drafter, block_width=9, max_decode_steps=10,
                prior_alpha=1.0)
  sums = dict(inputs=5, tokens=50.0, tokens_sq=500.0, iterations=10.0, iterations_sq=20.0)
  fast = dict(batch_size=3, alpha=1.0, tokens={"4": sums}, walls={"4": [1e-4, 100],
                                                                 "0": [10.0, 50]})
  slow = dict(fast, walls={"4": [10.0, 100], "0": [0.1, 50]})
  for prior, gamma in ((fast, 4), (slow, 0)):
    out = sj.generate_many(target, tokens, lengths, prior=prior, **common)
    assert out.slots.phases[0]["gamma"] == gamma  # then re-decided at each stash
    if gamma:  # a measured plan's second stash (inputs 8-9) started ahead, in bfloat16
      assert out.slots.started_ahead == 1
    for i in range(len(tokens)):
      one = sj.generate(target, tokens[i:i + 1], lengths[i:i + 1], max_decode_steps=10,
                        block_width=9)
      np.testing.assert_array_equal(np.asarray(out.sequences[i]), np.asarray(one.sequences[0]),
                                    err_msg=f"gamma {gamma}, input {i}")
  # Sums no call measures (iterations without inputs: every per-input rate divides by 0).
  broken = dict(sums, inputs=0)
  with pytest.raises(ValueError, match=r"prior\['tokens'\]\['4'\] holds sums no call measures"):
    sj.generate_many(target, tokens, lengths, prior=dict(fast, tokens={"4": broken}), **common)
  with pytest.raises(ValueError, match="the last two per gamma"):
    sj.generate_many(target, tokens, lengths, prior=dict(fast, tokens=[40.0, 50.0]), **common)


def test_auto_gamma_decodes_a_draft_whose_proposals_cannot_be_timed_alone():
  """A draft whose proposals need more than its state (the target's cache): gamma='auto'
  times whole loop iterations only (the proposals alone, timed for a record that decided
  nothing, raised here), so it decodes, greedy outputs the target's."""
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=4)

  class NeedsTheCache(sj.ModelDraft):
    def proposer(self, params, plan):
      inner = super().proposer(params, plan)

      def propose(rng, state, sequences, lengths, max_drafted=None, *, target_cache):
        return inner.propose(rng, state, sequences, lengths, max_drafted)
      return inner._replace(propose=propose, reads_cache=True)

  out = sj.generate_many(target, tokens, lengths, batch_size=2, max_decode_steps=8,
                         draft=NeedsTheCache(tiny_model("decoder_only", seed=11)))
  want = sj.generate(target, tokens, lengths, max_decode_steps=8)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_auto_gamma_times_a_lookup_draft_without_a_network(dtype):
  """A prompt-lookup draft makes no network call: under gamma='auto' the outputs equal
  target-only `generate` alone, greedy. In bfloat16 the default block width is 8 (GPUs,
  TPUs): its candidates (the plans timed and those not worth timing) stop at gamma 4
  (gamma 8 needs 9 slots and raised before any work, with no block_width given)."""
  target = tiny_model("decoder_only", dtype=dtype)
  tokens, lengths = _inputs("decoder_only", n=5)
  out = sj.generate_many(target, tokens, lengths, batch_size=2, max_decode_steps=6,
                         draft=sj.PromptLookupDraft(16))
  planning = out.slots.planning
  plans = set(planning["timed"]) | {int(g) for g in planning["untimed"]}
  assert max(plans) == (8 if dtype == "float32" else 4) and 0 in plans, planning
  want = sj.generate(target, tokens, lengths, max_decode_steps=6)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


def test_auto_gamma_runs_a_tree_only_where_it_measured_faster(monkeypatch):
  """gamma='auto' with a tree (a draft of its own shape): one speculative plan, the tree,
  against target-only. Tried on the first stash (at alpha = 1 its deepest path, 2 x 2
  greedy nodes, would emit 5 tokens an iteration), kept only while it measures faster;
  never tried where it loses even at alpha = 1. Timings fixed here (target-only 1 ms an
  iteration, the tree 2 ms or 10 ms, refills free), so that what decides is the rule.
  Greedy outputs equal target-only's whatever ran."""
  from specdec_jax import slots
  target = tiny_model("decoder_only")
  tokens, lengths = _inputs("decoder_only", n=12)
  drafter = tiny_model("decoder_only", seed=11)  # random: accepts almost nothing
  tree = sj.TreeDraft(drafter, (2, 1))
  common = dict(batch_size=2, max_decode_steps=10, block_width=9, draft=tree)
  want = sj.generate(target, tokens, lengths, max_decode_steps=10, block_width=9)

  def timed(tree_ms):
    monkeypatch.setattr(slots, "_iteration_ms", lambda *args: {
        g: (tree_ms if g else 1.0, 0.0) for g in args[-1]})

  timed(2.0)
  out = sj.generate_many(target, tokens, lengths, **common)
  phases = [(p["inputs"], p["gamma"]) for p in out.slots.phases]
  assert phases[0] == ([0, 8], 4), phases  # the tree's own shape, probed
  assert 4.9 < out.slots.phases[0]["rated"]["4"]["tokens"] <= 5.0
  # It measured about a token an iteration at twice target-only's cost: target-only after.
  assert phases[1:] and {g for _, g in phases[1:]} == {0}, phases
  assert out.slots.phases[1]["rated"]["4"]["tokens"] < 1.5
  assert out.slots.measured["tokens"]["4"]["inputs"] == 8
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))
  # The same tree measured fast (a prior: 5 tokens an iteration at 1 us) runs throughout.
  fast = dict(out.slots.measured, tokens={"4": _sums(20, 10.0, 2.0)},
              walls={"4": [1e-3, 1000], "0": [10.0, 50]})
  out = sj.generate_many(target, tokens, lengths, prior=fast, **common)
  assert {p["gamma"] for p in out.slots.phases} == {4}, out.slots.phases
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))
  # 10 ms an iteration against 1: 5 tokens an iteration lose, so it is never tried.
  timed(10.0)
  out = sj.generate_many(target, tokens, lengths, **common)
  assert {p["gamma"] for p in out.slots.phases} == {0}, out.slots.phases
  assert out.stats.drafted.sum() == 0
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))


def test_a_timed_iteration_leaves_out_what_a_call_costs_once(monkeypatch):
  """`_iteration_ms` counts what more iterations add to a call, not the call's own cost
  (its dispatch and transfers, paid once per segment in a decode): counted per iteration,
  it made target-only's 0.26 ms iteration 0.51 on the decoder-only demo pair at batch 1,
  and speculation looked ~1.4X faster than it ran. Each plan's iteration program is
  replaced here by one that costs 40 ms a call plus 2 ms an iteration (the real start
  and programs still run, so the plumbing is the real one); the old timing read 7 ms."""
  import time
  from specdec_jax import programs, settings, slots
  real = slots._slot_programs

  def fixed_cost(*args):
    start_fn, segment_fn, blank_fn, _ = real(*args)

    def iterate_fn(params, draft_params, carry, offset, count):
      time.sleep(0.040 + 0.002 * count)
      return carry
    return start_fn, segment_fn, blank_fn, iterate_fn

  monkeypatch.setattr(slots, "_slot_programs", fixed_cost)
  monkeypatch.setattr(slots, "PROGRAMS", programs.CompileCache())  # nothing timed before
  target, tokens, lengths, common = _auto_setup()
  drafter = settings.check_draft(target.config, common["draft"], tokens, lengths, 10)
  timed = slots._iteration_ms(
      target, drafter, tokens, lengths, 2,
      lambda g: settings.plan_settings(target.config, drafter if g else None,
                                       max_decode_steps=10, gamma=max(g, 1), block_width=9),
      [0, 4])
  for g, (ms, refill) in timed.items():
    assert 1.5 < ms < 3.5, (g, ms)  # 2 ms, give or take the sleeps' overshoot
    assert refill > 0
