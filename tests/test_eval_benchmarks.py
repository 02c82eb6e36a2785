"""evaluation.benchmarks: public benchmark formats read back, and bad input refused
(before any decode) with the file, the line and the fix."""

import codecs
import json
import os
import re
import sys
import types

import pytest

from specdec_jax import tasks
from specdec_jax.evaluation import benchmarks as bm

MT = bm.MT_BENCH_CATEGORIES
SPEC_ONLY = ("translation", "summarization", "qa", "math_reasoning", "rag")


def _jsonl(path, rows, raw_lines=()):
  path.parent.mkdir(parents=True, exist_ok=True)
  lines = [json.dumps(r) for r in rows] + list(raw_lines)
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return str(path)


def _mt_rows(first_id=81, per_category=2):
  """MT-Bench's layout: question_id ints from 81, two turns, references on some."""
  rows, qid = [], first_id
  for category in MT:
    for _ in range(per_category):
      row = {"question_id": qid, "category": category,
             "turns": [f"{category} question {qid}", f"{category} follow-up {qid}"]}
      if category in ("math", "reasoning", "coding"):
        row["reference"] = [f"answer {qid}", f"answer 2 {qid}"]
      rows.append(row)
      qid += 1
  return rows


def _spec_rows():
  """Spec-Bench's layout: MT-Bench's rows, then five single-turn tasks."""
  rows = _mt_rows(per_category=1)
  qid = 81 + len(rows)
  for category in SPEC_ONLY:
    for _ in range(2):
      rows.append({"question_id": qid, "category": category,
                   "turns": [f"{category} input {qid}"], "reference": [f"ref {qid}"]})
      qid += 1
  return rows


def _parquet(path, rows):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def _speed_rows(categories, per_category, turns=1):
  """SPEED-Bench's published columns (nvidia/SPEED-Bench's dataset card)."""
  rows = []
  for category in categories:
    for i in range(per_category):
      rows.append({"question_id": f"{category}{i:02d}".ljust(32, "0"), "category": category,
                   "sub_category": f"{category}_sub", "source": "src", "src_id": f"s_{i}",
                   "difficulty": "medium", "multiturn": turns > 1,
                   "turns": [f"{category} {i} turn {t}" for t in range(turns)]})
  return rows


# ---------------------------------------------------------------------------
# Published layouts.


def test_spec_bench_question_jsonl(tmp_path):
  path = _jsonl(tmp_path / "data/spec_bench/question.jsonl", _spec_rows())
  benchmark = bm.load_benchmark(path)
  assert benchmark.name == "spec_bench" and benchmark.source == path
  assert benchmark.categories == list(bm.SPEC_BENCH_CATEGORIES)
  by = benchmark.by_category()
  assert [q.question_id for q in by["mt_bench"]] == [str(i) for i in range(81, 89)]
  assert all(len(q.turns) == 2 for q in by["mt_bench"]) and benchmark.multi_turn
  assert by["mt_bench"][0].turns == ("writing question 81", "writing follow-up 81")
  assert by["qa"][1].turns == ("qa input 94",) and by["qa"][1].reference == ("ref 94",)
  assert benchmark.concurrency is None
  # The directory of a Spec-Bench checkout finds the same file.
  assert bm.load_benchmark(str(tmp_path)).questions == benchmark.questions
  picked = bm.load_benchmark(path, categories=["rag", "mt_bench"], limit_per_category=1)
  assert [(q.category, q.question_id) for q in picked.questions] == [("mt_bench", "81"),
                                                                     ("rag", "97")]


def test_mt_bench_question_jsonl(tmp_path):
  path = _jsonl(tmp_path / "mt_bench/question.jsonl", _mt_rows())
  benchmark = bm.load_benchmark(path)
  assert benchmark.name == "mt_bench"
  assert benchmark.categories == list(MT)
  assert len(benchmark.questions) == 16 and all(len(q.turns) == 2 for q in benchmark.questions)
  math = benchmark.by_category()["math"]
  assert [q.question_id for q in math] == ["87", "88"]
  assert math[0].reference == ("answer 87", "answer 2 87")
  assert benchmark.by_category()["writing"][0].reference is None
  assert len(bm.load_benchmark(path, categories="stem").questions) == 2  # One name, as a str.


