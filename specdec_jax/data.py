"""Seq2seq data: an offline code corpus, a SentencePiece tokenizer, padded examples.

The demo pair is trained on the source of the Python standard library of the
running interpreter (available offline on every machine that runs the project)
as a code-completion task: the input is some preceding lines of a file, the
target is the line(s) that follow. Files are split into train / held-out by a
hash of their path, so no held-out file is ever seen in training.

Examples are stored as padded int32 arrays (`Seq2SeqData`); batches are drawn
in a deterministic order that is a pure function of (seed, step), so a resumed
training run sees exactly the batches it would have seen without stopping.
`lm_windows` cuts the same corpus into language-model windows (decoder-only
pretraining), and `Prompts` holds the decode inputs of any family that
distillation continues with the target.
"""

import dataclasses
import hashlib
import io
import json
import os
import sys
import sysconfig
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from specdec_jax import results
from specdec_jax import tasks

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

# Indentation runs get their own pieces: Python code is mostly indentation.
_WHITESPACE_SYMBOLS = ["\n", " " * 4, " " * 8, " " * 12, " " * 16]


# ----------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SourceFile:
  """One corpus file: its path relative to the corpus root and its text."""
  path: str
  text: str


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def corpus_provenance() -> Dict[str, str]:
  """Where the stdlib corpus comes from (for the model card)."""
  return dict(corpus="Python standard library source (*.py, excluding site-packages)",
              python_version=sys.version.split()[0], implementation=sys.implementation.name,
              root=stdlib_root())


def stdlib_files(root: Optional[str] = None) -> List[SourceFile]:
  """Every *.py file under `root` (default: the running interpreter's stdlib), sorted.

  site-packages (third-party code that differs between machines) and files
  that are not valid UTF-8 are skipped.
  """
  root = root or stdlib_root()
  if not os.path.isdir(root):
    raise ValueError(f"corpus root {root!r} is not a directory")
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
    for name in sorted(filenames):
      if not name.endswith(".py"):
        continue
      full = os.path.join(dirpath, name)
      try:
        with open(full, encoding="utf-8") as f:
          text = f.read()
      except (UnicodeDecodeError, OSError):
        continue
      files.append(SourceFile(os.path.relpath(full, root).replace(os.sep, "/"), text))
  files.sort(key=lambda f: f.path)
  if not files:
    raise ValueError(f"no *.py files under {root!r}")
  return files


def is_heldout(path: str, heldout_percent: int) -> bool:
  """Deterministic file-level split: sha1(path) mod 100 < heldout_percent."""
  digest = hashlib.sha1(path.encode("utf-8")).hexdigest()
  return int(digest, 16) % 100 < heldout_percent


def split_files(files: Sequence[SourceFile], heldout_percent: int = 5):
  """(train_files, heldout_files), split by a hash of each file's path."""
  if not 0 < heldout_percent < 100:
    raise ValueError(f"heldout_percent must be in (0, 100), got {heldout_percent}")
  train = [f for f in files if not is_heldout(f.path, heldout_percent)]
  heldout = [f for f in files if is_heldout(f.path, heldout_percent)]
  return train, heldout


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

def train_tokenizer(lines: Iterable[str], vocab_size: int, *, max_sentences: int = 300_000,
                    seed: int = 0) -> bytes:
  """Trains a lossless SentencePiece unigram model on `lines`; returns its proto bytes.

  Ids: pad=0, eos=1, unk=2, no BOS (T5's convention). vocab_size is an upper
  bound (a small corpus may yield fewer pieces); it must exceed the 256 byte
  pieces plus the corpus's distinct characters. Whitespace is kept
  exactly (identity normalisation, no dummy prefix, no whitespace squashing)
  and unknown characters fall back to bytes, so `decode(encode(text)) == text`.
  """
  import sentencepiece as spm
  if vocab_size < 300:
    raise ValueError(f"vocab_size {vocab_size} is too small (byte fallback needs 256 pieces)")
  spm.set_random_generator_seed(seed + 1)  # Sentence sampling; fixed for reproducibility.
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
      model_type="unigram", pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
      normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, byte_fallback=True, user_defined_symbols=_WHITESPACE_SYMBOLS,
      allow_whitespace_only_pieces=True, split_digits=True, input_sentence_size=max_sentences,
      shuffle_input_sentence=True, max_sentence_length=8192, num_threads=1, minloglevel=2,
      hard_vocab_limit=False)  # A small corpus may support fewer pieces: use what it has.
  return model.getvalue()


