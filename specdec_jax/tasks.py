"""Inputs for experiments: tasks (datasets or local files) and tokenizers.

Sources:
* `local`: a JSONL file (one object per line with a string field, default
  "inputs", and optionally "targets") or a TSV file (input, optionally a tab
  and a target). Always available; bad lines fail with their line number.
* `inline`: the texts given in `Task.texts` (the launcher's `--prompt`).
* `wmt14_ende` and `cnndm`: WMT14 English-German and CNN/DailyMail test
  sets through tensorflow-datasets or Hugging Face `datasets` (the `data`
  extra). They download on first use, so they need one of those packages and
  a network connection; otherwise loading fails with a message saying so.

Tokenizers map text to T5 ids (pad 0, EOS 1, unknown 2):
* `SentencePieceTokenizer`: T5's vocabulary file (e.g. cc_all.32000 /
  `spiece.model`) plus T5's 100 extra ids.
* `ByteTokenizer`: UTF-8 bytes shifted by 3 (259 ids). A fallback for tiny
  random models and tests only: real T5 checkpoints need their SentencePiece
  model.
"""

import codecs
import dataclasses
import json
import os
from typing import List, Optional, Sequence, Tuple

import gin

from specdec_jax.families.t5.config import T5Config

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Example:
  inputs: str
  targets: Optional[str] = None


# ---------------------------------------------------------------------------
# Tokenizers.


class Tokenizer:
  """text <-> ids with T5's special ids. `vocab_size` = ids the tokenizer can emit."""
  vocab_size: int
  eos_id: int = EOS_ID
  pad_id: int = PAD_ID

  def encode(self, text: str) -> List[int]:
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError


@gin.configurable
class ByteTokenizer(Tokenizer):
  """UTF-8 bytes + 3 (ids 0..2 are pad, EOS, unknown): 259 ids, no training needed."""
  offset = 3
  vocab_size = 256 + offset

  def encode(self, text: str) -> List[int]:
    return [b + self.offset for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    out = bytearray()
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if self.offset <= i < self.vocab_size:
        out.append(i - self.offset)
    return out.decode("utf-8", errors="replace")


@gin.configurable
class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model plus `extra_ids` sentinel ids (T5: 100) after its pieces."""

  def __init__(self, model_path: str = gin.REQUIRED, extra_ids: int = 100):
    if not model_path or not os.path.isfile(model_path):
      raise FileNotFoundError(f"SentencePiece model file not found: {model_path!r}")
    try:
      import sentencepiece  # The `tokenizer` extra.
    except ImportError as e:
      raise ImportError("SentencePieceTokenizer needs `pip install sentencepiece` "
                        "(specdec_jax[tokenizer])") from e
    self.model_path = model_path
    self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    self.num_pieces = self._sp.get_piece_size()
    self.vocab_size = self.num_pieces + int(extra_ids)
    if self._sp.pad_id() not in (PAD_ID, -1) or self._sp.eos_id() != EOS_ID:
      raise ValueError(f"{model_path}: T5 needs pad id 0 and EOS id 1, the SentencePiece model "
                       f"has pad {self._sp.pad_id()} and EOS {self._sp.eos_id()}")

  def encode(self, text: str) -> List[int]:
    return list(self._sp.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._sp.decode([i for i in ids if 0 < i < self.num_pieces])


def check_vocab(tokenizer: Tokenizer, config: T5Config, name: str = "model") -> None:
  """Raises ValueError unless `config`'s vocabulary holds every id `tokenizer` emits."""
  if tokenizer.vocab_size > config.vocab_size:
    raise ValueError(
        f"tokenizer/model vocabulary mismatch: {type(tokenizer).__name__} emits ids up to "
        f"{tokenizer.vocab_size - 1} but the {name} has only {config.vocab_size} embeddings")
  if tokenizer.eos_id != config.eos_id or tokenizer.pad_id != config.pad_id:
    raise ValueError(f"tokenizer EOS/pad ids ({tokenizer.eos_id}/{tokenizer.pad_id}) differ "
                     f"from the {name}'s ({config.eos_id}/{config.pad_id})")


# ---------------------------------------------------------------------------
# Example sources.


def count_local(path: str) -> int:
  """How many examples (non-blank lines) a JSONL / TSV file holds, none parsed."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"input file not found: {path!r}")
  with open(path, "rb") as f:
    return sum(1 for line in f if line.strip())


def _text_lines(path: str):
  """Yields (line number, text) of a UTF-8 file; a line that is not UTF-8 is a
  ValueError naming the file, the line and the fix (not a UnicodeDecodeError from deep
  inside a loop). A byte-order mark opening the file (Notepad's and Excel's UTF-8) is
  dropped: it is no part of the first input's text."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      if number == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
      try:
        yield number, raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}:{number}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
            "input files must be UTF-8; convert it, e.g. iconv -f latin1 -t utf-8 "
            f"{os.path.basename(path)} > fixed{os.path.splitext(path)[1]}") from None


