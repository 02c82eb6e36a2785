"""Drafts for speculative decoding: one protocol (`base.Draft`), several proposers, every family.

* `ModelDraft`: a smaller model of the target's family (optionally stopping
  early when unsure).
* `NgramDraft`: unigram / bigram counts from a corpus or target samples.
* `PromptLookupDraft`: copies the continuation of a matching n-gram of the context.
* `AdaptiveGammaDraft`: wraps any draft with HF's `heuristic` length schedule.
* `TreeDraft` / `DynamicTreeDraft`: a token tree (static shape, or grown EAGLE-2 style by
  cumulative draft probability) from a model or n-gram draft, verified in one call.
* `FeatureDraft`: a feature head (EAGLE-style) over the target's own hidden states,
  driving any family's `families.feature_head.FeatureHead`.
* `MedusaDraft`: K Medusa heads on the target's last hidden state, every token of a
  proposal (chain or tree level) from one call.
* `ParallelDraft`: PARD, a small model of the target's vocabulary run once over the
  context plus K - 1 mask tokens (`drafts.parallel`: the base of one-call drafters).
* `DFlashDraft`: DFlash, a few non-causal layers over the target's features that fill a
  block of masks in one call (both families; T5's also cross-attends to the encoder).
* `MtpDraft`: a checkpoint's own multi-token-prediction modules (DeepSeek-V3, Qwen3-Next,
  MiMo) drafting through the feature-draft machinery (`sj.load_mtp_draft`).
* `SparseCacheDraft`: the target itself over a budgeted view of its own cache (a
  StreamingLLM window or TriForce-style retrieved chunks), no second model.
"""

from specdec_jax.drafts.base import (NOTHING, Draft, DraftStart, ProposalPlan, Reads,  # noqa: F401
                                     chain_proposer, target_features)
from specdec_jax.drafts.model_draft import ModelDraft
from specdec_jax.families.registry import is_model


def as_draft(draft) -> Draft:
  """Wraps a model (of any family) as a `ModelDraft`; passes a `Draft` through."""
  if isinstance(draft, Draft):
    return draft
  if is_model(draft):
    return ModelDraft(draft)
  raise TypeError(f"draft must be a model or a specdec_jax Draft, got {type(draft).__name__}")


from specdec_jax.drafts.adaptive import AdaptiveGammaDraft, heuristic_draft_length  # noqa: E402,F401
from specdec_jax.drafts.ngram import NgramDraft  # noqa: E402,F401
from specdec_jax.drafts.prompt_lookup import PromptLookupDraft  # noqa: E402,F401
from specdec_jax.drafts.tree_draft import DynamicTreeDraft, TreeDraft  # noqa: E402,F401
from specdec_jax.drafts.feature_draft import FeatureDraft  # noqa: E402,F401
from specdec_jax.drafts.medusa import MedusaDraft  # noqa: E402,F401
from specdec_jax.drafts.pard import ParallelDraft  # noqa: E402,F401
from specdec_jax.drafts.parallel import ParallelDrafter  # noqa: E402,F401
from specdec_jax.drafts.dflash import DFlashDraft  # noqa: E402,F401
from specdec_jax.drafts.mtp import MtpDraft  # noqa: E402,F401
from specdec_jax.drafts.sparse_cache import SparseCacheDraft  # noqa: E402,F401
