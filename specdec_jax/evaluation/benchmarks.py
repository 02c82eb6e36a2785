"""Benchmarks in their public formats, read into `questions.Benchmark`.

`load_benchmark(source, categories=None, limit_per_category=None)` takes a file,
a directory or a dataset name. Everything is read and checked before any decode:
a bad line is a ValueError naming `path:line`, the problem and the fix.

Formats (by file name):
* `.jsonl` / `.json`: one JSON object per line with a string `category`, the
  text in `turns` (a list of user turns) or `messages` (a list of
  {"role": "user", "content": ...}) or `prompt` / `input` / `text` /
  `question` (a string, or a list of turns), an optional `question_id` / `id`
  (else the 1-based line number) and an optional `reference` (a string or a
  list of strings). This covers:
  - Spec-Bench's `data/spec_bench/question.jsonl` (hemingkx/Spec-Bench): 480
    rows, the first 80 MT-Bench's two-turn questions under MT-Bench's eight
    categories, then translation, summarization, qa, math_reasoning and rag,
    80 each. Read as Spec-Bench reports it (its evaluation/speed.py): the eight
    MT-Bench categories become the one category 'mt_bench'.
  - MT-Bench's `fastchat/llm_judge/data/mt_bench/question.jsonl` (FastChat): 80
    two-turn questions in writing, roleplay, reasoning, math, coding,
    extraction, stem and humanities.
  - SPEED-Bench prepared by NVIDIA's prepare script (`<config>.jsonl`, rows with
    `messages`; what vLLM's `--dataset-name speed_bench` reads).
* `.parquet`: SPEED-Bench's published splits (Hugging Face nvidia/SPEED-Bench,
  read with pyarrow), columns `question_id` (string), `category`,
  `sub_category`, `turns` (list of strings), `source`, `src_id`, `difficulty`,
  `multiturn`. Config `qualitative`: 880 rows, 80 in each of coding,
  humanities, math, multilingual, qa, rag, reasoning, roleplay, stem,
  summarization, writing. Configs `throughput_1k` / `_2k` / `_8k` / `_16k` /
  `_32k` (input lengths): 1536 rows, 512 in each entropy tier low_entropy,
  mixed, high_entropy. Rows whose source SPEED-Bench may not redistribute hold a
  placeholder text instead of the prompt: such a file is refused, with the
  command that fills them in. Other parquet files need the same column names
  as the JSONL rows (`messages` may be a list of {role, content}).
* anything else (`.tsv`, `.txt`): `category<TAB>turn 1[<TAB>turn 2...]` per
  line, each further tab-separated column a further user turn; ids are the
  1-based line numbers. In a turn the two characters `\\n` stand for a newline,
  `\\t` for a tab and `\\\\` for one backslash; any other backslash is kept.
Blank lines are skipped and a UTF-8 byte-order mark is dropped (tasks._text_lines).

Benchmark.name: 'spec_bench' / 'mt_bench' / 'speed_bench_qualitative' /
'speed_bench_throughput_<length>' when the file's categories are exactly that
benchmark's, else the file's stem (a FastChat-style `<name>/question.jsonl`: the
folder's name). Benchmark.concurrency (SPEED-Bench's throughput split only): a
`concurrency` column if the file has one, else the number of questions in the
largest entropy tier (512 as published: the highest concurrency SPEED-Bench
measures, one tier per batch); `limit_per_category` lowers it.

A directory: the one file of a known layout inside (`DIRECTORY_LAYOUTS`, e.g. a
Spec-Bench checkout's data/spec_bench/question.jsonl, or a folder of parquet
shards); several or none is an error listing what it found or looked for.

Dataset names (`KNOWN_NAMES`) resolve through the directory named by the
environment variable SPECDEC_JAX_BENCHMARKS, laid out as
    $SPECDEC_JAX_BENCHMARKS/spec_bench/question.jsonl
    $SPECDEC_JAX_BENCHMARKS/mt_bench/question.jsonl
    $SPECDEC_JAX_BENCHMARKS/speed_bench/<config>.jsonl   (prepare script output)
      or speed_bench/<config>.parquet or speed_bench/<config>/*.parquet
(<config>: qualitative, throughput_1k, ... throughput_32k), and else through
Hugging Face `datasets` when it is installed and the benchmark has a hub id
(MT-Bench: lighteval/mt-bench; SPEED-Bench: nvidia/SPEED-Bench, whose
placeholder rows still need the prepare script). 'speed_bench_throughput' is
the 1k-token inputs.

`task_benchmark(tasks_by_category)` makes the paper's tasks (`tasks.Task`:
WMT EnDe, CNN/DM, local files) single-turn categories.
"""