def load_local(path: str, input_field: str = "inputs",
               target_field: str = "targets",
               indices: Optional[Sequence[int]] = None) -> List[Example]:
  """Reads JSONL (`.jsonl`/`.json`) or TSV (anything else). Blank lines are skipped.

  indices: only these examples (0-based over the non-blank lines), in this
  order (repeats allowed); the other lines are counted, not parsed (per-host
  input: each process reads its own rows).

  Raises:
    FileNotFoundError; ValueError naming the file and line number of a line
    that is not valid JSON, lacks a string `input_field`, or (TSV) has more
    than two tab-separated columns.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"input file not found: {path!r}")
  is_json = path.endswith((".jsonl", ".json"))
  wanted = None if indices is None else set(int(i) for i in indices)
  examples = []
  positions = []
  count = -1
  for number, line in _text_lines(path):
    line = line.rstrip("\n").rstrip("\r")
    if not line.strip():
      continue
    count += 1
    if wanted is not None and count not in wanted:
      continue
    positions.append(count)
    where = f"{path}:{number}"
    if is_json:
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON line ({e.msg})") from None
      if not isinstance(record, dict) or not isinstance(record.get(input_field), str):
        fields = f" (its fields: {sorted(record)})" if isinstance(record, dict) else ""
        raise ValueError(f"{where}: expected an object with a string field {input_field!r}"
                         f"{fields}; another field name: set Task.input_field")
      target = record.get(target_field)
      if target is not None and not isinstance(target, str):
        raise ValueError(f"{where}: field {target_field!r} must be a string")
      examples.append(Example(record[input_field], target))
    else:
      columns = line.split("\t")
      if len(columns) > 2:
        raise ValueError(f"{where}: expected 'input' or 'input<TAB>target', "
                         f"got {len(columns)} tab-separated columns")
      examples.append(Example(columns[0], columns[1] if len(columns) == 2 else None))
  if wanted is None:
    if not examples:
      raise ValueError(f"{path}: no examples")
    return examples
  by_index = dict(zip(positions, examples))
  absent = sorted(wanted - set(by_index))
  if absent:
    raise ValueError(f"{path}: has {count + 1} examples, no example {absent[0]}")
  return [by_index[int(i)] for i in indices]


# (tfds name, input key, target key), (HF name, HF config, input getter, target getter)
_DATASETS = {
    "wmt14_ende": (("wmt14_translate/de-en", "en", "de"),
                   ("wmt14", "de-en", lambda r: r["translation"]["en"],
                    lambda r: r["translation"]["de"])),
    "cnndm": (("cnn_dailymail", "article", "highlights"),
              ("cnn_dailymail", "3.0.0", lambda r: r["article"], lambda r: r["highlights"])),
}


def load_dataset(source: str, split: str = "test",
                 num_examples: Optional[int] = None) -> List[Example]:
  """WMT14 EnDe / CNN-DM via tensorflow-datasets, else Hugging Face `datasets`."""
  if source not in _DATASETS:
    raise ValueError(f"unknown dataset {source!r}; known: {sorted(_DATASETS)} (or 'local')")
  (tfds_name, tfds_in, tfds_out), (hf_name, hf_config, hf_in, hf_out) = _DATASETS[source]
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    tfds = None
  try:
    if tfds is not None:
      split_spec = split if num_examples is None else f"{split}[:{num_examples}]"
      data = tfds.as_numpy(tfds.load(tfds_name, split=split_spec))
      return [Example(r[tfds_in].decode("utf-8"), r[tfds_out].decode("utf-8")) for r in data]
    try:
      import datasets
    except ImportError:
      raise ImportError(
          f"dataset {source!r} needs tensorflow-datasets or Hugging Face datasets "
          "(pip install 'specdec_jax[data]'); or use the local task with a JSONL/TSV "
          "file") from None
    data = datasets.load_dataset(hf_name, hf_config, split=split)
    if num_examples is not None:
      data = data.select(range(min(num_examples, len(data))))
    return [Example(hf_in(r), hf_out(r)) for r in data]
  except ImportError:
    raise
  except Exception as e:  # Download/network failures surface with the dataset's name.
    raise RuntimeError(f"could not load dataset {source!r} (split {split!r}): "
                       f"{type(e).__name__}: {e}. It downloads on first use and needs a "
                       "network connection; a local JSONL/TSV file works offline.") from e


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Task:
  """Where inputs come from and how they are prefixed.

  Attributes:
    name: short name for reports ('ende', 'cnndm', ...).
    source: 'local', 'inline', 'wmt14_ende' or 'cnndm'.
    path: the JSONL/TSV file for 'local'.
    texts: the inputs themselves for 'inline'.
    split: dataset split.
    prefix: prepended to each input (T5: "translate English to German: ").
    input_field / target_field: JSONL field names.
  """
  name: str = "local"
  source: str = "local"
  path: Optional[str] = None
  split: str = "test"
  prefix: str = ""
  input_field: str = "inputs"
  target_field: str = "targets"
  texts: Tuple[str, ...] = ()

  def validate(self) -> None:
    """Fails fast (before any model loads) on a missing or unknown source."""
    if self.source == "local":
      if not self.path:
        raise ValueError("the local task needs Task.path (a JSONL or TSV file)")
      if not os.path.isfile(self.path):
        raise FileNotFoundError(f"input file not found: {self.path!r}")
    elif self.source == "inline":
      if not self.texts or not all(isinstance(t, str) for t in self.texts):
        raise ValueError("the inline task needs Task.texts, a non-empty tuple of strings")
    elif self.source not in _DATASETS:
      raise ValueError(f"unknown Task.source {self.source!r}; known: "
                       f"{['local', 'inline'] + sorted(_DATASETS)}")

  def count(self, num_examples: Optional[int] = None) -> int:
    """How many examples `load(num_examples)` gives, parsing none of a local file."""
    if num_examples is not None and num_examples < 1:
      raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    self.validate()
    if self.source == "local":
      total = count_local(self.path)
      if not total:
        raise ValueError(f"{self.path}: no examples")
    elif self.source == "inline":
      total = len(self.texts)
    else:
      total = len(self.load(num_examples))
    return total if num_examples is None else min(total, num_examples)

  def load(self, num_examples: Optional[int] = None,
           indices: Optional[Sequence[int]] = None) -> List[Example]:
    """The first `num_examples` examples (all when None), prefix applied.

    indices: only these of them, in this order (a local file parses only
    their lines: per-host input).
    """
    if num_examples is not None and num_examples < 1:
      raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    self.validate()
    if indices is not None:
      limit = self.count(num_examples) if self.source != "local" or num_examples else None
      if limit is not None and any(not 0 <= int(i) < limit for i in indices):
        raise ValueError(f"example indices {list(indices)} outside the {limit} examples")
      if self.source == "local":
        examples = load_local(self.path, self.input_field, self.target_field, indices=indices)
      else:
        every = self.load(num_examples)
        examples = [every[int(i)] for i in indices]
      return [Example(self.prefix + e.inputs, e.targets) for e in examples]
    if self.source == "local":
      examples = load_local(self.path, self.input_field, self.target_field)
    elif self.source == "inline":
      examples = [Example(t) for t in self.texts]
    else:
      examples = load_dataset(self.source, self.split, num_examples)
    examples = examples[:num_examples] if num_examples is not None else examples
    return [Example(self.prefix + e.inputs, e.targets) for e in examples]
