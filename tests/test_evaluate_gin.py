"""The harness on targets and drafts from the launcher's gin configuration.

Checkpoints written by the tests (test_launcher's tiny pairs: Llama with a BPE
tokenizer.json, Gemma 2 with a SentencePiece model and a chat template, T5):
the methods built from gin, a multi-turn benchmark through the chat template,
Table 2's drafts and tasks as methods and categories at T = 0 and T = 1, and a
draft whose tokenizer is not the target's refused before any decode.
"""

import json

import gin
import pytest

from experiments import evaluate as evaluate_lib
from experiments import evaluate_setup as setup_lib
from specdec_jax import text
from specdec_jax.evaluation import conversation, runner
from test_launcher import draft_with_another_tokenizer, pairs  # noqa: F401  (a fixture)

STEPS = 8


@pytest.fixture(autouse=True)
def _clear_gin():
  yield
  gin.clear_config()


def _questions(tmp_path, rows, name="question.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _options(benchmark, bindings, **kwargs):
  defaults = dict(pair="local", benchmark=benchmark, max_new_tokens=STEPS, repeats=1,
                  max_input_length=32, gin_bindings=list(bindings))
  defaults.update(kwargs)
  return setup_lib.Options(**defaults)


SINGLE = [dict(question_id=i, category=c, turns=[t]) for i, (c, t) in enumerate(
    [("animals", "the cat sat on"), ("animals", "the dog sat on the"),
     ("greetings", "hello world, hello")])]


def test_gin_methods_on_a_local_pair(pairs, tmp_path):  # noqa: F811
  target, draft = pairs["llama"]
  prepared = setup_lib.prepare(_options(
      _questions(tmp_path, SINGLE), [f"TARGET_CHECKPOINT = '{target}'",
                                     f"DRAFT_CHECKPOINT = '{draft}'"],
      methods=["model", "prompt_lookup", "ngram", "tree"]))
  assert list(prepared.methods) == ["vanilla", "model", "prompt_lookup", "ngram", "tree"]
  result = evaluate_lib.evaluate(prepared, str(tmp_path / "out"), plot=False)
  assert result["equality"]["passed"], result["equality"]
  assert result["benchmark"]["categories"] == ["animals", "greetings"]
  for name in ("model", "prompt_lookup", "ngram", "tree"):
    overall = result["methods"][name]["overall"]
    assert overall["equal"] == overall["total"] == 3
    assert overall["tau"] >= 1.0
  assert str(target) in json.dumps(json.loads((tmp_path / "out" / "identity.json").read_text()))
  # The theory's columns: the draft model's c timed, the tables' taken as 0.
  model = result["methods"]["model"]
  assert model["c"] > 0 and model["verify_cost"] > 0 and model["predicted_speedup"] > 0
  assert result["methods"]["prompt_lookup"]["c"] is None
  assert result["methods"]["tree"]["draft_calls"] == 3


def test_multi_turn_through_the_chat_template(pairs, tmp_path):  # noqa: F811
  target, draft = pairs["gemma2"]
  rows = [dict(question_id="a", category="chat", turns=["the cat sat", "and the dog"])]
  prepared = setup_lib.prepare(_options(
      _questions(tmp_path, rows), [f"TARGET_CHECKPOINT = '{target}'",
                                   f"DRAFT_CHECKPOINT = '{draft}'"], methods=["model"],
      max_input_length=64))
  assert prepared.subject.template is not None
  result = evaluate_lib.evaluate(prepared, str(tmp_path / "out"), plot=False, costs=False)
  assert result["equality"]["passed"]
  record = json.loads(next((tmp_path / "out" / "records" / "model").iterdir()).read_text())
  tokenizer = text.checkpoint_tokenizer(str(target))
  # Turn 2's prompt: the template over turn 1, the model's own answer, turn 2.
  rendered = conversation.render_chat_template(
      tokenizer.chat_template, conversation.chat_messages(rows[0]["turns"], record["texts"][:1]),
      bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
  assert record["prompt_tokens"][1] == len(tokenizer.encode(rendered, add_special_tokens=False))
  assert rendered.count("user: ") == 2 and rendered.endswith("model:")


def test_table2_drafts_and_tasks_at_both_temperatures(pairs, tmp_path):  # noqa: F811
  target, draft = pairs["t5"]
  files = {}
  for task, lines in (("ende", ["the cat sat on the mat", "hello world"]),
                      ("cnndm", ["a quick brown fox jumps over the lazy dog"])):
    files[task] = tmp_path / f"{task}.jsonl"
    files[task].write_text("".join(json.dumps(dict(inputs=t)) + "\n" for t in lines))
  bindings = [f"TARGET_CHECKPOINT = '{target}'", f"SMALL_CHECKPOINT = '{draft}'",
              f"BASE_CHECKPOINT = '{draft}'", f"LARGE_CHECKPOINT = '{target}'"]
  for role in ("target", "draft", "small", "base", "large"):
    bindings.append(f"{role}/ModelSpec.config = None")  # the tiny checkpoints' own shapes
  for task in ("ende", "cnndm"):
    bindings += [f"{task}/Task.source = 'local'", f"{task}/Task.path = '{files[task]}'"]
  for temperature in (0.0, 1.0):
    gin.clear_config()
    prepared = setup_lib.prepare(_options(
        "table2", bindings, pair=None, gin_files=[setup_lib.TABLE2_GIN],
        methods=["small", "base", "large"], temperature=temperature, repeats=2))
    assert prepared.benchmark.categories == ["ende", "cnndm"]
    result = evaluate_lib.evaluate(prepared, str(tmp_path / f"t{temperature:g}"), plot=False,
                                   costs=False)
    assert set(result["methods"]) == {"vanilla", "small", "base", "large"}
    if temperature == 0.0:
      assert result["equality"]["passed"]
      # The target drafting for itself: every draft accepted.
      assert result["methods"]["large"]["overall"]["alpha"] == pytest.approx(1.0)
    else:
      law = result["methods"]["small"]["law"]["ende"]
      assert law["pairs"] == 4 and "length" in law["p_values"]
      assert result["methods"]["small"]["overall"]["equal"] is None


def test_a_draft_with_another_tokenizer_is_refused(pairs, tmp_path, monkeypatch):  # noqa: F811
  target, draft = pairs["llama"]
  other = draft_with_another_tokenizer(draft, tmp_path)
  monkeypatch.setattr(runner, "generate", lambda *a, **k: pytest.fail("decoded"))
  with pytest.raises(ValueError, match="method 'model': the draft checkpoint's tokenizer"):
    setup_lib.prepare(_options(_questions(tmp_path, SINGLE),
                               [f"TARGET_CHECKPOINT = '{target}'",
                                f"DRAFT_CHECKPOINT = '{other}'"], methods=["model"]))


def test_no_target_is_a_clear_error():
  with pytest.raises(ValueError, match="no target: pass --pair"):
    setup_lib.prepare(setup_lib.Options(benchmark="x.jsonl"))
