"""The methods an evaluation compares: named draft configurations of one target.

A method is a draft (None: vanilla, target-only decoding), the gamma it drafts
per iteration and the rule that keeps its tokens. Every speculative method is
exact, so its greedy outputs must equal target-only decoding's at its block
width, and `runner` checks that they do.

`demo_methods(pair)` names every draft kind a demo pair ships
(`DEMO_METHODS`: what each name is); `experiments/evaluate.py` builds the same
names from the launcher's gin configuration for any other target.
`scale_demo_pair(pair, shape)` is `--scale_to`: the pair's target embedded at a
large model's shape, every draft fit to it, so every method above runs at that
model's cost with the trained pair's acceptance.
"""

import dataclasses
import os
from typing import Any, Callable, Dict, Optional, Sequence

from specdec_jax.drafts import (DynamicTreeDraft, ModelDraft, ParallelDraft, PromptLookupDraft,
                                SparseCacheDraft, TreeDraft, as_draft)
from specdec_jax.families.registry import family_of

VANILLA = "vanilla"
DEFAULT_GAMMA = 4
TREE_BRANCHING = (2, 2, 1)
# 11 nodes: the static tree's width too, so both share one target-only reference decode.
DYNAMIC_TREE = dict(topk=3, depth=4, node_budget=11)
# Where every loop scores DEFAULT_BLOCK_WIDTH = 8 slots (anything but float32 on a CPU:
# `core.decoding.narrow_by_default`), the trees above (11 slots each) do not fit a block:
# these do, scripts/gpu_benchmarks.py's W = 8 trees (7 and 8 slots, root included).
FIXED_WIDTH_TREE = (2, 1, 1)
FIXED_WIDTH_DYNAMIC_TREE = dict(topk=2, depth=4, node_budget=8)
# `scale_demo_pair`: the shape a pair's model draft and PARD drafter's model are embedded
# at beside a scaled target. The paper pairs T5-XXL with a T5-small-shaped draft
# (scripts/gpu_benchmarks.py's DRAFT_SHAPE); no benchmark grows a decoder-only draft, so
# those stay as shipped unless a draft shape is named. 'shipped': keep them as they are.
SCALED_DRAFT_SHAPES = {"t5": "t5_1_1_small"}
SHIPPED = "shipped"


@dataclasses.dataclass(frozen=True)
class Method:
  """One row of the evaluation's table.

  name: the row's name ('vanilla', 'model', 'prompt_lookup', ...).
  draft: a `specdec_jax.drafts.Draft`, or None for vanilla.
  gamma: tokens drafted per iteration (a tree's own shape decides instead).
  verification: 'token' or 'block' (`core.verification.VERIFIERS`).
  description: what the method is, in the words of results.md's legend.
  """
  name: str
  draft: Any = None
  gamma: int = DEFAULT_GAMMA
  verification: str = "token"
  description: str = ""

  @property
  def is_vanilla(self) -> bool:
    return self.draft is None


# The sparse-cache self-drafts' budget on the demo pairs: below every demo decode's cache
# (prompts of >= 32 tokens plus the decode), so it reads part of it.
SPARSE_BUDGET, SPARSE_SINKS, SPARSE_CHUNK = 32, 4, 8

# name -> what the method is, for --methods' help, the error on an unknown name and
# results.md's legend. Each builder takes the pair and gamma.
DEMO_METHODS = {
    VANILLA: "target-only decoding, one token per target call (the baseline)",
    "model": "the pair's distilled draft model (T5: 'small', decoder-only: 'draft'), a chain "
             "of gamma tokens verified token-wise",
    "model_tiny": "T5 only: the 'tiny' draft model (0.2M), a chain of gamma tokens",
    "block": "the draft model's chain kept by block verification (Sun et al.)",
    "tree": f"a static token tree, branching {TREE_BRANCHING} ({FIXED_WIDTH_TREE} where "
            "blocks are 8 wide: accelerators, bfloat16), drawn from the draft model",
    "dynamic_tree": "an EAGLE-2 dynamic tree around the draft model "
                    f"(topk {DYNAMIC_TREE['topk']}, depth {DYNAMIC_TREE['depth']}, "
                    f"{DYNAMIC_TREE['node_budget']} nodes; "
                    f"{FIXED_WIDTH_DYNAMIC_TREE['topk']}, {FIXED_WIDTH_DYNAMIC_TREE['depth']}, "
                    f"{FIXED_WIDTH_DYNAMIC_TREE['node_budget']} where blocks are 8 wide)",
    "eagle": "the pair's EAGLE-1 feature head over the target's hidden states",
    "medusa": "the pair's Medusa heads (one call drafts gamma tokens)",
    "dflash": "the pair's DFlash block drafter (one call drafts a block)",
    "pard": "the pair's PARD drafter (one call of a small model with mask tokens)",
    "ngram": "the pair's bigram table (NgramDraft, no model)",
    "prompt_lookup": "prompt lookup: copies what followed the context's last 1-3-gram",
    "sparse_cache": f"the target drafting for itself from {SPARSE_BUDGET} positions of its "
                    f"cache: {SPARSE_SINKS} sinks + the most recent (decoder-only)",
    "sparse_retrieval": f"the target drafting for itself from {SPARSE_BUDGET} positions of its "
                        f"cache: chunks of {SPARSE_CHUNK} retrieved by key (decoder-only)",
}
# The draft each head-like method reads from DemoPair.drafts.
_PAIR_DRAFTS = {"eagle": "feature", "medusa": "medusa", "dflash": "dflash", "pard": "parallel"}


