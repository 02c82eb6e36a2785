"""specdec_jax: exact speculative decoding for every model family, in JAX/Flax.

Layers (each a folder or module; nothing imports upward from `core/`):
  core/      sampling, token trees, verification/ (the token, block and tree rules and
             their registries), the decode loops, theory, outputs, dtypes
  families/  the family contract (base.py), the registry, and one folder per family
             (t5/, decoder_only/): network, fused decode, configs, checkpoints, axes
  drafts/    ModelDraft, NgramDraft, PromptLookupDraft, AdaptiveGammaDraft, TreeDraft,
             FeatureDraft, MedusaDraft, ParallelDraft and DFlashDraft (parallel.py: one-call
             drafters), MtpDraft (a checkpoint's own MTP modules), SparseCacheDraft (the
             target over a budgeted view of its own cache)
  generation.py (staged: settings.py, placement.py, memory.py, programs.py), slots.py
  (generate_many), loading.py, sharding.py, multihost.py, scaled_pair.py the entry points (scaled_pair: a trained
                                           pair embedded at a large model's cost)
  evaluation/                              the standard evaluation: benchmarks, methods x
                                           categories, speedup / tau / equality
                                           (`python -m experiments.evaluate`)
  t5x/, train/, tools/                     the T5X adapter, training, small tools
"""

from specdec_jax import data, memory, multihost, sharding
from specdec_jax.compile_cache import enable_compile_cache
from specdec_jax.core import theory
from specdec_jax.core.decoding import DecodingState, speculative_sample, temperature_sample
from specdec_jax.core.outputs import GenerateOutput, SpeculativeStats
from specdec_jax.core.sampling import adjust_probs
from specdec_jax.core.verification import TREE_LAWS, VERIFIERS
from specdec_jax.core.verification.block import (batched_block_verification_step,
                                                 block_verification_step)
from specdec_jax.core.verification.token import batched_speculative_step, speculative_step
from specdec_jax.demo_pair import DemoPair, load_demo_pair
from specdec_jax.core.token_tree import TreeShape
from specdec_jax.drafts import (AdaptiveGammaDraft, DFlashDraft, Draft, DraftStart,
                                DynamicTreeDraft, FeatureDraft, MedusaDraft, ModelDraft,
                                MtpDraft, NgramDraft, ParallelDraft, ParallelDrafter,
                                PromptLookupDraft, ProposalPlan, Reads, SparseCacheDraft,
                                TreeDraft, as_draft, chain_proposer, target_features)
from specdec_jax.core.decoding import ChainProposer, TargetFns
from specdec_jax.core.sampling import Sampling
from specdec_jax.core.tree_decoding import TreeProposer
from specdec_jax.settings import DecodeSettings, plan_settings
from specdec_jax.families.base import Context, DecodeStart, Family
from specdec_jax.families.decoder_only.feature_head import DecoderOnlyFeatureHead
from specdec_jax.families.feature_head import FeatureHead
from specdec_jax.families.t5.feature_head import T5FeatureHead
# The old name of `export_hf` for decoder-only models (`sj.export_hf` serves every family).
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                      get_decoder_config)
from specdec_jax.families.decoder_only.eagle3_head import Eagle3Head
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.registry import families, family_of, register
from specdec_jax.families.t5.checkpoints import export_t5x, save_model
from specdec_jax.families.t5.config import CONFIGS, T5Config, get_config
from specdec_jax.families.kernel_layout import with_kernel_layout
from specdec_jax.families.widen import EmbeddingError
from specdec_jax.scaled_pair import MemoryBudgetError, ScaledPair, embed_model, scale_pair
from specdec_jax.families.t5.model import Model
from specdec_jax.families.tensor_io import CheckpointError
from specdec_jax.generation import generate
from specdec_jax.slots import ManyOutput, SlotStats, generate_many
from specdec_jax.loading import (export_hf, load_dflash_draft, load_feature_draft,
                                 load_medusa_draft, load_model, load_mtp_draft,
                                 load_parallel_draft,
                                 load_sharded_model, save_dflash_draft, save_feature_draft,
                                 save_medusa_draft,
                                 shard_model)
from specdec_jax import evaluation
from specdec_jax.evaluation.benchmarks import load_benchmark
from specdec_jax.evaluation.questions import Benchmark, Question
from specdec_jax.memory import InsufficientMemory, plan_memory, plan_speculative_memory
from specdec_jax.sharding import Partitioner, make_partitioners
from specdec_jax.t5x.model import SpeculativeEncoderDecoderModel
from specdec_jax.train import distill
from specdec_jax.train import trainer as train
from specdec_jax.train.distill import distill_drafts, measure_alpha
from specdec_jax.train.feature_heads import feature_batch, feature_loss_fn, ttt_anchors
from specdec_jax.train.trainer import TrainState, fit, make_optimizer, train_step

__version__ = "0.2.0"
