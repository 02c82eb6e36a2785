r"""Speed of autoregressive vs speculative decoding, next to the paper's theory.

For a target and one or more drafts, every batch size, gamma and temperature,
in one process:

* compiles both decoders (`specdec_jax.generate` without / with the draft),
  then times them in interleaved repeats (the order alternates each repeat,
  so machine noise hits both) and reports ms/token, tokens/s and the speedup
  as the median of the paired per-repeat ratios (with min and max);
* measures alpha and tokens per iteration from the speculative run's stats;
* times single model calls inside a jitted loop on a filled cache (as they run
  inside the decode loops): c = draft one-token step / target one-token step,
  and the target's cost curve: scoring k tokens in one call relative to k = 1,
  k = 1 .. gamma + 1;
* predicts the speedup with Theorem 3.8 and with the measured cost curve
  (`theory.predicted_speedup_with_cost_curve`), and reports
  efficiency = measured speedup / the latter;
* estimates the share of an iteration spent outside the two models' calls
  (see `outside_share`), and checks that the timed repeats compiled nothing.

Example (a T5-base-shaped target, a T5-small-shaped and a tiny draft, plus a
perturbed copy of the target, 4k vocabulary to keep CPU time sane):

  python scripts/benchmark.py --target=t5_1_1_base \
    --draft=t5_1_1_small,tiny_draft --draft_noise=0.1 --vocab_size=4096 \
    --batch_sizes=1 --gammas=4 --temperatures=0,1 --max_decode_steps=64 \
    --repeats=5 --output_json=/tmp/bench.json

Random weights: EOS is disabled by default (`--stop_at_eos=false`) so every
row generates exactly `max_decode_steps` tokens in both decoders.
"""

import datetime
import os
import platform
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from specdec_jax.core import decoding
from specdec_jax import generation
from specdec_jax.core import theory
from specdec_jax.loading import load_model
from specdec_jax.core.dtypes import default_dtype
from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5.config import CONFIGS
from specdec_jax.drafts import as_draft
from specdec_jax.families.registry import is_model
from specdec_jax.tools.profiling import time_block_calls, time_proposals
from specdec_jax.tools import methods as methods_lib
from specdec_jax.tools.methods import Method, accelerator_predictions, paired_ratios
from specdec_jax.results import write_json_atomic
from specdec_jax.perturbation import perturbed_model
from specdec_jax.tools.testing import random_encoder_tokens

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "t5_1_1_small", "Target: a config name, a checkpoint path, or "
                    "a demo model: demo, or demo@SHAPE = the 9.7M demo target embedded in a "
                    "config's shape, e.g. demo@t5_1_1_xxl (see load_demo).")
flags.DEFINE_list("draft", ["tiny_draft"], "Drafts: config names, checkpoint paths, or demo "
                  "models (demo:small, demo:tiny, demo:small@t5_1_1_small).")
flags.DEFINE_list("draft_noise", [], "For each value s, also a draft that is a copy of the "
                  "target with every weight w -> w * (1 + s * N(0, 1)): alpha inside (0, 1).")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Batch sizes.")
flags.DEFINE_list("gammas", ["4"], "Drafted tokens per iteration.")
flags.DEFINE_integer("block_width", 0, "The target's block width W in the speculative loop and "
                     "the reference target-only decoding (0: gamma + 1, the narrowest exact "
                     "width); target-only width 1 is timed too and the faster is the baseline.")
flags.DEFINE_list("temperatures", ["0"], "Sampling temperatures (0 = greedy).")
flags.DEFINE_integer("max_decode_steps", 64, "Tokens generated per row.")
flags.DEFINE_integer("encoder_length", 32, "Encoder input length (random tokens).")
flags.DEFINE_integer("repeats", 5, "Timed repeats per decoder (after one warm-up call).")
flags.DEFINE_integer("vocab_size", 0, "Override the vocabulary of named configs (0 = keep).")
flags.DEFINE_integer("seed", 0, "Seed for random weights and inputs.")
flags.DEFINE_string("dtype", "", "Weights dtype: float32 / bfloat16 (default: float32 on CPU, "
                    "bfloat16 on accelerators).")
flags.DEFINE_bool("stop_at_eos", False, "Stop rows at EOS (random weights emit it at random).")
flags.DEFINE_integer("cost_calls", 8, "Model calls per timed loop when measuring c and the "
                     "cost curve.")
flags.DEFINE_string("output_json", "", "Write the results here (atomically).")
# Issue 22: chain, block verification and token trees side by side at one width.
flags.DEFINE_string("demo_pair", "", "A shipped demo pair (t5 / decoder_only): its target, its drafts "
                    "(--draft names them; default the first) and its held-out inputs "
                    "(--num_inputs), instead of --target and random inputs.")
flags.DEFINE_integer("num_inputs", 8, "--demo_pair: held-out inputs (split into --batch_sizes).")
flags.DEFINE_list("verifications", [], "Chain verifications to compare (token, block); with "
                  "--trees/--dynamic_trees or more than 'token', rows compare methods side by side "
                  "at one --block_width (see `method_rows`).")
flags.DEFINE_string("trees", "", "Static token trees, ';'-separated branchings, e.g. "
                    "'4,2,2,1;2,2,1' (sj.TreeDraft).")
