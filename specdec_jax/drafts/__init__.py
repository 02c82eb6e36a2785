"""Drafts for speculative decoding: one interface, several proposers."""

from specdec_jax.drafts.base import Draft
from specdec_jax.drafts.model_draft import ModelDraft


def as_draft(draft) -> Draft:
  """Wraps a `Model` as a `ModelDraft`; passes a `Draft` through."""
  if isinstance(draft, Draft):
    return draft
  from specdec_jax.model import Model
  if isinstance(draft, Model):
    return ModelDraft(draft)
  raise TypeError(f"draft must be a specdec_jax Model or Draft, got {type(draft).__name__}")
