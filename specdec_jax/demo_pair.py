"""The shipped demo pair: a code-completion T5 target, its drafts, tokenizer and held-out set.

Trained by `experiments/train_demo_pair.py` on the Python standard library
source (see demo_pair/MODEL_CARD.md). Weights are stored as bfloat16 bit
patterns (uint16) in .npz files to keep the repository small, and loaded back
as float32 (the fast dtype on CPU).

  pair = load_demo_pair()
  out = generate(pair.target, pair.heldout_inputs()[:4], max_decode_steps=40,
                 draft=pair.drafts['small'])
  print(pair.tokenizer.decode(out.sequences[0]))
"""

import dataclasses
import io
import json
import os
from typing import Any, Dict, List, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from specdec_jax import data
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import T5Config

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "demo_pair")
MODEL_NAMES = ("target", "small", "tiny")
NGRAM_NAMES = ("unigram", "bigram")


def save_weights_bf16(path: str, params) -> int:
  """Writes params as bfloat16 bit patterns (uint16) in an .npz, atomically; returns bytes."""
  flat = traverse_util.flatten_dict(params, sep="/")
  arrays = {k: np.asarray(np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)).view(np.uint16)
            for k, v in flat.items()}
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  data.write_bytes_atomic(path, buf.getvalue())
  return len(buf.getvalue())


def load_weights_bf16(path: str, config: T5Config):
  """Reads `save_weights_bf16` output as a float32 param tree, checking it fits `config`."""
  from specdec_jax.families.t5.model import init_params  # Only for the expected shapes.
  import jax
  expected = traverse_util.flatten_dict(
      jax.eval_shape(lambda: init_params(config.replace(dtype="float32"), 0)), sep="/")
  with np.load(path) as f:
    flat = {k: jnp.asarray(f[k].view(ml_dtypes.bfloat16).astype(np.float32)) for k in f.files}
  if set(flat) != set(expected):
    raise ValueError(f"{path}: parameter names differ from the config's; missing "
                     f"{sorted(set(expected) - set(flat))[:5]}, extra "
                     f"{sorted(set(flat) - set(expected))[:5]}")
  for k, v in flat.items():
    if v.shape != expected[k].shape:
      raise ValueError(f"{path}: {k} has shape {v.shape}, the config needs {expected[k].shape}")
  return traverse_util.unflatten_dict(flat, sep="/")


def config_to_json(config: T5Config) -> Dict[str, Any]:
  return dataclasses.asdict(config)


def config_from_json(d: Dict[str, Any]) -> T5Config:
  return T5Config(**dict(d, mlp_activations=tuple(d["mlp_activations"])))


@dataclasses.dataclass
class DemoPair:
  """The loaded pair.

  tokenizer: `data.Tokenizer`; target: `Model` (float32); drafts: {'small', 'tiny'} `Model`s;
  ngrams: {'unigram', 'bigram'} `NgramDraft`s; heldout: rows {'path', 'line', 'input',
  'target', 'input_ids', 'target_ids'}; info: config.json contents (settings, stats).
  """
  tokenizer: data.Tokenizer
  target: Model
  drafts: Dict[str, Model]
  ngrams: Dict[str, Any]
  heldout: List[Dict[str, Any]]
  info: Dict[str, Any]

  @property
  def input_len(self) -> int:
    return int(self.info["settings"]["input_len"])

  @property
  def max_decode_steps(self) -> int:
    return int(self.info["settings"]["target_len"])

  def heldout_inputs(self, n: Optional[int] = None) -> np.ndarray:
    """[n, input_len] int32 encoder tokens of the first n held-out examples."""
    rows = self.heldout if n is None else self.heldout[:n]
    return data.pad_rows([r["input_ids"] for r in rows], self.input_len)


def load_demo_pair(path: Optional[str] = None) -> DemoPair:
  """Loads the demo pair from `path` (default: the repository's demo_pair/)."""
  from specdec_jax.drafts.ngram import NgramDraft
  path = path or DEFAULT_DIR
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"no demo pair at {path!r} (config.json missing): train it with "
                            "`python -m experiments.train_demo_pair`")
  with open(config_path) as f:
    info = json.load(f)
  models = {}
  for name in MODEL_NAMES:
    config = config_from_json(info["models"][name])
    models[name] = Model(config, load_weights_bf16(os.path.join(path, f"{name}.npz"), config))
  ngrams = {name: NgramDraft.load(os.path.join(path, f"{name}.npz")) for name in NGRAM_NAMES
            if os.path.exists(os.path.join(path, f"{name}.npz"))}
  with open(os.path.join(path, "heldout.jsonl"), encoding="utf-8") as f:
    heldout = [json.loads(line) for line in f if line.strip()]
  tokenizer = data.Tokenizer.load(os.path.join(path, "tokenizer.model"))
  return DemoPair(tokenizer, models["target"], {n: models[n] for n in ("small", "tiny")},
                  ngrams, heldout, info)