import glob
import json
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from specdec_jax import tasks
from specdec_jax.evaluation.questions import Benchmark, Question

ENV_VAR = "SPECDEC_JAX_BENCHMARKS"

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                       "stem", "humanities")
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning",
                         "rag")
SPEED_QUALITATIVE_CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag",
                                "reasoning", "roleplay", "stem", "summarization", "writing")
SPEED_THROUGHPUT_TIERS = ("low_entropy", "mixed", "high_entropy")
SPEED_CONFIGS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k",
                 "throughput_16k", "throughput_32k")
# What SPEED-Bench publishes in place of text it may not redistribute.
SPEED_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SPEED_PREPARE = ("curl -LsSf https://raw.githubusercontent.com/NVIDIA-NeMo/Skills/refs/heads/"
                 "main/nemo_skills/dataset/speed-bench/prepare.py | python3 - --config {config} "
                 "--output_dir DIR")

TEXT_FIELDS = ("turns", "messages", "prompt", "input", "text", "question")
ID_FIELDS = ("question_id", "id")


def _known_names() -> Dict[str, Tuple[Tuple[str, ...], Optional[Tuple[str, Optional[str], str]],
                                      str]]:
  """name -> (paths under $SPECDEC_JAX_BENCHMARKS, (hub id, config, split) or None,
  where the file comes from)."""
  known = {
      "spec_bench": (("spec_bench/question.jsonl",), None,
                     "data/spec_bench/question.jsonl of github.com/hemingkx/Spec-Bench"),
      "mt_bench": (("mt_bench/question.jsonl",), ("lighteval/mt-bench", None, "train"),
                   "fastchat/llm_judge/data/mt_bench/question.jsonl of github.com/lm-sys/FastChat"),
  }
  for config in SPEED_CONFIGS:
    known[f"speed_bench_{config}"] = (
        tuple(f"speed_bench/{config}{ext}" for ext in (".jsonl", ".parquet", "")),
        ("nvidia/SPEED-Bench", config, "test"),
        f"{config}.jsonl from NVIDIA's SPEED-Bench prepare script "
        f"({SPEED_PREPARE.format(config=config)})")
  return known


KNOWN_NAMES = _known_names()
ALIASES = {"speed_bench_throughput": "speed_bench_throughput_1k"}

# Looked for inside a directory passed as the source: exactly one may be there.
DIRECTORY_LAYOUTS = ("data/spec_bench/question.jsonl",  # a Spec-Bench checkout
                     "fastchat/llm_judge/data/mt_bench/question.jsonl",  # a FastChat checkout
                     "spec_bench/question.jsonl",
                     "mt_bench/question.jsonl", "question.jsonl") + tuple(
                         f"{c}{ext}" for c in SPEED_CONFIGS for ext in (".jsonl", ".parquet"))

Row = Tuple[str, int, Dict[str, Any]]  # (where, 1-based line or row number, record)


# ---------------------------------------------------------------------------
# Readers: rows of one file (no checks beyond the format's own).


def read_jsonl_rows(path: str) -> List[Row]:
  """The objects of a JSONL file, each with `path:line`."""
  rows = []
  for number, line in tasks._text_lines(path):  # pylint: disable=protected-access
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: not a JSON line ({e.msg} at column {e.colno}): each line "
                       "must be one JSON object") from None
    if not isinstance(record, dict):
      raise ValueError(f"{where}: expected a JSON object ({{\"category\": ..., \"turns\": "
                       f"[...]}}), got a JSON {type(record).__name__}")
    rows.append((where, number, record))
  return rows


