r"""Runs one target/draft pair on one task: autoregressive vs speculative decoding.

Every model family, text in and text out. A pair is one gin file plus flags
(T5X style; later flags override earlier ones):

  # Named pairs (configs/pairs/*.gin) name the shapes the checkpoints must have.
  python -m experiments.run --pair=llama_3_1_8b__llama_3_2_1b \
    --gin_file=configs/tasks/local_file.gin --gin.INPUT_FILE="'prompts.jsonl'" \
    --gin.TARGET_CHECKPOINT="'/ckpt/Llama-3.1-8B'" \
    --gin.DRAFT_CHECKPOINT="'/ckpt/Llama-3.2-1B'" --output_dir=/tmp/llama

  # Any two local directories of one family; or a draft kind instead of a model.
  python -m experiments.run --pair=local --gin.TARGET_CHECKPOINT="'/ckpt/a'" \
    --gin.DRAFT_CHECKPOINT="'/ckpt/b'" --prompt="def fib(n):" --output_dir=/tmp/one
  python -m experiments.run --pair=local --gin_file=configs/drafts/prompt_lookup.gin \
    --gin.TARGET_CHECKPOINT="'/ckpt/a'" --prompt="..." --output_dir=/tmp/pld
  # A token tree around the pair's draft model (or dynamic_tree.gin; BLOCK_WIDTH >= its nodes).
  python -m experiments.run --pair=local --gin_file=configs/drafts/tree.gin \
    --gin.TARGET_CHECKPOINT="'/ckpt/a'" --gin.DRAFT_CHECKPOINT="'/ckpt/b'" --prompt="..." \
    --output_dir=/tmp/tree

  # T5 (Table 2): the same, with a T5X checkpoint's vocabulary named.
  python -m experiments.run --pair=t5_1_1_xxl__small --gin_file=configs/tasks/wmt_ende.gin \
    --gin.TARGET_CHECKPOINT="'/ckpt/xxl'" --gin.DRAFT_CHECKPOINT="'/ckpt/small'" \
    --gin.VOCABULARY="'/ckpt/spiece.model'" --gin.GAMMA=7 --output_dir=/tmp/ende

Text goes through the target checkpoint's own tokenizer (`specdec_jax.text`:
tokenizer.json, tokenizer.model or spiece.model; `VOCABULARY` overrides the
directory; `CHAT_TEMPLATE=True` wraps each input in tokenizer_config.json's
chat template), and the family turns the ids into `generate`'s inputs
(`Family.text_inputs`). The launcher never asks which family it runs: it
loads, tokenizes, decodes and scores through the family contract.

Both decoders see the same batches (the last one padded with copies of its
final example, dropped from every statistic) after one compile warm-up each;
batches alternate between the two so that machine drift hits both alike.

Writes `results.json` (the Table 2 fields and every decoded completion) and
`results.md` (the Table 2 row) atomically, and only once every measurement
succeeded: a failed run leaves no results.
"""

import abc
import collections
import contextlib
import dataclasses
import functools
import glob
import json
import os
import re
import sys
import time
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from absl import app
from absl import flags
from absl import logging
import gin
import jax
import numpy as np
import tqdm

from experiments import launch_checks
from experiments.output_lock import OutputLock
from experiments.run_identity import describe, file_fingerprints, rows_digest
from experiments.run_progress import BatchRecord, RunProgress
from experiments.gin_flags import (GIN_BINDINGS, GIN_FILES, GIN_SEARCH_PATHS, parse_gin,
                                   rewrite_gin_args)
from specdec_jax.compile_cache import enable_compile_cache
from specdec_jax import results as results_lib
from specdec_jax.core import sampling
from specdec_jax import multihost, sharding
from specdec_jax import settings as settings_lib
from specdec_jax import tasks
from specdec_jax import text
from specdec_jax.core import theory
from specdec_jax.evaluation.law import mean_log_probs, sign_test_p_value
from specdec_jax.core.verification import VERIFIERS
from specdec_jax.tools.profiling import block_step_seconds
from specdec_jax.core.token_tree import TreeShape
from specdec_jax.drafts import (DFlashDraft, Draft, DynamicTreeDraft, FeatureDraft,
                                MedusaDraft, ModelDraft, NgramDraft, ParallelDraft,
                                PromptLookupDraft, SparseCacheDraft, TreeDraft)
from specdec_jax.drafts.tree_draft import LAWS as TREE_LAWS
from specdec_jax.core.outputs import SpeculativeStats
from specdec_jax.families.hub import check_hub_id, looks_like_hub_id
from specdec_jax.families.registry import families, family_of
from specdec_jax.families.t5.config import T5Config
from specdec_jax.generation import generate
from specdec_jax.slots import generate_many, stash_size
from specdec_jax import demo_pair
from specdec_jax.loading import (load_dflash_draft, load_feature_draft, load_medusa_draft,
                                 load_model, load_parallel_draft, load_sharded_model,
                                 shard_model)
from specdec_jax.perturbation import perturbed_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS_DIR = os.path.join(REPO_ROOT, "configs", "pairs")

gin.external_configurable(T5Config, module="specdec_jax")

# Family false-alarm rate of the temperature > 0 distribution check (two sign
# tests, Bonferroni-corrected).
DISTRIBUTION_CHECK_FALSE_ALARM = 0.01


def named_config(name: str):
  """The config a registered family names `name` (`gpt2`, `llama_3_1_8b`, ...)."""
  for family in families():
    config = family.lookup_config(name)
    if config is not None:
      return config
  raise ValueError(f"unknown model config {name!r} in a ModelSpec; named configs: "
                   + "; ".join(f"{f.name}: {', '.join(sorted(f.named_configs()))}"
                               for f in families()))


