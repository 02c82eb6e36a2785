"""Why a method wins where it wins: its draft's cost c and the theory's speedup.

Theorem 3.8 with a verification call of its own cost: an iteration emits τ
tokens for `draft_calls` draft calls of cost c (each relative to one
one-token target step) plus one target call scoring W tokens, of cost C(W);
target-only decoding pays one step per token. So

    predicted speedup = τ / (draft_calls · c + C(W))

with τ the evaluation's own measured tokens per target call. c is timed for
drafts that run a model of their own (a draft model, a tree around one, PARD);
a feature head, Medusa heads or a DFlash block read the target's hidden states
and are costed at 0 here (said in the row's `c_note`), as are tables (n-gram,
prompt lookup), whose host-free lookups cost next to nothing.
"""

from typing import Any, Dict, Optional

from specdec_jax.core import theory
from specdec_jax.drafts import (DynamicTreeDraft, FeatureDraft, ModelDraft, NgramDraft,
                                ParallelDrafter, PromptLookupDraft, TreeDraft)
from specdec_jax.tools.profiling import block_step_seconds

TIMING_REPEATS = 5


def cost_model(draft) -> Optional[Any]:
  """The model whose one-token step is c's numerator, or None."""
  inner = getattr(draft, "inner", None) if isinstance(draft, (TreeDraft, DynamicTreeDraft)) \
      else draft
  model = getattr(inner, "model", None)
  return model if model is not None and hasattr(model, "config") else None


def draft_calls(draft, gamma: int) -> int:
  """Draft calls per iteration: gamma for a chain, the depth for a tree, one for a
  drafter that fills a whole proposal in one call."""
  if isinstance(draft, (TreeDraft, DynamicTreeDraft)):
    return draft.depth
  if isinstance(draft, ParallelDrafter):
    return 1
  return gamma


def _note(draft) -> Optional[str]:
  if isinstance(draft, (NgramDraft, PromptLookupDraft)):
    return "a table lookup: c taken as 0"
  if isinstance(draft, (FeatureDraft, ParallelDrafter)) and cost_model(draft) is None:
    return "heads over the target's hidden states: c not timed, taken as 0"
  return None


def method_costs(target, probe_inputs, probe_lengths, max_decode_steps: int, methods,
                 widths: Dict[str, int], figures: Dict[str, Dict[str, Any]]
                 ) -> Dict[str, Dict[str, Any]]:
  """{method: {c, verify_cost, draft_calls, predicted_speedup, c_note}} (vanilla none).

  probe_inputs [1, C] (and probe_lengths [1], decoder-only): the prompt the one-token
  steps are timed on; widths: each method's block width W; figures: results.json's
  per-method figures (their overall τ)."""
  def step(model, k: int) -> float:
    # The cache must hold a k-token block even when the answers are shorter.
    return block_step_seconds(model, probe_inputs, k, max(max_decode_steps, k + 1),
                              TIMING_REPEATS, lengths=probe_lengths)

  target_step = step(target, 1)
  verify_costs: Dict[int, float] = {}
  out = {}
  for name, method in methods.items():
    if method.is_vanilla:
      continue
    width = widths[name]
    if width not in verify_costs:
      verify_costs[width] = step(target, width) / target_step
    model = cost_model(method.draft)
    c = 0.0 if model is None else step(model, 1) / target_step
    calls = draft_calls(method.draft, method.gamma)
    tau = figures[name]["overall"]["tau"]
    predicted = (theory.predicted_tree_speedup(max(tau, 1.0), c, calls, verify_costs[width])
                 if tau is not None else None)
    out[name] = dict(c=c if model is not None else None, verify_cost=verify_costs[width],
                     draft_calls=calls, predicted_speedup=predicted, c_note=_note(method.draft),
                     target_step_ms=target_step * 1e3)
  return out
