"""The shipped demo pairs: a trained target, its drafts, tokenizer and held-out set, per family.

Two pairs ship, both trained on the Python standard library source with one
tokenizer (2048 pieces, pad 0, EOS 1):

* `demo_pair/` (family 't5'): a code-completion T5 target (9.7M) with 'small'
  (1.1M) and 'tiny' (0.2M) distilled drafts (`experiments/train_demo_pair.py`,
  demo_pair/MODEL_CARD.md). Weights are bfloat16 bit patterns (uint16) in
  .npz files; held-out rows in heldout.jsonl.
* `demo_pair_decoder_only/` (family 'decoder_only'): a GPT-like target (2.2M)
  with a distilled 'draft' (0.19M), Hugging Face GPT2LMHeadModel directories in
  bfloat16 (`experiments/train_decoder_only_pair.py`,
  demo_pair_decoder_only/MODEL_CARD.md); held-out prompts in heldout.npz.

Both load as one `DemoPair`, float32 by default (the fast dtype on CPU):

  pair = load_demo_pair()                  # or load_demo_pair("decoder_only"), or a directory
  tokens, lengths = pair.inputs(4)
  out = generate(pair.target, tokens, lengths, max_decode_steps=pair.max_decode_steps,
                 draft=ModelDraft(next(iter(pair.drafts.values()))))
  print(pair.tokenizer.decode(out.sequences[0]))
"""

import dataclasses
import io
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from specdec_jax import data
from specdec_jax.families.t5.config import T5Config
from specdec_jax.families.t5.model import Model

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The shipped pair of each family.
DIRS = {"t5": os.path.join(_REPO, "demo_pair"),
        "decoder_only": os.path.join(_REPO, "demo_pair_decoder_only")}
DEFAULT_DIR = DIRS["t5"]
# The file that marks each layout, and the command that writes it.
MARKERS = {"t5": "config.json", "decoder_only": "info.json"}
TRAINERS = {"t5": "python -m experiments.train_demo_pair",
            "decoder_only": "python -m experiments.train_decoder_only_pair"}
T5_MODEL_NAMES = ("target", "small", "tiny")
NGRAM_NAMES = ("unigram", "bigram")
# A trained feature head (`experiments/train_feature_heads.py`): bf16 weights, settings/stats.
FEATURE_HEAD_FILES = ("feature_head.npz", "feature_head.json")
FEATURE_DRAFT_NAME = "feature"
FEATURE_CARD_MARK = "<!-- feature head: written by experiments/train_feature_heads.py -->"
# Trained Medusa heads (the same trainer, HeadSettings.kind = 'medusa').
MEDUSA_HEAD_FILES = ("medusa_heads.npz", "medusa_heads.json")
MEDUSA_DRAFT_NAME = "medusa"
MEDUSA_CARD_MARK = "<!-- medusa heads: written by experiments/train_feature_heads.py -->"
# Trained block drafters (the same trainer, HeadSettings.kind = 'dflash' / 'parallel').
DFLASH_FILES = ("dflash.npz", "dflash.json")
DFLASH_DRAFT_NAME = "dflash"
DFLASH_CARD_MARK = "<!-- dflash drafter: written by experiments/train_feature_heads.py -->"
PARALLEL_FILES = ("parallel.npz", "parallel.json")
PARALLEL_DRAFT_NAME = "parallel"
PARALLEL_CARD_MARK = "<!-- parallel drafter: written by experiments/train_feature_heads.py -->"


def save_npz_atomic(path: str, **arrays) -> None:
  """Writes arrays as an uncompressed .npz, atomically."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  data.write_bytes_atomic(path, buf.getvalue())


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
  return _read_bf16_like(path, jax.eval_shape(
      lambda: init_params(config.replace(dtype="float32"), 0)), "the config's")


def _read_bf16_like(path: str, expected, whose: str = "the head's"):
  """Reads `save_weights_bf16` output as float32 arrays shaped like `expected` (a tree of
  ShapeDtypeStructs), naming any missing, extra or misshapen entry."""
  expected = traverse_util.flatten_dict(expected, sep="/")
  with np.load(path) as f:
    flat = {k: jnp.asarray(f[k].view(ml_dtypes.bfloat16).astype(np.float32)) for k in f.files}
  if set(flat) != set(expected):
    raise ValueError(f"{path}: parameter names differ from {whose}; missing "
                     f"{sorted(set(expected) - set(flat))[:5]}, extra "
                     f"{sorted(set(flat) - set(expected))[:5]}")
  for k, v in flat.items():
    if v.shape != expected[k].shape:
      raise ValueError(f"{path}: {k} has shape {v.shape}, {whose} needs {expected[k].shape}")
  return traverse_util.unflatten_dict(flat, sep="/")


def load_feature_head(path: str, target):
  """The trained feature head in pair directory `path` as an `sj.FeatureDraft` for `target`
  (its params cast to the target's dtype), or None when the pair ships none."""
  from specdec_jax.drafts.feature_draft import FeatureDraft
  from specdec_jax.families.registry import family_of
  npz, meta = (os.path.join(path, name) for name in FEATURE_HEAD_FILES)
  if not os.path.exists(npz):
    return None
  with open(meta) as f:
    info = json.load(f)
  if info.get("kind", "eagle1") != "eagle1":
    raise ValueError(f"{meta}: unknown feature head kind {info.get('kind')!r}")
  fc_bias = bool(info.get("fc_bias", False))
  head = family_of(target).feature_head(target.config, **({"fc_bias": True} if fc_bias else {}))
  params = _read_bf16_like(npz, jax.eval_shape(lambda: head.init_params(0)))
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, target.config.dtype), params)
  return FeatureDraft(target, head_params=params, fc_bias=fc_bias)