class Tokenizer(tasks.Tokenizer):
  """A SentencePiece model with T5's special ids (pad 0, eos 1, unk 2) and no extra ids."""

  def __init__(self, model_proto: bytes):
    import sentencepiece as spm
    self.model_proto = model_proto
    self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
    if (self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id()) != (PAD_ID, EOS_ID, UNK_ID):
      raise ValueError("tokenizer must use pad=0, eos=1, unk=2, got "
                       f"{(self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id())}")
    self.vocab_size = self.sp.get_piece_size()

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    with open(path, "rb") as f:
      return cls(f.read())

  def save(self, path: str):
    write_bytes_atomic(path, self.model_proto)

  def encode(self, text: str) -> List[int]:
    return self.sp.encode(text)

  def encode_lines(self, text: str) -> List[int]:
    """Encodes line by line and concatenates: the form the code-completion examples use
    (`completion_examples`). It can differ from `encode(text)` by a few pieces around line
    starts; both decode back to `text`."""
    return [t for line in text.splitlines(keepends=True) for t in self.sp.encode(line)]

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes ids, stopping at the first EOS and dropping padding."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS_ID:
        break
      if i != PAD_ID:
        out.append(i)
    return self.sp.decode(out)


# ----------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Seq2SeqData:
  """Padded examples: inputs [n, input_len] int32, targets [n, target_len] int32.

  Rows are right-padded with 0; each target row ends with EOS (1) unless it
  was truncated to exactly target_len tokens.
  """
  inputs: np.ndarray
  targets: np.ndarray

  def __post_init__(self):
    for name in ("inputs", "targets"):
      x = getattr(self, name)
      if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"Seq2SeqData.{name} must be a 2-D int array, got {x.dtype} {x.shape}")
    if len(self.inputs) != len(self.targets):
      raise ValueError(f"{len(self.inputs)} inputs but {len(self.targets)} targets")
    if len(self.inputs) == 0:
      raise ValueError("Seq2SeqData is empty")

  def __len__(self):
    return len(self.inputs)

  def check_vocab(self, vocab_size: int):
    """Raises if any token id falls outside [0, vocab_size)."""
    for name in ("inputs", "targets"):
      x = getattr(self, name)
      if x.min() < 0 or x.max() >= vocab_size:
        raise ValueError(f"{name} hold token ids in [{x.min()}, {x.max()}], outside the "
                         f"vocabulary [0, {vocab_size})")

  def take(self, indices) -> Dict[str, np.ndarray]:
    return dict(inputs=self.inputs[indices], targets=self.targets[indices])

  def save(self, path: str):
    buf = io.BytesIO()
    np.savez_compressed(buf, inputs=self.inputs, targets=self.targets)
    write_bytes_atomic(path, buf.getvalue())

  @classmethod
  def load(cls, path: str) -> "Seq2SeqData":
    with np.load(path) as f:
      return cls(f["inputs"].astype(np.int32), f["targets"].astype(np.int32))

  def prompts(self) -> "Prompts":
    """The inputs as decode prompts, with the targets as the reference batch."""
    return Prompts(self.inputs, references=dict(inputs=self.inputs, targets=self.targets))


