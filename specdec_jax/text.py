"""Text in, text out: a checkpoint's own tokenizer, for every model family.

`checkpoint_tokenizer(checkpoint, vocabulary)` finds what a checkpoint
directory holds, in the order Hugging Face's `AutoTokenizer` prefers:

* `tokenizer.json`: a Hugging Face fast tokenizer, read by the `tokenizers`
  package. Its own post-processor adds the special tokens the model was
  trained with (Llama 3's `<|begin_of_text|>`, T5's `</s>`; none for GPT-2 or
  Qwen2), so ids equal `AutoTokenizer(text).input_ids`.
* `tokenizer.model` (Llama 2, Gemma, Mistral) or `spiece.model` (T5): a
  SentencePiece model. BOS is prepended when the model defines one, unless
  `tokenizer_config.json` says `add_bos_token: false` (HF's Llama and Gemma
  tokenizers do the same); T5's has none.

`vocabulary` (the launcher's `VOCABULARY`) overrides the directory: a file of
either kind, or a directory to search the same way. `tokenizer_config.json`
beside the tokenizer file gives the chat template (or `chat_template.jinja`),
the BOS/EOS strings the template uses, `add_bos_token` and T5's `extra_ids`.

How a family turns the ids into `generate`'s inputs (T5 appends EOS,
decoder-only prompts stay as they are) is the family's `text_inputs`.
"""

import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence

from specdec_jax import tasks

# Searched in this order in a checkpoint directory (or a VOCABULARY directory).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model")
CONFIG_FILE = "tokenizer_config.json"


class TokenizerNotFound(FileNotFoundError):
  """A checkpoint directory without tokenizer files, and no VOCABULARY."""


def _read_tokenizer_config(directory: str) -> Dict[str, Any]:
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path}: expected a JSON object")
  template_file = os.path.join(directory, "chat_template.jinja")
  if "chat_template" not in config and os.path.isfile(template_file):
    with open(template_file, encoding="utf-8") as f:  # transformers >= 4.43 writes it apart.
      config["chat_template"] = f.read()
  return config


def _token_string(value) -> Optional[str]:
  """tokenizer_config.json spells special tokens as strings or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _chat_template(config: Dict[str, Any]) -> Optional[str]:
  """The default template: a string, or HF's list of {"name", "template"}."""
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return template if isinstance(template, str) else None


class FileTokenizer(tasks.Tokenizer):
  """A tokenizer read from a checkpoint's files (base of the two kinds below).

  Attributes:
    source: the tokenizer file, for messages.
    vocab_size: one past the largest id it can emit (special tokens included).
    chat_template / bos_token / eos_token: from tokenizer_config.json, or None.
  """
  source: str
  chat_template: Optional[str] = None
  bos_token: Optional[str] = None
  eos_token: Optional[str] = None

  def _configure(self, path: str) -> Dict[str, Any]:
    self.source = path
    config = _read_tokenizer_config(os.path.dirname(os.path.abspath(path)))
    self.chat_template = _chat_template(config)
    self.bos_token = _token_string(config.get("bos_token"))
    self.eos_token = _token_string(config.get("eos_token"))
    return config

  def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
    raise NotImplementedError


class HFTokenizer(FileTokenizer):
  """A Hugging Face `tokenizer.json` (the `tokenizers` package)."""

  def __init__(self, path: str):
    try:
      import tokenizers  # The `tokenizer` extra.
    except ImportError as e:
      raise ImportError(f"{path} needs the `tokenizers` package: pip install tokenizers "
                        "(specdec_jax[tokenizer])") from e
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # The Rust side raises a bare Exception on a bad file.
      raise ValueError(f"{path}: not a tokenizer.json the `tokenizers` package reads ({e})"
                       ) from None
    self._configure(path)
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1 if vocab else 0
    eos = vocab.get(self.eos_token) if self.eos_token else None
    self.eos_id = -1 if eos is None else int(eos)

  def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class SentencePieceFileTokenizer(FileTokenizer):
  """A SentencePiece model file (`tokenizer.model`, `spiece.model`), BOS as the
  model defines it (tokenizer_config.json's `add_bos_token` may turn it off),
  plus tokenizer_config.json's `extra_ids` (T5's sentinels) after its pieces."""

  def __init__(self, path: str):
    try:
      import sentencepiece
    except ImportError as e:
      raise ImportError(f"{path} needs `pip install sentencepiece`") from e
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except Exception as e:  # A C++ RuntimeError/OSError with the parser's words.
      raise ValueError(f"{path}: not a SentencePiece model ({e})") from None
    config = self._configure(path)
    self.num_pieces = self._sp.get_piece_size()
    extra_ids = config.get("extra_ids", 0)
    self.vocab_size = self.num_pieces + (extra_ids if isinstance(extra_ids, int) else 0)
    add_bos = config.get("add_bos_token")
    self.add_bos = self._sp.bos_id() >= 0 and add_bos is not False
    self.eos_id = self._sp.eos_id()
    self.pad_id = self._sp.pad_id()
    # SentencePiece never reads a control piece from text, but a chat template
    # writes "<bos>", "<eos>" as text: HF's tokenizers map those strings to
    # their ids (special added tokens), and so does this one.
    controls = [i for i in (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id())
                if i >= 0]
    self._specials = {self._sp.id_to_piece(i): i for i in controls}

  def _encode_text(self, text: str) -> List[int]:
    if not self._specials:
      return list(self._sp.encode(text))
    pattern = "(" + "|".join(re.escape(p) for p in sorted(self._specials, key=len,
                                                          reverse=True)) + ")"
    ids = []
    for part in re.split(pattern, text):
      if part in self._specials:
        ids.append(self._specials[part])
      elif part:
        ids.extend(self._sp.encode(part))
    return ids

  def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
    ids = self._encode_text(text)
    return [self._sp.bos_id()] + ids if add_special_tokens and self.add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    # Control pieces (BOS, EOS, pad) decode to nothing; sentinels are not pieces.
    return self._sp.decode([int(i) for i in ids if 0 <= int(i) < self.num_pieces])