def load_medusa_heads(path: str, target):
  """The trained Medusa heads in pair directory `path` as an `sj.MedusaDraft` for `target`
  (params cast to the target's dtype), or None when the pair ships none."""
  from specdec_jax.drafts.medusa import MedusaDraft
  npz, meta = (os.path.join(path, name) for name in MEDUSA_HEAD_FILES)
  if not os.path.exists(npz):
    return None
  with open(meta) as f:
    info = json.load(f)
  if info.get("kind") != "medusa":
    raise ValueError(f"{meta}: kind {info.get('kind')!r}, expected 'medusa'")
  shape = MedusaDraft(target, num_heads=info["num_heads"], num_layers=info["num_layers"],
                      share_lm_head=bool(info.get("share_lm_head", False)))
  params = _read_bf16_like(npz, jax.eval_shape(lambda: shape.init_params(0)))
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, target.config.dtype), params)
  return MedusaDraft(target, num_heads=shape.num_heads, num_layers=shape.num_layers,
                     share_lm_head=shape.share_lm_head, params=params)


def _tuples(x):
  """JSON lists as tuples, recursively (frozen configs hold tuples)."""
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x


def load_dflash_drafter(path: str, target):
  """The trained DFlash drafter in pair directory `path` as an `sj.DFlashDraft` for
  `target` (its DFlashConfig from dflash.json, computing in the target's dtype), or None
  when the pair ships none."""
  from specdec_jax.drafts.dflash import DFlashConfig, DFlashDraft
  npz, meta = (os.path.join(path, name) for name in DFLASH_FILES)
  if not os.path.exists(npz):
    return None
  with open(meta) as f:
    info = json.load(f)
  if info.get("kind") != "dflash":
    raise ValueError(f"{meta}: kind {info.get('kind')!r}, expected 'dflash'")
  fields = {k: _tuples(v) for k, v in info["config"].items()}
  config = DFlashConfig(**dict(fields, dtype=str(target.config.dtype)))
  shape = DFlashDraft(target, config=config)  # random arrays: only their shapes are read
  params = _read_bf16_like(npz, jax.eval_shape(lambda: shape.init_params(0)))
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, target.config.dtype), params)
  return DFlashDraft(target, config=config, params=params)


def load_parallel_drafter(path: str, target):
  """The trained PARD drafter in pair directory `path` as an `sj.ParallelDraft` (a model
  of the target's family, in the target's dtype, with parallel.json's config, mask id and
  K), or None when the pair ships none."""
  from specdec_jax.drafts.pard import ParallelDraft
  from specdec_jax.families.registry import family_of
  npz, meta = (os.path.join(path, name) for name in PARALLEL_FILES)
  if not os.path.exists(npz):
    return None
  with open(meta) as f:
    info = json.load(f)
  if info.get("kind") != "parallel":
    raise ValueError(f"{meta}: kind {info.get('kind')!r}, expected 'parallel'")
  family = family_of(target)
  fields = {k: _tuples(v) for k, v in info["config"].items()}
  config = type(target.config)(**dict(fields, dtype="float32"))
  params = _read_bf16_like(npz, family.abstract_params(config), "the drafter config's")
  dtype = str(target.config.dtype)
  model = family.model_type(config.replace(dtype=dtype),
                            jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params))
  return ParallelDraft(model, mask_token_id=int(info["mask_token_id"]), gamma=int(info["gamma"]))


def with_card_section(card: str, mark: str, section: str) -> str:
  """`card` (a MODEL_CARD.md's text) with the section under `mark` replaced by `section`
  (appended when there is none): from `mark` to the next section mark (a line starting
  '<!-- ' that names its writer) or the end."""
  if mark not in card:
    return f"{card.rstrip(chr(10))}\n\n{mark}\n{section}"
  before, after = card.split(mark, 1)
  rest = after.split("\n<!-- ", 1)
  tail = f"\n<!-- {rest[1]}" if len(rest) > 1 else ""
  return f"{before}{mark}\n{section}{tail}"