@dataclasses.dataclass(frozen=True)
class Prompts:
  """What a decode of any family reads, n rows of it, and optionally reference outputs.

  inputs: [n, C] int32, right-padded (T5 encoder tokens, decoder-only prompts).
  lengths: [n] int32, each row's length where the family takes lengths
    (decoder-only prompts); None where it reads the padding (T5).
  references: None, or the family's training batch of the same n rows holding
    reference outputs (T5 {'inputs', 'targets'}; decoder-only `lm_batch`).
  """
  inputs: np.ndarray
  lengths: Optional[np.ndarray] = None
  references: Optional[Dict[str, np.ndarray]] = None

  def __post_init__(self):
    inputs = np.asarray(self.inputs)
    if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.integer) or not len(inputs):
      raise ValueError(f"Prompts.inputs must be a non-empty 2-D int array, got {inputs.dtype} "
                       f"{inputs.shape}")
    if self.lengths is not None and np.shape(self.lengths) != (len(inputs),):
      raise ValueError(f"Prompts.lengths must have shape ({len(inputs)},), got "
                       f"{np.shape(self.lengths)}")
    for name, x in (self.references or {}).items():
      if len(x) != len(inputs):
        raise ValueError(f"reference {name!r} has {len(x)} rows, the inputs {len(inputs)}")

  def __len__(self):
    return len(self.inputs)

  def check_vocab(self, vocab_size: int):
    """Raises if a real input token (or any reference token) falls outside [0, vocab_size)."""
    inputs = np.asarray(self.inputs)
    real = (np.ones(inputs.shape, bool) if self.lengths is None else
            np.arange(inputs.shape[1])[None] < np.asarray(self.lengths)[:, None])
    arrays = dict(inputs=inputs[real])
    arrays.update({k: np.asarray(v) for k, v in (self.references or {}).items()
                   if np.issubdtype(np.asarray(v).dtype, np.integer)})
    for name, x in arrays.items():
      if x.size and (x.min() < 0 or x.max() >= vocab_size):
        raise ValueError(f"{name} hold token ids in [{x.min()}, {x.max()}], outside the "
                         f"vocabulary [0, {vocab_size})")

  def take(self, indices) -> "Prompts":
    pick = lambda x: None if x is None else np.asarray(x)[indices]  # noqa: E731
    refs = None if self.references is None else {k: pick(v) for k, v in self.references.items()}
    return Prompts(pick(self.inputs), pick(self.lengths), refs)


def as_prompts(data) -> Prompts:
  """`Prompts` from Prompts, Seq2SeqData (inputs + reference targets) or an input array."""
  if isinstance(data, Prompts):
    return data
  if isinstance(data, Seq2SeqData):
    return data.prompts()
  return Prompts(np.asarray(data, np.int32))


def pad_rows(rows: Sequence[Sequence[int]], length: int) -> np.ndarray:
  """[len(rows), length] int32, each row right-padded with 0 (rows longer than length raise)."""
  out = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    if len(row) > length:
      raise ValueError(f"row {i} has {len(row)} tokens, more than {length}")
    out[i, :len(row)] = row
  return out


def encode_pairs(pairs: Sequence[Tuple[str, str]], tokenizer: Tokenizer, input_len: int,
                 target_len: int) -> Seq2SeqData:
  """Tokenizes (input, target) text pairs; inputs keep their last input_len tokens,
  targets their first target_len - 1 tokens plus EOS."""
  inputs, targets = [], []
  for src, tgt in pairs:
    inputs.append(tokenizer.encode(src)[-input_len:])
    targets.append(tokenizer.encode(tgt)[:target_len - 1] + [EOS_ID])
  return Seq2SeqData(pad_rows(inputs, input_len), pad_rows(targets, target_len))


@dataclasses.dataclass(frozen=True)
class CompletionTask:
  """How code-completion examples are cut from a file.

  An example at line i has input = lines [i - context_lines, i) (keeping the
  last input_len tokens) and target = lines [i, i + target_lines) (the first
  target_len - 1 tokens, then EOS). Examples start every `stride` lines and
  only where the first target line is not blank.
  """
  input_len: int = 96
  target_len: int = 48
  context_lines: int = 16
  target_lines: int = 3
  stride: int = 3