class DraftSpec(abc.ABC):
  """What `Experiment.draft` holds: a draft described by settings, which builds itself
  for the loaded target (`ModelSpec`, `DraftKind`, `TreeSpec`; `ReadyDraft` wraps a
  `Draft` given as is). `run_experiment`'s stages ask it, in order:

  - `check()`: fails fast, before anything loads (paths, kinds, shapes).
  - `build(target, rows, tokenizer, partitioner)`: the `Draft` for the loaded target
    (rows: the tokenized inputs; a checkpoint is read onto `partitioner`'s mesh).
  - `theory_gamma` / `verify_block`: the gamma results.json and the theory use, and
    the timed verification call.
  - `place(draft, target, partitioner)`: the draft once the target is on the mesh.
  - `cost_model(draft)`: the model whose one-token step is c's numerator (None: c is
    taken as 0).
  - `report` / `report_markdown`: results.json's and results.md's fields of its own.

  The defaults are a chain's.
  """

  def check(self) -> None:
    """Fails fast, before anything loads."""

  @abc.abstractmethod
  def build(self, target, rows, tokenizer, partitioner=None) -> Draft:
    """The `Draft` for the loaded `target`, on the host (rows: the tokenized inputs;
    tokenizer: the target's, which a draft model must read too)."""

  def place(self, draft: Draft, target, partitioner: sharding.Partitioner) -> Draft:
    """A model draft's weights go onto the mesh leaf by leaf (as the target's); other
    drafts stay as they are (`generate` replicates their arrays)."""
    if not isinstance(draft, ModelDraft):
      return draft
    return ModelDraft(shard_model(draft.model, partitioner), draft.confidence_threshold,
                      draft.vocab_size if draft.padding else None)

  def cost_model(self, draft: Draft):
    return draft.model if isinstance(draft, ModelDraft) else None

  def theory_gamma(self, draft: Draft, gamma: int) -> int:
    """The gamma of results.json and of the theory's formulas."""
    return gamma

  def verify_block(self, gamma: int, block_width: int) -> Tuple[int, str]:
    """(tokens of the timed verification call, which the decode must reach; how an error
    names them)."""
    return gamma + 1, f"gamma + 1 ({gamma + 1})"

  def report(self, draft: Draft, stats: SpeculativeStats, block_width: int, temperature: float,
             c: Optional[float], verify_cost: float) -> Dict[str, Any]:
    """results.json's fields of this kind of draft."""
    return {}

  def report_markdown(self, result: Dict[str, Any]) -> str:
    """results.md's lines under the Table 2 row for this kind of draft."""
    return ""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelSpec(DraftSpec):
  """How to obtain a target or draft model, of any family.

  Attributes:
    name: label for reports (Table 2's draft column: 'small', 'base', ...).
    config: the network's config, or a named config ('llama_3_2_1b',
      't5_1_1_small', ...; random init when there is no checkpoint; with a
      checkpoint, its parameter shapes must match the checkpoint's).
    checkpoint: a path for `specdec_jax.load_model` (HF / T5X / Orbax).
    seed: random-init seed.
    dtype: 'float32' / 'bfloat16'; default float32 on CPU, bfloat16 elsewhere.
    perturb_target: drafts only, for offline demos: use the target's weights
      times (1 + perturb_target * N(0, 1)) instead of a model of its own.
  """
  name: str = "model"
  config: Any = None
  checkpoint: Optional[str] = None
  seed: int = 0
  dtype: Optional[str] = None
  perturb_target: Optional[float] = None

  def validate(self, role: str) -> None:
    """Fails fast, before anything loads, on a missing path or an empty spec."""
    if self.checkpoint is not None:
      if not os.path.exists(self.checkpoint) and looks_like_hub_id(self.checkpoint):
        # Loading fetches it; offline, say so now, with the recipe, in flags.
        check_hub_id(self.checkpoint,
                     f"pass --gin.{role.upper()}_CHECKPOINT=\"'DIR'\" (the downloaded directory)")
      elif not os.path.exists(self.checkpoint):
        raise FileNotFoundError(f"{role} checkpoint not found: {self.checkpoint!r}")
    elif self.config is None and self.perturb_target is None:
      raise ValueError(f"{role} ModelSpec needs a config, a checkpoint or perturb_target")
    if self.perturb_target is not None and role != "draft":
      raise ValueError("perturb_target applies to the draft only")
    self.resolved_config()

  def resolved_config(self):
    """The config object (a named config looked up), or None."""
    return named_config(self.config) if isinstance(self.config, str) else self.config

  def check(self) -> None:
    self.validate("draft")

  def warn_on_other_tokenizer(self, tokenizer) -> Optional[str]:
    """Warns (and returns the warning) when this draft checkpoint ships a tokenizer that
    encodes text differently from the target's `tokenizer`, which the launcher feeds
    both models: the outputs stay the target's, but the draft then guesses in another
    vocabulary and alpha falls to about 0."""
    if self.checkpoint is None or getattr(tokenizer, "source", None) is None:
      return None
    try:
      own = text.checkpoint_tokenizer(self.checkpoint)
    except (FileNotFoundError, ValueError, ImportError):
      return None  # No tokenizer of its own: it is meant to read the target's.
    if os.path.abspath(own.source) == os.path.abspath(tokenizer.source):
      return None
    difference = text.tokenizer_difference(tokenizer, own)
    if difference is None:
      return None
    warning = (f"the draft checkpoint's tokenizer ({own.source}) encodes text differently from "
               f"the target's ({tokenizer.source}): {difference}. Outputs stay the target's, "
               "but the draft reads and proposes other ids, so almost nothing is accepted: use "
               "a draft trained with the target's tokenizer")
    logging.warning("%s", warning)
    return warning

  def build(self, target, rows, tokenizer, partitioner=None) -> Draft:
    """The draft model (or the target's noisy copy), checked against the tokenizer."""
    if self.perturb_target is not None:
      logging.info("draft: the target with %.0f%% weight noise", 100 * self.perturb_target)
      model = perturbed_model(target, self.perturb_target, seed=self.seed + 1)
    else:
      model = load_spec(self, "draft", partitioner)
    text.check_vocab_size(tokenizer, model.config, _model_source(self, "draft"),
                          DRAFT_VOCAB_FIX)
    if model.config.vocab_size < target.config.vocab_size:
      # One tokenizer, embedding tables padded to different sizes (Qwen2.5):
      # q = 0 on the ids the draft lacks keeps the outputs exact.
      logging.info("draft: %d logits padded to the target's %d", model.config.vocab_size,
                   target.config.vocab_size)
      return ModelDraft(model, target_vocab_size=target.config.vocab_size)
    return ModelDraft(model)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DraftKind(DraftSpec):
  """A draft that is not a model, built for the target once it is loaded.

  Attributes:
    kind: 'prompt_lookup' (copies what followed the last n-gram of the
      context; `PromptLookupDraft`), 'ngram' (`NgramDraft`), 'feature'
      (an EAGLE-style head over the target's hidden states, `FeatureDraft`;
      configs/drafts/feature.gin), or a drafter that fills a whole proposal in
      one call: 'medusa' (`MedusaDraft`), 'dflash' (`DFlashDraft`;
      configs/drafts/dflash.gin) or 'parallel' (PARD, `ParallelDraft`;
      configs/drafts/parallel.gin); or 'sparse_cache' (the target drafting for itself
      from a budgeted view of its own cache, `SparseCacheDraft`;
      configs/drafts/sparse_cache.gin).
    max_ngram / min_ngram: prompt lookup's n-gram lengths.
    budget / policy / sinks / chunk: 'sparse_cache': the cache positions each draft
      step reads, 'window' (sinks + most recent) or 'retrieval' (chunks by key
      similarity), the window's sink positions, the retrieval's chunk.
    positions: 'dflash' / 'parallel' without a trained drafter: the laws one call
      gives (K; a DFlash block of K + 1).
    path: n-gram: a file `NgramDraft.save` wrote; None fits a bigram on the
      task's tokenized inputs. Feature: a public EAGLE-1 / EAGLE-3 head
      directory (config.json + weights; `load_feature_draft`) or a directory
      with a head trained here (feature_head.npz + feature_head.json, as the
      demo pairs ship; `experiments/train_feature_heads.py`); None: a random
      head of the target's family (smoke tests and cost measurements only:
      it drafts noise, logged as such). Medusa / DFlash: a public Medusa-1 /
      z-lab DFlash directory, or a demo pair directory that ships one
      (medusa_heads.npz, dflash.npz); None: random (logged as such).
      Parallel: a public PARD directory (an HF causal LM naming its
      `pard_token`) or a demo pair directory that ships parallel.npz; required.
  """
  kind: str = gin.REQUIRED
  max_ngram: int = 3
  min_ngram: int = 1
  path: Optional[str] = None
  positions: int = 4
  budget: int = 256
  policy: str = "window"
  sinks: int = 4
  chunk: int = 32

  KINDS = ("prompt_lookup", "ngram", "feature", "medusa", "dflash", "parallel",
           "sparse_cache")
  # Kinds built from the target's own arrays (they are built again for a placed target).
  READS_TARGET = ("feature", "medusa", "dflash")

  @property
  def name(self) -> str:
    return self.kind

  def check(self) -> None:
    if self.kind not in self.KINDS:
      raise ValueError(f"unknown DraftKind.kind {self.kind!r}; known: {list(self.KINDS)}")
    if self.kind in ("feature", "medusa", "dflash", "parallel"):
      if self.path is not None and not os.path.isdir(self.path):
        raise FileNotFoundError(f"{self.kind} draft directory not found: {self.path!r}")
      if self.kind == "parallel" and self.path is None:
        raise ValueError("DraftKind.kind='parallel' needs a trained PARD drafter: set "
                         "--gin.DraftKind.path to a PARD directory or a demo pair directory "
                         "that ships parallel.npz (an untrained one drafts noise)")
      if isinstance(self.positions, bool) or int(self.positions) != self.positions or (
          self.positions < 1):
        raise ValueError(f"DraftKind.positions must be an int >= 1, got {self.positions!r}")
    elif self.path is not None and not os.path.isfile(self.path):
      raise FileNotFoundError(f"n-gram draft file not found: {self.path!r}")

  def build(self, target, rows, tokenizer=None, partitioner=None) -> Draft:
    """The draft for `target` (a model; n-gram kinds read only its config); rows: the
    tokenized inputs."""
    target_config = target.config
    family = family_of(target_config)
    if self.kind in self.READS_TARGET:
      return self._head_draft(target)
    if self.kind == "parallel":
      return self._parallel_draft(target)
    if self.kind == "sparse_cache":
      return self._sparse_cache_draft(target)
    if self.kind == "prompt_lookup":
      return PromptLookupDraft(target_config.vocab_size, self.max_ngram, self.min_ngram)
    if self.path is not None:
      return NgramDraft.load(self.path)
    return NgramDraft.fit([np.asarray(r, np.int64) for r in rows], target_config.vocab_size,
                          order=2, eos_id=family.eos_id(target_config),
                          pad_id=target_config.pad_id)

  def place(self, draft: Draft, target, partitioner: sharding.Partitioner) -> Draft:
    # Heads and the sparse-cache draft read the target's arrays: built again from the
    # placed target.
    if self.kind == "sparse_cache":
      return self._sparse_cache_draft(target)
    return self._head_draft(target) if self.kind in self.READS_TARGET else draft

  def _sparse_cache_draft(self, target) -> Draft:
    return SparseCacheDraft(target, budget=self.budget, policy=self.policy, sinks=self.sinks,
                            chunk=self.chunk)

  def _head_draft(self, target) -> Draft:
    """A feature, Medusa or DFlash draft: random, trained here (a demo pair directory) or
    public (EAGLE, Medusa-1, z-lab DFlash)."""
    random_head, pair_files, from_pair, public = {
        "feature": (lambda: FeatureDraft(target), demo_pair.FEATURE_HEAD_FILES,
                    demo_pair.load_feature_head, load_feature_draft),
        "medusa": (lambda: MedusaDraft(target), demo_pair.MEDUSA_HEAD_FILES,
                   demo_pair.load_medusa_heads, load_medusa_draft),
        "dflash": (lambda: DFlashDraft(target, block_size=self.positions + 1),
                   demo_pair.DFLASH_FILES, demo_pair.load_dflash_drafter, load_dflash_draft),
    }[self.kind]
    if self.path is None:
      logging.warning("draft: a RANDOM %s draft (DraftKind.path unset): it drafts noise; set "
                      "--gin.DraftKind.path to a public checkpoint or a drafter trained here",
                      self.kind)
      return random_head()
    if os.path.isfile(os.path.join(self.path, pair_files[0])):
      return from_pair(self.path, target)
    return public(self.path, target)

  def _parallel_draft(self, target) -> Draft:
    if os.path.isfile(os.path.join(self.path, demo_pair.PARALLEL_FILES[0])):
      draft = demo_pair.load_parallel_drafter(self.path, target)
    else:
      draft = load_parallel_draft(self.path, gamma=self.positions,
                                  dtype=str(target.config.dtype))
    if draft.vocab_size < target.config.vocab_size:
      draft = ParallelDraft(draft.model, draft.mask_token_id, draft.gamma,
                            target_vocab_size=target.config.vocab_size)
    return draft


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TreeSpec(DraftSpec):
  """A token-tree draft (`TreeDraft` / `DynamicTreeDraft`) around a model, n-gram or feature
  draft.

  configs/drafts/tree.gin and dynamic_tree.gin bind it. The target's block
  width (BLOCK_WIDTH, `Experiment.block_width`) must hold the tree's
  `num_nodes` slots, root included; by default it is num_nodes where
  `decoding.narrow_by_default` (float32 on CPU), else
  `decoding.DEFAULT_BLOCK_WIDTH` (`settings.plan_settings` decides, and
  names the width to pass).

  Attributes:
    inner: the draft that scores every node: the pair's `ModelSpec` (default
      in the gin files: @draft/ModelSpec()), an n-gram or a feature-head
      `DraftKind` (prompt lookup gives no law at every node).
    kind: 'tree' (static `TreeDraft`: `branching` children per depth, drawn
      by `children`) or 'dynamic_tree' (`DynamicTreeDraft`: `topk`, `depth`,
      `node_budget`, grown by cumulative draft probability).
  """
  inner: Union[ModelSpec, DraftKind] = gin.REQUIRED
  kind: str = "tree"
  branching: Tuple[int, ...] = (2, 2, 1)
  children: str = "without_replacement"
  topk: int = 4
  depth: int = 4
  node_budget: int = 16

  KINDS = ("tree", "dynamic_tree")

  @property
  def name(self) -> str:
    if self.kind == "tree":
      return f"tree{'x'.join(map(str, self.branching))}({self.inner.name})"
    return f"dynamic_tree_k{self.topk}d{self.depth}n{self.node_budget}({self.inner.name})"

  def check(self) -> None:
    """Fails fast, before anything loads, on a bad shape, law or inner draft."""
    if self.kind not in self.KINDS:
      raise ValueError(f"unknown TreeSpec.kind {self.kind!r}; known: {list(self.KINDS)}")
    if not isinstance(self.inner, (ModelSpec, DraftKind)):
      raise TypeError(f"TreeSpec.inner must be a ModelSpec or a DraftKind, got "
                      f"{type(self.inner).__name__}")
    self.inner.check()
    if getattr(self.inner, "kind", None) == "prompt_lookup":
      raise ValueError("TreeSpec.inner is a prompt-lookup draft, which gives no distribution "
                       "at every tree node: use the pair's @draft/ModelSpec() or an n-gram "
                       "DraftKind")
    if self.kind == "tree":
      TreeShape(self.branching)
      if self.children not in TREE_LAWS:
        raise ValueError(f"TreeSpec.children must be one of {TREE_LAWS}, got {self.children!r}")

  def build(self, target, rows, tokenizer, partitioner=None) -> TreeDraft:
    return self._grow(self.inner.build(target, rows, tokenizer, partitioner))

  def place(self, draft: TreeDraft, target, partitioner: sharding.Partitioner) -> TreeDraft:
    return self._grow(self.inner.place(draft.inner, target, partitioner))

  def _grow(self, inner: Draft) -> TreeDraft:
    if self.kind == "tree":
      return TreeDraft(inner, self.branching, children=self.children)
    return DynamicTreeDraft(inner, topk=self.topk, depth=self.depth,
                            node_budget=self.node_budget)

  def cost_model(self, draft: TreeDraft):
    return self.inner.cost_model(draft.inner)

  def theory_gamma(self, draft: TreeDraft, gamma: int) -> int:
    # A tree's gamma is its depth (draft calls per iteration); the loop's own
    # deepest node (greedy pending tokens included) is results["tree"]["max_depth"].
    return draft.depth

  def verify_block(self, gamma: int, block_width: int) -> Tuple[int, str]:
    # The target scores the tree's W slots in one call.
    return block_width, (f"the block width ({block_width}): raise MAX_DECODE_STEPS or lower "
                         "BLOCK_WIDTH")

  def report(self, draft: TreeDraft, stats: SpeculativeStats, block_width: int,
             temperature: float, c: Optional[float], verify_cost: float) -> Dict[str, Any]:
    """The tree, its measured statistics, and the theory's predictions from the measured
    per-rank acceptance (`theory.tree_expected_tokens`)."""
    description = dict(kind=self.kind, inner=self.inner.name, num_nodes=draft.num_nodes,
                       block_width=block_width, depth=draft.depth, max_depth=stats.gamma,
                       law=draft.law(temperature < sampling.MIN_TEMPERATURE),
                       verification="recursive rejection sampling over the tree")
    if self.kind == "tree":
      description.update(branching=list(self.branching), children=self.children)
    else:
      description.update(topk=self.topk, node_budget=self.node_budget)
    if stats.rank_tried is None:
      # No input drafted the tree: GAMMA='auto' ran target-only throughout (the tree
      # predicted or measured slower; said in the warnings). Nothing of it was measured.
      return dict(tree=description, depth_histogram=None, per_rank_acceptance=None,
                  rank_tried=None, expected_tokens_per_iteration=None, best_tree_shape=None,
                  predicted_speedup=None, predicted_speedup_measured_verify_cost=None,
                  predicted_speedup_note="the tree did not run (GAMMA='auto' ran "
                                         "target-only throughout)")
    per_rank = stats.per_rank_acceptance.tolist()
    if self.kind == "tree":
      expected = theory.tree_expected_tokens(self.branching, per_rank)
      note = None
    else:
      # No static shape to score: the predictions use the measured tokens per iteration.
      expected = None
      note = "dynamic tree: predicted speedups use the measured tokens per iteration"
    tokens = max(expected if expected is not None else stats.mean_tokens_per_iteration, 1.0)
    calls = draft.depth  # one draft call per depth (the first feeds the pending chain)
    return dict(
        tree=description, depth_histogram=stats.depth_histogram.sum(0).tolist(),
        per_rank_acceptance=per_rank, rank_tried=stats.rank_tried.sum(0).tolist(),
        expected_tokens_per_iteration=expected,
        best_tree_shape=list(theory.best_tree_shape(per_rank, block_width, draft.depth)),
        predicted_speedup=theory.predicted_tree_speedup(tokens, c or 0.0, calls, 1.0),
        predicted_speedup_measured_verify_cost=theory.predicted_tree_speedup(
            tokens, c or 0.0, calls, verify_cost),
        predicted_speedup_note=note)

  def report_markdown(self, result: Dict[str, Any]) -> str:
    tree = result["tree"]
    shape = (f"branching {tuple(tree['branching'])}, children {tree['children']}"
             if tree["kind"] == "tree" else
             f"topk {tree['topk']}, depth {tree['depth']}, node_budget {tree['node_budget']}")
    if result["per_rank_acceptance"] is None:
      return (f"\nTree: {tree['kind']} ({shape}) around {tree['inner']}; "
              f"{tree['num_nodes']} nodes: it did not run (GAMMA='auto' ran target-only "
              "throughout; --gin.GAMMA=4 runs it at its shape).\n")
    return (f"\nTree: {tree['kind']} ({shape}) around {tree['inner']}; {tree['num_nodes']} "
            f"nodes, block width {tree['block_width']}, verified by {tree['verification']} "
            f"(law {tree['law']}).\n\n"
            f"- tokens per iteration: {result['mean_tokens_per_iteration']:.2f} measured, "
            f"{_fmt_or_na(result['expected_tokens_per_iteration'])} predicted\n"
            f"- accepted-depth histogram (depth 0..{len(result['depth_histogram']) - 1}): "
            f"{result['depth_histogram']}\n"
            f"- per-rank acceptance: "
            f"{', '.join(f'{a:.2f}' for a in result['per_rank_acceptance'])}"
            f"\n- best static shape for these rates within {tree['block_width']} nodes and "
            f"depth {tree['depth']} (theory.best_tree_shape): "
            f"{tuple(result['best_tree_shape'])}\n")


