"""T5X's `MODEL`, decoding speculatively: a drop-in for T5X's own infer/eval binaries.

`SpeculativeEncoderDecoderModel` is `t5x.models.EncoderDecoderModel` (it
subclasses it whenever a source install of T5X is importable) whose
`predict_batch` can run `decoding.speculative_sample`:

* Its network, `T5XNetwork`, is our T5 called the way T5X calls
  `t5x.examples.t5.network.Transformer` (encoder/decoder input and target
  tokens, segment ids, positions, `enable_dropout`, `decode`), with exactly
  T5X's parameter tree, so `get_initial_variables`, `score_batch`, `loss_fn`
  and `eval_fn` are T5X's own, and any T5X checkpoint of the target restores
  unchanged through `RestoreCheckpointConfig`.
* The params T5X initialises, restores and passes around are the TARGET's.
  The draft is named on the model (in gin: a checkpoint path that
  `specdec_jax.load_model` reads, T5X / Hugging Face / Orbax) and keeps its
  own params. `{'target': ..., 'draft': ...}` params are accepted too.
* `predict_batch_with_aux` encodes once, allocates the cache and runs
  `decode_fn`: `decoding.temperature_sample` (plain decoding, the draft
  unused) or `decoding.speculative_sample`. These are the loops of
  `specdec_jax.generate`, so both produce the same tokens from the same rng;
  greedy, they equal T5X's `temperature_sample` driven by T5X's network.
  The aux is T5X's `{'scores': ...}` plus, when speculative, the per-row
  counters (`core.counters.LoopCounters`).

`t5x` cannot be installed from PyPI (its package there is an empty
placeholder); without it the class stands alone with the same decoding API.
"""

import functools
import inspect
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specdec_jax.core import decoding
from specdec_jax.drafts import Draft, ModelDraft
from specdec_jax.drafts.base import NOTHING, DraftStart, ProposalPlan
from specdec_jax.families.base import Context
from specdec_jax.families.t5.config import CONFIGS, T5Config, get_config
from specdec_jax.families.t5.family import FAMILY as T5_FAMILY, encoder_lengths
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.network import T5
from specdec_jax.programs import PROGRAMS
from specdec_jax.settings import plan_settings


def alias_jestimator_partition_spec() -> None:
  """Lets T5X import on current jax.

  T5X imports `jestimator` (PyPI 0.3.3, 2022), whose `amos_helper` does
  `from jax.experimental.pjit import PartitionSpec`, gone from current jax.
  Setting the old name to `jax.sharding.PartitionSpec` before T5X is imported
  is all it needs (`experiments/t5x_demo/site/sitecustomize.py` does the same
  for `python -m t5x.infer`).
  """
  import jax.experimental.pjit as pjit_module
  if not hasattr(pjit_module, "PartitionSpec"):
    pjit_module.PartitionSpec = jax.sharding.PartitionSpec


try:  # A source install of T5X; never available from PyPI.
  alias_jestimator_partition_spec()
  from t5x import models as _t5x_models
  _BASE = _t5x_models.EncoderDecoderModel
except ImportError:  # pragma: no cover - depends on the environment
  _t5x_models = None
  _BASE = object

Array = jax.Array
PyTree = Any

gin.external_configurable(decoding.temperature_sample, module="specdec_jax.core.decoding")
gin.external_configurable(decoding.speculative_sample, module="specdec_jax.core.decoding")


