"""The evaluation harness (experiments/evaluate.py, specdec_jax/evaluation/).

- per-category figures equal hand-computed ones (records by hand; the whole run on a
  stubbed clock and decoder, whose seconds and counters are known);
- a wrong verification rule makes the equality check fail and name the inputs;
- an interrupted run resumes: nothing finished is decoded again, the results equal
  an uninterrupted run's;
- bad input is refused before any decode, naming the problem and the fix.
"""

import json
import math
import types

import numpy as np
import pytest

import specdec_jax as sj
from experiments import evaluate as evaluate_lib
from experiments import evaluate_setup as setup_lib
from specdec_jax.core.outputs import SpeculativeStats
from specdec_jax.evaluation import metrics, runner
from specdec_jax.evaluation.store import RecordStore


def _run(seconds, tokens, calls, beta=(0.0, 0.0)):
  return dict(seconds=list(seconds), new_tokens=list(tokens), target_calls=list(calls),
              drafted=[0] * len(tokens), accepted=[0] * len(tokens),
              beta_sum=[beta[0]] * len(tokens), beta_count=[beta[1]] * len(tokens))


def test_figures_by_hand():
  """Speedup = mean per-input tokens/s over vanilla's; tau pooled; spread per repeat."""
  def record(method, qid, category, runs, equal=True):
    return dict(method=method, question_id=qid, category=category, runs=runs, equal=equal)
  vanilla = [record("vanilla", "a", "x", [_run([2.0], [10], [10]), _run([2.0], [10], [10])]),
             record("vanilla", "b", "x", [_run([1.0, 1.0], [4, 4], [4, 4])] * 2),
             record("vanilla", "c", "y", [_run([4.0], [8], [8])] * 2)]
  for r in vanilla:
    r["prefill_seconds"] = 0.5
  spec = [record("m", "a", "x", [_run([1.0], [10], [4], (3.0, 4.0)),
                                 _run([0.5], [10], [4], (3.0, 4.0))]),
          record("m", "b", "x", [_run([0.5, 0.5], [4, 4], [2, 2], (1.0, 2.0))] * 2, equal=False),
          record("m", "c", "y", [_run([1.0], [8], [2], (2.0, 2.0))] * 2)]
  figures = metrics.method_figures(spec, vanilla, ["x", "y"])
  x = figures["categories"]["x"]
  # tokens/s: a: repeats 10/1, 10/0.5 -> mean 15; b: 8/1 -> 8. vanilla: a 5, b 4.
  assert x["tokens_per_s"] == pytest.approx((15 + 8) / 2)
  assert x["speedup"] == pytest.approx(((15 + 8) / 2) / ((5 + 4) / 2))
  # Per repeat: (10 + 8) / 2 / 4.5 = 2 and (20 + 8) / 2 / 4.5.
  assert x["speedup_spread"]["min"] == pytest.approx(9 / 4.5)
  assert x["speedup_spread"]["max"] == pytest.approx(14 / 4.5)
  assert x["tau"] == pytest.approx((10 + 10 + 8 + 8) / (4 + 4 + 4 + 4))
  assert x["alpha"] == pytest.approx((3 + 3 + 1 * 2 * 2) / (4 + 4 + 2 * 2 * 2))
  assert (x["equal"], x["total"]) == (1, 2)
  assert x["prefill_seconds_per_input"] == pytest.approx(0.5)
  y = figures["categories"]["y"]
  assert y["speedup"] == pytest.approx(8.0 / 2.0) and y["tau"] == pytest.approx(4.0)
  overall = figures["overall"]
  assert overall["speedup"] == pytest.approx(((15 + 8 + 8) / 3) / ((5 + 4 + 2) / 3))
  assert overall["total"] == 3 and overall["equal"] == 2
  base = metrics.method_figures(vanilla, vanilla, ["x", "y"])["overall"]
  assert base["speedup"] == pytest.approx(1.0) and base["tau"] == pytest.approx(1.0)
  assert base["alpha"] is None


# ---------------------------------------------------------------------------
# The whole run on a stubbed clock and decoder.

