"""Verification rules: which drafted tokens to keep, and the next token.

One module per rule, all with the target's law as output law:
  token.py   the token rule (Leviathan et al. 2023): `speculative_step`, for a
             chain of gamma drafts, and `normalised_residual`, the one residual
             normalisation every rule uses.
  block.py   the block rule (Sun et al. 2025): `block_verification_step`, the
             same contract as the token rule.
  tree.py    recursive rejection sampling over token trees: `verify_tree`,
             `draw_children`, and the sibling laws (`SiblingLaw` objects).

The registries:
  VERIFIERS  chain rule name -> batched step with
             `token.batched_speculative_step`'s contract: (rngs [batch], draft_tokens
             [batch, gamma], draft_probs [batch, gamma, vocab], target_probs
             [batch, gamma + 1, vocab], num_drafted [batch] or None, greedy) ->
             (num_accepted [batch] int32, next_token [batch] int32). Both
             are exact; "block" accepts at least as many drafts on average.
  TREE_LAWS  sibling-law name -> `tree.SiblingLaw` object; LAWS its names,
             the `law=` / `children=` values tree verification and tree drafts
             take.
"""

from specdec_jax.core.verification import block
from specdec_jax.core.verification import token
from specdec_jax.core.verification import tree
from specdec_jax.core.verification.tree import LAWS, TREE_LAWS, SiblingLaw, tree_law

VERIFIERS = {
    "token": token.batched_speculative_step,
    "block": block.batched_block_verification_step,
}


def check_verification(verification: str) -> str:
  """Returns `verification` (a str) if it names a rule in VERIFIERS, else raises ValueError."""
  if not isinstance(verification, str) or verification not in VERIFIERS:
    raise ValueError(f"verification must be one of {sorted(VERIFIERS)}, got {verification!r}")
  return verification


__all__ = ["LAWS", "TREE_LAWS", "VERIFIERS", "SiblingLaw", "block", "check_verification",
           "token", "tree", "tree_law"]