def _unescape(text: str) -> str:
  """`\\n`, `\\t` and `\\\\` in a TSV turn; any other backslash stays as written."""
  escapes = {"n": "\n", "t": "\t", "\\": "\\"}
  return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(0)), text)


def read_tsv_rows(path: str) -> List[Row]:
  """`category<TAB>turn[<TAB>turn...]` lines as records with `category` and `turns`."""
  rows = []
  for number, line in tasks._text_lines(path):  # pylint: disable=protected-access
    line = line.rstrip("\n").rstrip("\r")
    if not line.strip():
      continue
    where = f"{path}:{number}"
    columns = line.split("\t")
    if len(columns) < 2:
      raise ValueError(f"{where}: expected 'category<TAB>text' (further tabs: further "
                       "turns), found no tab; write a tab inside a turn as \\t")
    rows.append((where, number, {"category": columns[0],
                                 "turns": [_unescape(c) for c in columns[1:]]}))
  return rows


def read_parquet_rows(paths: Sequence[str]) -> List[Row]:
  """The rows of one parquet file or of its shards in order, each with `path: row N`."""
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise ImportError(f"reading {paths[0]} needs pyarrow (pip install pyarrow, or "
                      "specdec_jax[data])") from e
  rows = []
  for path in paths:
    try:
      records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's own errors: a truncated or non-parquet file.
      raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    rows.extend((f"{path}: row {i}", i, record) for i, record in enumerate(records, start=1))
  return rows


def _hub_rows(hub: Tuple[str, Optional[str], str]) -> List[Row]:
  """A hub dataset's rows (raises ImportError without `datasets`)."""
  import datasets  # The `data` extra; offline machines fail in load_dataset.
  hub_id, config, split = hub
  data = datasets.load_dataset(hub_id, config, split=split)
  label = f"{hub_id}" + (f"[{config}]" if config else "")
  return [(f"{label} row {i}", i, dict(r)) for i, r in enumerate(data, start=1)]


# ---------------------------------------------------------------------------
# One record -> one Question.


def _fields(record: Dict[str, Any]) -> str:
  return f"(its fields: {sorted(record)})"


def _string_list(where: str, name: str, value, record) -> Tuple[str, ...]:
  if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"{where}: field {name!r} must be a list of strings, got "
                     f"{type(value).__name__} {_fields(record)}")
  return tuple(value)


def _turns(where: str, record: Dict[str, Any]) -> Tuple[str, ...]:
  """The user turns, from the first text field the record has."""
  name = next((f for f in TEXT_FIELDS if f in record), None)
  if name is None:
    raise ValueError(f"{where}: no text field: expected one of {list(TEXT_FIELDS)} "
                     f"{_fields(record)}")
  value = record[name]
  if name == "messages":
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
      raise ValueError(f"{where}: field 'messages' must be a list of {{\"role\", \"content\"}} "
                       f"objects with string content {_fields(record)}")
    roles = sorted({str(m.get("role")) for m in value} - {"user"})
    if roles:
      raise ValueError(f"{where}: 'messages' holds {roles} messages: only user turns are "
                       "read (the answers are decoded); drop the others")
    turns = tuple(m["content"] for m in value)
  elif name == "turns" or not isinstance(value, str):
    turns = _string_list(where, name, value, record)
  else:
    turns = (value,)
  if not turns:
    raise ValueError(f"{where}: field {name!r} is empty: a question needs a user turn")
  for i, turn in enumerate(turns, start=1):
    if not turn.strip():
      raise ValueError(f"{where}: turn {i} of {name!r} is empty")
  return turns