@dataclasses.dataclass(frozen=True)
class ReadyDraft(DraftSpec):
  """A `Draft` given as is (`Experiment(draft=NgramDraft(...))`, from Python)."""
  draft: Draft

  @property
  def name(self) -> str:
    return type(self.draft).__name__

  def build(self, target, rows, tokenizer, partitioner=None) -> Draft:
    return self.draft


def draft_spec(draft: Union[DraftSpec, Draft]) -> DraftSpec:
  """`Experiment.draft` as a `DraftSpec` (a `Draft` wrapped in `ReadyDraft`)."""
  if isinstance(draft, DraftSpec):
    return draft
  if not isinstance(draft, Draft):
    raise TypeError(f"Experiment.draft must be a ModelSpec, a DraftKind, a TreeSpec or a Draft, "
                    f"got {type(draft).__name__}")
  return ReadyDraft(draft)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Experiment:
  """One measurement: a target, a draft, a task and the decoding settings.

  `draft` is a `DraftSpec` (a `ModelSpec`, a `DraftKind`, a `TreeSpec`) or
  any `specdec_jax.drafts.Draft`.
  tokenizer: None (default) reads the target checkpoint's own (or
  `vocabulary`'s: a tokenizer file or directory, the VOCABULARY macro);
  a `tasks.Tokenizer` (e.g. the byte fallback for random tiny models) wins
  over both. chat_template: render each input as one user turn of the
  tokenizer's chat template (instruction-tuned checkpoints).
  gamma: a chain's tokens per proposal, or 'auto' (default; the GAMMA macro): with
  slots, `sj.generate_many` chooses gamma (0: target-only) for each phase of inputs
  from what each choice measured at this batch size (else its iteration timed there)
  and the acceptance so far, each chunk starting from what the chunks before it
  measured; gamma is at most W - 1, so greedy outputs still equal target-only decoding
  at W.
  results.json gains `gamma_phases` (inputs, gamma, the alpha it was chosen at and
  the speedup predicted) and `gamma_auto_costs`; its `gamma` is the speculating gamma
  that decoded the most inputs. Without slots (SCHEDULING='batches', a mesh) and for
  a tree's shape, 'auto' plans with AUTO_PLAN_GAMMA (4), said in `warnings`.
  max_input_length: the inputs' width (T5 cuts longer inputs, a prompt
  longer than it is an error). max_decode_steps must be >= gamma + 1 (the
  block that measures verification cost has gamma + 1 tokens).
  block_width: the target's block width W in both loops (default
  `decoding.resolve_block_width`'s: gamma + 1 in float32 on CPU, else
  `decoding.DEFAULT_BLOCK_WIDTH`); greedy outputs are checked against
  target-only decoding at W, and the speedup is against the faster of
  target-only decoding at W and at width 1 (the BLOCK_WIDTH macro). A tree
  draft needs W >= its num_nodes (default: num_nodes on CPU float32).
  verification: how the speculative decoder keeps drafts
  (`core.verification.VERIFIERS`: 'token', or 'block' for Sun et al.'s block
  verification; the VERIFICATION macro). results.json records it; its
  `expected_tokens_per_iteration` stays the token-wise formula, a lower bound
  for 'block'. Tree drafts are verified by recursive rejection sampling
  over their tree, so they take 'token' only; results.json gains `tree`
  (shape, children law, width), `depth_histogram` and `per_rank_acceptance`.
  scheduling: 'slots' (default; the SCHEDULING macro): both decoders stream the
  inputs through batch_size slots (`sj.generate_many`: a row that ends gives its
  slot to the next input), in saved chunks of CHUNK_BATCHES stashes' worth of inputs
  (`sj.slots.stash_size(batch_size)`: max(batch_size, 8) each);
  'batches': fixed batches of batch_size, each decoded until its slowest row ends
  (what a mesh over several processes runs). results.json gains the tokens per
  second of each decoder and, with slots, their slot occupancy.
  """
  target: ModelSpec = gin.REQUIRED
  draft: Union[ModelSpec, DraftKind, TreeSpec, Draft] = gin.REQUIRED
  task: tasks.Task = gin.REQUIRED
  tokenizer: Optional[tasks.Tokenizer] = None
  vocabulary: Optional[str] = None
  chat_template: bool = False
  gamma: Union[int, str] = "auto"
  temperature: float = 0.0
  topk: int = 0
  topp: Optional[float] = None
  batch_size: int = 1
  max_input_length: int = 256
  max_decode_steps: int = 128
  seed: int = 0
  timing_repeats: int = 20
  block_width: Optional[int] = None
  verification: str = "token"
  scheduling: str = "slots"


SCHEDULINGS = ("slots", "batches")
# GAMMA='auto' (the default) lets `sj.generate_many` choose gamma per phase of inputs from
# what each choice measured at the batch size and the acceptance so far. Where it does not
# choose (fixed batches, a mesh, a tree's shape), and for the timed verification call and the block
# width, the launcher plans with this gamma.
AUTO_PLAN_GAMMA = 4
# Slots stream this many stashes' worth of inputs (max(batch_size, 8) each, started
# together) per saved chunk (`measure`): a resumed run restarts at the last chunk, the
# slots stay full inside one, and no stash is cut short but the last.
CHUNK_BATCHES = 4


@functools.lru_cache(maxsize=1)
def _random_model(config, dtype: str, seed: int):
  # Cached: consecutive experiments (Table 2 stand-in rows) reuse the target
  # instead of re-initialising it; random init is deterministic.
  return load_model(config, dtype=dtype, seed=seed)


def _shape_diffs(checkpoint_config, config) -> List[str]:
  """How a checkpoint's parameter shapes differ from `config`'s (the family's
  abstract params: every family, no allocation)."""
  family, expected = family_of(checkpoint_config), family_of(config)
  if family is not expected:
    return [f"family: checkpoint {family.name} vs config {expected.name}"]
  flat = lambda c: {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)  # noqa
                    for path, leaf in jax.tree_util.tree_leaves_with_path(
                        family.abstract_params(c))}
  got, want = flat(checkpoint_config), flat(config)
  return [f"{name}: checkpoint {got.get(name)} vs config {want.get(name)}"
          for name in sorted(set(got) | set(want)) if got.get(name) != want.get(name)]


