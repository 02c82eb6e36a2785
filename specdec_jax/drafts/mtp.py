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

  # Chain steps (`FeatureDraft.proposer`): step i runs module i mod N (vLLM's reuse rule),
  # which sees the accepted context and its own draft keys of this proposal.
  def _draft_step(self, params, tokens, features, positions, cache, step: int, context_end):
    return self._apply(params, tokens, features, positions, cache,
                       module=step % self.num_modules, context_end=context_end)

  def _step_logits(self, params, hidden, step: int):
    return self.head.logits(params["head"], params["target"], hidden, step % self.num_modules)

  def tree_expander(self, params, settings):
    """Token trees from the one module (`FeatureDraft.tree_expander`); a tree of several
    modules would need a module per depth, which is not built."""
    if self.head.num_modules != 1:
      raise TypeError(f"this MtpDraft has {self.head.num_modules} modules; token trees are "
                      "grown from a single MTP module (draft a chain, or keep one module)")
    return super().tree_expander(params, settings)