# Seconds per target call of each method, and its tau. Dyadic, so that the stub clock's
# sums are exact whatever it read before (a resumed run starts at another time).
COST = {"vanilla": 1 / 128, "model": 3 / 256, "prompt_lookup": 5 / 512}
TAU = {"vanilla": 1.0, "model": 2.5, "prompt_lookup": 2.0}


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _fake_generate(clock, calls):
  """A stand-in for `generate`: answers of a length set by the prompt, the clock
  advanced by the method's cost per target call."""
  def generate(target, inputs, lengths, *, max_decode_steps, draft=None, block_width=None,
               **kwargs):
    name = {None: "vanilla", sj.ModelDraft: "model",
            sj.PromptLookupDraft: "prompt_lookup"}[None if draft is None else type(draft)]
    row = np.asarray(inputs)[0]
    length = min(max_decode_steps, 3 + int(row.sum()) % 7)
    target_calls = length if draft is None else math.ceil(length / TAU[name])
    clock.now += COST[name] * target_calls
    calls.append((name, int(row.sum()), max_decode_steps))
    sequences = np.zeros((1, max_decode_steps), np.int32)
    sequences[0, :length] = 5 + (row.sum() + np.arange(length)) % 50
    stats = None
    if draft is not None:
      one = lambda v: np.asarray([v])  # noqa: E731
      stats = SpeculativeStats(
          gamma=4, iterations=one(target_calls), drafted=one(4 * target_calls),
          accepted=one(length - target_calls), accepted_raw=one(length - target_calls),
          position_accepted=np.zeros((1, 4)), position_drafted=np.zeros((1, 4)),
          beta_sum=one(0.5 * target_calls), beta_count=one(target_calls), emitted=one(length))
    return types.SimpleNamespace(sequences=sequences, lengths=np.asarray([length]), stats=stats)
  return generate


def _questions_file(tmp_path, rows):
  path = tmp_path / "question.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


QUESTIONS = [dict(question_id=i, category=c, turns=t) for i, (c, t) in enumerate([
    ("completion", ["def add(a, b):\n"]), ("completion", ["import os\nimport sys\n"]),
    ("editing", ["x = 1\ny = 2\nx = 1\n"]),
    ("multi", ["class A:\n", "    def f(self):\n"])])]


def _prepare(tmp_path, methods=("model", "prompt_lookup"), **options):
  return setup_lib.prepare(setup_lib.Options(
      pair="demo_decoder_only", benchmark=_questions_file(tmp_path, QUESTIONS),
      methods=list(methods), max_new_tokens=12, repeats=2, chat_template="plain", **options))


def _stubbed(monkeypatch):
  clock, calls = FakeClock(), []
  monkeypatch.setattr(runner, "generate", _fake_generate(clock, calls))
  return clock, calls


def _expected(prepared, method):
  """Hand-computed tokens/s and tau per category from the stub's rules."""
  subject = prepared.subject
  out = {}
  for question in prepared.benchmark.questions:
    answers, tokens, calls = [], 0, 0
    for turn in range(len(question.turns)):
      ids = runner.prompt_ids(subject, question.turns[:turn + 1], answers)
      inputs, _ = runner.Decoder(subject, prepared.settings).inputs(ids)
      length = min(12, 3 + int(np.asarray(inputs)[0].sum()) % 7)
      sequence = 5 + (np.asarray(inputs)[0].sum() + np.arange(length)) % 50
      answers.append(subject.tokenizer.decode([int(t) for t in sequence]))
      tokens += length
      calls += length if method == "vanilla" else math.ceil(length / TAU[method])
    out.setdefault(question.category, []).append((tokens / (COST[method] * calls), tokens, calls))
  return out