def load_spec(spec: ModelSpec, role: str, partitioner: Optional[sharding.Partitioner] = None):
  """Loads or initialises the model `spec` describes (not perturb_target).

  With a partitioner, a checkpoint is read straight onto its mesh
  (`load_sharded_model`: each process reads only its devices' slices).
  """
  config = spec.resolved_config()
  if spec.checkpoint is None:
    logging.info("%s: random %s weights (seed %d)", role, spec.name, spec.seed)
    return _random_model(config, spec.dtype or _default_dtype(), spec.seed)
  logging.info("%s: loading %s", role, spec.checkpoint)
  model = (load_model(spec.checkpoint, dtype=spec.dtype) if partitioner is None else
           load_sharded_model(spec.checkpoint, partitioner, dtype=spec.dtype))
  if config is not None:
    diffs = _shape_diffs(model.config, config)
    if diffs:
      shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
      raise ValueError(f"{role} checkpoint {spec.checkpoint!r} does not match the configured "
                       f"{spec.name} shapes: {shown}")
  return model


def _default_dtype() -> str:
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _model_source(spec: ModelSpec, role: str) -> str:
  """How messages name a model: its checkpoint's config.json, or its config."""
  if spec.checkpoint is None:
    return f"{role} ({spec.name}, random weights)"
  config_json = os.path.join(spec.checkpoint, "config.json")
  return f"{role} checkpoint {config_json if os.path.isfile(config_json) else spec.checkpoint}"


DRAFT_VOCAB_FIX = (
    "the launcher feeds the draft the target's tokenizer, so a draft model must share the "
    "target's vocabulary (an embedding table at least as large): choose a draft trained "
    "with the target's tokenizer (--gin.DRAFT_CHECKPOINT), or a draft kind that needs no "
    "model (configs/drafts/prompt_lookup.gin)")


def _config_vocab_size(spec: ModelSpec) -> Optional[int]:
  """A checkpoint's config.json `vocab_size` (read before any weights load), or None."""
  path = spec.checkpoint and os.path.join(spec.checkpoint, "config.json")
  if not path or not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      size = json.load(f).get("vocab_size")
  except (OSError, ValueError, AttributeError):
    return None  # Loading says what is wrong with it.
  return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_vocab_sizes(exp: Experiment, spec: DraftSpec, tokenizer) -> None:
  """The tokenizer against both checkpoints' config.json, before any weights load."""
  inner = getattr(spec, "inner", spec)  # A tree's draft model.
  roles = [(exp.target, "target", _target_vocab_fix(exp))]
  if isinstance(inner, ModelSpec) and inner.perturb_target is None:
    roles.append((inner, "draft", DRAFT_VOCAB_FIX))
  for model_spec, role, fix in roles:
    size = _config_vocab_size(model_spec)
    if size is not None:
      text.check_vocab_size(tokenizer, types.SimpleNamespace(vocab_size=size),
                            _model_source(model_spec, role), fix)


def _target_vocab_fix(exp: Experiment) -> str:
  """What to change when the tokenizer emits ids the target lacks: the setting that
  chose the tokenizer."""
  if exp.tokenizer is not None:
    return "Experiment.tokenizer is not this checkpoint's tokenizer: unbind it or pass its own"
  if exp.vocabulary is not None:
    return (f"--gin.VOCABULARY ({exp.vocabulary!r}) is not this checkpoint's tokenizer: point "
            "it at the checkpoint's own, or leave it unset to read the checkpoint directory's")
  return ("the tokenizer was read from the target checkpoint's directory, which then holds "
          "another model's tokenizer file: put this model's there, or name it with "
          "--gin.VOCABULARY")


def batch_rows(num_rows: int, batch_size: int):
  """Yields (row indices [batch_size], number of real rows); the last batch repeats
  its final row."""
  for start in range(0, num_rows, batch_size):
    rows = np.arange(start, min(start + batch_size, num_rows))
    real = len(rows)
    yield np.concatenate([rows, np.repeat(rows[-1:], batch_size - real)]), real


@dataclasses.dataclass(frozen=True)
class HostLayout:
  """Per-host input on several processes: the rows of every global batch each feeds.

  Global batch k holds examples `batch_rows(count, batch_size)` (the last
  one padded with repeats of the final example), exactly as on one process;
  process p feeds its block `multihost.process_row_block(local_batch, p)` of
  each, so the decode (`generate(..., process_local=True)`) sees the same
  global batches, and the outputs equal the single-process run's.
  """
  batch_size: int
  processes: int

  @property
  def local_batch(self) -> int:
    return self.batch_size // self.processes

  def example_indices(self, count: int, process: Optional[int] = None) -> List[int]:
    """The example of each row `process` (default this one) feeds, batch by batch."""
    block = multihost.process_row_block(self.local_batch, process)
    return [int(i) for index, _ in batch_rows(count, self.batch_size) for i in index[block]]

  def gather(self, count: int, local_examples, local_rows):
    """Every process's examples and token rows -> (examples, rows) in file order."""
    texts = multihost.gather_texts([e.inputs for e in local_examples])
    token_rows = multihost.gather_ragged(local_rows)
    n = len(local_rows)
    examples, rows = [None] * count, [None] * count
    for process in range(self.processes):
      for j, i in enumerate(self.example_indices(count, process)):
        examples[i] = tasks.Example(texts[process * n + j])
        rows[i] = [int(t) for t in token_rows[process * n + j]]
    return examples, rows


def host_layout(partitioners, batch_size: int) -> Optional[HostLayout]:
  """Per-host input when a mesh spans several processes, else None (every
  process reads every row)."""
  if partitioners is None or jax.process_count() == 1 or not multihost.spans_processes(
      partitioners[0].replicated()):
    return None
  processes = jax.process_count()
  if batch_size % processes:
    raise ValueError(f"batch_size {batch_size} must be a multiple of the {processes} processes: "
                     f"under per-host input each feeds batch_size / {processes} rows of every "
                     "batch (set --gin.Experiment.batch_size)")
  return HostLayout(batch_size, processes)


def model_inputs(family, config, rows, width: int):
  """`family.text_inputs`, its errors naming the launcher's setting."""
  try:
    return family.text_inputs(config, rows, width)
  except ValueError as e:
    raise ValueError(f"{e}: MAX_INPUT_LENGTH is {width} (raise --gin.MAX_INPUT_LENGTH, "
                     "or shorten the input)") from None


# ---------------------------------------------------------------------------
# Measurements.


def distribution_check(base_stats: Dict[str, np.ndarray],
                       spec_stats: Dict[str, np.ndarray]) -> Dict[str, Any]:
  """Are speculative samples distributed like the baseline's (temperature > 0)?

  For every input the two decoders drew one sample each with independent
  keys; under exactness (Theorem 3.1) the pair is exchangeable, so each
  per-input difference of a statistic is positive or negative with
  probability 1/2. An exact sign test per statistic (output length; mean
  target log-probability), Bonferroni-corrected, fails with probability at
  most DISTRIBUTION_CHECK_FALSE_ALARM when the distributions are equal.
  It detects shifts in these statistics, not every possible difference.
  """
  threshold = DISTRIBUTION_CHECK_FALSE_ALARM / len(base_stats)
  p_values = {name: sign_test_p_value(spec_stats[name] - base_stats[name])
              for name in base_stats}
  return dict(test="paired sign tests (exact, two-sided), Bonferroni",
              false_alarm_rate=DISTRIBUTION_CHECK_FALSE_ALARM, p_values=p_values,
              baseline_means={k: float(np.mean(v)) for k, v in base_stats.items()},
              speculative_means={k: float(np.mean(v)) for k, v in spec_stats.items()},
              passed=bool(min(p_values.values()) >= threshold))


# ---------------------------------------------------------------------------
# The experiment.


def make_partitioners(mesh_shape: Optional[str]):
  """--mesh_shape, else a configs/sharding/*.gin binding, else None (one device)."""
  if mesh_shape is None:
    try:
      gin.query_parameter("specdec_jax.sharding.make_partitioners.mesh_shape")
    except ValueError:
      return None
    return sharding.make_partitioners()
  return sharding.make_partitioners(mesh_shape)


def _stack_stats(parts: Sequence[SpeculativeStats]) -> SpeculativeStats:
  # Trees' optional counters are None for chains; gamma is the loop's depth.
  fields = [f.name for f in dataclasses.fields(SpeculativeStats) if f.name != "gamma"]
  return SpeculativeStats(gamma=parts[0].gamma, **{
      f: None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])
      for f in fields})


def _take_stats(stats: SpeculativeStats, real: int) -> SpeculativeStats:
  return dataclasses.replace(stats, **{
      f.name: np.asarray(getattr(stats, f.name))[:real] for f in dataclasses.fields(stats)
      if f.name != "gamma" and getattr(stats, f.name) is not None})


# results.md's line for a non-default verification rule (chains only).
VERIFICATION_NOTES = {
    "block": "\nVerification: block (Sun et al., arXiv 2403.10444); "
             "expected_tokens_per_iteration is the token-wise formula, a lower bound.\n"}


def _fmt_or_na(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.2f}"


# `specdec_jax.settings`' words for generate's arguments -> the launcher's gin macros.
_LAUNCHER_WORDS = (
    # The launcher runs both decoders at the one width: no "and the same ... to the
    # target-only decoding" to say.
    (re.compile(r"pass block_width=(\d+) \(or more\).*", re.S),
     r"pass --gin.BLOCK_WIDTH=\1 (or more)"),
    (re.compile(r"\bblock_width="), "BLOCK_WIDTH="),
    (re.compile(r"\bgamma="), "GAMMA="),
    (re.compile(r"\bverification="), "VERIFICATION="),
    (re.compile(r"\bdrop verification\b"), "drop VERIFICATION"),
)


@contextlib.contextmanager
def launcher_words():
  """Re-raises a ValueError of `specdec_jax.settings` naming the gin macro to set
  (--gin.BLOCK_WIDTH=11) where it names generate's argument (block_width=11)."""
  try:
    yield
  except ValueError as e:
    message = str(e)
    for pattern, words in _LAUNCHER_WORDS:
      message = pattern.sub(words, message)
    raise ValueError(message) from None


# ---------------------------------------------------------------------------
# The experiment: plan, build, measure, report.


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `plan` fixed before any weights load."""
  spec: DraftSpec
  tokenizer: Any
  examples: List[tasks.Example]
  rows: List[List[int]]  # every example's token ids, in file order
  local_rows: Optional[List[List[int]]]  # this process's own, under per-host input
  partitioners: Optional[Tuple[sharding.Partitioner, sharding.Partitioner]]
  hosts: Optional[HostLayout]
  warnings: Tuple[str, ...] = ()  # results.json's `warnings`: what may cost the speedup


@dataclasses.dataclass(frozen=True)
class Setup:
  """What `build` made: the models on their devices and the decode's validated settings."""
  target: Any
  draft: Draft
  cost_model: Any  # the draft's model, whose step gives c (None: c is taken as 0)
  inputs: np.ndarray  # every example's row [examples, C]
  prompt_lengths: Optional[np.ndarray]
  local_inputs: Optional[Tuple[np.ndarray, Optional[np.ndarray]]]  # this process's, per host
  settings: settings_lib.DecodeSettings  # the block width W among them
  gamma: int  # results.json's and the theory's (a tree: its depth)
  verify_tokens: int  # tokens of the timed verification call


