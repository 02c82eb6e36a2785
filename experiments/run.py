r"""Runs one target/draft pair on one task: autoregressive vs speculative decoding.

Usage (T5X style; later flags override earlier ones):

  python -m experiments.run \
    --gin_file=configs/pairs/t5_1_1_xxl__small.gin \
    --gin_file=configs/tasks/wmt_ende.gin \
    --gin.TARGET_CHECKPOINT="'/ckpt/xxl'" --gin.DRAFT_CHECKPOINT="'/ckpt/small'" \
    --gin.VOCABULARY="'/ckpt/spiece.model'" --gin.GAMMA=7 \
    --output_dir=/tmp/ende_small --num_examples=100

  # Offline: the tiny random pair on a local file.
  python -m experiments.run --gin_file=configs/pairs/tiny_demo.gin \
    --gin_file=configs/tasks/local_file.gin --gin.INPUT_FILE="'inputs.jsonl'" \
    --output_dir=/tmp/tiny

Both decoders see the same batches (the last one padded with copies of its
final example, dropped from every statistic) after one compile warm-up each;
batches alternate between the two so that machine drift hits both alike.

Writes `results.json` and `results.md` (the paper's Table 2 row) atomically,
and only once every measurement succeeded: a failed run leaves no results.
"""

import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Dict, Optional, Sequence, Union

from absl import app
from absl import flags
from absl import logging
import gin
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from experiments.gin_flags import (GIN_BINDINGS, GIN_FILES, GIN_SEARCH_PATHS, parse_gin,
                                   rewrite_gin_args)
from specdec_jax.core import decoding
from specdec_jax.core import results as results_lib
from specdec_jax.core import sampling
from specdec_jax import sharding
from specdec_jax import tasks
from specdec_jax.core import theory
from specdec_jax.tools.profiling import block_step_seconds
from specdec_jax.drafts import Draft, ModelDraft
from specdec_jax.core.outputs import SpeculativeStats, sequence_lengths
from specdec_jax.loading import load_model, shard_model
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import T5Config
from specdec_jax.t5x.model import SpeculativeEncoderDecoderModel
from specdec_jax.tools.testing import perturbed_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

gin.external_configurable(T5Config, module="specdec_jax")