def test_plain_jsonl_fields_ids_and_name(tmp_path):
  path = tmp_path / "my_bench.jsonl"
  rows = [{"category": "code", "turns": ["t1", "t2"], "id": "a"},
          {"category": "code", "prompt": "p"},
          {"category": "chat", "input": "i", "question_id": 70},
          {"category": "chat", "text": "x\ny"},
          {"category": "chat", "question": "q?", "reference": "r"},
          {"category": "chat", "prompt": ["listed", "turns"]}]
  path.write_bytes(codecs.BOM_UTF8 + ("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n"
                   + "\n".join(json.dumps(r) for r in rows[2:]) + "\n").encode())
  benchmark = bm.load_benchmark(str(path))
  assert benchmark.name == "my_bench"
  assert [(q.question_id, q.category, q.turns) for q in benchmark.questions] == [
      ("a", "code", ("t1", "t2")), ("2", "code", ("p",)), ("70", "chat", ("i",)),
      ("5", "chat", ("x\ny",)), ("6", "chat", ("q?",)), ("7", "chat", ("listed", "turns"))]
  assert benchmark.questions[4].reference == ("r",)


def test_tsv_with_escapes_and_turns(tmp_path):
  path = tmp_path / "mine.tsv"
  path.write_text("code\tdef f():\\n  return 1\n\nchat\tfirst\tsecond \\t tab \\\\n \\x\n",
                  encoding="utf-8")
  benchmark = bm.load_benchmark(str(path))
  assert benchmark.name == "mine"
  assert [(q.question_id, q.category, q.turns) for q in benchmark.questions] == [
      ("1", "code", ("def f():\n  return 1",)),
      ("3", "chat", ("first", "second \t tab \\n \\x"))]


def test_speed_bench_parquet_splits(tmp_path):
  qualitative = _parquet(tmp_path / "qualitative.parquet",
                         _speed_rows(bm.SPEED_QUALITATIVE_CATEGORIES, 2, turns=2))
  benchmark = bm.load_benchmark(qualitative)
  assert benchmark.name == "speed_bench_qualitative" and benchmark.concurrency is None
  assert benchmark.categories == list(bm.SPEED_QUALITATIVE_CATEGORIES)
  assert benchmark.questions[0].question_id == "coding00".ljust(32, "0")
  assert benchmark.questions[0].turns == ("coding 0 turn 0", "coding 0 turn 1")
  throughput = _parquet(tmp_path / "throughput_2k.parquet",
                        _speed_rows(bm.SPEED_THROUGHPUT_TIERS, 3))
  benchmark = bm.load_benchmark(throughput)
  assert benchmark.name == "speed_bench_throughput_2k"
  assert benchmark.categories == list(bm.SPEED_THROUGHPUT_TIERS)
  assert benchmark.concurrency == 3  # A tier per batch.
  assert bm.load_benchmark(throughput, limit_per_category=2).concurrency == 2
  rows = [dict(r, concurrency=64) for r in _speed_rows(bm.SPEED_THROUGHPUT_TIERS, 2)]
  assert bm.load_benchmark(_parquet(tmp_path / "c.parquet", rows)).concurrency == 64
  rows[3]["concurrency"] = 8
  with pytest.raises(ValueError, match=r"c2.parquet: row 1: column 'concurrency' holds several "
                                       r"values \[8, 64\]: split the file"):
    bm.load_benchmark(_parquet(tmp_path / "c2.parquet", rows))
  # NVIDIA's prepare script's output: the same rows with `messages`.
  prepared = [dict({k: v for k, v in r.items() if k != "turns"},
                   messages=[{"role": "user", "content": t} for t in r["turns"]])
              for r in _speed_rows(bm.SPEED_THROUGHPUT_TIERS, 2)]
  benchmark = bm.load_benchmark(_jsonl(tmp_path / "prepared/throughput_16k.jsonl", prepared))
  assert benchmark.name == "speed_bench_throughput_16k" and benchmark.concurrency == 2
  assert benchmark.questions[-1].turns == ("high_entropy 1 turn 0",)
  benchmark = bm.load_benchmark(_parquet(tmp_path / "messages.parquet", prepared))
  assert benchmark.questions[0].turns == ("low_entropy 0 turn 0",)