def _model_draft_name(family: str) -> str:
  return "small" if family == "t5" else "draft"


def _model_draft(pair) -> ModelDraft:
  return ModelDraft(pair.drafts[_model_draft_name(pair.family)])


def _tree_shapes(target):
  """(static branching, dynamic tree settings) that fit the target's default blocks: on a
  CPU in float32 a block is as wide as its draft needs; elsewhere every loop scores 8
  slots (so that greedy outputs are identical by construction) and the trees shrink."""
  from specdec_jax.core import decoding
  if decoding.narrow_by_default(target.config.dtype):
    return TREE_BRANCHING, DYNAMIC_TREE
  return FIXED_WIDTH_TREE, FIXED_WIDTH_DYNAMIC_TREE


def demo_builders(pair) -> Dict[str, Callable[[int], Method]]:
  """{name: gamma -> Method} for what `pair` ships."""
  describe = DEMO_METHODS
  branching, dynamic = _tree_shapes(pair.target)
  tree_words = (f"a static token tree, branching {branching}, drawn from the draft model",
                "an EAGLE-2 dynamic tree around the draft model (topk {topk}, depth {depth}, "
                "{node_budget} nodes)".format(**dynamic))
  builders = {
      VANILLA: lambda g: Method(VANILLA, None, 0, description=describe[VANILLA]),
      "model": lambda g: Method("model", _model_draft(pair), g, description=describe["model"]),
      "block": lambda g: Method("block", _model_draft(pair), g, "block", describe["block"]),
      "tree": lambda g: Method("tree", TreeDraft(_model_draft(pair), branching), g,
                               description=tree_words[0]),
      "dynamic_tree": lambda g: Method("dynamic_tree", DynamicTreeDraft(
          _model_draft(pair), **dynamic), g, description=tree_words[1]),
      "prompt_lookup": lambda g: Method("prompt_lookup", PromptLookupDraft(
          pair.target.config.vocab_size, 3, 1), g, description=describe["prompt_lookup"]),
  }
  if family_of(pair.target).supports_sparse_view:
    builders["sparse_cache"] = lambda g: Method("sparse_cache", SparseCacheDraft(
        pair.target, SPARSE_BUDGET, "window", sinks=SPARSE_SINKS), g,
        description=describe["sparse_cache"])
    builders["sparse_retrieval"] = lambda g: Method("sparse_retrieval", SparseCacheDraft(
        pair.target, SPARSE_BUDGET, "retrieval", chunk=SPARSE_CHUNK), g,
        description=describe["sparse_retrieval"])
  if "tiny" in pair.drafts:
    builders["model_tiny"] = lambda g: Method("model_tiny", ModelDraft(pair.drafts["tiny"]), g,
                                              description=describe["model_tiny"])
  if "bigram" in pair.ngrams:
    builders["ngram"] = lambda g: Method("ngram", pair.ngrams["bigram"], g,
                                         description=describe["ngram"])
  for name, key in _PAIR_DRAFTS.items():
    if key in pair.drafts:
      builders[name] = (lambda n, k: lambda g: Method(n, as_draft(pair.drafts[k]), g,
                                                      description=describe[n]))(name, key)
  return builders


def check_names(names: Sequence[str], known: Sequence[str], where: str) -> None:
  """A clear error for an unknown or repeated method name, before any decode."""
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"unknown method(s) {unknown} for {where}; known: {', '.join(known)} "
                     "(--methods=NAME,NAME,...)")
  repeated = sorted({n for n in names if list(names).count(n) > 1})
  if repeated:
    raise ValueError(f"--methods names {repeated} more than once")