def completion_examples(files: Sequence[SourceFile], tokenizer: Tokenizer, task: CompletionTask,
                        with_text: bool = False):
  """Cuts code-completion examples from every file.

  Returns Seq2SeqData and, if with_text, a list of dicts
  {'path', 'line', 'input', 'target'} (the text of each example, untruncated
  by tokens — the token arrays are what the models see).
  """
  inputs, targets, texts = [], [], []
  for source in files:
    lines = source.text.splitlines(keepends=True)
    line_ids = [tokenizer.encode(line) for line in lines]  # As in Tokenizer.encode_lines.
    for i in range(1, len(lines), task.stride):
      if not lines[i].strip():
        continue
      src = [t for ids in line_ids[max(0, i - task.context_lines):i] for t in ids]
      tgt = [t for ids in line_ids[i:i + task.target_lines] for t in ids]
      if not src or not tgt:
        continue
      src = src[-task.input_len:]
      tgt = tgt[:task.target_len - 1] + [EOS_ID]
      inputs.append(src)
      targets.append(tgt)
      if with_text:
        texts.append(dict(path=source.path, line=i,
                          input="".join(lines[max(0, i - task.context_lines):i]),
                          target="".join(lines[i:i + task.target_lines])))
  data = Seq2SeqData(pad_rows(inputs, task.input_len), pad_rows(targets, task.target_len))
  return (data, texts) if with_text else data


def lm_windows(texts, tokenizer, length: int, eos_id: int) -> np.ndarray:
  """Fixed-length language-model windows [n, length] int32 from a corpus.

  Each text (e.g. `SourceFile.text`) is tokenized line by line
  (`tokenizer.encode_lines`, as the completion examples) and ended with
  `eos_id`; the texts are concatenated in order and cut into consecutive
  windows, the remainder dropped. Every window token is a target
  (`families.decoder_only.batch.lm_batch(windows, [length] * n)`), so
  documents follow each other across EOS as in GPT-style pretraining.
  """
  if int(length) != length or length < 2:
    raise ValueError(f"length must be an int >= 2, got {length!r}")
  stream = []
  for text in texts:
    stream.extend(tokenizer.encode_lines(text))
    stream.append(int(eos_id))
  n = len(stream) // length
  if n == 0:
    raise ValueError(f"the corpus has {len(stream)} tokens, fewer than one window of {length}")
  return np.asarray(stream[:n * length], np.int32).reshape(n, length)


# ----------------------------------------------------------------------------
# Text pair files (JSONL / TSV)
# ----------------------------------------------------------------------------

def read_pairs(path: str, input_key: str = "input", target_key: str = "target"):
  """Reads (input, target) text pairs from JSONL ({input_key, target_key}) or TSV."""
  pairs = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      if path.endswith(".tsv"):
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 2:
          raise ValueError(f"{path}:{n}: expected 2 tab-separated fields, got {len(parts)}")
        pairs.append((parts[0].replace("\\n", "\n"), parts[1].replace("\\n", "\n")))
      else:
        row = json.loads(line)
        if input_key not in row or target_key not in row:
          raise ValueError(f"{path}:{n}: missing {input_key!r} or {target_key!r}")
        pairs.append((row[input_key], row[target_key]))
  if not pairs:
    raise ValueError(f"{path} holds no examples")
  return pairs


def write_jsonl(path: str, rows: Iterable[dict]):
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
  write_bytes_atomic(path, text.encode("utf-8"))


# Kept here for the data pipeline's callers; the implementation is results'.
write_bytes_atomic = results.write_bytes_atomic


# ----------------------------------------------------------------------------
# Batching: a deterministic function of (seed, step)
# ----------------------------------------------------------------------------

def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Example indices [batch_size] of batch number `step`.

  Epoch e visits the examples in the order of a permutation seeded by
  (seed, e); batches never straddle epochs (the last partial batch of an
  epoch is dropped). A pure function of its arguments, so resuming at any
  step gives the same batches as never stopping.
  """
  if batch_size > num_examples:
    raise ValueError(f"batch_size {batch_size} exceeds the {num_examples} examples")
  per_epoch = num_examples // batch_size
  epoch, within = divmod(int(step), per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return order[within * batch_size:(within + 1) * batch_size]


def batches(data: Seq2SeqData, batch_size: int, seed: int,
            start_step: int = 0) -> Iterator[Dict[str, np.ndarray]]:
  """Infinite batches {'inputs', 'targets'} ([batch_size, len] int32) from `start_step` on."""
  step = start_step
  while True:
    yield data.take(batch_indices(len(data), batch_size, step, seed))
    step += 1