def read_tokenizer(path: str) -> FileTokenizer:
  """The tokenizer in a file (by its name: *.json is HF's, else SentencePiece) or a
  directory (the first of TOKENIZER_FILES it holds)."""
  if os.path.isdir(path):
    for name in TOKENIZER_FILES:
      if os.path.isfile(os.path.join(path, name)):
        return read_tokenizer(os.path.join(path, name))
    raise TokenizerNotFound(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file not found: {path!r}")
  if path.endswith(".json"):
    return HFTokenizer(path)
  return SentencePieceFileTokenizer(path)


def checkpoint_tokenizer(checkpoint: Optional[str], vocabulary: Optional[str] = None
                         ) -> FileTokenizer:
  """`vocabulary` if given, else the tokenizer `checkpoint`'s directory holds.

  Raises:
    TokenizerNotFound: naming the checkpoint, the files looked for and the
      VOCABULARY binding that would supply one.
  """
  if vocabulary:
    return read_tokenizer(vocabulary)
  if checkpoint is None:
    raise TokenizerNotFound("no tokenizer: the target has no checkpoint directory to read "
                            "one from; set --gin.VOCABULARY to a tokenizer.json, "
                            "tokenizer.model or spiece.model")
  directory = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
  try:
    return read_tokenizer(directory)
  except TokenizerNotFound:
    raise TokenizerNotFound(
        f"no tokenizer for the target checkpoint {checkpoint}: it holds none of "
        f"{', '.join(TOKENIZER_FILES)}, and VOCABULARY is not set (set "
        "--gin.VOCABULARY to a tokenizer file or directory)") from None


# Text that exercises words, numbers, code and punctuation: two tokenizers that encode it
# alike are, for drafting purposes, the same.
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. In 2026, 3.14 * r**2 = area; "
              "def f(x): return x + 1  # über naïve café")


def tokenizer_difference(target: tasks.Tokenizer, draft: tasks.Tokenizer,
                         texts: Sequence[str] = ()) -> Optional[str]:
  """How `draft` encodes text differently from `target` (None when the probe text and
  `texts` give the same ids): a draft that reads other ids for the same text proposes
  tokens the target almost never accepts. Outputs stay exact; only the speedup is lost."""
  for text in [PROBE_TEXT, *texts[:3]]:
    want, got = target.encode(text), draft.encode(text)
    if want != got:
      shown = text if len(text) <= 40 else text[:37] + "..."
      return (f"{shown!r} is {want[:8]}{'...' if len(want) > 8 else ''} for the target and "
              f"{got[:8]}{'...' if len(got) > 8 else ''} for the draft")
  return None


def check_vocab_size(tokenizer: tasks.Tokenizer, config, model_source: str,
                     fix: str = "use this checkpoint's own tokenizer") -> None:
  """ValueError naming the tokenizer file and the checkpoint when the tokenizer can
  emit an id the model has no embedding for; `fix` says what to change (the caller
  knows where the tokenizer came from)."""
  if tokenizer.vocab_size > config.vocab_size:
    source = getattr(tokenizer, "source", type(tokenizer).__name__)
    raise ValueError(
        f"tokenizer/model vocabulary mismatch: {source} emits ids up to "
        f"{tokenizer.vocab_size - 1} but the {model_source} has only {config.vocab_size} "
        f"embeddings: {fix}")


def render_chat(tokenizer: FileTokenizer, text: str) -> str:
  """`text` as one user turn of the tokenizer's chat template, ready for the
  assistant's answer (HF's `apply_chat_template(..., add_generation_prompt=True)`)."""
  template = getattr(tokenizer, "chat_template", None)
  if not template:
    source = getattr(tokenizer, "source", type(tokenizer).__name__)
    raise ValueError(f"CHAT_TEMPLATE is set but {source} has no chat template (none in "
                     f"{CONFIG_FILE} or chat_template.jinja beside it): is this an "
                     "instruction-tuned checkpoint?")
  try:
    import jinja2  # noqa: F401  (checked here for the CHAT_TEMPLATE message)
  except ImportError as e:
    raise ImportError("CHAT_TEMPLATE needs jinja2 (pip install jinja2) to render "
                      "tokenizer_config.json's template") from e
  # The general (multi-turn) renderer, imported here rather than at the top so that
  # evaluation modules may import this one without a cycle.
  from specdec_jax.evaluation import conversation
  return conversation.next_prompt([text], [], template=template,
                                  bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


def encode_texts(tokenizer: tasks.Tokenizer, texts: Sequence[str], chat: bool = False
                 ) -> List[List[int]]:
  """One id list per text, with the tokenizer's own special tokens; with `chat`,
  each text rendered by the chat template first (which writes the special
  tokens itself, so the tokenizer adds none, as in HF)."""
  if chat:
    return [tokenizer.encode(render_chat(tokenizer, t), add_special_tokens=False)
            for t in texts]
  return [list(tokenizer.encode(t)) for t in texts]


def decode_rows(tokenizer: tasks.Tokenizer, sequences, lengths, eos_id: int) -> List[str]:
  """Texts of generated rows: sequences [n, N] int32, lengths [n] (tokens up to and
  including EOS, as `generate` returns them); a final EOS is not text."""
  texts = []
  for row, length in zip(sequences, lengths):
    ids = [int(i) for i in row[:int(length)]]
    if ids and ids[-1] == eos_id:
      ids = ids[:-1]
    texts.append(tokenizer.decode(ids))
  return texts