def _question_id(where: str, number: int, record: Dict[str, Any]) -> str:
  name = next((f for f in ID_FIELDS if f in record), None)
  if name is None:
    return str(number)
  value = record[name]
  if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
    raise ValueError(f"{where}: field {name!r} must be an integer or a non-empty string, got "
                     f"{value!r} {_fields(record)}")
  return str(value)


def parse_question(where: str, number: int, record: Dict[str, Any]) -> Question:
  """One record as a Question; a missing or wrongly typed field is a ValueError at `where`."""
  category = record.get("category")
  if not isinstance(category, str) or not category.strip():
    got = "no field 'category'" if "category" not in record else f"'category' {category!r}"
    raise ValueError(f"{where}: expected a non-empty string field 'category', got {got} "
                     f"{_fields(record)}")
  turns = _turns(where, record)
  reference = record.get("reference")
  if isinstance(reference, str):
    reference = (reference,)
  elif reference is not None:
    reference = _string_list(where, "reference", reference, record)
  return Question(_question_id(where, number, record), category, turns, reference or None)


# ---------------------------------------------------------------------------
# Rows -> Benchmark.


def _texts(record: Dict[str, Any]) -> List[Any]:
  """A record's turn texts, unchecked (`turns`, or the contents of `messages`)."""
  turns = record.get("turns")
  if isinstance(record.get("messages"), list):
    turns = [m.get("content") for m in record["messages"] if isinstance(m, dict)]
  return list(turns) if isinstance(turns, (list, tuple)) else []


def _check_placeholders(rows: Sequence[Row], source: str) -> None:
  """SPEED-Bench's redistribution placeholders: refused, with the command to fill them."""
  held = [where for where, _, record in rows
          if any(isinstance(t, str) and t.startswith(SPEED_PLACEHOLDER) for t in _texts(record))]
  if held:
    config = next((c for c in reversed(SPEED_CONFIGS) if c in source), "<config>")
    raise ValueError(
        f"{held[0]}: {len(held)} of {len(rows)} rows hold SPEED-Bench's placeholder "
        f"({SPEED_PLACEHOLDER!r}) instead of their prompt: their sources may not be "
        "redistributed and must be fetched. Build the full split with NVIDIA's prepare "
        f"script ({SPEED_PREPARE.format(config=config)}) and pass DIR/{config}.jsonl")


def _speed_length(source: str) -> Optional[str]:
  match = re.findall(r"throughput_(\d+k)", source)
  return match[-1] if match else None


def benchmark_name(categories: Iterable[str], source: str) -> str:
  """Which public benchmark a file is, by its categories; else the file's stem."""
  found = set(categories)
  if found == set(MT_BENCH_CATEGORIES):
    return "mt_bench"
  if found in (set(MT_BENCH_CATEGORIES + SPEC_BENCH_CATEGORIES[1:]), set(SPEC_BENCH_CATEGORIES)):
    return "spec_bench"
  if found == set(SPEED_QUALITATIVE_CATEGORIES):
    return "speed_bench_qualitative"
  if found == set(SPEED_THROUGHPUT_TIERS):
    length = _speed_length(source)
    return "speed_bench_throughput" + (f"_{length}" if length else "")
  stem = os.path.splitext(os.path.basename(source.rstrip(os.sep)))[0]
  if stem == "question":  # FastChat's layout: data/<benchmark>/question.jsonl.
    stem = os.path.basename(os.path.dirname(os.path.abspath(source))) or stem
  return stem


def _unique(questions: Sequence[Question], wheres: Sequence[str]) -> None:
  seen: Dict[str, str] = {}
  for question, where in zip(questions, wheres):
    if question.question_id in seen:
      raise ValueError(f"{where}: question_id {question.question_id!r} again (first at "
                       f"{seen[question.question_id]}): ids must be unique; renumber one")
    seen[question.question_id] = where