@dataclasses.dataclass(frozen=True)
class Measured:
  """What `measure` decoded (padding rows dropped) and timed."""
  sequences: Dict[str, np.ndarray]  # 'baseline', 'speculative'
  lengths: Dict[str, np.ndarray]
  stats: SpeculativeStats
  walltime: Dict[str, float]  # 'baseline' (at W), 'baseline_width_1', 'speculative'
  target_step: float  # seconds of one one-token target call
  verify_cost: float  # the verification call / one one-token call
  draft_step: Optional[float]  # seconds of one one-token call of the cost model
  occupancy: Optional[Dict[str, float]] = None  # slot occupancy per decoder (slots only)
  phases: Optional[List[Dict[str, Any]]] = None  # the speculative decoder's gamma per phase


def run_experiment(exp: Experiment, output_dir: str, num_examples: Optional[int] = None,
                   mesh_shape: Optional[str] = None, wait_for_output_dir: bool = False
                   ) -> Dict[str, Any]:
  """Runs `exp`, writes results.json and results.md into output_dir, returns the results.

  One run at a time in output_dir (`experiments.output_lock`): another run holding it
  is a ValueError naming it before anything is read, or, with `wait_for_output_dir`,
  waited for.

  Four stages: `plan` (every check that needs no weights; the inputs),
  `build` (the models and the draft, the settings validated, then placed),
  `measure` (both decoders, the step times) and `report` (the results). The
  files are written once every measurement succeeded, by one process.

  Each finished batch is kept in output_dir/progress (`experiments.run_progress`):
  the same experiment run again resumes where it stopped, another one in the
  same directory is refused. Ctrl-C raises `Interrupted` (how many inputs
  are done).
  """
  lock = (OutputLock(output_dir, wait=wait_for_output_dir) if multihost.is_output_process()
          else contextlib.nullcontext())
  with lock:
    planned = plan(exp, num_examples, mesh_shape)
    progress = open_progress(exp, planned, output_dir, num_examples, mesh_shape)
    setup = build(exp, planned)
    measured = measure(exp, planned, setup, progress)
    result = report(exp, planned, setup, measured)
    _write_results(exp, planned, output_dir, result)
  logging.info("speedup %.2fx, alpha %.3f, c %s, identical %s", result["speedup"],
               result["alpha"], result["c"], result.get("identical_outputs", "n/a (sampled)"))
  return result


def _write_results(exp: Experiment, planned: Plan, output_dir: str,
                   result: Dict[str, Any]) -> None:
  """results.json and results.md, atomically, by one process."""
  if multihost.is_output_process():  # Multi-host: one writer.
    results_lib.write_json_atomic(os.path.join(output_dir, "results.json"), result)
    results_lib.write_text_atomic(os.path.join(output_dir, "results.md"),
                                  results_lib.TABLE2_HEADER + "\n" + result["markdown_row"] + "\n"
                                  + "\n" + results_lib.TABLE2_LEGEND + "\n"
                                  + planned.spec.report_markdown(result)
                                  + VERIFICATION_NOTES.get(exp.verification, ""))


class Interrupted(Exception):
  """Ctrl-C (SIGINT) during the decoding: how far it got, in one line."""

  def __init__(self, done: int, total: int, resumable: bool):
    self.done, self.total = done, total
    super().__init__(f"stopped after {done} of {total} inputs; " + (
        "rerun the same command to resume" if resumable else "nothing was kept"))


def open_progress(exp: Experiment, planned: Plan, output_dir: str,
                  num_examples: Optional[int], mesh_shape: Optional[str]
                  ) -> Optional[RunProgress]:
  """The output directory's record of finished batches (`experiments.run_progress`),
  keyed by everything that decides the outputs (`experiments.run_identity`): the gin
  configuration, the experiment's settings, the tokenized inputs and the contents of
  every file the settings name (checkpoints, vocabulary). None on several processes
  (no resume there)."""
  if jax.process_count() > 1:
    return None
  settings = describe(exp)
  identity = dict(gin_config=gin.config_str(), experiment=settings,
                  inputs_sha256=rows_digest(planned.rows), num_examples=len(planned.rows),
                  mesh_shape=mesh_shape, backend=jax.default_backend(),
                  files=file_fingerprints(settings, output_dir))
  return RunProgress.open(output_dir, identity)


def finished_results(exp: Experiment, output_dir: str, num_examples: Optional[int] = None,
                     mesh_shape: Optional[str] = None) -> Optional[Dict[str, Any]]:
  """output_dir's results.json when this very experiment wrote it (its progress record
  holds this run's identity: settings, inputs, the checkpoints' contents); None when
  there is none; a ValueError naming what differs when another configuration (or a
  checkpoint since rewritten) wrote it. Loads no weights: a driver of many runs
  (`experiments.reproduce_table2`) skips the finished ones with it."""
  result = results_lib.read_json(os.path.join(output_dir, "results.json"))
  if result is not None:
    open_progress(exp, plan(exp, num_examples, mesh_shape), output_dir, num_examples,
                  mesh_shape)
  return result


def plan(exp: Experiment, num_examples: Optional[int] = None,
         mesh_shape: Optional[str] = None) -> Plan:
  """Everything that can fail cheaply fails before any model is loaded; then the task's
  inputs are read and tokenized (each process its own rows when the mesh spans several)."""
  launch_checks.raise_if_any(experiment_problems(exp))
  exp.task.validate()
  exp.target.validate("target")
  spec = draft_spec(exp.draft)
  spec.check()
  tokenizer = exp.tokenizer or text.checkpoint_tokenizer(exp.target.checkpoint, exp.vocabulary)
  _check_vocab_sizes(exp, spec, tokenizer)
  partitioners = make_partitioners(mesh_shape)
  hosts = host_layout(partitioners, exp.batch_size)
  read = functools.partial(_read_rows, exp, tokenizer, num_examples)
  if hosts is None:
    (examples, rows), local_rows = read(), None
  else:
    # Per-host input: every process parses and tokenizes only the rows it feeds
    # (its block of every global batch), then the rows and texts are gathered
    # for the drafts that fit on the inputs and for process 0's results.
    count = exp.task.count(num_examples)
    mine = hosts.example_indices(count)
    local_examples, local_rows = multihost.on_every_process(
        lambda: read(mine), "reading this process's inputs")
    examples, rows = hosts.gather(count, local_examples, local_rows)
  logging.info("%d examples from task %s", len(examples), exp.task.name)
  inner = getattr(spec, "inner", spec)  # A tree's draft model.
  warning = (inner.warn_on_other_tokenizer(tokenizer)
             if isinstance(inner, ModelSpec) and inner.perturb_target is None else None)
  return Plan(spec, tokenizer, examples, rows, local_rows, partitioners, hosts,
              tuple(w for w in [warning] if w))


def _read_rows(exp: Experiment, tokenizer, num_examples: Optional[int], indices=None):
  """(examples, token rows) of the task (those at `indices`)."""
  examples = exp.task.load(num_examples, indices)
  rows = text.encode_texts(tokenizer, [e.inputs for e in examples], exp.chat_template)
  config = exp.target.resolved_config()
  if config is not None:  # Named shapes: bad text fails before the weights load.
    text.check_vocab_size(tokenizer, config, _model_source(exp.target, "target"),
                          _target_vocab_fix(exp))
    model_inputs(family_of(config), config, rows, exp.max_input_length)
  return examples, rows


def build(exp: Experiment, planned: Plan) -> Setup:
  """Loads the target and builds the draft on the host, validates the decode's settings
  through `specdec_jax.settings` (in the launcher's words), then places both on the mesh."""
  target_part, draft_part = planned.partitioners or (None, None)
  target = load_spec(exp.target, "target", target_part)
  family, config = family_of(target), target.config
  text.check_vocab_size(planned.tokenizer, config, _model_source(exp.target, "target"),
                        _target_vocab_fix(exp))
  inputs, prompt_lengths = model_inputs(family, config, planned.rows, exp.max_input_length)
  # The prompt and the generated tokens must fit the cache the family builds
  # (learned positions): a clear error now, not at the first compile.
  try:
    family.check_inputs(config, inputs, prompt_lengths, exp.max_decode_steps)
  except ValueError as e:
    steps = setting_name("max_decode_steps")
    raise ValueError(f"{e} ({setting_name('max_input_length')} is {exp.max_input_length}, "
                     f"{steps} is {exp.max_decode_steps}: lower --gin.{steps} or shorten the "
                     "inputs)") from None
  spec = planned.spec
  draft = spec.build(target, planned.rows, planned.tokenizer, draft_part)
  with launcher_words():
    draft = settings_lib.check_draft(config, draft, inputs, prompt_lengths,
                                     exp.max_decode_steps, row_keys=_slots(exp, planned))
    settings = settings_lib.plan_settings(
        config, draft, max_decode_steps=exp.max_decode_steps, temperature=exp.temperature,
        topk=exp.topk, topp=exp.topp, gamma=planned_gamma(exp, draft),
        verification=exp.verification, block_width=exp.block_width)
  verify_tokens, needed = spec.verify_block(planned_gamma(exp, draft), settings.block_width)
  if exp.max_decode_steps < verify_tokens:  # The timed verification call must fit.
    raise ValueError(f"max_decode_steps ({exp.max_decode_steps}) must be >= {needed}")
  if planned.partitioners is not None:
    # Params go onto the mesh leaf by leaf; the compiled decode follows their
    # shardings (GSPMD), the batch is split over `data`.
    target = shard_model(target, target_part)
    draft = spec.place(draft, target, draft_part)
  local_inputs = None if planned.hosts is None else model_inputs(
      family, config, planned.local_rows, exp.max_input_length)
  return Setup(target, draft, spec.cost_model(draft), inputs, prompt_lengths, local_inputs,
               settings, spec.theory_gamma(draft, planned_gamma(exp, draft)), verify_tokens)