def with_feature_head_section(card: str, section: str) -> str:
  """`with_card_section` for the feature head's section."""
  return with_card_section(card, FEATURE_CARD_MARK, section)


def config_to_json(config: T5Config) -> Dict[str, Any]:
  return dataclasses.asdict(config)


def config_from_json(d: Dict[str, Any]) -> T5Config:
  return T5Config(**dict(d, mlp_activations=tuple(d["mlp_activations"])))


@dataclasses.dataclass
class DemoPair:
  """A loaded demo pair (either family).

  family: 't5' or 'decoder_only'.
  tokenizer: `data.Tokenizer`.
  target: the target model (`Model` / `DecoderOnlyModel`), in the loaded dtype.
  drafts: {name: draft}: models of the target's family (T5: 'small',
    'tiny'; decoder-only: 'draft'), then, where the pair ships one, its
    trained feature head 'feature' (an `sj.FeatureDraft`, not a model: wrap
    entries with `sj.drafts.as_draft`, which passes a Draft through, rather
    than `ModelDraft`).
  ngrams: {'unigram', 'bigram'} `NgramDraft`s.
  heldout: rows {'path', 'input_ids', 'target_ids'} of held-out files (T5
    rows also hold the text, 'input', 'target', and 'line'): the input ids
    are the context (T5: encoder input; decoder-only: the prompt), the target
    ids the reference continuation.
  input_len: C, the width `inputs` pads rows to.
  max_decode_steps: new tokens per input the pair was evaluated with.
  info: the pair's config.json / info.json (settings, stats).
  card_alphas: {draft: {temperature: alpha}} as the trainers measured them on
    held-out prompts (config.json / info.json and the heads' .json files), for
    choosing gamma before measuring; {} where the cards say nothing.
  """
  family: str
  tokenizer: data.Tokenizer
  target: Any
  drafts: Dict[str, Any]
  ngrams: Dict[str, Any]
  heldout: List[Dict[str, Any]]
  input_len: int
  max_decode_steps: int
  info: Dict[str, Any]
  card_alphas: Dict[str, Dict[float, float]] = dataclasses.field(default_factory=dict)

  def inputs(self, n: Optional[int] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """(tokens [n, input_len] int32, lengths [n] int32 or None) of the first n held-out rows.

    Right-padded with 0. Pass both to `generate(target, tokens, lengths, ...)`:
    lengths is None for T5, whose encoder reads the padding (id 0), and the
    prompt lengths for decoder-only models.
    """
    rows = self.heldout if n is None else self.heldout[:n]
    tokens = data.pad_rows([r["input_ids"] for r in rows], self.input_len)
    if self.family == "t5":
      return tokens, None
    return tokens, np.asarray([len(r["input_ids"]) for r in rows], np.int32)

  def heldout_inputs(self, n: Optional[int] = None) -> np.ndarray:
    """[n, input_len] int32: the tokens of `inputs(n)`, for T5 (whose padding says the lengths)."""
    tokens, lengths = self.inputs(n)
    if lengths is not None:
      raise ValueError(f"a {self.family} pair's inputs need their lengths: use "
                       "`tokens, lengths = pair.inputs(n)`")
    return tokens

  def references(self, n: Optional[int] = None) -> np.ndarray:
    """[n, max_decode_steps] int32: each row's reference continuation, 0-padded."""
    rows = self.heldout if n is None else self.heldout[:n]
    return data.pad_rows([r["target_ids"] for r in rows], self.max_decode_steps)


def _card_alphas(records) -> Dict[str, Dict[float, float]]:
  """Every {draft: {temperature: alpha}} table under an "alpha" key of the cards' stats
  (later records win: the heads' evaluations are the most recent)."""
  found: Dict[str, Dict[float, float]] = {}

  def walk(node):
    if not isinstance(node, dict):
      return
    for key, value in node.items():
      if key in ("alpha", "alpha_after") and isinstance(value, dict):
        walk(value)  # {"alpha": {"alpha": {...}}} nests once in info.json
        for draft, by_temp in value.items():
          if isinstance(by_temp, dict) and all(
              isinstance(v, (int, float)) for v in by_temp.values()):
            try:
              found.setdefault(draft, {}).update({float(t): float(v) for t, v in by_temp.items()})
            except ValueError:
              continue
      elif key != "alpha_before":
        walk(value)

  for record in records:
    walk(record.get("stats", {}))
  return found


def _detect_family(path: str) -> Optional[str]:
  """The family whose layout `path` holds, or None."""
  for family, marker in MARKERS.items():
    if os.path.exists(os.path.join(path, marker)):
      return family
  return None


def _cast(model, dtype: str):
  """`model` with params and config in `dtype` (the bf16-stored weights cast losslessly up)."""
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), model.params)
  return type(model)(model.config.replace(dtype=dtype), params)