def _select(questions: List[Question], source: str, categories: Optional[Sequence[str]],
            limit_per_category: Optional[int]) -> List[Question]:
  """The questions of `categories` (all when None), at most `limit_per_category` each."""
  if categories is not None:
    wanted = [categories] if isinstance(categories, str) else list(categories)
    present = list(dict.fromkeys(q.category for q in questions))
    absent = [c for c in wanted if c not in present]
    if absent:
      raise ValueError(f"{source}: no category {absent[0]!r}; it has {present}")
    questions = [q for q in questions if q.category in wanted]
  if limit_per_category is not None:
    if limit_per_category < 1:
      raise ValueError(f"limit_per_category must be >= 1, got {limit_per_category}")
    counts: Dict[str, int] = {}
    kept = []
    for q in questions:
      counts[q.category] = counts.get(q.category, 0) + 1
      if counts[q.category] <= limit_per_category:
        kept.append(q)
    questions = kept
  return questions


def _concurrency(name: str, rows: Sequence[Row], questions: Sequence[Question]) -> Optional[int]:
  """The throughput split's batch size: its column, else the largest tier's size."""
  values = [(where, record["concurrency"]) for where, _, record in rows
            if "concurrency" in record]
  for where, value in values:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{where}: column 'concurrency' must be a positive integer, got {value!r}")
  distinct = sorted({value for _, value in values})
  if len(distinct) > 1:
    raise ValueError(f"{rows[0][0]}: column 'concurrency' holds several values {distinct}: "
                     "split the file, one concurrency each")
  if distinct:
    return distinct[0]
  if not name.startswith("speed_bench_throughput"):
    return None
  sizes: Dict[str, int] = {}
  for q in questions:
    sizes[q.category] = sizes.get(q.category, 0) + 1
  return max(sizes.values())


def build_benchmark(rows: Sequence[Row], source: str, *, name: Optional[str] = None,
                    categories: Optional[Sequence[str]] = None,
                    limit_per_category: Optional[int] = None) -> Benchmark:
  """Rows of any reader as a checked Benchmark (all of it checked before selecting).

  name: the benchmark's name when the caller knows it (a dataset name); else
    `benchmark_name` of the rows.
  """
  if not rows:
    raise ValueError(f"{source}: no questions (every line blank)")
  _check_placeholders(rows, source)
  questions = [parse_question(where, number, record) for where, number, record in rows]
  _unique(questions, [where for where, _, _ in rows])
  name = name or benchmark_name((q.category for q in questions), source)
  if name == "spec_bench":  # Spec-Bench reports MT-Bench's eight categories as one task.
    questions = [Question(q.question_id, "mt_bench", q.turns, q.reference)
                 if q.category in MT_BENCH_CATEGORIES else q for q in questions]
  questions = _select(questions, source, categories, limit_per_category)
  return Benchmark(name=name, source=source, questions=tuple(questions),
                   concurrency=_concurrency(name, rows, questions))


# ---------------------------------------------------------------------------
# Sources: files, directories, names.


def _parquet_shards(directory: str) -> List[str]:
  return sorted(glob.glob(os.path.join(directory, "*.parquet")))


def _file_rows(path: str) -> List[Row]:
  """The rows of a file, or of a folder of parquet shards, by its name."""
  if os.path.isdir(path):
    return read_parquet_rows(_parquet_shards(path))
  if path.endswith(".parquet"):
    return read_parquet_rows([path])
  if path.endswith((".jsonl", ".json")):
    return read_jsonl_rows(path)
  return read_tsv_rows(path)


def find_in_directory(directory: str) -> str:
  """The one file of a known layout in `directory` (or the directory: parquet shards)."""
  if _parquet_shards(directory):
    return directory
  found = [os.path.join(directory, p) for p in DIRECTORY_LAYOUTS
           if os.path.isfile(os.path.join(directory, p))]
  found += [os.path.join(directory, c) for c in SPEED_CONFIGS
            if _parquet_shards(os.path.join(directory, c))]
  if not found:
    raise FileNotFoundError(
        f"{directory}: no benchmark file of a known layout inside (looked for "
        f"{list(DIRECTORY_LAYOUTS[:5])}, SPEED-Bench's <config>.jsonl / <config>.parquet / "
        "<config>/*.parquet, or parquet files): pass the file itself")
  if len(found) > 1:
    raise ValueError(f"{directory}: several benchmarks inside ({found}): pass one of them")
  return found[0]