def test_stubbed_run_figures_equal_hand_computed(tmp_path, monkeypatch):
  clock, calls = _stubbed(monkeypatch)
  conversations, conversation = [], runner.Decoder.conversation

  def spy(self, method, question, repeat, *args, **kwargs):
    if not method.name.startswith("target_only"):
      conversations.append((question.question_id, repeat, method.name))
    return conversation(self, method, question, repeat, *args, **kwargs)
  monkeypatch.setattr(runner.Decoder, "conversation", spy)
  prepared = _prepare(tmp_path)
  result = evaluate_lib.evaluate(prepared, str(tmp_path / "out"), plot=False, clock=clock,
                                 costs=False)
  vanilla = _expected(prepared, "vanilla")
  for method in ("model", "prompt_lookup"):
    mine = _expected(prepared, method)
    for category, rows in mine.items():
      figures = result["methods"][method]["categories"][category]
      speed = np.mean([r[0] for r in rows])
      assert figures["tokens_per_s"] == pytest.approx(speed)
      assert figures["speedup"] == pytest.approx(speed / np.mean([r[0] for r in vanilla[category]]))
      assert figures["tau"] == pytest.approx(sum(r[1] for r in rows) / sum(r[2] for r in rows))
      assert figures["alpha"] == pytest.approx(0.5)
      assert figures["speedup_spread"]["min"] == pytest.approx(figures["speedup"])
  assert result["methods"]["vanilla"]["overall"]["tau"] == pytest.approx(1.0)
  # Interleaved: each question's decodes (every method, every repeat) end before the
  # next question's begin, and the methods' order rotates from repeat to repeat.
  order = [(q, r) for q, r, _ in conversations]
  assert order == sorted(order, key=lambda x: int(x[0]))
  first = [m for q, r, m in conversations if q == "0"]
  assert first[:3] != first[3:] and sorted(first[:3]) == sorted(first[3:])
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert set(saved["methods"]) == {"vanilla", "model", "prompt_lookup"}
  assert set(saved["methods"]["model"]["categories"]["editing"]) >= {
      "speedup", "tau", "alpha", "tokens_per_s", "equal", "total"}
  assert "| model |" in (tmp_path / "out" / "results.md").read_text()


def test_resume_loses_nothing_and_repeats_nothing(tmp_path, monkeypatch):
  clock, calls = _stubbed(monkeypatch)
  prepared = _prepare(tmp_path)
  whole = evaluate_lib.evaluate(prepared, str(tmp_path / "whole"), plot=False, clock=clock,
                                 costs=False)

  def stop_after_two(done, total):
    if done == 2:
      raise KeyboardInterrupt
  calls.clear()
  with pytest.raises(KeyboardInterrupt):
    evaluate_lib.evaluate(prepared, str(tmp_path / "cut"), plot=False, clock=clock,
                          progress=stop_after_two, costs=False)
  first = list(calls)
  calls.clear()
  resumed = evaluate_lib.evaluate(prepared, str(tmp_path / "cut"), plot=False, clock=clock,
                                 costs=False)
  assert resumed["resumed_records"] == 2 * 3  # two questions x three methods
  # The resumed run decoded only the last two questions (whose prompts differ).
  done_prompts = {c[1] for c in first}
  assert not done_prompts & {c[1] for c in calls if c[2] == 12}
  assert resumed["methods"] == whole["methods"]


def test_another_identity_in_the_output_dir_is_refused(tmp_path):
  RecordStore(str(tmp_path), dict(settings=dict(repeats=3)))
  with pytest.raises(ValueError, match="another evaluation's records.*repeats"):
    RecordStore(str(tmp_path), dict(settings=dict(repeats=2)))


# ---------------------------------------------------------------------------
# Equality on real decodes.


def _accept_all(rngs, draft_tokens, draft_probs, target_probs, num_drafted, greedy):
  """A wrong rule: every drafted token is kept, whatever the target says."""
  import jax.numpy as jnp
  batch, gamma = draft_tokens.shape
  accepted = (jnp.full((batch,), gamma, jnp.int32) if num_drafted is None
              else num_drafted.astype(jnp.int32))
  next_token = jnp.argmax(target_probs[jnp.arange(batch), accepted], axis=-1).astype(jnp.int32)
  return accepted, next_token