# Family false-alarm rate of the temperature > 0 distribution check (two sign
# tests, Bonferroni-corrected).
DISTRIBUTION_CHECK_FALSE_ALARM = 0.01
# Shape fields a checkpoint must agree on with the config a pair file names.
_SHAPE_FIELDS = ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim",
                 "num_encoder_layers", "num_decoder_layers", "mlp_activations",
                 "logits_via_embedding")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to obtain a target or draft model.

  Attributes:
    name: label for reports (Table 2's draft column: 'small', 'base', ...).
    config: the network's T5Config (random init when no checkpoint; with a
      checkpoint, its shapes must match the checkpoint's).
    checkpoint: a path for `specdec_jax.load_model` (HF / T5X / Orbax).
    seed: random-init seed.
    dtype: 'float32' / 'bfloat16'; default float32 on CPU, bfloat16 elsewhere.
    perturb_target: drafts only, for offline demos: use the target's weights
      times (1 + perturb_target * N(0, 1)) instead of a model of its own.
  """
  name: str = "model"
  config: Optional[T5Config] = None
  checkpoint: Optional[str] = None
  seed: int = 0
  dtype: Optional[str] = None
  perturb_target: Optional[float] = None

  def validate(self, role: str) -> None:
    """Fails fast, before anything loads, on a missing path or an empty spec."""
    if self.checkpoint is not None:
      if not os.path.exists(self.checkpoint):
        raise FileNotFoundError(f"{role} checkpoint not found: {self.checkpoint!r}")
    elif self.config is None and self.perturb_target is None:
      raise ValueError(f"{role} ModelSpec needs a config, a checkpoint or perturb_target")
    if self.perturb_target is not None and role != "draft":
      raise ValueError("perturb_target applies to the draft only")


_SPECULATIVE_COUNTERS = frozenset(decoding.init_stats(1, 1))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Experiment:
  """One measurement: a target, a draft, a task and the decoding settings.

  `draft` is a `ModelSpec` or any `specdec_jax.drafts.Draft` (n-gram, prompt
  lookup, ...). max_decode_steps must be >= gamma + 1 (the block that measures
  verification cost has gamma + 1 tokens). block_width: the target's block
  width W in both loops (default `decoding.resolve_block_width`'s: gamma + 1
  in float32 on CPU, else `decoding.DEFAULT_BLOCK_WIDTH`); greedy
  outputs are checked against target-only decoding at W, and the speedup is
  against the faster of target-only decoding at W and at width 1.
  """
  target: ModelSpec = gin.REQUIRED
  draft: Union[ModelSpec, Draft] = gin.REQUIRED
  task: tasks.Task = gin.REQUIRED
  tokenizer: tasks.Tokenizer = gin.REQUIRED
  gamma: int = 4
  temperature: float = 0.0
  topk: int = 0
  topp: float = 0.0
  batch_size: int = 1
  max_input_length: int = 256
  max_decode_steps: int = 128
  seed: int = 0
  timing_repeats: int = 20
  block_width: Optional[int] = None


# ---------------------------------------------------------------------------
# Loading.


@functools.lru_cache(maxsize=1)
def _random_model(config: T5Config, dtype: str, seed: int) -> Model:
  # Cached: consecutive experiments (Table 2 stand-in rows) reuse the target
  # instead of re-initialising it; random init is deterministic.
  return load_model(config, dtype=dtype, seed=seed)


def load_spec(spec: ModelSpec, role: str) -> Model:
  """Loads or initialises the model `spec` describes (not perturb_target)."""
  if spec.checkpoint is None:
    logging.info("%s: random %s weights (seed %d)", role, spec.name, spec.seed)
    return _random_model(spec.config, spec.dtype or _default_dtype(), spec.seed)
  logging.info("%s: loading %s", role, spec.checkpoint)
  model = load_model(spec.checkpoint, dtype=spec.dtype)
  if spec.config is not None:
    diffs = [f"{f}: checkpoint {getattr(model.config, f)!r} vs config "
             f"{getattr(spec.config, f)!r}" for f in _SHAPE_FIELDS
             if getattr(model.config, f) != getattr(spec.config, f)]
    if diffs:
      raise ValueError(f"{role} checkpoint {spec.checkpoint!r} does not match the configured "
                       f"{spec.name} shapes: " + "; ".join(diffs))
  return model


def _default_dtype() -> str:
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_draft(spec: Union[ModelSpec, Draft], target: Model) -> Draft:
  if isinstance(spec, Draft):
    return spec
  if spec.perturb_target is not None:
    logging.info("draft: the target with %.0f%% weight noise", 100 * spec.perturb_target)
    return ModelDraft(perturbed_model(target, spec.perturb_target, seed=spec.seed + 1))
  return ModelDraft(load_spec(spec, "draft"))


def batches(tokens: np.ndarray, batch_size: int):
  """Yields (batch [batch_size, len], number of real rows); pads the last batch."""
  for start in range(0, len(tokens), batch_size):
    chunk = tokens[start:start + batch_size]
    real = len(chunk)
    if real < batch_size:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, axis=0)])
    yield chunk, real


# ---------------------------------------------------------------------------
# Measurements.


def mean_log_probs(model: Model, encoder_tokens, sequences: np.ndarray, lengths: np.ndarray,
                   temperature: float, topk: int, topp: float) -> np.ndarray:
  """[batch] mean log-probability of each row's tokens under the target's sampling
  distribution (teacher forced)."""
  decoder_inputs = np.pad(sequences[:, :-1], ((0, 0), (1, 0)))
  logits = model.logits(encoder_tokens, decoder_inputs)
  probs = sampling.adjust_probs(logits, temperature, topk, topp)
  token_probs = np.asarray(jnp.take_along_axis(probs, jnp.asarray(sequences)[..., None],
                                               axis=-1)[..., 0])
  mask = np.arange(sequences.shape[1])[None] < lengths[:, None]
  logs = np.log(np.maximum(token_probs, 1e-30))
  return (logs * mask).sum(1) / np.maximum(mask.sum(1), 1)


def sign_test_p_value(differences: Sequence[float]) -> float:
  """Exact two-sided sign test of "median difference 0" (zeros dropped)."""
  nonzero = [d for d in differences if d != 0]
  n = len(nonzero)
  if n == 0:
    return 1.0
  positives = sum(d > 0 for d in nonzero)
  tail = min(positives, n - positives)
  p = 2 * sum(math.comb(n, i) for i in range(tail + 1)) / 2**n
  return min(1.0, p)


def distribution_check(base_stats: Dict[str, np.ndarray],
                       spec_stats: Dict[str, np.ndarray]) -> Dict[str, Any]:
  """Are speculative samples distributed like the baseline's (temperature > 0)?

  For every input the two decoders drew one sample each with independent
  keys; under exactness (Theorem 3.1) the pair is exchangeable, so each
  per-input difference of a statistic is positive or negative with
  probability 1/2. An exact sign test per statistic (output length; mean
  target log-probability), Bonferroni-corrected, fails with probability at
  most DISTRIBUTION_CHECK_FALSE_ALARM when the distributions are equal.
  It detects shifts in these statistics, not every possible difference.
  """
  threshold = DISTRIBUTION_CHECK_FALSE_ALARM / len(base_stats)
  p_values = {name: sign_test_p_value(spec_stats[name] - base_stats[name])
              for name in base_stats}
  return dict(test="paired sign tests (exact, two-sided), Bonferroni",
              false_alarm_rate=DISTRIBUTION_CHECK_FALSE_ALARM, p_values=p_values,
              baseline_means={k: float(np.mean(v)) for k, v in base_stats.items()},
              speculative_means={k: float(np.mean(v)) for k, v in spec_stats.items()},
              passed=bool(min(p_values.values()) >= threshold))


# ---------------------------------------------------------------------------
# The experiment.


def make_partitioners(mesh_shape: Optional[str]):
  """--mesh_shape, else a configs/sharding/*.gin binding, else None (one device)."""
  if mesh_shape is None:
    try:
      gin.query_parameter("specdec_jax.sharding.make_partitioners.mesh_shape")
    except ValueError:
      return None
    return sharding.make_partitioners()
  return sharding.make_partitioners(mesh_shape)


def run_experiment(exp: Experiment, output_dir: str, num_examples: Optional[int] = None,
                   mesh_shape: Optional[str] = None) -> Dict[str, Any]:
  """Runs `exp`, writes results.json and results.md into output_dir, returns the results."""
  if exp.max_decode_steps < exp.gamma + 1:
    raise ValueError(f"max_decode_steps ({exp.max_decode_steps}) must be >= gamma + 1 "
                     f"({exp.gamma + 1})")
  if exp.batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {exp.batch_size}")
  # Everything that can fail cheaply fails before any model is loaded.
  exp.task.validate()
  exp.target.validate("target")
  if isinstance(exp.draft, ModelSpec):
    exp.draft.validate("draft")
  if exp.target.config is not None:
    tasks.check_vocab(exp.tokenizer, exp.target.config, "target")
  examples = exp.task.load(num_examples)
  logging.info("%d examples from task %s", len(examples), exp.task.name)

  target = load_spec(exp.target, "target")
  tasks.check_vocab(exp.tokenizer, target.config, "target")
  draft = load_draft(exp.draft, target)
  draft.check_compatible(target.config)
  partitioners = make_partitioners(mesh_shape)
  if partitioners is not None:
    # Params go onto the mesh leaf by leaf; the compiled decode follows their
    # shardings (GSPMD), the batch is split over `data`.
    target_part, draft_part = partitioners
    target = shard_model(target, target_part)
    if isinstance(draft, ModelDraft):
      draft = ModelDraft(shard_model(draft.model, draft_part),
                         draft.confidence_threshold)
  draft_model = draft.model if isinstance(draft, ModelDraft) else None

  encoder_tokens = tasks.encode_batch(exp.tokenizer, [e.inputs for e in examples],
                                      exp.max_input_length)
  settings = dict(gamma=exp.gamma, temperature=exp.temperature, topk=exp.topk, topp=exp.topp)
  width = decoding.resolve_block_width(exp.block_width, exp.gamma, dtype=target.config.dtype)
  # Two exact target-only decoders: at the speculative loop's width W (the
  # reference its greedy outputs must equal bit for bit) and at width 1
  # (often faster on CPU). The speedup is against the faster of the two.
  reference = SpeculativeEncoderDecoderModel(target.config, draft=draft, block_width=width,
                                             **settings)
  narrow = (SpeculativeEncoderDecoderModel(target.config, draft=draft, block_width=1,
                                           **settings) if width != 1 else None)
  speculative = SpeculativeEncoderDecoderModel(
      target.config, draft=draft, decode_fn=decoding.speculative_sample, block_width=width,
      **settings)
  params = {"target": target.params, "draft": draft.params}
  decoder_inputs = np.zeros((exp.batch_size, exp.max_decode_steps), np.int32)
  rng = jax.random.PRNGKey(exp.seed)

  def decode(model, batch, key):
    start = time.perf_counter()
    if partitioners is not None:
      batch = jax.device_put(batch, partitioners[0].batch_sharding(batch.shape))
    decodes, aux = model.predict_batch_with_aux(
        params, {"encoder_input_tokens": batch, "decoder_input_tokens": decoder_inputs},
        rng=key)
    decodes = jax.block_until_ready(decodes)
    if jax.process_count() > 1:  # Rows live on other hosts' devices too.
      from jax.experimental import multihost_utils
      decodes, aux = multihost_utils.process_allgather((decodes, aux), tiled=True)
    return np.asarray(decodes), jax.device_get(aux), time.perf_counter() - start

  all_batches = list(batches(encoder_tokens, exp.batch_size))
  logging.info("compiling (warm-up on the first batch)")
  decode(reference, all_batches[0][0], rng)
  if narrow is not None:
    decode(narrow, all_batches[0][0], rng)
  decode(speculative, all_batches[0][0], rng)

  walltime = {"baseline": 0.0, "baseline_width_1": 0.0, "speculative": 0.0}
  outputs = {"baseline": [], "speculative": []}
  row_stats = []
  for index, (batch, real) in enumerate(tqdm.tqdm(all_batches, desc="batches", unit="batch")):
    # Independent keys for the two decoders: the distribution check needs
    # independent samples (greedy ignores them).
    base_key = jax.random.fold_in(rng, 2 * index)
    spec_key = jax.random.fold_in(rng, 2 * index + 1)
    base_out, _, base_time = decode(reference, batch, base_key)
    if narrow is not None:
      walltime["baseline_width_1"] += decode(narrow, batch, base_key)[2]
    spec_out, stats, spec_time = decode(speculative, batch, spec_key)
    walltime["baseline"] += base_time
    walltime["speculative"] += spec_time
    outputs["baseline"].append(base_out[:real])
    outputs["speculative"].append(spec_out[:real])
    # The aux also carries T5X's own entries (scores); keep the counters.
    row_stats.append({k: np.asarray(v)[:real] for k, v in stats.items()
                      if k in _SPECULATIVE_COUNTERS})
  sequences = {k: np.concatenate(v) for k, v in outputs.items()}
  lengths = {k: np.asarray(sequence_lengths(jnp.asarray(v), target.config.eos_id))
             for k, v in sequences.items()}
  stats = SpeculativeStats(gamma=exp.gamma, emitted=lengths["speculative"],
                           **{k: np.concatenate([s[k] for s in row_stats])
                              for k in row_stats[0]})

  logging.info("timing decode steps (c and the verification cost)")
  probe = jnp.asarray(all_batches[0][0])
  target_step = block_step_seconds(target, probe, 1, exp.max_decode_steps, exp.timing_repeats)
  # One target call on gamma + 1 tokens, relative to one token (1 if
  # verification were free, as Theorem 3.8 assumes).
  verify_cost = block_step_seconds(target, probe, exp.gamma + 1, exp.max_decode_steps,
                                   exp.timing_repeats) / target_step
  c = None
  draft_step = None
  if draft_model is not None:
    draft_step = block_step_seconds(draft_model, probe, 1, exp.max_decode_steps,
                                    exp.timing_repeats)
    c = draft_step / target_step

  alpha = stats.alpha
  baseline_width = width
  baseline_time = walltime["baseline"]
  if narrow is not None and walltime["baseline_width_1"] < baseline_time:
    baseline_width, baseline_time = 1, walltime["baseline_width_1"]
  speedup = baseline_time / walltime["speculative"]
  identical_rows = np.all(sequences["baseline"] == sequences["speculative"], axis=1)
  result = dict(
      task=exp.task.name, target=exp.target.name,
      draft=exp.draft.name if isinstance(exp.draft, ModelSpec) else type(draft).__name__,
      target_params=target.config.num_params,
      draft_params=None if draft_model is None else draft_model.config.num_params,
      num_examples=len(examples), batch_size=exp.batch_size,
      max_input_length=exp.max_input_length, max_decode_steps=exp.max_decode_steps,
      backend=jax.default_backend(), **settings,
      walltime_baseline_s=baseline_time, walltime_speculative_s=walltime["speculative"],
      walltime_target_only_s={str(width): walltime["baseline"],
                              **({"1": walltime["baseline_width_1"]} if narrow else {})},
      speedup=speedup, speedup_baseline_block_width=baseline_width, block_width=width,
      identical_outputs_checked_against=f"target-only decoding at block width {width}",
      tokens_baseline=int(lengths["baseline"].sum()),
      tokens_speculative=int(lengths["speculative"].sum()),
      acceptance_rate=stats.acceptance_rate, alpha=alpha,
      mean_tokens_per_iteration=stats.mean_tokens_per_iteration,
      expected_tokens_per_iteration=theory.expected_tokens_per_iteration(alpha, exp.gamma),
      per_position_acceptance=stats.per_position_acceptance.tolist(),
      target_step_ms=1e3 * target_step,
      draft_step_ms=None if draft_step is None else 1e3 * draft_step,
      c=c, c_note=None if c is not None else "draft is not a model: its cost is taken as 0",
      target_verify_cost=verify_cost,
      predicted_speedup=theory.walltime_improvement(alpha, exp.gamma, c or 0.0),
      predicted_speedup_measured_verify_cost=theory.predicted_speedup_with_verify_cost(
          alpha, exp.gamma, c or 0.0, verify_cost),
      identical_fraction=float(identical_rows.mean()),
      operative_gin_config=gin.operative_config_str())
  if exp.temperature < sampling.MIN_TEMPERATURE:
    result["identical_outputs"] = bool(identical_rows.all())
    if not result["identical_outputs"]:
      logging.error("greedy outputs differ on %d of %d inputs", int((~identical_rows).sum()),
                    len(identical_rows))
  else:
    result["identical_outputs"] = None  # Samples differ by design; see distribution_check.
    encoder = jnp.asarray(encoder_tokens)
    per_row = {name: dict(length=lengths[name].astype(np.float64),
                          mean_log_prob=mean_log_probs(target, encoder, sequences[name],
                                                       lengths[name], exp.temperature,
                                                       exp.topk, exp.topp))
               for name in sequences}
    result["distribution_check"] = distribution_check(per_row["baseline"],
                                                      per_row["speculative"])
  result["samples"] = [
      dict(input=e.inputs, baseline=exp.tokenizer.decode(b), speculative=exp.tokenizer.decode(s))
      for e, b, s in list(zip(examples, sequences["baseline"], sequences["speculative"]))[:3]]
  result["markdown_row"] = results_lib.table2_row(
      result["task"], result["draft"], exp.temperature, exp.gamma, alpha, speedup,
      result["predicted_speedup"], c)

  if sharding.is_output_process():  # Multi-host: one writer.
    results_lib.write_json_atomic(os.path.join(output_dir, "results.json"), result)
    results_lib.write_text_atomic(os.path.join(output_dir, "results.md"),
                                  results_lib.TABLE2_HEADER + "\n" + result["markdown_row"] + "\n")
  logging.info("speedup %.2fx, alpha %.3f, c %s, identical %s", speedup, alpha, c,
               result["identical_outputs"])
  return result


# ---------------------------------------------------------------------------
# Command line.

# Module-level flags (absl); experiments.reproduce_table2 reuses OUTPUT_DIR,
# NUM_EXAMPLES and the gin flags (experiments/gin_flags.py).
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/results.md go.")
NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "Use only the first N examples.")
MESH_SHAPE = flags.DEFINE_string(
    "mesh_shape", None, "Shard across devices on a 'data,model' mesh, e.g. '2,4' or '1,-1' "
    "(target: T5X rules, draft: replicated; see configs/sharding/*.gin). Default: one device.")
MULTIHOST = flags.DEFINE_bool(
    "multihost", False, "Call jax.distributed.initialize first (TPU pods and SLURM are "
    "auto-detected); only process 0 writes results.")
COORDINATOR_ADDRESS = flags.DEFINE_string("coordinator_address", None,
                                          "host:port of process 0 (multihost, if not detected).")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes (multihost, if not detected).")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id (multihost, if not detected).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not OUTPUT_DIR.value:
    raise app.UsageError("--output_dir is required")
  if MULTIHOST.value:  # Before any other JAX call.
    sharding.initialize_distributed(COORDINATOR_ADDRESS.value, NUM_PROCESSES.value,
                                    PROCESS_ID.value)
  try:
    parse_gin(GIN_FILES.value, GIN_BINDINGS.value, GIN_SEARCH_PATHS.value)
    exp = Experiment()
    result = run_experiment(exp, OUTPUT_DIR.value, NUM_EXAMPLES.value, MESH_SHAPE.value)
  except (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError) as e:
    # A clean one-line error instead of a traceback for configuration and
    # input mistakes; nothing has been written.
    logging.error("%s", e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(results_lib.TABLE2_HEADER)
  print(result["markdown_row"])


if __name__ == "__main__":
  app.run(main, argv=rewrite_gin_args(sys.argv))
