"""Drafts for speculative decoding: one interface, several proposers.

* `ModelDraft`: a smaller T5 (optionally stopping early when unsure).
* `NgramDraft`: unigram / bigram counts from a corpus or target samples.
* `PromptLookupDraft`: copies the continuation of a matching n-gram.
* `AdaptiveGammaDraft`: wraps any draft with HF's `heuristic` length schedule.
"""

from specdec_jax.drafts.base import Draft
from specdec_jax.drafts.model_draft import ModelDraft


def as_draft(draft) -> Draft:
  """Wraps a `Model` as a `ModelDraft`; passes a `Draft` through."""
  if isinstance(draft, Draft):
    return draft
  from specdec_jax.families.t5.model import Model
  if isinstance(draft, Model):
    return ModelDraft(draft)
  from specdec_jax.families.decoder_only.model import DecoderOnlyModel
  if isinstance(draft, DecoderOnlyModel):
    raise TypeError(f"a decoder-only draft ({draft.config.family}) cannot draft for a T5 "
                    "target: model drafts must be of the target's family (n-gram drafts work "
                    "for both)")
  raise TypeError(f"draft must be a specdec_jax Model or Draft, got {type(draft).__name__}")


from specdec_jax.drafts.adaptive import AdaptiveGammaDraft, heuristic_draft_length  # noqa: E402
from specdec_jax.drafts.ngram import NgramDraft  # noqa: E402
from specdec_jax.drafts.prompt_lookup import PromptLookupDraft  # noqa: E402