flags.DEFINE_string("dynamic_trees", "", "Dynamic (EAGLE-2) trees, ';'-separated "
                    "'topk,depth,node_budget' (sj.DynamicTreeDraft).")
flags.DEFINE_enum("children", "without_replacement", ["without_replacement", "iid", "topk"],
                  "Static trees' children law.")
flags.DEFINE_list("accelerator_verify_costs", ["0.92", "0.95"], "Scenario C(W) values for the "
                  "accelerator predictions of method rows (H200: C(8) = 0.92 measured; wider W "
                  "is an extrapolation).")
flags.DEFINE_list("accelerator_draft_costs", ["0.126", "0.039"], "Scenario draft costs c for the "
                  "accelerator predictions (H200: t5_1_1_small-shaped 0.126, 2-layer 0.039); "
                  "this machine's measured c is used too.")

# Never emitted: with it, every row decodes exactly max_decode_steps tokens.
NO_EOS = -1

METHOD = {
    "timing": "wall time of a whole generate call (encoder, cache, decode loop) after a warm-up "
              "call; AR and speculative alternate within each repeat, their order flipping each "
              "repeat; speedup = median over repeats of ar_ms / spec_ms (paired).",
    "c": "median time of one draft decode_block call with k=1 over one target decode_block call "
         "with k=1, each timed as `cost_calls` calls in a jitted fori_loop on a cache filled to "
         "half its length, at the row's batch size.",
    "block_cost": "block_cost[k-1] = target decode_block time for k tokens / for 1 token, same "
                  "method, k = 1..gamma+1.",
    "predictions": "theorem_3_8 = (1 - a^(g+1)) / ((1 - a)(g c + 1)); generalised = (1 - a^(g+1)) "
                   "/ ((1 - a)(g c + block_cost[g])) with the measured alpha a; "
                   "generalised_measured_tokens uses the measured tokens per iteration as the "
                   "numerator instead (no i.i.d. acceptance assumption).",
    "efficiency": "measured speedup / generalised prediction.",
    "outside_share": "iteration_ms = (spec_ms - target and draft prefill) / loop iterations (the "
                     "batch loop runs until its slowest row is done); model_ms = one draft call "
                     "with k=2 + (gamma-1) draft calls with k=1 + one target call with "
                     "k=gamma+1, timed separately; outside_share = 1 - model_ms / iteration_ms "
                     "(sampling, acceptance, bookkeeping). ar_outside_share is the same for the "
                     "autoregressive loop against one target k=1 call per step.",
}


# ---------------------------------------------------------------------------
# Pure helpers (unit-tested).


def efficiency(speedup: float, alpha: float, gamma: int, c: float,
               block_cost: Sequence[float]) -> float:
  """Measured speedup / `theory.predicted_speedup_with_cost_curve(alpha, gamma, c, block_cost)`."""
  return speedup / theory.predicted_speedup_with_cost_curve(alpha, gamma, c, block_cost)


def outside_share(iteration_ms: float, model_ms: float) -> float:
  """Share of an iteration not spent in model calls: 1 - model_ms / iteration_ms (>= 0)."""
  if iteration_ms <= 0:
    raise ValueError(f"iteration_ms must be > 0, got {iteration_ms}")
  return max(0.0, 1.0 - model_ms / iteration_ms)