def test_speed_bench_placeholders_refused(tmp_path):
  rows = _speed_rows(bm.SPEED_THROUGHPUT_TIERS, 2)
  rows[1]["turns"] = [bm.SPEED_PLACEHOLDER + "\n\n{question}"]
  rows[4]["turns"] = [bm.SPEED_PLACEHOLDER]
  path = _parquet(tmp_path / "throughput_8k/test-00000-of-00001.parquet", rows)
  with pytest.raises(ValueError) as error:
    bm.load_benchmark(path)
  message = str(error.value)
  assert message.startswith(f"{path}: row 2: 2 of 6 rows hold SPEED-Bench's placeholder")
  assert "prepare.py | python3 - --config throughput_8k --output_dir DIR" in message


def test_directories(tmp_path):
  shards = tmp_path / "qualitative"
  _parquet(shards / "test-00000-of-00002.parquet", _speed_rows(bm.SPEED_QUALITATIVE_CATEGORIES, 1))
  extra = dict(_speed_rows(["coding"], 1)[0], question_id="x")
  _parquet(shards / "test-00001-of-00002.parquet", [extra])
  benchmark = bm.load_benchmark(str(shards))
  assert len(benchmark.questions) == 12 and benchmark.questions[-1].question_id == "x"
  assert bm.load_benchmark(str(tmp_path)).questions == benchmark.questions  # <config>/ shards.
  fastchat = tmp_path / "FastChat"
  _jsonl(fastchat / "fastchat/llm_judge/data/mt_bench/question.jsonl", _mt_rows())
  assert bm.load_benchmark(str(fastchat)).name == "mt_bench"
  _jsonl(fastchat / "question.jsonl", _mt_rows())
  with pytest.raises(ValueError, match=r"several benchmarks inside .*question.jsonl.*: pass one"):
    bm.load_benchmark(str(fastchat))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty: no benchmark file of a known layout"):
    bm.load_benchmark(str(tmp_path / "empty"))


# ---------------------------------------------------------------------------
# Dataset names.


def test_names_through_the_environment_directory(tmp_path, monkeypatch):
  monkeypatch.setenv(bm.ENV_VAR, str(tmp_path))
  _jsonl(tmp_path / "spec_bench/question.jsonl", _spec_rows())
  benchmark = bm.load_benchmark("spec_bench")
  assert benchmark.name == "spec_bench" and benchmark.categories[0] == "mt_bench"
  assert benchmark.source == str(tmp_path / "spec_bench/question.jsonl")
  _parquet(tmp_path / "speed_bench/throughput_1k.parquet",
           _speed_rows(bm.SPEED_THROUGHPUT_TIERS, 4))
  benchmark = bm.load_benchmark("speed_bench_throughput", categories=["mixed"])
  assert benchmark.name == "speed_bench_throughput_1k" and benchmark.concurrency == 4
  assert benchmark.categories == ["mixed"]


def test_names_through_hugging_face_datasets(monkeypatch):
  calls = []

  def load_dataset(hub_id, config, split):
    calls.append((hub_id, config, split))
    return _mt_rows(per_category=1)

  monkeypatch.delenv(bm.ENV_VAR, raising=False)
  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
  benchmark = bm.load_benchmark("mt_bench")
  assert calls == [("lighteval/mt-bench", None, "train")]
  assert benchmark.name == "mt_bench" and len(benchmark.questions) == 8
  assert benchmark.source == "lighteval/mt-bench"


