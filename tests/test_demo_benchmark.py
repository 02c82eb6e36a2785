"""The demo pairs' shipped mini-benchmarks (`scripts/make_demo_benchmark.py`): Spec-Bench's
question.jsonl layout, the five categories with the counts the script writes, every prompt
within its pair's positions, and the script reproducing the files byte for byte."""

import importlib.util
import json
import os
import sys

import pytest

from specdec_jax import data
from specdec_jax.demo_pair import DIRS

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location(
    "make_demo_benchmark", os.path.join(_REPO, "scripts", "make_demo_benchmark.py"))
benchmark = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(benchmark)

PAIRS = ("t5", "decoder_only")
# The harness joins turn 1, its answer and turn 2 with a newline each.
JOIN_TOKENS = 2


def _shipped(family):
  with open(os.path.join(DIRS[family], benchmark.BENCHMARK_FILE), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _settings(family):
  """The pair's own settings (config.json / info.json), not the script's copy of them."""
  marker = "config.json" if family == "t5" else "info.json"
  with open(os.path.join(DIRS[family], marker)) as f:
    return json.load(f)


def _tokens(tokenizer, text):
  """Tokens as a harness may encode the text: whole, or line by line as the trainers did."""
  return max(len(tokenizer.encode(text)), len(tokenizer.encode_lines(text)))


@pytest.mark.parametrize("family", PAIRS)
def test_spec_bench_layout_and_counts(family):
  rows = _shipped(family)
  for row in rows:
    assert list(row) == ["question_id", "category", "turns"], row
    assert isinstance(row["question_id"], int) and isinstance(row["category"], str)
    assert row["turns"] and all(isinstance(t, str) and t.strip() for t in row["turns"])
    assert all(t.endswith("\n") for t in row["turns"]), "turns are whole lines"
    assert len(row["turns"]) == (2 if row["category"] == "multi_turn" else 1), row
  assert [r["question_id"] for r in rows] == list(range(1, len(rows) + 1))
  categories = [r["category"] for r in rows]
  assert list(dict.fromkeys(categories)) == list(benchmark.CATEGORIES)
  assert {c: categories.count(c) for c in benchmark.CATEGORIES} == {
      c: benchmark.PER_CATEGORY for c in benchmark.CATEGORIES}
  assert len({tuple(r["turns"]) for r in rows}) == len(rows), "no question twice"


def test_t5_prompts_fit():
  """Single turns fit the trained encoder width (input_len, EOS included), long_context
  is longer than that (a few hundred tokens), and a multi-turn prompt with its answer
  (target_len tokens, EOS included) stays within a few hundred too."""
  settings = _settings("t5")["settings"]
  width, answer = settings["input_len"], settings["target_len"]
  tokenizer = data.Tokenizer.load(os.path.join(DIRS["t5"], "tokenizer.model"))
  for row in _shipped("t5"):
    counts = [_tokens(tokenizer, t) for t in row["turns"]]
    if row["category"] == "long_context":
      assert 4 * width <= counts[0] + 1 <= 6 * width + 1, (row["question_id"], counts)
    else:
      assert all(n + 1 <= width for n in counts), (row["question_id"], counts)
    longest = sum(counts) + (len(counts) - 1) * (answer + JOIN_TOKENS) + 1
    assert longest <= 6 * width + 1, (row["question_id"], longest)


def test_decoder_only_prompts_fit():
  """Every question's longest prompt (all its turns, an answer of new_tokens after each
  earlier turn, the joining newlines) plus the new answer fits the model's positions."""
  settings = _settings("decoder_only")["settings"]
  positions, new_tokens = settings["seq_len"], settings["new_tokens"]
  tokenizer = data.Tokenizer.load(os.path.join(DIRS["decoder_only"], "tokenizer.model"))
  longest_single = 0
  for row in _shipped("decoder_only"):
    counts = [_tokens(tokenizer, t) for t in row["turns"]]
    longest = sum(counts) + (len(counts) - 1) * (new_tokens + JOIN_TOKENS)
    assert longest + new_tokens <= positions, (row["question_id"], counts)
    if row["category"] == "long_context":
      longest_single = max(longest_single, counts[0])
  assert longest_single >= positions - new_tokens - 8, "long_context reaches near the limit"


def _same_corpus():
  """Why the script cannot reproduce the shipped files here, or None when it can: it reads
  the running interpreter's stdlib, which must be the one the pairs were trained on."""
  root = data.stdlib_root()
  if not os.path.isdir(root):
    return f"no stdlib source at {root}"
  trained = _settings("t5")["provenance"]["python_version"]
  here = sys.version.split()[0]
  if here != trained:
    return f"stdlib of Python {here}, the pairs' corpus is Python {trained}'s"
  return None


@pytest.mark.skipif(_same_corpus() is not None, reason=f"{_same_corpus()}")
def test_script_reproduces_shipped_files(tmp_path):
  benchmark.main(["--out_root", str(tmp_path)])
  for family in PAIRS:
    name = os.path.join(benchmark.BUDGETS[family].out_dir, benchmark.BENCHMARK_FILE)
    with open(os.path.join(_REPO, name), "rb") as shipped, open(tmp_path / name, "rb") as made:
      assert made.read() == shipped.read(), f"{name} differs from the script's output"
