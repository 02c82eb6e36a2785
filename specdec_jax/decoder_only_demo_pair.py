"""The shipped decoder-only demo pair: a GPT-like code target, its drafts, held-out prompts.

Trained by `experiments/train_decoder_only_pair.py` on the Python standard
library with the T5 demo pair's tokenizer (see
demo_pair_decoder_only/MODEL_CARD.md): the paper's Table 3 setting (a GPT-like
target with a small distilled draft, unigram and bigram drafts) in miniature.
`target/` and `draft/` are Hugging Face GPT2LMHeadModel directories in
bfloat16, loaded here as float32 (the fast dtype on CPU).

  pair = load_decoder_only_demo_pair()
  out = decoder_only_generate(pair.target, pair.prompts[:4], pair.prompt_lengths[:4],
                              max_decode_steps=pair.new_tokens, draft=pair.draft)
  print(pair.tokenizer.decode(out.sequences[0]))
"""

import dataclasses
import json
import os
from typing import Any, Dict, Optional

import numpy as np

from specdec_jax import data
from specdec_jax.families.decoder_only.model import DecoderOnlyModel

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "demo_pair_decoder_only")
NGRAM_NAMES = ("unigram", "bigram")


@dataclasses.dataclass
class DecoderOnlyDemoPair:
  """The loaded pair.

  tokenizer: `data.Tokenizer` (2048 pieces, EOS 1); target / draft:
  `DecoderOnlyModel`s (GPT-2 layout; the draft distilled from the target);
  ngrams: {'unigram', 'bigram'} `NgramDraft`s; prompts: [n, P] int32
  right-padded held-out prompts with prompt_lengths [n] int32; references:
  [n, new_tokens] int32, each prompt's file continued; prompt_paths: [n] the
  held-out stdlib file of each prompt; info: info.json (settings, stats, alpha).
  """
  tokenizer: data.Tokenizer
  target: DecoderOnlyModel
  draft: DecoderOnlyModel
  ngrams: Dict[str, Any]
  prompts: np.ndarray
  prompt_lengths: np.ndarray
  references: np.ndarray
  prompt_paths: np.ndarray
  info: Dict[str, Any]

  @property
  def new_tokens(self) -> int:
    """New tokens per prompt that alpha was measured with (prompt + new fit the positions)."""
    return int(self.info["settings"]["new_tokens"])


def load_decoder_only_demo_pair(path: Optional[str] = None,
                                dtype: str = "float32") -> DecoderOnlyDemoPair:
  """Loads the pair from `path` (default: the repository's demo_pair_decoder_only/).

  Args:
    path: the exported directory.
    dtype: compute dtype of both models ('float32' default; 'bfloat16' keeps
      the shipped weights as they are).
  Raises:
    FileNotFoundError: no pair at `path`, naming the command that makes one.
  """
  from specdec_jax.families.decoder_only.checkpoints import load_hf_decoder_only
  from specdec_jax.drafts.ngram import NgramDraft
  path = path or DEFAULT_DIR
  info_path = os.path.join(path, "info.json")
  if not os.path.exists(info_path):
    raise FileNotFoundError(f"no decoder-only demo pair at {path!r} (info.json missing): train "
                            "it with `python -m experiments.train_decoder_only_pair`")
  with open(info_path) as f:
    info = json.load(f)
  target = load_hf_decoder_only(os.path.join(path, "target"), dtype=dtype)
  draft = load_hf_decoder_only(os.path.join(path, "draft"), dtype=dtype)
  ngrams = {name: NgramDraft.load(os.path.join(path, f"{name}.npz")) for name in NGRAM_NAMES}
  with np.load(os.path.join(path, "heldout.npz")) as f:
    heldout = {k: f[k] for k in f.files}
  tokenizer = data.Tokenizer.load(os.path.join(path, "tokenizer.model"))
  return DecoderOnlyDemoPair(tokenizer, target, draft, ngrams,
                             heldout["prompts"].astype(np.int32),
                             heldout["prompt_lengths"].astype(np.int32),
                             heldout["references"].astype(np.int32),
                             heldout["prompt_paths"], info)