def _resolve_name(name: str) -> Tuple[List[Row], str]:
  """A dataset name's rows: $SPECDEC_JAX_BENCHMARKS, else Hugging Face `datasets`."""
  relative, hub, origin = KNOWN_NAMES[name]
  root = os.environ.get(ENV_VAR)
  if root:
    for rel in relative:
      path = os.path.join(root, rel)
      if os.path.isfile(path) or (os.path.isdir(path) and _parquet_shards(path)):
        return _file_rows(path), path
    searched = f"{ENV_VAR}={root} holds none of {list(relative)}"
  else:
    searched = f"{ENV_VAR} is not set"
  if hub is None:
    tried = "it has no Hugging Face hub copy"
  else:
    try:
      return _hub_rows(hub), hub[0] + (f"[{hub[1]}]" if hub[1] else "")
    except ImportError:
      tried = f"Hugging Face datasets is not installed (pip install datasets) for {hub[0]}"
    except Exception as e:  # Offline, or the hub refused: said with the name.
      tried = f"Hugging Face {hub[0]} did not load ({type(e).__name__}: {e})"
  raise FileNotFoundError(
      f"benchmark {name!r} not found: {searched}, and {tried}. Put {origin} at "
      f"${ENV_VAR}/{relative[0]}, or pass --benchmark=PATH to the file")


def load_benchmark(source: str, *, categories: Optional[Sequence[str]] = None,
                   limit_per_category: Optional[int] = None) -> Benchmark:
  """A benchmark from a file, a directory or a dataset name (see the module docstring).

  Args:
    source: a path, or one of KNOWN_NAMES (or ALIASES); an existing path wins.
    categories: only these categories (in the file's order); each must exist.
    limit_per_category: at most this many questions of each category, the first ones.

  Raises:
    FileNotFoundError: no such file, or a dataset name found nowhere.
    ValueError: a bad line (with `path:line`), an unknown name or category, or no questions.
  """
  if not os.path.exists(source):
    canonical = ALIASES.get(source, source)
    if canonical in KNOWN_NAMES:
      rows, path = _resolve_name(canonical)
      return build_benchmark(rows, path, name=canonical, categories=categories,
                             limit_per_category=limit_per_category)
    known = sorted(KNOWN_NAMES) + sorted(ALIASES)
    if os.sep in source or "." in os.path.basename(source):
      raise FileNotFoundError(f"benchmark file not found: {source!r} (dataset names: {known})")
    raise ValueError(f"unknown benchmark {source!r}: known names are {known}, or pass the "
                     "path of a benchmark file or directory")
  path = find_in_directory(source) if os.path.isdir(source) else source
  return build_benchmark(_file_rows(path), path, categories=categories,
                         limit_per_category=limit_per_category)


def task_benchmark(tasks_by_category: Dict[str, tasks.Task],
                   num_examples: Optional[int] = None) -> Benchmark:
  """The paper's tasks (WMT EnDe, CNN/DM, local files) as single-turn categories.

  Args:
    tasks_by_category: category name -> its Task (prefix applied by Task.load).
    num_examples: the first this many examples of each task (all when None).

  Question ids are "{category}-{index}" (0-based, Task.load's order); a task's
  targets are the references.
  """
  if not tasks_by_category:
    raise ValueError("task_benchmark needs at least one category -> Task")
  questions = []
  for category, task in tasks_by_category.items():
    for index, example in enumerate(task.load(num_examples)):
      reference = (example.targets,) if example.targets is not None else None
      questions.append(Question(f"{category}-{index}", category, (example.inputs,), reference))
  source = ", ".join(f"{c}={t.path if t.source == 'local' else t.source}"
                     for c, t in tasks_by_category.items())
  return Benchmark(name="+".join(tasks_by_category), source=source, questions=tuple(questions))