class T5XNetwork(T5):
  """`models.t5.T5` with T5X's calling convention (`t5x.examples.t5.network.Transformer`).

  The parameter tree is T5's, which is T5X's. Teacher forcing masks exactly
  as T5X's example network does, so logits agree at every position, padded
  ones included:
    * encoder self-attention: query and key both non-padding, same segment;
    * decoder self-attention: causal, query and key targets non-padding
      (`decoder_target_tokens`), same segment;
    * cross-attention: decoder target non-padding, encoder token non-padding,
      same segment.
  Positions are accepted and unused, as in T5X's network: relative position
  biases depend only on key minus query within a segment, and packing masks
  every pair across segments. The network has no dropout (`enable_dropout` is
  accepted for T5X's loops and ignored). `decode=True` is T5X's one-token
  cached decoding, which this model replaces with `predict_batch_with_aux`.
  """

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Optional[Array] = None,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None,
               encoder_positions: Optional[Array] = None,
               decoder_positions: Optional[Array] = None, *,
               enable_dropout: bool = True, decode: bool = False,
               max_decode_length: Optional[int] = None) -> Array:
    """Teacher-forced logits [batch, dec_len, vocab] float32.

    Args:
      encoder_input_tokens: [batch, enc_len] (any numeric dtype; T5X
        initialises with float ones), 0 = padding.
      decoder_input_tokens: [batch, dec_len], targets shifted right.
      decoder_target_tokens: [batch, dec_len]; None: mask only causally (as
        `T5.__call__`).
      encoder_segment_ids / decoder_segment_ids: [batch, enc_len] /
        [batch, dec_len] packing ids, or None.
      encoder_positions / decoder_positions: unused (see class docstring).
      enable_dropout / max_decode_length: accepted, unused.
      decode: must be False.
    """
    del encoder_positions, decoder_positions, enable_dropout, max_decode_length
    if decode:
      raise ValueError("T5XNetwork has no one-token cached decode: decoding is "
                       "SpeculativeEncoderDecoderModel.predict_batch_with_aux's")
    pad = self.config.pad_id
    encoder_tokens = jnp.asarray(encoder_input_tokens).astype(jnp.int32)
    decoder_tokens = jnp.asarray(decoder_input_tokens).astype(jnp.int32)
    encoder_valid = encoder_tokens != pad  # [batch, enc_len]
    encoder_attention = encoder_valid[:, :, None] & encoder_valid[:, None, :]
    if encoder_segment_ids is not None:
      encoder_attention &= _same_segment(encoder_segment_ids, encoder_segment_ids)
    encoded = self.encoder(self.token_embedder(encoder_tokens), encoder_valid,
                           attention_mask=encoder_attention)
    length = decoder_tokens.shape[1]
    positions = jnp.arange(length)[None]
    self_mask = cross_mask = None
    if decoder_target_tokens is not None:
      decoder_valid = jnp.asarray(decoder_target_tokens).astype(jnp.int32) != pad
      causal = positions[:, None, :] <= positions[:, :, None]  # [1, q, k]
      self_mask = causal & decoder_valid[:, :, None] & decoder_valid[:, None, :]
      cross_mask = decoder_valid[:, :, None] & encoder_valid[:, None, :]
      if decoder_segment_ids is not None:
        self_mask &= _same_segment(decoder_segment_ids, decoder_segment_ids)
      if encoder_segment_ids is not None and decoder_segment_ids is not None:
        cross_mask &= _same_segment(decoder_segment_ids, encoder_segment_ids)
    hidden, _ = self.decoder(self.token_embedder(decoder_tokens), positions, positions,
                             self.decoder.cross_key_values(encoded), encoder_valid,
                             self_mask=self_mask, cross_mask=cross_mask)
    return self.decoder.project_logits(hidden, self.token_embedder.embedding)


def _same_segment(query_segments: Array, key_segments: Array) -> Array:
  """[batch, q] and [batch, k] segment ids -> [batch, q, k] bool."""
  return jnp.asarray(query_segments)[:, :, None] == jnp.asarray(key_segments)[:, None, :]


def params_axes(params: PyTree) -> Dict[str, Any]:
  """T5X's 'params_axes' collection for our params: each `x` gets `x_axes`.

  T5X's partitioner reads every param's logical axis names from this
  collection (Flax's `param_with_axes` writes it in T5X's own network); the
  names are the T5 family's (`families/t5/sharding.py`), which are T5X's.
  """
  from flax.linen import partitioning as flax_partitioning
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params))
  return traverse_util.unflatten_dict({
      path[:-1] + (path[-1] + "_axes",): flax_partitioning.AxisMetadata(
          names=T5_FAMILY.param_logical_axes(path, np.ndim(value)))
      for path, value in flat.items()})


