"""specdec_jax: exact speculative decoding for T5 and decoder-only models in JAX/Flax.

Public API:
  load_model (every family), save_model, export_hf, export_t5x, Model, T5Config, generate, GenerateOutput, SpeculativeStats,
  temperature_sample, speculative_sample, speculative_step, adjust_probs;
  drafts (ModelDraft, NgramDraft, PromptLookupDraft, AdaptiveGammaDraft), theory,
  sharding, train / distill, load_demo_pair.
"""

from specdec_jax.families.t5.checkpoints import (CheckpointError, export_hf, export_t5x, load_checkpoint_model,
                                     save_model)
from specdec_jax.demo_pair import DemoPair, load_demo_pair
from specdec_jax.train.distill import distill_drafts, measure_alpha
from specdec_jax.families.t5.embed import EmbeddingError, embed_model
from specdec_jax.core.decoding import DecodingState, speculative_sample, temperature_sample
from specdec_jax.drafts import (AdaptiveGammaDraft, Draft, ModelDraft, NgramDraft,
                                PromptLookupDraft, as_draft)
from specdec_jax.generation import generate
from specdec_jax.core.outputs import GenerateOutput, SpeculativeStats
from specdec_jax.loading import load_decoder_only_model, load_model
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import CONFIGS, T5Config, get_config
from specdec_jax import data, sharding
from specdec_jax.train import distill
from specdec_jax.core import theory
from specdec_jax.train import trainer as train
from specdec_jax.core.sampling import adjust_probs
from specdec_jax.sharding import (Partitioner, load_sharded_model, make_partitioners, plan_memory,
                                  plan_speculative_memory, shard_model)
from specdec_jax.core.speculative import batched_speculative_step, speculative_step
from specdec_jax.t5x.model import SpeculativeEncoderDecoderModel
from specdec_jax.train.trainer import TrainState, fit, make_optimizer, train_step
# Decoder-only models (GPT-2 / Llama / Qwen2 layouts).
from specdec_jax.families.decoder_only.checkpoints import export_hf_decoder_only, load_hf_decoder_only
from specdec_jax.decoder_only_demo_pair import DecoderOnlyDemoPair, load_decoder_only_demo_pair
from specdec_jax.decoder_only_generation import decoder_only_generate
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.drafts.decoder_only_draft import DecoderOnlyModelDraft
from specdec_jax.drafts.decoder_only_prompt_lookup import DecoderOnlyPromptLookupDraft
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                get_decoder_config)
from specdec_jax.families.decoder_only import sharding as decoder_only_sharding
from specdec_jax.train import decoder_only as train_decoder_only

__version__ = "0.1.0"