def test_names_found_nowhere_and_unknown_names(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails.
  monkeypatch.setenv(bm.ENV_VAR, str(tmp_path))
  with pytest.raises(FileNotFoundError) as error:
    bm.load_benchmark("mt_bench")
  message = str(error.value)
  assert f"{bm.ENV_VAR}={tmp_path} holds none of ['mt_bench/question.jsonl']" in message
  assert "Hugging Face datasets is not installed" in message
  assert "--benchmark=PATH" in message and "FastChat" in message
  monkeypatch.delenv(bm.ENV_VAR)
  with pytest.raises(FileNotFoundError, match=f"{bm.ENV_VAR} is not set, and it has no "
                                              "Hugging Face hub copy"):
    bm.load_benchmark("spec_bench")
  with pytest.raises(ValueError, match=r"unknown benchmark 'specbench': known names are "
                                       r"\['mt_bench', 'spec_bench', 'speed_bench_qualitative'"):
    bm.load_benchmark("specbench")
  with pytest.raises(ValueError, match="or pass the path of a benchmark file"):
    bm.load_benchmark("specbench")


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("line,message", [
    ('{"category": "c", "turns": ["a"]', r":2: not a JSON line \(.*\): each line must be one JSON"),
    ('["c", "a"]', r":2: expected a JSON object .*got a JSON list"),
    ('{"turns": ["a"]}', r":2: expected a non-empty string field 'category', got no field "
                         r"'category' \(its fields: \['turns'\]\)"),
    ('{"category": 3, "turns": ["a"]}', r":2: .*got 'category' 3 \(its fields: \['category', "
                                        r"'turns'\]\)"),
    ('{"category": "c", "body": "a"}', r":2: no text field: expected one of \['turns', 'messages',"
                                       r" 'prompt', 'input', 'text', 'question'\] \(its fields: "
                                       r"\['body', 'category'\]\)"),
    ('{"category": "c", "turns": "a"}', r":2: field 'turns' must be a list of strings, got str"),
    ('{"category": "c", "turns": ["a", 2]}', r":2: field 'turns' must be a list of strings"),
    ('{"category": "c", "turns": []}', r":2: field 'turns' is empty: a question needs a user turn"),
    ('{"category": "c", "turns": ["a", " "]}', r":2: turn 2 of 'turns' is empty"),
    ('{"category": "c", "prompt": 5}', r":2: field 'prompt' must be a list of strings, got int"),
    ('{"category": "c", "turns": ["a"], "question_id": 1.5}',
     r":2: field 'question_id' must be an integer or a non-empty string, got 1.5"),
    ('{"category": "c", "turns": ["a"], "reference": [1]}',
     r":2: field 'reference' must be a list of strings"),
    ('{"category": "c", "messages": [{"role": "assistant", "content": "a"}]}',
     r":2: 'messages' holds \['assistant'\] messages: only user turns are read"),
    ('{"category": "c", "messages": "a"}', r":2: field 'messages' must be a list of"),
])
def test_bad_jsonl_lines(tmp_path, line, message):
  path = _jsonl(tmp_path / "bad.jsonl", [{"category": "c", "turns": ["ok"]}], [line])
  with pytest.raises(ValueError, match=re_escape_path(path) + message):
    bm.load_benchmark(path)


def re_escape_path(path):
  return "^" + re.escape(path)


def test_duplicates_categories_empty_and_missing(tmp_path):
  path = _jsonl(tmp_path / "dup.jsonl", [{"category": "c", "turns": ["a"], "question_id": 4},
                                         {"category": "c", "turns": ["b"]},
                                         {"category": "d", "turns": ["b"], "question_id": "4"}])
  with pytest.raises(ValueError, match=re_escape_path(path) + r":3: question_id '4' again \(first "
                                       f"at {re_escape_path(path)[1:]}:1\\): ids must be unique"):
    bm.load_benchmark(path)
  path = _jsonl(tmp_path / "ok.jsonl", [{"category": "c", "turns": ["a"]},
                                        {"category": "d", "turns": ["b"]}])
  with pytest.raises(ValueError, match=r"ok.jsonl: no category 'qa'; it has \['c', 'd'\]"):
    bm.load_benchmark(path, categories=["c", "qa"])
  with pytest.raises(ValueError, match="limit_per_category must be >= 1, got 0"):
    bm.load_benchmark(path, limit_per_category=0)
  blank = tmp_path / "blank.jsonl"
  blank.write_text("\n  \n")
  with pytest.raises(ValueError, match=r"blank.jsonl: no questions \(every line blank\)"):
    bm.load_benchmark(str(blank))
  with pytest.raises(FileNotFoundError, match=r"benchmark file not found: '.*nowhere.jsonl'"):
    bm.load_benchmark(str(tmp_path / "nowhere.jsonl"))
  tsv = tmp_path / "bad.tsv"
  tsv.write_text("c\tok\nno tab here\n")
  with pytest.raises(ValueError, match=r"bad.tsv:2: expected 'category<TAB>text'"):
    bm.load_benchmark(str(tsv))
  latin = tmp_path / "latin.jsonl"
  latin.write_bytes(b'{"category": "c", "turns": ["ok"]}\n'
                    b'{"category": "c", "turns": ["caf\xe9"]}\n')
  with pytest.raises(ValueError, match=r"latin.jsonl:2: not UTF-8"):
    bm.load_benchmark(str(latin))


def test_bad_parquet_columns(tmp_path):
  rows = [{"question_id": "a", "domain": "coding", "turns": ["x"]}]
  path = _parquet(tmp_path / "odd.parquet", rows)
  with pytest.raises(ValueError, match=re_escape_path(path) + r": row 1: expected a non-empty "
                     r"string field 'category', got no field 'category' \(its fields: "
                     r"\['domain', 'question_id', 'turns'\]\)"):
    bm.load_benchmark(path)
  not_parquet = tmp_path / "junk.parquet"
  not_parquet.write_text("not parquet")
  with pytest.raises(ValueError, match=r"junk.parquet: not a readable parquet file"):
    bm.load_benchmark(str(not_parquet))


def test_task_benchmark_from_local_tasks(tmp_path):
  ende = tmp_path / "ende.jsonl"
  ende.write_text("".join(json.dumps({"inputs": f"sentence {i}", "targets": f"Satz {i}"}) + "\n"
                          for i in range(3)))
  docs = tmp_path / "docs.tsv"
  docs.write_text("an article\nanother article\n")
  benchmark = bm.task_benchmark({
      "ende": tasks.Task(name="ende", source="local", path=str(ende),
                         prefix="translate English to German: "),
      "cnndm": tasks.Task(name="cnndm", source="local", path=str(docs), prefix="summarize: ")},
      num_examples=2)
  assert benchmark.categories == ["ende", "cnndm"] and not benchmark.multi_turn
  assert [(q.question_id, q.turns, q.reference) for q in benchmark.questions] == [
      ("ende-0", ("translate English to German: sentence 0",), ("Satz 0",)),
      ("ende-1", ("translate English to German: sentence 1",), ("Satz 1",)),
      ("cnndm-0", ("summarize: an article",), None),
      ("cnndm-1", ("summarize: another article",), None)]
  assert benchmark.name == "ende+cnndm"
  assert benchmark.source == f"ende={ende}, cnndm={docs}"
  assert len(bm.task_benchmark({"ende": tasks.Task(path=str(ende))}).questions) == 3
  with pytest.raises(FileNotFoundError):
    bm.task_benchmark({"ende": tasks.Task(path=os.path.join(str(tmp_path), "none.jsonl"))})