def machine_info() -> Dict[str, Any]:
  cpu = "unknown"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  return dict(nproc=os.cpu_count(), cpu=cpu, backend=jax.default_backend(),
              devices=[str(d) for d in jax.devices()], jax=jax.__version__,
              python=platform.python_version(),
              load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


# ---------------------------------------------------------------------------
# Timing.


def _block(tree):
  return jax.block_until_ready(tree)


def _seconds(fn) -> float:
  start = time.perf_counter()
  _block(fn())
  return time.perf_counter() - start


def time_prefill(model: Model, encoder_tokens, max_len: int, repeats: int) -> float:
  """Median ms of encoding and allocating the cache (the decoders' fixed cost)."""
  batch = encoder_tokens.shape[0]
  fn = lambda: model.init_cache(batch, max_len, encoder_tokens)
  _block(fn())
  return statistics.median(_seconds(fn) * 1e3 for _ in range(repeats))


# ---------------------------------------------------------------------------
# One benchmark row.


def benchmark_row(target: Model, draft: Model, draft_name: str, batch: int, gamma: int,
                  temperature: float, max_decode_steps: int, encoder_length: int, repeats: int,
                  seed: int = 0, stop_at_eos: bool = False, cost_calls: int = 8,
                  block_width: Optional[int] = None) -> Dict[str, Any]:
  """Times AR vs speculative `generate` for one setting; returns a JSON-able dict.

  block_width: the target's width W in the speculative loop and in the
  reference target-only decoding (default gamma + 1, the narrowest exact
  width); target-only decoding at width 1 is timed too, and the speedup is
  against the faster of the two.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  vocab = target.config.vocab_size
  tokens = random_encoder_tokens(batch, encoder_length, vocab, seed=seed,
                                 min_length=encoder_length)
  eos_id = None if stop_at_eos else NO_EOS
  kwargs = dict(max_decode_steps=max_decode_steps, temperature=temperature, eos_id=eos_id,
                rng=jax.random.PRNGKey(seed))
  # Target-only decoding at the speculative loop's width W is the reference its
  # greedy outputs must equal bit for bit; at width 1 it may be faster (CPU).
  # The speedup is against the faster of the two: the fixed width never
  # flatters it.
  width = decoding.resolve_block_width(gamma + 1 if block_width is None else block_width, gamma)
  ar = lambda: generate_sequences(target, tokens, block_width=width, **kwargs)
  ar_narrow = lambda: generate_sequences(target, tokens, block_width=1, **kwargs)
  spec = lambda: generate_sequences(target, tokens, draft=draft, gamma=gamma,
                                    block_width=width, **kwargs)

  ar_out, spec_out = ar(), spec()  # compile and warm up
  ar_narrow()
  compiles_before = generation.compile_count()
  ar_wide_s, ar_narrow_s, spec_s = [], [], []
  for repeat in range(repeats):
    order = [(ar, ar_wide_s), (ar_narrow, ar_narrow_s), (spec, spec_s)]
    shift = repeat % len(order)
    for fn, store in order[shift:] + order[:shift]:
      store.append(_seconds(fn))
  compiles_after = generation.compile_count()
  baseline_width = 1 if statistics.median(ar_narrow_s) < statistics.median(ar_wide_s) else width
  ar_s = ar_narrow_s if baseline_width == 1 else ar_wide_s

  ar_tokens = int(np.asarray(ar_out.lengths).sum())
  spec_tokens = int(np.asarray(spec_out.lengths).sum())
  ar_ms = statistics.median(ar_s) * 1e3
  spec_ms = statistics.median(spec_s) * 1e3
  speedup = paired_ratios(ar_s, spec_s)
  stats = spec_out.stats
  alpha = stats.alpha
  tokens_per_iteration = stats.mean_tokens_per_iteration

  ks = list(range(1, gamma + 2))
  block_ms = time_block_calls({"target": target}, tokens, max_decode_steps, ks, repeats,
                              cost_calls)["target"]
  draft_ms = time_block_calls({"draft": draft}, tokens, max_decode_steps, [1, 2], repeats,
                              cost_calls)["draft"]
  c = draft_ms[1] / block_ms[1]
  block_cost = [block_ms[k] / block_ms[1] for k in ks]
  prefill_target = time_prefill(target, tokens, max_decode_steps, repeats)
  prefill_draft = time_prefill(draft, tokens, max_decode_steps, repeats)

  loop_iterations = int(np.max(stats.iterations))
  iteration_ms = (spec_ms - prefill_target - prefill_draft) / max(loop_iterations, 1)
  model_ms = draft_ms[2] + (gamma - 1) * draft_ms[1] + block_ms[gamma + 1]
  ar_step_ms = (ar_ms - prefill_target) / max_decode_steps

  theorem = theory.walltime_improvement(alpha, gamma, c)
  generalised = theory.predicted_speedup_with_cost_curve(alpha, gamma, c, block_cost)
  cost_per_iteration = gamma * c + block_cost[gamma]
  generalised_measured = tokens_per_iteration / cost_per_iteration
  return dict(
      target=_describe(target),
      draft=draft_name,
      draft_config=_describe(draft),
      batch_size=batch, gamma=gamma, temperature=temperature,
      max_decode_steps=max_decode_steps, encoder_length=encoder_length, repeats=repeats,
      tokens_ar=ar_tokens, tokens_spec=spec_tokens,
      identical_greedy_outputs=(bool(np.array_equal(np.asarray(ar_out.sequences),
                                                    np.asarray(spec_out.sequences)))
                                if temperature == 0 else None),
      identical_checked_against=f"target-only decoding at block width {width}",
      block_width=width, baseline_block_width=baseline_width,
      ar_ms_by_width={"1": statistics.median(ar_narrow_s) * 1e3,
                      str(width): statistics.median(ar_wide_s) * 1e3},
      ar_ms_per_token=ar_ms / ar_tokens, ar_tokens_per_s=ar_tokens / ar_ms * 1e3,
      spec_ms_per_token=spec_ms / spec_tokens, spec_tokens_per_s=spec_tokens / spec_ms * 1e3,
      ar_ms=ar_ms, spec_ms=spec_ms,
      ar_ms_all=[s * 1e3 for s in ar_s], spec_ms_all=[s * 1e3 for s in spec_s],
      speedup=speedup["median"], speedup_min=speedup["min"], speedup_max=speedup["max"],
      alpha=alpha, acceptance_rate=stats.acceptance_rate,
      mean_tokens_per_iteration=tokens_per_iteration,
      expected_tokens_per_iteration=theory.expected_tokens_per_iteration(alpha, gamma),
      per_position_acceptance=stats.per_position_acceptance.tolist(),
      loop_iterations=loop_iterations,
      target_step_ms=block_ms[1], draft_step_ms=draft_ms[1], draft_block2_ms=draft_ms[2],
      target_block_ms={str(k): v for k, v in block_ms.items()},
      c=c, block_cost=block_cost,
      prefill_target_ms=prefill_target, prefill_draft_ms=prefill_draft,
      prediction_theorem_3_8=theorem, prediction_generalised=generalised,
      prediction_generalised_measured_tokens=generalised_measured,
      efficiency=speedup["median"] / generalised,
      efficiency_measured_tokens=speedup["median"] / generalised_measured,
      iteration_ms=iteration_ms, iteration_model_ms=model_ms,
      outside_share=outside_share(iteration_ms, model_ms) if iteration_ms > 0 else None,
      ar_step_ms=ar_step_ms,
      ar_outside_share=outside_share(ar_step_ms, block_ms[1]) if ar_step_ms > 0 else None,
      compile_count_before=compiles_before, compile_count_after=compiles_after,
      recompiled=compiles_after != compiles_before,
  )


def generate_sequences(model, tokens, **kwargs):
  out = generation.generate(model, tokens, **kwargs)
  _block(out.sequences)
  return out


def _describe(model: Model) -> str:
  cfg = model.config
  return (f"emb{cfg.emb_dim}/h{cfg.num_heads}x{cfg.head_dim}/mlp{cfg.mlp_dim}/"
          f"L{cfg.num_encoder_layers}+{cfg.num_decoder_layers}/V{cfg.vocab_size}/"
          f"{cfg.num_params / 1e6:.1f}M/{cfg.dtype}")


# ---------------------------------------------------------------------------
# Issue 22: chain, block verification and token trees side by side.


METHODS_METHOD = {
    "width": "every method and the target-only reference run at one block width W (the target "
             "scores W slots per call whatever the method); target-only decoding at width 1 is "
             "timed too and the baseline is the faster of width 1 and width W.",
    "timing": "each input batch is decoded once by every side (compile, and the stats), then "
              "`repeats` rounds: in each round every batch is decoded by every side, the order "
              "rotating each round and batch; a side's round time is its sum over batches; "
              "speedup = median over rounds of baseline_round / method_round (paired).",
    "predicted_tokens": "chain ('token'): eq. 1 (1 - a^(g+1)) / (1 - a) with the run's alpha a; "
                        "block verification: none (measured only: Sun et al. 2025 accepts at "
                        "least what token-wise does on the same drafts, no closed form here); "
                        "static tree: theory.tree_expected_tokens(branching, the run's measured "
                        "per-rank acceptance); dynamic tree: none (its topology changes every "
                        "iteration), best_static_* gives the best static shape of the same budget "
                        "under the measured per-rank acceptance.",
    "draft_calls": "draft calls per iteration: gamma for a chain, the depth D for a tree (one "
                   "call per depth).",
    "costs": "c = draft k=1 call / target k=1 call; C(k) = target call scoring k tokens / 1 "
             "token; timed in a jitted loop on a filled cache (`time_block_calls`), target and "
             "draft interleaved in one call, max(repeats, 5) samples each. c_proposal = one "
             "whole gamma-token proposal (the draft's calls and its sampling, "
             "`time_proposals`) / gamma / target k=1 call, for every kind of draft; a draft "
             "that is no model (a feature head) has c = c_proposal (c_kind says which).",
    "predicted_speedup_here": "tokens_per_iteration (measured) / (draft_calls * c + C(W)) with "
                              "this machine's c and C(W) (theory.predicted_tree_speedup).",
    "accelerator_predictions": "the same formula with scenario C(W) and c values "
                               "(--accelerator_verify_costs, --accelerator_draft_costs, plus "
                               "this machine's c): keys 'C=<C(W)>,c=<c>'.",
    "greedy_identity": "temperature 0: every row's sequences equal target-only decoding at width "
                       "W, bit for bit.",
}


def parse_trees(spec: str) -> List[Tuple[int, ...]]:
  """'4,2,2,1;2,2,1' -> [(4, 2, 2, 1), (2, 2, 1)] ('' -> [])."""
  out = []
  for part in spec.split(";"):
    part = part.strip()
    if part:
      branching = tuple(int(b) for b in part.split(","))
      if not branching or min(branching) < 1:
        raise ValueError(f"a tree's branching must be ints >= 1, got {part!r}")
      out.append(branching)
  return out


def parse_dynamic_trees(spec: str) -> List[Tuple[int, int, int]]:
  """'4,4,16;2,3,8' -> [(4, 4, 16), (2, 3, 8)] as (topk, depth, node_budget)."""
  out = []
  for part in spec.split(";"):
    part = part.strip()
    if part:
      values = tuple(int(v) for v in part.split(","))
      if len(values) != 3:
        raise ValueError(f"a dynamic tree is 'topk,depth,node_budget', got {part!r}")
      out.append(values)
  return out


def build_methods(draft, gamma: int, verifications: Sequence[str],
                  trees: Sequence[Tuple[int, ...]], dynamic_trees: Sequence[Tuple[int, int, int]],
                  children: str = "without_replacement") -> List[Method]:
  """The flags' methods around `draft`: chains by verification, then static, then dynamic trees."""
  built = []
  for verification in verifications:
    if verification not in ("token", "block"):
      raise ValueError(f"--verifications takes token and/or block, got {verification!r}")
    built.append(methods_lib.chain(draft, gamma, verification))
  built += [methods_lib.tree(draft, branching, children) for branching in trees]
  built += [methods_lib.dynamic_tree(draft, *spec) for spec in dynamic_trees]
  if not built:
    raise ValueError("no method: give --verifications, --trees or --dynamic_trees")
  return built


def method_width(methods: Sequence[Method], block_width: Optional[int]) -> int:
  """The one width W all methods share: block_width, or the smallest that holds every method."""
  need = max(m.nodes for m in methods)
  if block_width is None:
    return need
  if block_width < need:
    worst = max(methods, key=lambda m: m.nodes)
    raise ValueError(f"--block_width={block_width} is narrower than {worst.name!r} needs "
                     f"({worst.nodes} slots): use --block_width >= {need}")
  return int(block_width)


def method_rows(target, draft, draft_name: str, inputs, lengths, batch: int, gamma: int,
                temperature: float, max_decode_steps: int, repeats: int, methods: Sequence[Method],
                block_width: int, seed: int = 0, eos_id: Optional[int] = None,
                cost_calls: int = 8, verify_costs: Sequence[float] = (0.92, 0.95),
                draft_costs: Sequence[float] = (0.126, 0.039)) -> Dict[str, Any]:
  """Every method of `methods` and target-only decoding (widths 1 and W) on the same inputs.

  inputs [n, C] (lengths [n] or None: decoder-only prompt lengths) are split
  into batches of `batch` rows (n must be a multiple). See METHODS_METHOD.
  Returns a JSON-able dict: the shared figures and `methods`, one row each.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  n = inputs.shape[0]
  if n % batch:
    raise ValueError(f"{n} inputs do not split into batches of {batch}")
  width = block_width
  chunks = [(inputs[i:i + batch], None if lengths is None else lengths[i:i + batch])
            for i in range(0, n, batch)]
  base = dict(max_decode_steps=max_decode_steps, temperature=temperature, eos_id=eos_id)
  sides = {"target W=1": dict(base, block_width=1),
           f"target W={width}": dict(base, block_width=width)}
  for m in methods:
    sides[m.name] = dict(base, block_width=width, **m.kwargs)

  def call(side, b):
    x, l = chunks[b]
    return generate_sequences(target, x, prompt_lengths=l, rng=jax.random.PRNGKey(seed + b),
                              **sides[side])

  outputs = {side: [call(side, b) for b in range(len(chunks))] for side in sides}  # compile
  compiles_before = generation.compile_count()
  rounds = {side: [] for side in sides}
  order = list(sides)
  for repeat in range(repeats):
    spent = {side: 0.0 for side in sides}
    for b in range(len(chunks)):
      shift = (repeat * len(chunks) + b) % len(order)
      for side in order[shift:] + order[:shift]:
        spent[side] += _seconds(lambda: call(side, b).sequences)
    for side in sides:
      rounds[side].append(spent[side])
  compiles_after = generation.compile_count()
  narrow, wide = rounds["target W=1"], rounds[f"target W={width}"]
  baseline = "target W=1" if statistics.median(narrow) <= statistics.median(wide) else (
      f"target W={width}")
  base_rounds = rounds[baseline]

  ks = sorted({1, width} | {m.nodes for m in methods})
  draft_model = draft.model if hasattr(draft, "model") else draft
  timed = {"target": target}
  # A model stepped once per drafted token: c is its one-token call. A drafter that fills
  # the proposal in one call (PARD's model over context plus masks) is timed by proposal.
  if is_model(draft_model) and as_draft(draft).calls_per_proposal(gamma) == gamma:
    timed["draft"] = draft_model
  # Target and draft in one call: their samples interleave, so a shared
  # machine's load hits c's numerator and denominator alike.
  ms = time_block_calls(timed, inputs[:batch], max_decode_steps, ks, max(repeats, 5),
                        cost_calls, lengths=None if lengths is None else lengths[:batch])
  block_ms = ms["target"]
  # Every kind of draft (a feature head is no model): one whole gamma-token proposal,
  # its calls and its sampling, per drafted token (`time_proposals`).
  proposal_ms = time_proposals(target, {"draft": draft}, inputs[:batch], max_decode_steps,
                               gamma, max(repeats, 5), cost_calls,
                               lengths=None if lengths is None else lengths[:batch])["draft"]
  c_proposal = proposal_ms / gamma / block_ms[1]
  if "draft" in ms:
    draft_step_ms = ms["draft"][1]
    c = draft_step_ms / block_ms[1]
  else:
    draft_step_ms, c = proposal_ms / gamma, c_proposal
  cost_curve = {str(k): block_ms[k] / block_ms[1] for k in ks}
  verify_cost = cost_curve[str(width)]
  reference = [np.asarray(o.sequences) for o in outputs[f"target W={width}"]]

  rows = []
  for m in methods:
    outs = outputs[m.name]
    pooled = methods_lib.pooled_stats([o.stats for o in outs])
    tokens = pooled["tokens_per_iteration"]
    speed = paired_ratios(base_rounds, rounds[m.name])
    row = dict(method=m.name, kind=m.kind, spec=list(m.spec) if isinstance(m.spec, tuple)
               else m.spec, draft_calls=m.draft_calls, nodes=m.nodes,
               tokens_per_iteration=tokens, **methods_lib.predicted_tokens(m, pooled),
               alpha=pooled["alpha"], acceptance_rate=pooled["acceptance_rate"],
               stats=pooled, ms=statistics.median(rounds[m.name]) * 1e3,
               ms_all=[s * 1e3 for s in rounds[m.name]],
               speedup=speed["median"], speedup_min=speed["min"], speedup_max=speed["max"],
               predicted_speedup_here=theory.predicted_tree_speedup(
                   tokens, c, m.draft_calls, verify_cost),
               accelerator_predictions=accelerator_predictions(
                   tokens, m.draft_calls, verify_costs, list(draft_costs) + [c]),
               identical_greedy_outputs=(all(np.array_equal(r, np.asarray(o.sequences))
                                             for r, o in zip(reference, outs))
                                         if temperature == 0 else None))
    rows.append(row)
  return dict(draft=draft_name, batch_size=batch, gamma=gamma, temperature=temperature,
              max_decode_steps=max_decode_steps, repeats=repeats, num_inputs=n,
              block_width=width, baseline=baseline,
              target_ms_by_width={"1": statistics.median(narrow) * 1e3,
                                  str(width): statistics.median(wide) * 1e3},
              baseline_ms=statistics.median(base_rounds) * 1e3,
              target_block_ms={str(k): v for k, v in block_ms.items()}, cost_curve=cost_curve,
              verify_cost=verify_cost, c=c, draft_step_ms=draft_step_ms,
              c_kind="k=1 call" if "draft" in ms else "proposal per token",
              c_proposal=c_proposal, proposal_ms=proposal_ms,
              identical_checked_against=f"target-only decoding at block width {width}",
              compile_count_before=compiles_before, compile_count_after=compiles_after,
              recompiled=compiles_after != compiles_before, methods=rows)


METHOD_HEADER = ("method", "T", "W", "calls", "tok/it", "pred", "alpha", "ms", "speedup [min,max]",
                 "pred here", "identical")


def format_method_table(results: Sequence[Dict[str, Any]]) -> str:
  cells = [list(METHOD_HEADER)]
  for res in results:
    for r in res["methods"]:
      pred = r["predicted_tokens_per_iteration"]
      cells.append([r["method"], f"{res['temperature']:g}", str(res["block_width"]),
                    str(r["draft_calls"]), f"{r['tokens_per_iteration']:.2f}",
                    "-" if pred is None else f"{pred:.2f}", f"{r['alpha']:.2f}",
                    f"{r['ms']:.0f}",
                    f"{r['speedup']:.2f} [{r['speedup_min']:.2f},{r['speedup_max']:.2f}]",
                    f"{r['predicted_speedup_here']:.2f}",
                    {None: "-", True: "yes", False: "NO"}[r["identical_greedy_outputs"]]])
  widths = [max(len(line[i]) for line in cells) for i in range(len(METHOD_HEADER))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells]
  notes = [f"T={res['temperature']:g}: baseline {res['baseline']} "
           f"({res['baseline_ms']:.0f} ms; " + ", ".join(
               f"W={w}: {ms:.0f} ms" for w, ms in res["target_ms_by_width"].items())
           + f"), c = {res['c']:.3f}, C({res['block_width']}) = {res['verify_cost']:.2f}"
           for res in results]
  return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:] + notes)


def run_methods(target, draft_models: Dict[str, Any], inputs_for, batch_sizes: Sequence[int],
                gammas: Sequence[int], temperatures: Sequence[float], max_decode_steps: int,
                repeats: int, verifications: Sequence[str], trees, dynamic_trees,
                block_width: Optional[int], seed: int = 0, eos_id: Optional[int] = None,
                cost_calls: int = 8, children: str = "without_replacement",
                verify_costs=(0.92, 0.95), draft_costs=(0.126, 0.039)) -> List[Dict[str, Any]]:
  """`method_rows` for every (draft, batch, gamma, temperature); inputs_for(batch) -> (x, l)."""
  results = []
  for draft_name, draft in draft_models.items():
    for batch in batch_sizes:
      inputs, lengths = inputs_for(batch)
      for gamma in gammas:
        methods = build_methods(draft, gamma, verifications, trees, dynamic_trees, children)
        width = method_width(methods, block_width)
        for temperature in temperatures:
          logging.info("methods: draft=%s batch=%d gamma=%d W=%d temperature=%g", draft_name,
                       batch, gamma, width, temperature)
          results.append(method_rows(target, draft, draft_name, inputs, lengths, batch, gamma,
                                     temperature, max_decode_steps, repeats, methods, width, seed,
                                     eos_id, cost_calls, verify_costs, draft_costs))
  return results


# ---------------------------------------------------------------------------
# Loading and the driver.


DEMO_NOTE = ("'demo...' models are the shipped demo pair's (demo_pair/); 'demo@SHAPE' is the "
             "9.7M demo target EMBEDDED function-preservingly in SHAPE (specdec_jax.families.t5.embed): the "
             "demo target's function and 2048-token vocabulary at SHAPE's cost, not a trained "
             "model of that size.")


def load_demo(name: str, dtype: str) -> Model:
  """'demo' (the 9.7M target), 'demo:small' / 'demo:tiny' (its drafts), each optionally
  '@SHAPE': embedded in a named config's shape (e.g. 'demo@t5_1_1_xxl', issue 15)."""
  from specdec_jax.families.t5 import embed
  from specdec_jax.demo_pair import load_demo_pair
  base, _, shape = name.partition("@")
  role = base.partition(":")[2] or "target"
  # Embedding reads the float32 weights; unembedded models load in `dtype` (lossless).
  pair = load_demo_pair(dtype="float32" if shape else dtype)
  models = dict(pair.drafts, target=pair.target)
  if not (base == "demo" or base.startswith("demo:")) or role not in models:
    raise ValueError(f"unknown demo model {name!r}: use demo, demo:small or demo:tiny, "
                     f"optionally @SHAPE (a config name)")
  model = models[role]
  if not is_model(model):
    raise ValueError(f"{name!r} is the pair's feature head, not a model: benchmark it with "
                     f"--demo_pair=t5 --draft={role} --verifications=token")
  if shape:
    return embed.embed_model(model, shape, dtype=dtype)
  return model


def load(name_or_path: str, vocab_size: int, seed: int, dtype: str = "") -> Model:
  """A named config with random weights (vocabulary overridable), a demo model
  (`load_demo`), or a checkpoint."""
  dtype = dtype or default_dtype()
  if name_or_path.startswith("demo") and not os.path.exists(name_or_path):
    return load_demo(name_or_path, dtype)
  if name_or_path in CONFIGS:
    overrides = dict(vocab_size=vocab_size) if vocab_size else {}
    return load_model(name_or_path, dtype=dtype, seed=seed, **overrides)
  return load_model(name_or_path, dtype=dtype)


def load_drafts(target: Model, drafts: Sequence[str], noises: Sequence[float],
                vocab_size: int, seed: int, dtype: str = "") -> Dict[str, Model]:
  """Named/path drafts (named ones get the target's vocabulary) and perturbed copies."""
  out = {}
  for i, name in enumerate(drafts):
    out[name] = load(name, vocab_size or target.config.vocab_size, seed + 1 + i, dtype)
  for noise in noises:
    if not noise > 0:
      raise ValueError(f"--draft_noise values must be > 0, got {noise}")
    out[f"target*(1+{noise:g}N)"] = perturbed_model(target, noise, seed + 100)
  if not out:
    raise ValueError("no draft: give --draft and/or --draft_noise")
  return out


HEADER = ("draft", "b", "g", "T", "AR ms/tok", "SD ms/tok", "speedup [min,max]", "alpha",
          "tok/it", "c", "C(g+1)", "Th3.8", "gen", "eff", "outside")


def format_row(row: Dict[str, Any]) -> List[str]:
  return [row["draft"], str(row["batch_size"]), str(row["gamma"]), f"{row['temperature']:g}",
          f"{row['ar_ms_per_token']:.2f}", f"{row['spec_ms_per_token']:.2f}",
          f"{row['speedup']:.2f} [{row['speedup_min']:.2f},{row['speedup_max']:.2f}]",
          f"{row['alpha']:.2f}", f"{row['mean_tokens_per_iteration']:.2f}", f"{row['c']:.3f}",
          f"{row['block_cost'][-1]:.2f}", f"{row['prediction_theorem_3_8']:.2f}",
          f"{row['prediction_generalised']:.2f}", f"{row['efficiency']:.2f}",
          "-" if row["outside_share"] is None else f"{row['outside_share']:.2f}"]


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
  cells = [list(HEADER)] + [format_row(r) for r in rows]
  widths = [max(len(line[i]) for line in cells) for i in range(len(HEADER))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells]
  return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def run(target_name: str, drafts: Sequence[str], noises: Sequence[float],
        batch_sizes: Sequence[int], gammas: Sequence[int], temperatures: Sequence[float],
        max_decode_steps: int, encoder_length: int, repeats: int, vocab_size: int = 0,
        seed: int = 0, stop_at_eos: bool = False, cost_calls: int = 8,
        dtype: str = "", block_width: Optional[int] = None) -> Dict[str, Any]:
  """Runs every (draft, batch, gamma, temperature) row; returns the JSON document."""
  target = load(target_name, vocab_size, seed, dtype)
  draft_models = load_drafts(target, drafts, noises, vocab_size, seed, dtype)
  rows = []
  for draft_name, draft in draft_models.items():
    for batch in batch_sizes:
      for gamma in gammas:
        for temperature in temperatures:
          logging.info("row: draft=%s batch=%d gamma=%d temperature=%g", draft_name, batch,
                       gamma, temperature)
          rows.append(benchmark_row(target, draft, draft_name, batch, gamma, temperature,
                                    max_decode_steps, encoder_length, repeats, seed,
                                    stop_at_eos, cost_calls, block_width))
  return dict(machine=machine_info(), method=METHOD,
              settings=dict(target=target_name, target_config=_describe(target),
                            target_note=DEMO_NOTE if target_name.startswith("demo") else None,
                            drafts=list(draft_models), batch_sizes=list(batch_sizes),
                            gammas=list(gammas), temperatures=list(temperatures),
                            max_decode_steps=max_decode_steps, encoder_length=encoder_length,
                            repeats=repeats, vocab_size=target.config.vocab_size, seed=seed,
                            stop_at_eos=stop_at_eos, cost_calls=cost_calls,
                            block_width=block_width),
              rows=rows)


def methods_mode() -> bool:
  """Whether the flags ask for the side-by-side method comparison (issue 22)."""
  return bool(FLAGS.verifications or FLAGS.trees or FLAGS.dynamic_trees)


def main_methods():
  """--verifications / --trees / --dynamic_trees: `run_methods`, printed and written."""
  if FLAGS.demo_pair:
    from specdec_jax.demo_pair import load_demo_pair
    pair = load_demo_pair(FLAGS.demo_pair, dtype=FLAGS.dtype or default_dtype())
    target = pair.target
    names = FLAGS.draft if FLAGS["draft"].present else [next(iter(pair.drafts))]
    unknown = [n for n in names if n not in pair.drafts]
    if unknown:
      raise app.UsageError(f"--draft={unknown}: the {FLAGS.demo_pair} pair's drafts are "
                           f"{sorted(pair.drafts)}")
    draft_models = {n: pair.drafts[n] for n in names}
    steps = FLAGS.max_decode_steps if FLAGS["max_decode_steps"].present else (
        pair.max_decode_steps)
    # A trained pair stops at EOS unless told not to.
    eos_id = NO_EOS if (FLAGS["stop_at_eos"].present and not FLAGS.stop_at_eos) else None

    def inputs_for(batch):
      x, l = pair.inputs(FLAGS.num_inputs // batch * batch)
      return x, l
    target_name = f"demo pair {FLAGS.demo_pair}"
  else:
    target = load(FLAGS.target, FLAGS.vocab_size, FLAGS.seed, FLAGS.dtype)
    draft_models = load_drafts(target, FLAGS.draft, [float(s) for s in FLAGS.draft_noise],
                               FLAGS.vocab_size, FLAGS.seed, FLAGS.dtype)
    steps = FLAGS.max_decode_steps
    eos_id = None if FLAGS.stop_at_eos else NO_EOS

    def inputs_for(batch):
      return random_encoder_tokens(batch, FLAGS.encoder_length, target.config.vocab_size,
                                   seed=FLAGS.seed, min_length=FLAGS.encoder_length), None
    target_name = FLAGS.target
  verifications = FLAGS.verifications or ["token"]
  trees, dynamic = parse_trees(FLAGS.trees), parse_dynamic_trees(FLAGS.dynamic_trees)
  results = run_methods(
      target, draft_models, inputs_for, [int(b) for b in FLAGS.batch_sizes],
      [int(g) for g in FLAGS.gammas], [float(t) for t in FLAGS.temperatures], steps,
      FLAGS.repeats, verifications, trees, dynamic, FLAGS.block_width or None, FLAGS.seed,
      eos_id, FLAGS.cost_calls, FLAGS.children,
      [float(v) for v in FLAGS.accelerator_verify_costs],
      [float(v) for v in FLAGS.accelerator_draft_costs])
  document = dict(
      machine=machine_info(), method=METHODS_METHOD,
      settings=dict(target=target_name, target_config=str(target.config), pair=FLAGS.demo_pair or None,
                    drafts=list(draft_models), batch_sizes=[int(b) for b in FLAGS.batch_sizes],
                    gammas=[int(g) for g in FLAGS.gammas],
                    temperatures=[float(t) for t in FLAGS.temperatures], max_decode_steps=steps,
                    repeats=FLAGS.repeats, verifications=verifications,
                    trees=[list(t) for t in trees], dynamic_trees=[list(t) for t in dynamic],
                    children=FLAGS.children, block_width=FLAGS.block_width or None,
                    num_inputs=FLAGS.num_inputs if FLAGS.demo_pair else None,
                    eos_id=eos_id, seed=FLAGS.seed, cost_calls=FLAGS.cost_calls),
      results=results)
  print(f"target {target_name}, drafts {list(draft_models)}, {steps} new tokens max, machine "
        f"{document['machine']['cpu']} x{document['machine']['nproc']}, load "
        f"{document['machine']['load_average']}")
  print(format_method_table(results))
  if any(r["recompiled"] for r in results):
    print("WARNING: the timed repeats compiled new programs (see compile_count_*)")
  if FLAGS.output_json:
    write_json_atomic(FLAGS.output_json, document)
    print(f"wrote {FLAGS.output_json}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if methods_mode():
    return main_methods()
  result = run(FLAGS.target, FLAGS.draft, [float(s) for s in FLAGS.draft_noise],
               [int(b) for b in FLAGS.batch_sizes], [int(g) for g in FLAGS.gammas],
               [float(t) for t in FLAGS.temperatures], FLAGS.max_decode_steps,
               FLAGS.encoder_length, FLAGS.repeats, FLAGS.vocab_size, FLAGS.seed,
               FLAGS.stop_at_eos, FLAGS.cost_calls, FLAGS.dtype, FLAGS.block_width or None)
  print(f"target {result['settings']['target']} ({result['settings']['target_config']}), "
        f"{FLAGS.max_decode_steps} new tokens, machine {result['machine']['cpu']} "
        f"x{result['machine']['nproc']}")
  if "@" in FLAGS.target and FLAGS.target.startswith("demo"):
    print(f"NOTE: {DEMO_NOTE}")
  print(format_table(result["rows"]))
  if any(r["recompiled"] for r in result["rows"]):
    print("WARNING: the timed repeats compiled new programs (see compile_count_*)")
  if FLAGS.output_json:
    write_json_atomic(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
  app.run(main)