def encoder_context(encoder_tokens: Array, pad_id: int) -> Context:
  """The drafts' view of T5X's encoder inputs [batch, enc_len], traceable.

  T5X hands `predict_batch` `pad_id`-padded rows without lengths (under its
  pjit, so no host check): a row's context ends after its last non-padding
  token (`encoder_lengths`, the rule `T5Family.check_inputs` uses on the host).
  """
  return T5_FAMILY.context(encoder_tokens, encoder_lengths(encoder_tokens, pad_id))


def _as_config(config: Union[str, T5Config]) -> T5Config:
  if isinstance(config, T5Config):
    return config
  if isinstance(config, str) and config in CONFIGS:
    return get_config(config)
  raise TypeError(f"target_config must be a T5Config or a config name ({', '.join(CONFIGS)}), "
                  f"got {config!r}")


def _as_draft(draft: Union[None, Draft, T5Config, Model, str, os.PathLike],
              dtype: Optional[str]) -> Optional[Draft]:
  """A `Draft` for the draft argument.

  A T5Config means a model draft of that shape whose params come with each
  call (`params['draft']`); a path is a checkpoint `load_model` reads now.
  """
  if draft is None or isinstance(draft, Draft):
    return draft
  if isinstance(draft, T5Config):
    return ModelDraft(Model(draft, None))
  if isinstance(draft, Model):
    return ModelDraft(draft)
  if isinstance(draft, (str, os.PathLike)):
    from specdec_jax.loading import load_model
    return ModelDraft(load_model(draft, dtype=dtype))
  raise TypeError(f"draft must be a Draft, Model, T5Config or checkpoint path, "
                  f"got {type(draft).__name__}")


def _is_params_tree(params: Mapping[str, Any]) -> bool:
  """True for a bare T5 params tree (T5X's convention), False for {'target', 'draft'}."""
  return "token_embedder" in params


# The T5X variable collection that carries the draft's params when
# `draft_as_variables=True` (T5X's `flax_mutables`).
DRAFT_COLLECTION = "draft"
# Drafts of models built with draft_as_variables=True, for restore_draft_variables.
_DRAFTS_TO_RESTORE = []


def _shapes(tree) -> Any:
  return jax.tree_util.tree_map(lambda x: tuple(np.shape(x)), flax.core.unfreeze(tree))


@gin.configurable
def restore_draft_variables(state_dict: Mapping[str, Any], target_state_dict: Mapping[str, Any]
                            ) -> Mapping[str, Any]:
  """A T5X `RestoreStateTransformationFn` supplying the draft to a target-only checkpoint.

  With `draft_as_variables=True`, T5X's train state holds the draft under
  `flax_mutables['draft']`, which a checkpoint of the target lacks. Listed in
  `RestoreCheckpointConfig.state_transformation_fns`, this adds the arrays of
  the model's draft (matched by shapes) to the state read from the checkpoint,
  so T5X restores them, sharded by its partitioner, with the target.
  """
  wanted = target_state_dict.get("flax_mutables", {}).get(DRAFT_COLLECTION)
  if wanted is None or DRAFT_COLLECTION in state_dict.get("flax_mutables", {}):
    return state_dict
  for draft_params in reversed(_DRAFTS_TO_RESTORE):
    if _shapes(draft_params) == _shapes(wanted):
      mutables = dict(state_dict.get("flax_mutables", {}))
      mutables[DRAFT_COLLECTION] = jax.tree_util.tree_map(
          np.asarray, flax.core.unfreeze(draft_params))
      return dict(state_dict, flax_mutables=mutables)
  raise ValueError("restore_draft_variables: no SpeculativeEncoderDecoderModel built with "
                   "draft_as_variables=True has a draft of the shapes this train state wants")