def test_a_wrong_verifier_fails_the_equality_check(tmp_path, monkeypatch):
  from specdec_jax.core import verification
  monkeypatch.setitem(verification.VERIFIERS, "accept_all", _accept_all)
  prepared = _prepare(tmp_path, methods=("model",), categories=None)
  wrong = setup_lib.methods_lib.Method("wrong", prepared.methods["model"].draft, 4,
                                       "accept_all", "the draft model, every token kept")
  prepared = setup_lib.dataclasses.replace(
      prepared, methods=dict(prepared.methods, wrong=wrong),
      settings=setup_lib.dataclasses.replace(prepared.settings, repeats=1))
  result = evaluate_lib.evaluate(prepared, str(tmp_path / "out"), plot=False, costs=False)
  equality = result["equality"]
  assert not equality["passed"]
  assert "model" not in equality["differing"]
  differing = equality["differing"]["wrong"]
  assert differing and all(d["turn"] == 0 for d in differing if d["question_id"] != "3")
  assert result["methods"]["model"]["overall"]["equal"] == 4
  lines = evaluate_lib._summary(result)
  assert any(line.startswith("equality FAILED: wrong differs from target-only decoding on")
             for line in lines)


# ---------------------------------------------------------------------------
# Bad input, refused before any decode.


@pytest.fixture
def no_decode(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("decoded before the input was checked")
  monkeypatch.setattr(runner, "generate", refuse)


def test_unknown_method_and_category(tmp_path, no_decode):
  with pytest.raises(ValueError, match=r"unknown method\(s\) \['sparse_cach'\].*known: vanilla"):
    _prepare(tmp_path, methods=("model", "sparse_cach"))
  with pytest.raises(ValueError, match="recipes"):
    _prepare(tmp_path, categories=["completion", "recipes"])


def test_missing_field_names_its_line(tmp_path, no_decode):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(QUESTIONS[0]) + "\n" + json.dumps(dict(question_id=9, turns=["x"]))
                  + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:2.*category"):
    setup_lib.prepare(setup_lib.Options(pair="demo_t5", benchmark=str(path)))


def test_multi_turn_without_a_chat_template_says_what_is_used_instead(tmp_path, no_decode):
  with pytest.raises(ValueError, match="no chat template.*--chat_template=plain uses the plain"):
    setup_lib.prepare(setup_lib.Options(pair="demo_t5",
                                        benchmark=_questions_file(tmp_path, QUESTIONS)))


def test_prompt_past_the_positions_is_refused(tmp_path, no_decode):
  long = [dict(question_id=1, category="long", turns=["x = 1\n" * 200])]
  with pytest.raises(ValueError, match=r"question 1 \(long\).*positions"):
    setup_lib.prepare(setup_lib.Options(pair="demo_decoder_only",
                                        benchmark=_questions_file(tmp_path, long)))


def test_bad_flags(tmp_path, no_decode):
  with pytest.raises(ValueError,
                     match="unknown pair 'demo_llama'.*or a demo pair: demo_decoder_only"):
    setup_lib.prepare(setup_lib.Options(pair="demo_llama"))
  with pytest.raises(ValueError, match="--repeats must be >= 1"):
    setup_lib.prepare(setup_lib.Options(pair="demo_t5", repeats=0))



def test_batches_through_slots_keep_outputs_exact(tmp_path):
  """batch_size 2: each category's questions stream through generate_many's slots, turn by
  turn; the outputs still equal target-only decoding's, and each call's seconds are shared
  by its inputs' tokens (every input of a call shows the call's tokens/s)."""
  prepared = _prepare(tmp_path, methods=("model",), batch_size=2)
  assert prepared.settings.batch_size == 2
  prepared = setup_lib.dataclasses.replace(
      prepared, settings=setup_lib.dataclasses.replace(prepared.settings, repeats=1))
  result = evaluate_lib.evaluate(prepared, str(tmp_path / "out"), plot=False, costs=False)
  assert result["equality"]["passed"], result["equality"]
  records = [json.loads(p.read_text()) for p in (tmp_path / "out" / "records" / "model").iterdir()]
  completion = [r for r in records if r["category"] == "completion"]
  speeds = [sum(r["runs"][0]["new_tokens"]) / sum(r["runs"][0]["seconds"]) for r in completion]
  assert speeds[0] == pytest.approx(speeds[1])