def measure(exp: Experiment, planned: Plan, setup: Setup,
            progress: Optional[RunProgress] = None) -> Measured:
  """Both decoders on every batch, after one compile warm-up each, batches alternating
  between them so that machine drift hits both alike; then the step times.

  With `progress`, the batches it holds are read back instead of decoded, and each
  newly finished batch is saved at once; Ctrl-C raises `Interrupted`.
  """
  batches = list(batch_rows(len(planned.examples), _chunk(exp, planned)))
  done = progress.batches() if progress is not None else {}
  if done:  # Said on stderr too: a rerun meant to measure again reads the old batches.
    note = (f"resuming: {len(done)} of {len(batches)} batches already decoded in "
            f"{progress.directory} (delete it to decode everything afresh)")
    logging.info("%s", note)
    print(note, file=sys.stderr)
  try:
    records = _decode_batches(exp, planned, setup, batches, done, progress)
    times = progress.step_times() if progress is not None else None
    if times is None:
      times = _step_times(exp, setup, batches[0][0])
      if progress is not None:
        progress.save_step_times(times)
  except KeyboardInterrupt:
    finished = progress.batches() if progress is not None else {}
    raise Interrupted(sum(r.rows for r in finished.values()), len(planned.examples),
                      progress is not None) from None
  walltime = {k: sum(r.seconds[k] for r in records) for k in records[0].seconds}
  sequences = {k: np.concatenate([r.sequences[k] for r in records]) for k in records[0].sequences}
  lengths = {k: np.concatenate([r.lengths[k] for r in records]) for k in records[0].lengths}
  phases = [p for r in records for p in (r.phases or [])] or None
  occupancy = None
  if all(r.occupancy is not None for r in records):
    rows = np.asarray([r.rows for r in records], np.float64)
    occupancy = {k: float(np.dot(rows, [r.occupancy[k] for r in records]) / rows.sum())
                 for k in records[0].occupancy}
  return Measured(sequences, lengths, _stack_stats([r.stats for r in records]), walltime,
                  *times, occupancy=occupancy, phases=phases)


def _slots(exp: Experiment, planned: Plan) -> bool:
  """Whether the decoders stream through slots (not under a mesh: `generate_many` runs on
  one device)."""
  return exp.scheduling == "slots" and planned.partitioners is None and planned.hosts is None


def _chunk(exp: Experiment, planned: Plan) -> int:
  """Inputs per saved record: a batch, or CHUNK_BATCHES stashes' worth of slots."""
  if _slots(exp, planned):
    return CHUNK_BATCHES * stash_size(exp.batch_size)
  return exp.batch_size


def _decode_batches(exp: Experiment, planned: Plan, setup: Setup, batches,
                    done: Dict[int, BatchRecord], progress: Optional[RunProgress]
                    ) -> List[BatchRecord]:
  """Every batch's record: those in `done` as they are, the others decoded (and saved)."""
  width = setup.settings.block_width
  decode = _decoder(exp, planned, setup, batches)
  rng = jax.random.PRNGKey(exp.seed)
  if len(done) < len(batches):
    logging.info("compiling (warm-up on the first batch)")
    decode(False, width, 0, rng)
    if width != 1:
      decode(False, 1, 0, rng)
    decode(True, width, 0, rng)
  records = []
  bar = tqdm.tqdm(batches, desc="inputs" if _slots(exp, planned) else "batches",
                  unit="chunk" if _slots(exp, planned) else "batch", initial=0)
  for batch_index, (_, real) in enumerate(bar):
    if batch_index in done:
      records.append(done[batch_index])
      _show_progress(bar, records)
      continue
    # Independent keys for the two decoders: the distribution check needs
    # independent samples (greedy ignores them).
    base_key = jax.random.fold_in(rng, 2 * batch_index)
    spec_key = jax.random.fold_in(rng, 2 * batch_index + 1)
    base_out, base_len, _, base_time, base_occupancy, _ = decode(False, width, batch_index,
                                                                 base_key)
    width_1_time = decode(False, 1, batch_index, base_key)[3] if width != 1 else 0.0
    # gamma='auto' starts each chunk at the acceptance of the chunks before it, and with
    # what the chunk before it measured (this process's; none after a resume).
    prior = _stack_stats([r.stats for r in records]).alpha if records else None
    spec_out, spec_len, stats, spec_time, spec_occupancy, phases = decode(
        True, width, batch_index, spec_key, prior_alpha=prior)
    record = BatchRecord(
        sequences={"baseline": base_out[:real], "speculative": spec_out[:real]},
        lengths={"baseline": base_len[:real], "speculative": spec_len[:real]},
        stats=_take_stats(stats, real),
        seconds={"baseline": base_time, "baseline_width_1": width_1_time,
                 "speculative": spec_time},
        occupancy=None if base_occupancy is None else {"baseline": base_occupancy,
                                                       "speculative": spec_occupancy},
        phases=phases)
    if progress is not None:
      progress.save_batch(batch_index, record)
    records.append(record)
    _show_progress(bar, records)
  return records


def _show_progress(bar, records: List[BatchRecord]) -> None:
  """Inputs done, tokens/s and alpha so far, on the bar: set after each batch, so that
  its last state counts every input."""
  tokens = sum(int(r.lengths["speculative"].sum()) for r in records)
  seconds = sum(r.seconds["speculative"] for r in records)
  stats = _stack_stats([r.stats for r in records])
  bar.set_postfix(inputs=sum(len(r.lengths["speculative"]) for r in records),
                  tok_s=f"{tokens / max(seconds, 1e-9):.0f}", alpha=f"{stats.alpha:.2f}")


def _decoder(exp: Experiment, planned: Plan, setup: Setup, batches):
  """decode(use_draft, block_width, batch_index, key) -> (sequences, lengths, stats,
  seconds, slot occupancy or None) of one batch (with slots: one chunk), the whole batch's outputs on every process (process 0 writes
  them all).

  Two exact target-only decoders: at the speculative loop's width W (the
  reference its greedy outputs must equal bit for bit) and at width 1 (often
  faster on CPU). The speedup is against the faster of the two.
  """
  target_part, draft_part = planned.partitioners or (None, None)
  hosts = planned.hosts

  learned = {}  # gamma='auto': the last chunk's `out.slots.measured`, the next one's prior
  # gamma='auto''s plan search of the first call with the draft: `_decode_batches`' warm-up,
  # whose phases are dropped, so its seconds (the cold compiles) go with the next call's.
  warm_up = {}

  def decode(use_draft: bool, block_width: int, batch_index: int, key,
             prior_alpha: Optional[float] = None):
    start = time.perf_counter()
    if _slots(exp, planned):  # the chunk's real rows through batch_size slots
      index, real = batches[batch_index]
      index = index[:real]
      lengths = setup.prompt_lengths
      out = generate_many(setup.target, setup.inputs[index],
                          None if lengths is None else lengths[index],
                          batch_size=exp.batch_size, max_decode_steps=exp.max_decode_steps,
                          temperature=exp.temperature, topk=exp.topk, topp=exp.topp, rng=key,
                          draft=setup.draft if use_draft else None, gamma=exp.gamma,
                          block_width=block_width, prior_alpha=prior_alpha if use_draft and
                          exp.gamma == "auto" else None,
                          prior=learned.get(block_width) if use_draft and exp.gamma == "auto"
                          else None,
                          stream_left=len(setup.inputs) - int(index[0])
                          if use_draft and exp.gamma == "auto" else None,
                          verification=exp.verification if use_draft else "token")
      if use_draft and out.slots.measured is not None:
        learned[block_width] = out.slots.measured
      sequences = np.asarray(jax.block_until_ready(out.sequences))
      pad = len(batches[batch_index][0]) - real  # the record's rows, as batches have them
      sequences = np.concatenate([sequences, np.repeat(sequences[-1:], pad, 0)])
      lens = np.asarray(out.lengths)
      lens = np.concatenate([lens, np.repeat(lens[-1:], pad, 0)])
      stats = None if out.stats is None else _pad_stats(out.stats, pad)
      phases = [dict(p, inputs=[int(index[0]) + i for i in p["inputs"]])
                for p in out.slots.phases] if use_draft else None
      if use_draft and out.slots.planning is not None:
        planning = dict(out.slots.planning, warm_up_seconds=0.0)
        if not warm_up:  # the warm-up: its own phases are dropped
          warm_up.update(seconds=planning["seconds"], untimed=planning["untimed"])
        elif warm_up["seconds"] is not None:  # carried once; its reasons first (they decided)
          planning.update(warm_up_seconds=warm_up["seconds"],
                          untimed={**planning["untimed"], **warm_up["untimed"]})
          warm_up["seconds"] = None
        phases[0]["planning"] = planning
      return (sequences, lens, stats, time.perf_counter() - start, out.slots.occupancy,
              phases)
    if hosts is None:
      index = batches[batch_index][0]
      inputs, lengths = setup.inputs, setup.prompt_lengths
    else:  # This process's rows of the batch: its own tokenized lines.
      index = slice(batch_index * hosts.local_batch, (batch_index + 1) * hosts.local_batch)
      inputs, lengths = setup.local_inputs
    out = generate(setup.target, inputs[index], None if lengths is None else lengths[index],
                   max_decode_steps=exp.max_decode_steps, temperature=exp.temperature,
                   topk=exp.topk, topp=exp.topp, rng=key,
                   draft=setup.draft if use_draft else None,
                   gamma=planned_gamma(exp, setup.draft),
                   block_width=block_width,
                   verification=exp.verification if use_draft else "token",
                   partitioner=target_part, draft_partitioner=draft_part,
                   process_local=hosts is not None, global_outputs=True)
    sequences = np.asarray(jax.block_until_ready(out.sequences))
    return (sequences, np.asarray(out.lengths), out.stats, time.perf_counter() - start, None,
            None)

  return decode


def _pad_stats(stats: SpeculativeStats, pad: int) -> SpeculativeStats:
  """stats with its last row repeated `pad` times (rows as a padded batch has them)."""
  if not pad:
    return stats
  fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
  return SpeculativeStats(**{k: (v if k == "gamma" or v is None else
                                 np.concatenate([v, np.repeat(v[-1:], pad, 0)]))
                             for k, v in fields.items()})


def _step_times(exp: Experiment, setup: Setup, rows) -> Tuple[float, float, Optional[float]]:
  """(seconds of a one-token target call, the verification call relative to it, seconds
  of a one-token call of the draft's model or None), on the inputs' `rows`."""
  logging.info("timing decode steps (c and the verification cost)")
  probe = setup.inputs[rows]
  probe_lengths = None if setup.prompt_lengths is None else setup.prompt_lengths[rows]

  def step(model, k):
    return block_step_seconds(model, probe, k, exp.max_decode_steps, exp.timing_repeats,
                              lengths=probe_lengths)

  target_step = step(setup.target, 1)
  # One target call on gamma + 1 tokens (a tree: its W slots), relative to
  # one token (1 if verification were free, as Theorem 3.8 assumes).
  verify_cost = step(setup.target, setup.verify_tokens) / target_step
  draft_step = None if setup.cost_model is None else step(setup.cost_model, 1)
  return target_step, verify_cost, draft_step