@gin.configurable
class SpeculativeEncoderDecoderModel(_BASE):
  """T5X's `EncoderDecoderModel` over a target network, decoding with a draft.

  Args:
    target_config: the target's `T5Config` or a config name ('t5_1_1_xxl').
      Its dtype is the compute dtype; params may be stored in any dtype.
    draft: the draft: a checkpoint path (T5X `checkpoint_N`, Hugging Face or
      Orbax directory; loaded now with `load_model`, dtype `draft_dtype`), a
      `Model` or any `specdec_jax.drafts.Draft` (both carry their arrays), or
      a `T5Config` (a draft whose params come as `params['draft']`); None for
      plain decoding only.
    decode_fn: `decoding.temperature_sample` or `decoding.speculative_sample`.
    gamma: tokens drafted per iteration (speculative_sample).
    verification: how speculative_sample keeps drafts, a name in
      `core.verification.VERIFIERS`: "token" (default) or "block" (Sun et al. 2025's
      block verification; same output law, at least as many tokens per
      iteration on average). Only "token" with temperature_sample.
    temperature / topk / topp: sampling settings, shared by target and draft.
      topk defaults to 0 (no truncation), unlike T5X's topk=1.
    input_vocabulary / output_vocabulary / optimizer_def / label_smoothing /
      z_loss / loss_normalizing_factor / default_decoder_params: T5X's
      `EncoderDecoderModel` arguments (used when t5x is importable).
    block_width: width of every target call; default as in
      `specdec_jax.generate` (`decoding.resolve_block_width`: float32 on CPU
      1 or gamma + 1, else `decoding.DEFAULT_BLOCK_WIDTH`).
    draft_dtype: dtype a draft checkpoint is loaded in (default: the
      target's compute dtype).
    draft_as_variables: pass the draft's params through T5X's train state
      (variable collection 'draft', T5X's `flax_mutables`): T5X's partitioner
      shards them by their logical axes and hands them to `predict_batch` as
      arguments. Otherwise they are constants of T5X's compiled infer step
      (copied into the program: fine for small drafts). Needs
      `RestoreCheckpointConfig.state_transformation_fns =
      [@t5x_model.restore_draft_variables]` when restoring a target checkpoint.
  """

  def __init__(self, target_config: Union[str, T5Config],
               draft: Union[None, Draft, T5Config, Model, str, os.PathLike] = None,
               decode_fn: Callable[..., Any] = decoding.temperature_sample,
               gamma: int = 4, temperature: float = 0.0, topk: int = 0,
               topp: Optional[float] = None, input_vocabulary=None, output_vocabulary=None,
               block_width: Optional[int] = None, draft_dtype: Optional[str] = None,
               optimizer_def=None, label_smoothing: float = 0.0, z_loss: float = 0.0,
               loss_normalizing_factor=None, default_decoder_params=None,
               draft_as_variables: bool = False, verification: str = "token"):
    # Gin's dynamic registration hands over a wrapper of the function.
    decode_fn = inspect.unwrap(decode_fn)
    if decode_fn not in (decoding.temperature_sample, decoding.speculative_sample):
      raise ValueError("decode_fn must be decoding.temperature_sample or "
                       f"decoding.speculative_sample, got {decode_fn!r}")
    target_config = _as_config(target_config)
    self.target_config = target_config
    speculative = decode_fn is decoding.speculative_sample
    if speculative and draft is None:
      raise ValueError("decode_fn=speculative_sample needs a draft")
    if not speculative and verification != "token":
      raise ValueError(f"verification={verification!r} applies to speculative decoding; "
                       "pass decode_fn=speculative_sample and a draft")
    self.draft = _as_draft(draft, draft_dtype or target_config.dtype)
    if self.draft is not None:
      self.draft.check_compatible(target_config)
    # The checks `generate` and the launcher make, with T5X's decode length left open;
    # the block width as in `generate`, so plain and speculative decoding of one model
    # give identical greedy outputs.
    self.settings = plan_settings(
        target_config, self.draft if speculative else None, max_decode_steps=None,
        temperature=temperature, topk=topk, topp=topp, gamma=gamma, verification=verification,
        block_width=block_width)
    if speculative and (self.draft.reads != NOTHING or
                        self.draft.block_slots(self.settings.gamma) != self.settings.gamma + 1):
      raise ValueError(f"the T5X model decodes chain drafts that read nothing from the target "
                       f"(a model, n-gram, prompt lookup or adaptive draft); a "
                       f"{type(self.draft).__name__} needs `specdec_jax.generate`")
    self.verification = verification
    self._decode_fn = decode_fn
    self.gamma = self.settings.gamma if speculative else int(gamma)
    self.block_width = self.settings.block_width
    sampling_settings = self.settings.sampling
    self.temperature = sampling_settings.temperature
    self.topk, self.topp = sampling_settings.topk, sampling_settings.topp
    self.draft_as_variables = bool(draft_as_variables)
    if self.draft_as_variables:
      if self.draft is None or self.draft.params is None:
        raise ValueError("draft_as_variables=True needs a draft with params (a checkpoint "
                         "path, Model or Draft)")
      _DRAFTS_TO_RESTORE.append(self.draft.params)
    self.module = T5XNetwork(target_config)
    if _BASE is not object:  # Needs a source install of t5x.
      super().__init__(module=self.module, input_vocabulary=input_vocabulary,
                       output_vocabulary=output_vocabulary, optimizer_def=optimizer_def,
                       decode_fn=decode_fn, label_smoothing=label_smoothing, z_loss=z_loss,
                       loss_normalizing_factor=loss_normalizing_factor,
                       default_decoder_params=default_decoder_params)

  @property
  def is_speculative(self) -> bool:
    return self._decode_fn is decoding.speculative_sample

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    """T5X's initial variables: {'params': target params, 'params_axes': their axes}.

    With draft_as_variables, also {'draft': draft params, 'draft_axes': ...}.

    Args:
      rng: init PRNG key.
      input_shapes: feature name -> shape; 'encoder_input_tokens' and
        'decoder_input_tokens' are required (as in T5X).
      input_types: feature name -> dtype (T5X's default: float32).
    """
    input_types = {} if input_types is None else input_types

    def ones(name, default=jnp.float32):
      if name not in input_shapes:
        return None
      return jnp.ones(input_shapes[name], input_types.get(name, default))

    decoder = ones("decoder_input_tokens")
    variables = self.module.init(
        rng, ones("encoder_input_tokens"), decoder, decoder,
        encoder_segment_ids=ones("encoder_segment_ids", jnp.int32),
        decoder_segment_ids=ones("decoder_segment_ids", jnp.int32),
        enable_dropout=False, decode=False)
    initial = {"params": variables["params"], "params_axes": params_axes(variables["params"])}
    if self.draft_as_variables:
      initial[DRAFT_COLLECTION] = self.draft.params
      initial[DRAFT_COLLECTION + "_axes"] = params_axes(self.draft.params)
    return flax.core.freeze(initial)

  def _compute_logits(self, params: PyTree, batch: Mapping[str, Array], dropout_rng=None,
                      mutable=False, other_variables=None):
    """T5X's teacher-forced forward pass (score_batch, loss_fn); target params only."""
    if not _is_params_tree(params) and "target" in params:
      params = params["target"]
    if _BASE is object:
      raise NotImplementedError("score_batch / loss_fn need T5X (a source install)")
    # T5X hands its flax_mutables to the network; the draft is not the network's.
    other_variables = {k: v for k, v in (other_variables or {}).items()
                       if k != DRAFT_COLLECTION}
    return super()._compute_logits(params, batch, dropout_rng=dropout_rng, mutable=mutable,
                                   other_variables=other_variables)

  def _decode(self, target_params: PyTree, draft_params: Optional[PyTree], encoder_tokens: Array,
              decoder_inputs: Array, rng: Array, num_decodes: int, max_decode_steps):
    """Traced body: encode + cache, then the decode loop. See predict_batch_with_aux."""
    batch, length = decoder_inputs.shape
    context = encoder_context(encoder_tokens, self.target_config.pad_id)
    # The family's start: the encoder output's cross-attention keys/values and
    # room for `length` decoder positions. T5 loop positions are absolute (offset 0).
    cache = T5_FAMILY.start(self.target_config, target_params, context.tokens, context.lengths,
                            length).cache
    target_fn = T5_FAMILY.block_fn(self.target_config, target_params)
    common = dict(eos_id=self.target_config.eos_id, decode_rng=rng,
                  temperature=self.temperature, topk=self.topk, topp=self.topp,
                  max_decode_steps=max_decode_steps)
    if not self.is_speculative:
      decodes, log_prob = self._decode_fn(
          decoder_inputs, cache, decoding.block_to_state_fn(target_fn, self.block_width),
          num_decodes=num_decodes, **common)
      return decodes, {"scores": log_prob}
    draft_state = self.draft.init_state(draft_params, DraftStart(context, length, self.gamma))
    proposer = self.draft.proposer(draft_params, ProposalPlan(
        self.settings.sampling, self.gamma, self.block_width))
    decodes, stats = self._decode_fn(decoder_inputs, cache, target_fn, draft_state, None,
                                     gamma=self.gamma, proposer=proposer,
                                     block_width=self.block_width,
                                     verification=self.verification, **common)
    return decodes, dict(stats, scores=self._log_likelihood(target_params, encoder_tokens,
                                                            decoder_inputs, decodes))

  def _log_likelihood(self, target_params: PyTree, encoder_tokens: Array, decoder_inputs: Array,
                      decodes: Array) -> Array:
    """[batch] log p_target(decode | input) under the raw softmax, EOS included.

    The speculative loop keeps no per-token log-probs (accepted drafts never
    sample from the target's distribution), so T5X's 'scores' are recomputed
    by one teacher-forced target pass: T5X's `score_batch` of the decodes.
    """
    shifted = jnp.concatenate([decoder_inputs[:, :1], decodes[:, :-1]], axis=1)
    logits = self.module.apply({"params": target_params}, encoder_tokens, shifted, decodes,
                               enable_dropout=False)
    token_log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1),
                                          decodes[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(decodes != self.target_config.pad_id, token_log_probs, 0.0), axis=-1)

  def predict_batch_with_aux(self, params: Mapping[str, PyTree], batch: Mapping[str, Array],
                             rng: Optional[Array] = None, decoder_params=None,
                             return_all_decodes: Optional[bool] = None,
                             num_decodes: Optional[int] = None,
                             prompt_with_targets: bool = False,
                             max_decode_steps: Optional[int] = None,
                             flax_mutables: Optional[Mapping[str, PyTree]] = None
                             ) -> Tuple[Array, Dict[str, Array]]:
    """Decodes a batch, T5X style.

    Args:
      params: the target's params tree (what T5X restores and passes), the
        draft's then being the model's own; or `{'target': ..., 'draft': ...}`
        ('draft' may be absent for temperature_sample or a draft with params).
      batch: 'encoder_input_tokens' [batch, enc_len] int32 and
        'decoder_input_tokens' [batch, dec_len] int32 (only the shape is used:
        decoder prompts are not supported).
      rng: decode PRNG key (default PRNGKey(0)).
      decoder_params: None, or T5X's {'decode_rng': key} (sampling settings
        live on the model).
      return_all_decodes: temperature_sample only: return [batch,
        num_decodes, dec_len] instead of the most likely decode (default as
        T5X: the model's `default_decoder_params`, else False).
      num_decodes: samples per input (temperature_sample only; 1 otherwise).
      prompt_with_targets: unsupported (must be False).
      max_decode_steps: at most this many tokens (default dec_len).
      flax_mutables: T5X's other variable collections; with
        draft_as_variables, the draft's params are flax_mutables['draft'].
    Returns:
      decodes [batch, dec_len] int32 (0 after EOS) and aux: {'scores': [batch]}
      as T5X's temperature_sample (log-prob of each decode); speculative_sample
      adds its per-row counters (`core.counters.LoopCounters`), its 'scores' being
      the target's log-likelihood of each decode.
    """
    defaults = getattr(self, "_default_decoder_params", None)
    if return_all_decodes is None:
      return_all_decodes = defaults.return_all_decodes if defaults else False
    if num_decodes is None:
      num_decodes = defaults.num_decodes if defaults else 1
    decoder_params = dict(decoder_params or {})
    if "decode_rng" in decoder_params:
      if rng is not None:
        raise ValueError("got an rng both as `rng` and as decoder_params['decode_rng']")
      rng = decoder_params.pop("decode_rng")
    if decoder_params:
      raise ValueError(f"decoder_params {sorted(decoder_params)} are not supported: set "
                       "sampling on the model")
    if prompt_with_targets:
      raise ValueError("prompt_with_targets is not supported")
    encoder_tokens = jnp.asarray(batch["encoder_input_tokens"], jnp.int32)
    # As T5X without prompt_with_targets: decoder_input_tokens (in T5X's infer,
    # the targets shifted right) only give the decode length, never a prompt.
    decoder_inputs = jnp.zeros_like(jnp.asarray(batch["decoder_input_tokens"], jnp.int32))
    if encoder_tokens.ndim != 2 or decoder_inputs.ndim != 2:
      raise ValueError("encoder_input_tokens and decoder_input_tokens must be [batch, length]")
    if encoder_tokens.shape[0] != decoder_inputs.shape[0]:
      raise ValueError(f"batch mismatch: {encoder_tokens.shape[0]} encoder rows, "
                       f"{decoder_inputs.shape[0]} decoder rows")
    if self.is_speculative and num_decodes != 1:
      raise ValueError("speculative_sample draws one decode per input (num_decodes=1)")
    target_params, draft_params = self._split_params(params, flax_mutables)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    # Target-only decoding ignores the draft and gamma: leaving them out of the
    # key lets models that differ only there share one compiled decoder (a
    # launcher sweeping gamma compiles its target-only baseline once).
    draft_key = ((None if self.draft is None else self.draft.compile_key(), self.gamma,
                  self.verification) if self.is_speculative else (None, None, None))
    key = (self.target_config, *draft_key, self._decode_fn.__name__, self.block_width,
           self.temperature, self.topk, self.topp, int(num_decodes), max_decode_steps)
    # Shared by every model instance with the same static structure, so re-creating a
    # model (one per experiment) never recompiles.
    program = PROGRAMS.get(("t5x",) + key, lambda: jax.jit(functools.partial(
        self._decode, num_decodes=int(num_decodes), max_decode_steps=max_decode_steps)))
    decodes, aux = program(target_params, draft_params, encoder_tokens, decoder_inputs, rng)
    if not self.is_speculative and not return_all_decodes:
      # T5X: decodes are sorted by increasing log-prob; keep the most likely.
      decodes, aux = decodes[:, -1], {"scores": aux["scores"][:, -1]}
    return decodes, aux

  def _split_params(self, params: Mapping[str, PyTree],
                    flax_mutables: Optional[Mapping[str, PyTree]] = None
                    ) -> Tuple[PyTree, Optional[PyTree]]:
    """(target params, draft params or None) from either params convention."""
    if not isinstance(params, Mapping):
      raise TypeError(f"params must be a mapping, got {type(params).__name__}")
    if _is_params_tree(params):
      target, draft = params, None
    elif "target" in params:
      target, draft = params["target"], params.get("draft")
    else:
      raise ValueError("params must be the target's T5 params tree (token_embedder, encoder, "
                       f"decoder) or {{'target': ..., 'draft': ...}}; got keys {sorted(params)}")
    if not self.is_speculative:
      return dict(target), None
    if draft is None and flax_mutables and DRAFT_COLLECTION in flax_mutables:
      draft = flax_mutables[DRAFT_COLLECTION]
    if draft is None:
      draft = self.draft.params
    if draft is None:
      raise ValueError("params must be {'target': ..., 'draft': ...}: this draft (given as a "
                       "T5Config) has no params of its own; or name a draft checkpoint")
    return dict(target), draft

  def predict_batch(self, params: Mapping[str, PyTree], batch: Mapping[str, Array],
                    rng: Optional[Array] = None,
                    flax_mutables: Optional[Mapping[str, PyTree]] = None, **kwargs) -> Array:
    """`predict_batch_with_aux` without the aux: decodes [batch, dec_len]."""
    return self.predict_batch_with_aux(params, batch, rng=rng, flax_mutables=flax_mutables,
                                       **kwargs)[0]