def _load_t5(path: str, info, dtype: str):
  models = {}
  for name in T5_MODEL_NAMES:
    config = config_from_json(info["models"][name])
    models[name] = _cast(Model(config, load_weights_bf16(os.path.join(path, f"{name}.npz"),
                                                         config)), dtype)
  with open(os.path.join(path, "heldout.jsonl"), encoding="utf-8") as f:
    heldout = [json.loads(line) for line in f if line.strip()]
  settings = info["settings"]
  return (models["target"], {n: models[n] for n in T5_MODEL_NAMES[1:]}, heldout,
          int(settings["input_len"]), int(settings["target_len"]))


def _load_decoder_only(path: str, info, dtype: str):
  from specdec_jax.loading import load_model
  target = load_model(os.path.join(path, "target"), dtype=dtype)
  drafts = {"draft": load_model(os.path.join(path, "draft"), dtype=dtype)}
  with np.load(os.path.join(path, "heldout.npz")) as f:
    prompts, lengths = f["prompts"], f["prompt_lengths"]
    references, paths = f["references"], f["prompt_paths"]
  heldout = [dict(path=str(p), input_ids=row[:n].tolist(), target_ids=ref.tolist())
             for row, n, ref, p in zip(prompts, lengths, references, paths)]
  return (target, drafts, heldout, int(prompts.shape[1]), int(info["settings"]["new_tokens"]))


def load_demo_pair(path: Optional[str] = None, dtype: str = "float32",
                   with_feature_head: bool = True) -> DemoPair:
  """Loads a demo pair.

  Args:
    path: a pair's directory (its layout says the family: config.json for
      T5, info.json for decoder-only), or a family name, 't5' or
      'decoder_only', for that family's shipped pair (a directory of that
      name needs a path spelling, './t5'). Default: the shipped T5 pair.
    dtype: compute dtype of the models ('float32' default; 'bfloat16' keeps
      the shipped weights as they are).
    with_feature_head: list the pair's trained heads, when it ships them,
      after the model drafts: its feature head (feature_head.npz) as
      drafts['feature'] (an `sj.FeatureDraft`), its Medusa heads
      (medusa_heads.npz) as drafts['medusa'] (an `sj.MedusaDraft`), its DFlash
      drafter (dflash.npz) as drafts['dflash'] (an `sj.DFlashDraft`) and its PARD
      drafter (parallel.npz) as drafts['parallel'] (an `sj.ParallelDraft`).
  Raises:
    FileNotFoundError: no pair at `path`, naming the command that trains one.
  """
  from specdec_jax.core.dtypes import canonical_dtype
  from specdec_jax.drafts.ngram import NgramDraft
  path = DIRS.get(path or "t5", path)
  family = _detect_family(path)
  if family is None:
    wanted = [f for f, d in DIRS.items() if os.path.abspath(path) == d]
    commands = [TRAINERS[f] for f in wanted] or list(TRAINERS.values())
    raise FileNotFoundError(
        f"no demo pair at {path!r} (neither {' nor '.join(MARKERS.values())} there): train it "
        f"with `{'` or `'.join(commands)}`")
  dtype = canonical_dtype(dtype)
  with open(os.path.join(path, MARKERS[family])) as f:
    info = json.load(f)
  load = _load_t5 if family == "t5" else _load_decoder_only
  target, drafts, heldout, input_len, max_decode_steps = load(path, info, dtype)
  if with_feature_head:
    for name, load_head in ((FEATURE_DRAFT_NAME, load_feature_head),
                            (MEDUSA_DRAFT_NAME, load_medusa_heads),
                            (DFLASH_DRAFT_NAME, load_dflash_drafter),
                            (PARALLEL_DRAFT_NAME, load_parallel_drafter)):
      head = load_head(path, target)
      if head is not None:
        drafts[name] = head
  ngrams = {name: NgramDraft.load(os.path.join(path, f"{name}.npz")) for name in NGRAM_NAMES
            if os.path.exists(os.path.join(path, f"{name}.npz"))}
  tokenizer = data.Tokenizer.load(os.path.join(path, "tokenizer.model"))
  records = [info]
  for meta in (FEATURE_HEAD_FILES[1], MEDUSA_HEAD_FILES[1], DFLASH_FILES[1], PARALLEL_FILES[1]):
    if os.path.exists(os.path.join(path, meta)):
      with open(os.path.join(path, meta)) as f:
        records.append(json.load(f))
  return DemoPair(family, tokenizer, target, drafts, ngrams, heldout, input_len,
                  max_decode_steps, info, _card_alphas(records))