def report(exp: Experiment, planned: Plan, setup: Setup, measured: Measured) -> Dict[str, Any]:
  """results.json's fields: the Table 2 figures and the theory's predictions, the draft's
  own fields, the exactness check, and every completion."""
  config, settings, stats = setup.target.config, setup.settings, measured.stats
  width, alpha, walltime = settings.block_width, stats.alpha, measured.walltime
  gamma = _theory_gamma(exp, setup, measured)
  auto = exp.gamma == "auto" and bool(measured.phases)
  auto_planning = results_lib.auto_planning(measured.phases) if auto else None
  if auto_planning is not None:  # the plan search's cost, said beside the speedup
    logging.info("GAMMA=%s; its plan search took %.1f s (compiles and timings of plans %s, "
                 "over %d calls)", results_lib.auto_gamma_label(measured.phases),
                 auto_planning["seconds"], auto_planning["timed"], auto_planning["calls"])
  c = None if measured.draft_step is None else measured.draft_step / measured.target_step
  baseline_width, baseline_time = width, walltime["baseline"]
  if width != 1 and walltime["baseline_width_1"] < baseline_time:
    baseline_width, baseline_time = 1, walltime["baseline_width_1"]
  speedup = baseline_time / walltime["speculative"]
  cost = setup.cost_model
  auto_warnings = _auto_gamma_warnings(exp, planned, setup, measured)
  for warning in auto_warnings:  # on the console too, not only in results.json
    logging.warning("%s", warning)
  result = dict(
      task=exp.task.name, target=exp.target.name, draft=planned.spec.name,
      target_checkpoint=_checkpoint_path(exp.target),
      draft_checkpoint=_checkpoint_path(planned.spec),
      family=family_of(config).name, target_params=config.num_params,
      draft_params=None if cost is None else cost.config.num_params,
      tokenizer=getattr(planned.tokenizer, "source", type(planned.tokenizer).__name__),
      chat_template=exp.chat_template,
      num_examples=len(planned.examples), batch_size=exp.batch_size,
      max_input_length=exp.max_input_length, max_decode_steps=exp.max_decode_steps,
      backend=jax.default_backend(), processes=jax.process_count(),
      per_host_input=planned.hosts is not None, gamma=gamma, temperature=exp.temperature,
      topk=exp.topk, topp=exp.topp, verification=exp.verification,
      walltime_baseline_s=baseline_time, walltime_speculative_s=walltime["speculative"],
      walltime_target_only_s={str(width): walltime["baseline"],
                              **({"1": walltime["baseline_width_1"]} if width != 1 else {})},
      speedup=speedup, speedup_baseline_block_width=baseline_width, block_width=width,
      identical_outputs_checked_against=f"target-only decoding at block width {width}",
      tokens_baseline=int(measured.lengths["baseline"].sum()),
      tokens_speculative=int(measured.lengths["speculative"].sum()),
      scheduling="slots" if _slots(exp, planned) else "batches",
      tokens_per_s_baseline=float(measured.lengths["baseline"].sum()) / max(baseline_time,
                                                                               1e-9),
      tokens_per_s_speculative=float(measured.lengths["speculative"].sum()) / max(
          walltime["speculative"], 1e-9),
      slot_occupancy=measured.occupancy,
      gamma_setting=exp.gamma,
      gamma_phases=None if measured.phases is None else [
          {k: v for k, v in p.items() if k not in _PHASE_COSTS + ("planning",)}
          for p in measured.phases],
      gamma_auto_costs=None if not measured.phases or exp.gamma != "auto" else {
          k: v for k, v in measured.phases[-1].items() if k in _PHASE_COSTS},
      gamma_auto_planning=auto_planning,
      acceptance_rate=stats.acceptance_rate, alpha=alpha,
      mean_tokens_per_iteration=stats.mean_tokens_per_iteration,
      expected_tokens_per_iteration=theory.expected_tokens_per_iteration(alpha, gamma),
      per_position_acceptance=stats.per_position_acceptance.tolist(),
      target_step_ms=1e3 * measured.target_step,
      draft_step_ms=None if measured.draft_step is None else 1e3 * measured.draft_step,
      c=c, c_note=None if c is not None else "draft is not a model: its cost is taken as 0",
      target_verify_cost=measured.verify_cost,
      predicted_speedup=theory.walltime_improvement(alpha, gamma, c or 0.0),
      predicted_speedup_measured_verify_cost=theory.predicted_speedup_with_verify_cost(
          alpha, gamma, c or 0.0, measured.verify_cost),
      operative_gin_config=gin.operative_config_str(),
      warnings=list(planned.warnings) + auto_warnings)
  result.update(planned.spec.report(setup.draft, stats, width, exp.temperature, c,
                                    measured.verify_cost))
  result.update(_exactness(exp, setup, measured))
  result.update(_completions(planned, setup, measured))
  # results.md's "predicted" column: Theorem 3.8 with the measured costs (c and the
  # verification call's cost relative to one token), not free verification.
  result["markdown_row"] = results_lib.table2_row(
      result["task"], result["draft"], exp.temperature,
      results_lib.auto_gamma_label(measured.phases) if auto else gamma, alpha, speedup,
      result["predicted_speedup_measured_verify_cost"], c)
  return result


# A phase's measurements (the same in every phase of a call; the last call's hold every
# plan timed): results.json keeps them once, as `gamma_auto_costs`.
_PHASE_COSTS = ("iteration_ms", "refill_ms")


def _auto_gamma_warnings(exp: Experiment, planned: Plan, setup: Setup,
                         measured: Measured) -> List[str]:
  """GAMMA='auto' where nothing chooses, or where it never ran the draft: said, with what
  ran."""
  if exp.gamma != "auto":
    return []
  if measured.phases and not any(p["gamma"] for p in measured.phases):
    planning = results_lib.auto_planning(measured.phases) or {}
    untimed = "; ".join(f"gamma {g} {why}" for g, why in planning.get("untimed", {}).items())
    why = (f"plans not worth compiling and timing: {untimed}" if untimed and
           planning.get("timed") == [0] else
           "speculation was predicted or measured slower at this batch size")
    return [f"GAMMA='auto' ran target-only throughout ({why}), so the draft's statistics are "
            "empty: set --gin.GAMMA to an int to measure the draft"]
  if isinstance(setup.draft, (TreeDraft, DynamicTreeDraft)):
    return []
  if not _slots(exp, planned):
    return [f"GAMMA='auto' chooses gamma between phases of slot decoding; fixed batches "
            f"(SCHEDULING='batches' or a mesh) drafted gamma={setup.gamma} throughout: set "
            "--gin.GAMMA to an int to choose it"]
  return []


def _theory_gamma(exp: Experiment, setup: Setup, measured: Measured) -> int:
  """results.json's gamma (the theory's): the setup's, or under gamma='auto' with slots
  the speculating gamma that decoded the most inputs (the setup's if none speculated)."""
  if exp.gamma != "auto" or not measured.phases or isinstance(setup.draft, (TreeDraft, DynamicTreeDraft)):
    return setup.gamma
  inputs = collections.Counter()
  for phase in measured.phases:
    if phase["gamma"]:
      inputs[phase["gamma"]] += phase["inputs"][1] - phase["inputs"][0]
  return inputs.most_common(1)[0][0] if inputs else setup.gamma


def _checkpoint_path(spec) -> Optional[str]:
  """The checkpoint a spec reads, as an absolute path (None: random weights, or a draft
  that is not a model)."""
  inner = getattr(spec, "inner", spec)  # A tree's model.
  checkpoint = getattr(inner, "checkpoint", None) or getattr(inner, "path", None)
  return os.path.abspath(checkpoint) if isinstance(checkpoint, str) else None


def _exactness(exp: Experiment, setup: Setup, measured: Measured) -> Dict[str, Any]:
  """Greedy: whether every output equals target-only decoding's. Sampled: outputs differ
  by design, and `distribution_check` compares the two decoders' samples."""
  sequences, lengths = measured.sequences, measured.lengths
  identical_rows = np.all(sequences["baseline"] == sequences["speculative"], axis=1) & (
      lengths["baseline"] == lengths["speculative"])
  if setup.settings.sampling.greedy:
    out = dict(identical_fraction=float(identical_rows.mean()),
               identical_outputs=bool(identical_rows.all()))
    if not out["identical_outputs"]:
      logging.error("greedy outputs differ on %d of %d inputs", int((~identical_rows).sum()),
                    len(identical_rows))
    return out
  # Sampled: the two decoders draw with independent keys, so their outputs differ by
  # design and identity means nothing; distribution_check is the exactness test.
  out = {}
  per_row = {name: dict(length=lengths[name].astype(np.float64),
                        mean_log_prob=mean_log_probs(setup.target, setup.inputs,
                                                     setup.prompt_lengths, sequences[name],
                                                     lengths[name], exp.max_decode_steps,
                                                     exp.temperature, exp.topk, exp.topp))
             for name in sequences}
  out["distribution_check"] = distribution_check(per_row["baseline"], per_row["speculative"])
  return out


def _completions(planned: Plan, setup: Setup, measured: Measured) -> Dict[str, Any]:
  """Every input with both decoders' texts, and the first three as samples."""
  lengths = measured.lengths
  texts = {name: text.decode_rows(planned.tokenizer, sequences, lengths[name],
                                  setup.settings.eos_id)
           for name, sequences in measured.sequences.items()}
  completions = [
      dict(input=e.inputs, input_tokens=len(r), baseline=b, speculative=s,
           baseline_tokens=int(bl), speculative_tokens=int(sl))
      for e, r, b, s, bl, sl in zip(planned.examples, planned.rows, texts["baseline"],
                                    texts["speculative"], lengths["baseline"],
                                    lengths["speculative"])]
  samples = [dict(input=c["input"], baseline=c["baseline"], speculative=c["speculative"])
             for c in completions[:3]]
  return dict(completions=completions, samples=samples)


# ---------------------------------------------------------------------------
# Command line.

# Module-level flags (absl); experiments.reproduce_table2 reuses OUTPUT_DIR,
# NUM_EXAMPLES and the gin flags (experiments/gin_flags.py).
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/results.md go.")
NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "Use only the first N examples.")
MESH_SHAPE = flags.DEFINE_string(
    "mesh_shape", None, "Shard across devices on a 'data,model' mesh, e.g. '2,4' or '1,-1' "
    "(target: T5X rules, draft: replicated; see configs/sharding/*.gin). Default: one device.")
MULTIHOST = flags.DEFINE_bool(
    "multihost", False, "Call jax.distributed.initialize first (TPU pods and SLURM are "
    "auto-detected); only process 0 writes results.")
COORDINATOR_ADDRESS = flags.DEFINE_string("coordinator_address", None,
                                          "host:port of process 0 (multihost, if not detected).")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes (multihost, if not detected).")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id (multihost, if not detected).")
PAIR = flags.DEFINE_string(
    "pair", None, "A named pair: configs/pairs/NAME.gin, read before the --gin_file files "
    "(e.g. llama_3_1_8b__llama_3_2_1b, or local with TARGET_CHECKPOINT / DRAFT_CHECKPOINT); "
    "experiments.evaluate also takes demo_t5 and demo_decoder_only, the shipped demo pairs.")
WAIT_FOR_OUTPUT_DIR = flags.DEFINE_bool(
    "wait_for_output_dir", False,
    "When another run is writing into --output_dir, wait for it to finish (default: refuse).")
PROMPT = flags.DEFINE_string(
    "prompt", None, "One input text instead of a task: its completion goes to stdout and "
    "the results. Not with an input file or a task gin file.")


