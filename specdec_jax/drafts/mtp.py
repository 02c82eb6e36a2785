"""A checkpoint's own multi-token-prediction (MTP) modules as a draft (`sj.MtpDraft`).

DeepSeek-V3 (and GLM-4.5), Qwen3-Next / Qwen3.5 and MiMo ship N modules beside
the model, trained to predict the token after next from the model's last hidden
state and the next token. As a draft that is the EAGLE-1 scheme with a
different head (`families/decoder_only/mtp_head.py` holds the math and where
it was checked): head position t holds the pair (h_{t-1}, x_t), the module's
output is fed back with the token it drew, and the law of x_{t+1} comes from
the module's (or the target's) LM head. `FeatureDraft` drives it; this class
adds the order of the modules:

* the accepted pairs (the target's features, `observe`) go through every
  module, so each has its context in its own KV cache;
* drafting step i runs module i mod N (one module reused for every step when N
  = 1, as every public checkpoint has; vLLM's reuse rule for N > 1), on the
  previous step's output and the token drawn from it; with N > 1 a module sees
  the context and the draft keys it wrote itself in this proposal.

Exactness is the engine's: each drafted token is drawn from exactly the law
returned for it, and the state a proposal starts from is a function of accepted
tokens (the target's features at accepted positions only).

`sj.load_mtp_draft(path, target)` reads the modules from a checkpoint directory
(`drafts/mtp_checkpoints.py`).
"""

from typing import Hashable

import jax.numpy as jnp

from specdec_jax.core import sampling
from specdec_jax.drafts.base import chain_proposer
from specdec_jax.drafts.feature_draft import FeatureDraft
from specdec_jax.families.registry import family_of

LAYOUTS = ("deepseek", "qwen3_next", "mimo")


def _mtp_head(target, layout, num_modules, own_embeddings):
  family = family_of(target)
  if family.name != "decoder_only":
    raise TypeError(f"MTP modules are decoder-only checkpoints' (DeepSeek-V3, Qwen3-Next, "
                    f"MiMo); the target is a {family.name} model")
  from specdec_jax.families.decoder_only.mtp_head import MtpHead  # the family's head
  return MtpHead(target.config, layout, num_modules, own_embeddings)


class MtpDraft(FeatureDraft):
  """A checkpoint's MTP modules drafting for their model.

  Args:
    target: the decoder-only model the modules belong to (its embedding, LM head and
      layer kind).
    layout: 'deepseek' (eh_proj over [enorm(emb); hnorm(h)], shared_head),
      'qwen3_next' (fc over [pre_fc_norm_embedding(emb); pre_fc_norm_hidden(h)], zero-
      centred norms) or 'mimo' (input_proj over [hidden_layernorm(h);
      token_layernorm(emb)], the pre-norm hidden state).
    num_modules: N modules (drafting step i runs module i mod N).
    params: the modules' arrays (`MtpHead.init_params`' tree); None: random (seed).
    own_embeddings: each module has its own embedding table.
  """

  def __init__(self, target, layout: str = "deepseek", num_modules: int = 1, params=None,
               seed: int = 0, own_embeddings: bool = False):
    head = _mtp_head(target, layout, num_modules, own_embeddings)
    super().__init__(target, head_params=params, seed=seed, head=head)

  @property
  def layout(self) -> str:
    return self.head.layout.name

  @property
  def num_modules(self) -> int:
    return self.head.num_modules

  def static_key(self) -> Hashable:
    return ("mtp", self.head.static_key())

  def grown_params(self, small_target, large_config):
    from specdec_jax.families.widen import EmbeddingError
    raise EmbeddingError("a checkpoint's MTP modules have no function-preserving growing rule")

  def _apply(self, params, tokens, features, positions, cache, tree=None, module=None,
             context_end=None):
    return self.head.apply(params["head"], params["target"], tokens, features, positions,
                           cache, tree, module=module, context_end=context_end)

  def proposer(self, params, plan):
    head, gamma, settings, n = self.head, plan.gamma, plan.sampling, self.head.num_modules

    def draw(hidden, step_rng, module):
      probs = settings.probs(head.logits(params["head"], params["target"], hidden, module))
      return settings.draw(step_rng, probs), probs

    def propose(rng, state, sequences, lengths, max_drafted=None):
      batch = sequences.shape[0]
      rows = jnp.arange(batch)
      offset, count = state["offset"], state["count"]
      limit = (jnp.full((batch,), gamma, jnp.int32) if max_drafted is None else
               jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
      rngs = sampling.split_keys(rng, gamma)
      # The pending (accepted) pairs, token positions lengths - count + 1 .. lengths,
      # through every module; step 0 reads module 0's output at the last one.
      hidden, cache = self._apply(params, state["pending_tokens"], state["pending_features"],
                                  lengths - count + 1 + offset, state["cache"])
      last = hidden[rows, jnp.clip(count - 1, 0, hidden.shape[1] - 1)]
      token, probs = draw(last, rngs[0], 0)
      tokens, laws = [token], [probs]
      context_end = lengths + offset
      for i in range(1, gamma):
        # Module i mod N at position lengths + i: (its predecessor's output, x_i).
        hidden, cache = self._apply(params, token[:, None], last[:, None], context_end + i,
                                    cache, module=i % n, context_end=context_end)
        last = hidden[:, 0]
        token, probs = draw(last, rngs[i], i % n)
        tokens.append(token)
        laws.append(probs)
      keep = jnp.arange(gamma)[None] < limit[:, None]
      draft_tokens = jnp.where(keep, jnp.stack(tokens, axis=1), 0)
      draft_probs = jnp.where(keep[..., None], jnp.stack(laws, axis=1), 0.0)
      return draft_tokens, draft_probs, limit, dict(state, cache=cache)

    return chain_proposer(propose, plan, observe=self.observer(params))

  def tree_expander(self, params, settings):
    """Token trees from the one module (`FeatureDraft.tree_expander`); a tree of several
    modules would need a module per depth, which is not built."""
    if self.head.num_modules != 1:
      raise TypeError(f"this MtpDraft has {self.head.num_modules} modules; token trees are "
                      "grown from a single MTP module (draft a chain, or keep one module)")
    return super().tree_expander(params, settings)