def with_vanilla(names: Sequence[str]) -> list:
  """The names with vanilla first: it is always measured, the baseline of every speedup."""
  return [VANILLA] + [n for n in names if n != VANILLA]


def demo_methods(pair, names: Sequence[str], gamma: int = DEFAULT_GAMMA,
                 gammas: Optional[Dict[str, int]] = None) -> Dict[str, Method]:
  """The named methods of a demo pair ({name: Method}, vanilla first).

  names: any of what the pair ships (`DEMO_METHODS`; T5's 'model_tiny' only there).
  gamma: the chains' gamma; gammas: per-method overrides ({'prompt_lookup': 6}).
  """
  builders = demo_builders(pair)
  check_names(names, list(builders), f"the {pair.family} demo pair")
  gammas = dict(gammas or {})
  return {n: builders[n](gammas.get(n, gamma)) for n in with_vanilla(names)}


def scaled_dtype() -> str:
  """The dtype a scaled demo pair is loaded in: bfloat16 on accelerators (the paper's and
  scripts/gpu_benchmarks.py's), the pair's float32 on a CPU (whose bfloat16 dots are slow)."""
  import jax
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _memory_budget() -> Optional[int]:
  """Bytes a scaled pair may take: the accelerator's memory, or the host's on a CPU."""
  import jax
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 -- backends without memory statistics
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def scale_demo_pair(pair, scale_to: str):
  """(the demo pair at a large model's cost, what was built in words): `--scale_to`.

  scale_to: 'SHAPE' or 'SHAPE/DRAFT_SHAPE'. SHAPE, a named config of the pair's
    family with optional overrides (`scaled_pair.shape_config`: 't5_1_1_xxl',
    'gpt2_xl', 'gpt2_xl:emb_dim=4608,num_heads=72,mlp_dim=18432,num_layers=40'),
    is the target's: the trained target embedded function-preservingly
    (`scaled_pair.embed_model`: same greedy outputs, the large shape's cost); the
    feature, Medusa and DFlash heads grow with it (`scaled_pair.embed_draft`).
    DRAFT_SHAPE (default `SCALED_DRAFT_SHAPES`, 'shipped': none) is where the model
    draft ('small' / 'draft', which the block, tree and dynamic-tree methods also
    use) and PARD's model are embedded, as the GPU benchmark does. T5's 'tiny'
    draft, the n-gram tables and prompt lookup stay as shipped (their cost is
    their own). Every method the pair ships stays available.

  Built directly in memory (the large arrays are never written to disk: on an
  accelerator a bfloat16 XXL is 22 GB), after `scaled_pair.plan` has checked the
  bytes against this machine's memory. Kernels: out_in on a CPU (its fast dot),
  in_out elsewhere.
  """
  import jax
  from specdec_jax import scaled_pair
  from specdec_jax.families import kernel_layout as layouts
  shape, _, draft_shape = scale_to.partition("/")
  draft_shape = draft_shape or SCALED_DRAFT_SHAPES.get(pair.family, SHIPPED)
  layout = "out_in" if jax.default_backend() == "cpu" else "in_out"
  scaled_pair.plan(pair, shape, kernel_layout=layout, memory_budget_bytes=_memory_budget())

  def grow(model, to):
    return layouts.with_kernel_layout(scaled_pair.embed_model(model, to), layout)

  target = grow(pair.target, shape)
  drafts = {n: scaled_pair.embed_draft(d, pair.target, target) for n, d in pair.drafts.items()}
  words = [f"the {pair.target.config.num_params / 1e6:.1f}M demo target embedded at {shape} "
           f"({target.config.num_params / 1e9:.2f}B, {target.config.dtype})"]
  grown = [n for n in drafts if drafts[n] is not pair.drafts[n]]
  if grown:
    words.append(f"{', '.join(grown)} grown with it")
  if draft_shape != SHIPPED:
    name = _model_draft_name(pair.family)
    drafts[name], embedded = grow(pair.drafts[name], draft_shape), [name]
    if "parallel" in pair.drafts:
      pard = pair.drafts["parallel"]
      drafts["parallel"] = ParallelDraft(
          grow(pard.model, draft_shape), pard.mask_token_id, pard.gamma,
          pard.vocab_size if pard.padding else None)
      embedded.append("parallel's model")
    words.append(f"{' and '.join(embedded)} embedded at {draft_shape}")
  kept = [n for n in drafts if drafts[n] is pair.drafts[n]] + ["the n-gram tables"]
  words.append(" and ".join(kept) + " as shipped")
  return dataclasses.replace(pair, target=target, drafts=drafts), "; ".join(words)