def known_pairs() -> List[str]:
  return sorted(os.path.basename(p)[:-len(".gin")]
                for p in glob.glob(os.path.join(PAIRS_DIR, "*.gin")))


def pair_gin_files(pair: Optional[str], gin_files: Sequence[str]) -> List[str]:
  """--pair's file first, then --gin_file's. An unknown pair, by --pair or as a
  configs/pairs/ path, is a ValueError listing the known ones."""
  files = list(gin_files)
  if pair is not None:
    path = os.path.join(PAIRS_DIR, f"{pair}.gin")
    if not os.path.isfile(path):
      raise ValueError(f"unknown pair {pair!r}; known pairs: {', '.join(known_pairs())}")
    files.insert(0, os.path.relpath(path, REPO_ROOT))
  for f in files:
    if os.path.normpath(os.path.dirname(f)) == os.path.join("configs", "pairs") and not (
        os.path.isfile(f) or os.path.isfile(os.path.join(REPO_ROOT, f))):
      raise ValueError(f"unknown pair file {f!r}; known pairs: {', '.join(known_pairs())}")
  return files


def _bound(name: str) -> Any:
  """The gin value bound to `name` (a parameter or a %MACRO), or None when unbound."""
  try:
    return gin.query_parameter(name)
  except (ValueError, KeyError):
    return None


def prompt_experiment(prompt: str) -> Experiment:
  """The configured Experiment on the one --prompt text. An input file or a task
  the gin files already bind is a ValueError: which inputs to run would be a guess."""
  if not prompt.strip():
    raise ValueError("--prompt is empty")
  input_file = _bound("%INPUT_FILE") or _bound("Task.path")
  input_file = input_file if isinstance(input_file, str) else None  # Not gin.REQUIRED.
  if input_file is not None or _bound("Experiment.task") is not None:
    what = f"an input file ({input_file!r})" if input_file is not None else "a task"
    raise ValueError(f"--prompt and {what} are both given: use one (drop the task gin file "
                     "or the --prompt flag)")
  return Experiment(task=tasks.Task(name="prompt", source="inline", texts=(prompt,)))


def setting_name(field: str) -> str:
  """How the user sets an Experiment field: its macro (GAMMA) when the configuration binds
  the field to one, else Experiment.<field>."""
  try:
    value = gin.query_parameter(f"Experiment.{field}")
  except (ValueError, KeyError):
    return f"Experiment.{field}"
  macro = getattr(value, "scoped_selector", "")
  if getattr(value, "selector", None) == "gin.macro":
    return macro.rsplit("/", 1)[0]
  return f"Experiment.{field}"


def _int_at_least(low: int):
  def check(value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
      raise ValueError(f"must be an int >= {low}")
  return check


def _optional(check):
  def optional(value):
    if value is not None:
      check(value)
  return optional


def _non_negative_number(value):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
    raise ValueError("must be a number >= 0")


def _mass(value):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
    raise ValueError("must be None (no top-p filtering) or a mass in (0, 1]")


def _flag(value):
  if not isinstance(value, bool):
    raise ValueError("must be True or False")


def _one_of(choices):
  def check(value):
    if value not in choices:
      raise ValueError(f"must be one of {list(choices)}")
  return check


def _verification(value):
  if value not in VERIFIERS:
    raise ValueError(f"must be one of {sorted(VERIFIERS)}")


# Each Experiment field's type and range: the same rules `specdec_jax.settings` applies to
# generate's arguments, stated here once per field so that every bad one is reported.
def _gamma(value):
  if value != "auto":
    try:
      _int_at_least(1)(value)
    except ValueError:
      raise ValueError("must be an int >= 1 or 'auto'") from None


def planned_gamma(exp: Experiment, draft: Optional[Draft] = None) -> int:
  """The gamma the launcher plans with: GAMMA, or under 'auto' AUTO_PLAN_GAMMA (at most
  the draft's own limit)."""
  if exp.gamma != "auto":
    return exp.gamma
  most = None if draft is None else getattr(draft, "max_gamma", None)
  return min(AUTO_PLAN_GAMMA, most or AUTO_PLAN_GAMMA)


FIELD_CHECKS = (
    ("gamma", _gamma), ("max_decode_steps", _int_at_least(1)),
    ("batch_size", _int_at_least(1)), ("max_input_length", _int_at_least(1)),
    ("timing_repeats", _int_at_least(1)), ("seed", _int_at_least(0)),
    ("topk", _int_at_least(0)), ("block_width", _optional(_int_at_least(1))),
    ("temperature", _non_negative_number), ("topp", _optional(_mass)),
    ("chat_template", _flag), ("verification", _verification),
    ("scheduling", _one_of(SCHEDULINGS)),
)


def experiment_problems(exp: Experiment) -> List[str]:
  """Every bad Experiment field, each naming the setting that fixes it (GAMMA, not
  Experiment.gamma, where the gin files bind a macro), before anything loads."""
  problems = []
  for field, check in FIELD_CHECKS:
    value = getattr(exp, field)
    try:
      check(value)
    except ValueError as e:
      name = setting_name(field)
      problems.append(f"{name} {e}, got {value!r}: set --gin.{name}")
  if problems:
    return problems
  with launcher_words():
    try:  # The sampling settings together (topk and topp exclusive, ...).
      sampling.Sampling(exp.temperature, exp.topk, exp.topp)
    except ValueError as e:
      problems.append(f"{e} (--gin.{setting_name('topk')} / --gin.{setting_name('topp')})")
  spec = exp.draft if isinstance(exp.draft, DraftSpec) else None
  gamma_value = planned_gamma(exp)
  if not isinstance(spec, TreeSpec) and exp.max_decode_steps < gamma_value + 1:
    steps, gamma = setting_name("max_decode_steps"), setting_name("gamma")
    problems.append(f"{steps} ({exp.max_decode_steps}) must be >= {gamma} + 1 "
                    f"({gamma_value + 1}): the timed verification call scores gamma + 1 "
                    f"tokens; raise --gin.{steps} or lower --gin.{gamma}")
  return problems


# Errors of a check that describe a bad input, not a bug: reported as problems.
INPUT_ERRORS = (ValueError, FileNotFoundError, TypeError, ImportError)


def input_problems(exp: Experiment, num_examples: Optional[int]) -> List[str]:
  """The models' specs, the draft's and the task's inputs (a local file read whole:
  its encoding and field), each problem on its own line."""
  problems = []
  for what, check in (("target", lambda: exp.target.validate("target")),
                      ("draft", lambda: draft_spec(exp.draft).check()),
                      ("task", lambda: _check_task(exp.task, num_examples))):
    try:
      check()
    except INPUT_ERRORS as e:
      problems.append(str(e))
  return problems


def _check_task(task: tasks.Task, num_examples: Optional[int]) -> None:
  if not isinstance(task, tasks.Task):
    raise TypeError(f"Experiment.task must be a Task, got {type(task).__name__}")
  task.validate()
  if task.source in ("local", "inline"):  # Read whole: datasets download, files do not.
    task.load(num_examples)


NO_INPUTS = ("no inputs: pass --prompt=TEXT, or a task gin file with its input file: "
             "--gin_file=configs/tasks/local_file.gin --gin.INPUT_FILE=\"'inputs.jsonl'\"")


def check_launch(pair: Optional[str], gin_files: Sequence[str], bindings: Sequence[str],
                 search_paths: Sequence[str], output_dir: Optional[str],
                 prompt: Optional[str] = None, num_examples: Optional[int] = None
                 ) -> Experiment:
  """Parses the configuration and checks everything that needs no weights; returns the
  Experiment, or raises `launch_checks.LaunchError` listing every problem found (each
  with the flag that fixes it). Warnings (settings nothing reads) are logged and
  printed."""
  problems = []
  output_problem = launch_checks.output_dir_problem(output_dir)
  if output_problem:
    problems.append(output_problem)
  if num_examples is not None and num_examples < 1:
    problems.append(f"--num_examples must be >= 1, got {num_examples}")
  try:
    files = pair_gin_files(pair, gin_files)
  except ValueError as e:
    launch_checks.raise_if_any(problems + [str(e)])
  binding_problems, good_bindings = launch_checks.binding_problems(bindings)
  problems += binding_problems
  try:
    parse_gin(files, [], search_paths)
    file_macros = launch_checks.defined_macros()
    parse_gin(files, good_bindings, search_paths)
  except ValueError as e:
    launch_checks.raise_if_any(problems + [str(e)])
  config_problems, warnings = launch_checks.config_problems(
      launch_checks.selector_of(Experiment), good_bindings, file_macros, os.path.join(REPO_ROOT, "configs"),
      provided=("task",) if prompt is not None else ())
  rejected = {launch_checks.split_binding(b)[0] for b in bindings
              if b not in good_bindings and launch_checks.split_binding(b)}
  problems += [NO_INPUTS if p.startswith("Experiment.task is not set") else p
               for p in config_problems
               if p.split(" ", 1)[0] not in rejected]  # Its binding's problem says it all.
  for warning in warnings:
    logging.warning("%s", warning)
    print(f"warning: {warning}", file=sys.stderr)
  launch_checks.raise_if_any(problems)
  try:
    exp = Experiment() if prompt is None else prompt_experiment(prompt)
  except INPUT_ERRORS as e:
    launch_checks.raise_if_any(problems + [str(e)])
  problems += experiment_problems(exp)
  problems += input_problems(exp, num_examples)
  launch_checks.raise_if_any(problems)
  return exp


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if MULTIHOST.value:  # Before any other JAX call.
    multihost.initialize_distributed(COORDINATOR_ADDRESS.value, NUM_PROCESSES.value,
                                    PROCESS_ID.value)
  # Compiled programs persist across runs (~/.cache/specdec_jax/jax; SPECDEC_JAX_CACHE=
  # turns it off): a rerun or a resumed run compiles nothing.
  enable_compile_cache()
  try:
    exp = check_launch(PAIR.value, GIN_FILES.value, GIN_BINDINGS.value, GIN_SEARCH_PATHS.value,
                       OUTPUT_DIR.value, PROMPT.value, NUM_EXAMPLES.value)
    result = run_experiment(exp, OUTPUT_DIR.value, NUM_EXAMPLES.value, MESH_SHAPE.value,
                            WAIT_FOR_OUTPUT_DIR.value)
  except (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError) as e:
    # A clean error instead of a traceback for configuration and input
    # mistakes; no results have been written.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except Interrupted as e:
    print(f"\n{e}", file=sys.stderr)
    sys.exit(130)
  except KeyboardInterrupt:
    print("\nstopped before any input was decoded; no results were written", file=sys.stderr)
    sys.exit(130)
  if PROMPT.value is not None and multihost.is_output_process():
    # The completion itself, as the speculative decoder produced it (greedy: the
    # target's own; it equals result['completions'][0]['baseline']).
    print(result["completions"][0]["speculative"])
  print(results_lib.TABLE2_HEADER)
  print(result["markdown_row"])


if __name__ == "__main__":
  app.run(main, argv=rewrite_gin_args(sys.argv))
