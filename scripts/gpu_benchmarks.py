r"""The paper's setting on one accelerator: an XXL-shaped target with real acceptance.

The target is the shipped 9.7M-parameter demo target (demo_pair/) EMBEDDED,
function-preservingly, in the T5 1.1 XXL shape (`specdec_jax.families.t5.embed`): it
computes exactly the demo target's function (its 2048-token vocabulary) at
the cost of an XXL decoder step. So the demo drafts' real, trained acceptance
rate meets a real XXL-sized step. It is not a trained 11B model; every report
says so.

Parts (each writes `<output_dir>/<part>.json`; `report` merges them into
`gpu_benchmarks.json` and `gpu_benchmarks.md`):

* `hf`: transformers (PyTorch) target-only `generate` on the same device in
  the same dtype, the same shape, random weights (run in its own process so
  the two frameworks do not share device memory).
* `ours`: on the embedded XXL target, in one process:
  - target-only `generate` ms/token (greedy, batch 1, EOS disabled), and the
    bandwidth floor (decoder + logits weights read once per token at the
    copy bandwidth measured here);
  - C(k): one target call scoring k tokens / one token;
  - both attention formulations of the decode step ('in_layout', 'dots'):
    operations per decoder layer as this device compiles them, step times;
  - c for the shipped drafts (1.1M 'small', 0.2M 'tiny'), the 'small' draft
    embedded in the t5_1_1_small shape (a T5-small-shaped draft with the same
    trained acceptance), and a random t5_small-shaped model;
  - the cost-realistic pair: held-out demo inputs, greedy, batch 1,
    target-only vs speculative `generate` with each draft: speedup (paired,
    interleaved repeats), alpha, identical outputs;
* `methods` (issue 22, its own process so a slow compile cannot cost `ours`):
  with the demo 'small' draft embedded at t5_1_1_small: at each
    width W of --method_widths (8, 16), token-wise and block verification
    of a chain (gamma = min(7, W - 1)), a static token tree and a dynamic
    (EAGLE-2) tree, all at W: tokens per iteration, alpha, speedup against
    the fastest exact target-only decoding (width 1 or W), C(W) measured,
    greedy identity with target-only decoding at W.

- features (issue 23): the demo pair's feature head (EAGLE-style, one T5
    decoder layer over the target's hidden states; `demo_pair/feature_head.npz`,
    a random head if none ships) embedded with the target at its shape
    (`embed.embed_feature_head_params`: the same drafts at the large cost)
    against the embedded 'small' draft: c per drafted token (whole gamma-token
    proposals, `profiling.time_proposals`), then chain gamma = 4 and a static
    and a dynamic tree of the head at W = 16: alpha, tokens per iteration,
    speedup against the fastest exact baseline, greedy identity. With them
    (issue 32) the pair's one-call drafters, where it ships them: Medusa heads
    and the DFlash drafter grown with the target, the PARD drafter's model
    embedded at the 'small' draft's shape; c per drafted token, a chain and a
    tree of each.

- evaluate: the evaluation harness (`python -m experiments.evaluate`, its own process) on
    the T5 pair's mini-benchmark (demo_pair/benchmark.jsonl) with --scale_to: the target
    at TARGET_SHAPE, the 'small' draft and PARD's model at DRAFT_SHAPE, the heads grown
    (`specdec_jax.evaluation.methods.scale_demo_pair`, bfloat16 on the GPU); every method
    the pair ships, greedy, batch 1, the harness's own greedy-equality check. Its
    results.json / results.md / speedup_tau.png go to <output_dir>/evaluate/, a summary to
    evaluate.json. Sized for the device budget (--evaluate_categories,
    --evaluate_per_category, --evaluate_timeout).

  scripts/gpu_benchmarks.sh               # on the GPU machine (<= 6 minutes)
  scripts/gpu_benchmarks.sh --dry_run     # CPU, tiny shapes, seconds (tested)
"""

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict

from absl import app
from absl import flags

PART = flags.DEFINE_enum("part", "ours", ["hf", "ours", "methods", "features", "evaluate",
                                         "report"], "What to run.")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "Tiny shapes, few repeats: a CPU check of every "
                            "code path (the numbers mean nothing).")
OUTPUT_DIR = flags.DEFINE_string("output_dir", "gpu_results", "Where JSON and Markdown go.")
TARGET_SHAPE = flags.DEFINE_string("target_shape", "t5_1_1_xxl", "Shape the demo target is "
                                   "embedded in (a config name).")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights and compute dtype.")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens per target-only decode (ours, HF).")
ENC_LEN = flags.DEFINE_integer("encoder_length", 64, "Encoder input length for ours vs HF.")
NUM_INPUTS = flags.DEFINE_integer("num_inputs", 8, "Held-out inputs for the pair.")
REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats.")
GAMMA = flags.DEFINE_integer("gamma", 0, "Drafted tokens per iteration; 0: the theory's "
                             "optimum for each draft's measured alpha, c and C(k).")
METHOD_INPUTS = flags.DEFINE_integer("method_inputs", 4, "Held-out inputs for the issue-22 rows.")
METHOD_WIDTHS = flags.DEFINE_list("method_widths", ["8", "16"], "Block widths of the issue-22 "
                                  "rows (chain / block / tree / dynamic tree at one width).")
# The evaluate part. These three categories' prompts share one padded width (64), so each
# method compiles once; long_context (512-token inputs) and multi_turn (a 256-token second
# turn) would each compile every method again: 'all' adds them where the budget allows.
EVALUATE_CATEGORIES = flags.DEFINE_list(
    "evaluate_categories", ["completion", "docstring_to_code", "editing"],
    "evaluate part: the mini-benchmark's categories ('all': every one).")
EVALUATE_PER_CATEGORY = flags.DEFINE_integer("evaluate_per_category", 2, "evaluate part: "
                                             "questions per category.")
EVALUATE_TIMEOUT = flags.DEFINE_integer(
    "evaluate_timeout", 150, "evaluate part: seconds the harness may run, its share of the "
    "script's device budget; past it the harness is stopped (its finished records stay in "
    "<output_dir>/evaluate/records: rerun the part to resume) and evaluate.json says so.")
# Per width: a static tree that fits (num_nodes <= W) and a dynamic tree of W nodes.
TREES = {8: (2, 1, 1), 12: (2, 2, 1), 16: (3, 2, 1)}
DYNAMIC_TREES = {8: (2, 4, 8), 12: (3, 4, 12), 16: (4, 4, 16)}

# The draft the paper pairs with T5-XXL is T5-small-shaped; the demo 'small'
# draft (emb 128, 1+1 layers, gated) embeds in t5_1_1_small's shape.
DRAFT_SHAPE = "t5_1_1_small"
DRY_SHAPES = {  # emb a multiple of the demo models' (256 target, 128 draft), few layers
    # Equal stacks: transformers 5's generate fails on T5s with uneven stacks.
    "target": dict(emb_dim=512, num_heads=8, head_dim=64, mlp_dim=1536, num_encoder_layers=6,
                   num_decoder_layers=6),
    "draft": dict(emb_dim=256, num_heads=2, head_dim=64, mlp_dim=512, num_encoder_layers=1,
                  num_decoder_layers=2),
}
TARGET_NOTE = ("The target is the shipped 9.7M-parameter demo target EMBEDDED function-"
               "preservingly in the {shape} shape (specdec_jax.families.t5.embed): same function and "
               "2048-token vocabulary as the 9.7M model, the cost of a {shape}-shaped step; "
               "not a trained 11B model.")


def _write(name: str, result: Dict[str, Any]):
  from specdec_jax.results import write_json_atomic
  os.makedirs(OUTPUT_DIR.value, exist_ok=True)
  path = os.path.join(OUTPUT_DIR.value, f"{name}.json")
  write_json_atomic(path, result)
  print(f"wrote {path}", flush=True)


def _machine():
  import jax
  return dict(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
              jax=jax.__version__, python=sys.version.split()[0],
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _shape_config(small_config, shape: str, role: str):
  """The large config for `role` ('target' / 'draft'): named shape, or tiny in a dry run."""
  from specdec_jax.families.t5 import embed
  if DRY_RUN.value:
    return embed.embedded_config(small_config, small_config.replace(**DRY_SHAPES[role]),
                                 dtype=DTYPE.value)
  return embed.embedded_config(small_config, shape, dtype=DTYPE.value)


def _demo_target_config():
  from specdec_jax import demo_pair
  with open(os.path.join(demo_pair.DEFAULT_DIR, "config.json")) as f:
    return demo_pair.config_from_json(json.load(f)["models"]["target"])


# ---------------------------------------------------------------------------
# transformers on the same device.


def hf_config(config):
  """transformers' T5Config for a specdec_jax T5Config (`checkpoints.t5config_to_hf_config`)."""
  import transformers
  from specdec_jax.families.t5.checkpoints import t5config_to_hf_config
  return transformers.T5Config(**t5config_to_hf_config(config))


def run_hf() -> Dict[str, Any]:
  import torch
  import transformers
  config = _shape_config(_demo_target_config(), TARGET_SHAPE.value, "target")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[DTYPE.value]
  torch.manual_seed(0)
  start = time.perf_counter()
  previous = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):  # initialise on the device: an 11B model on the host is slow
      model = transformers.T5ForConditionalGeneration(hf_config(config)).eval()
  finally:
    torch.set_default_dtype(previous)
  build_s = time.perf_counter() - start
  enc = torch.randint(2, config.vocab_size, (1, ENC_LEN.value), device=device)
  kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS.value, min_new_tokens=NEW_TOKENS.value,
                num_beams=1)

  def timed():
    if device == "cuda":
      torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
      out = model.generate(enc, **kwargs)
    if device == "cuda":
      torch.cuda.synchronize()
    return time.perf_counter() - start, out

  timed()
  seconds = [timed()[0] for _ in range(REPEATS.value)]
  ms = statistics.median(seconds) * 1e3 / NEW_TOKENS.value
  print(f"transformers {transformers.__version__} on {device}, {DTYPE.value}: {ms:.2f} ms/token",
        flush=True)
  return dict(part="hf", device=device, dtype=DTYPE.value, torch=torch.__version__,
              transformers=transformers.__version__, shape=TARGET_SHAPE.value,
              config=str(config), build_seconds=build_s, new_tokens=NEW_TOKENS.value,
              encoder_length=ENC_LEN.value, ms_per_token=ms,
              ms_per_token_all=[s * 1e3 / NEW_TOKENS.value for s in seconds])


# ---------------------------------------------------------------------------
# Ours.


def _copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
  """Device copy bandwidth, GB/s (read + write counted), median of a few copies."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1)
  jax.block_until_ready(copy(x))
  seconds = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(copy(x))
    seconds.append(time.perf_counter() - start)
  return 2 * nbytes / statistics.median(seconds) / 1e9


def _decoder_bytes(model) -> int:
  """Bytes of the weights one decode step reads: decoder and logits (no encoder)."""
  import jax
  leaves = jax.tree_util.tree_leaves(model.params["decoder"])
  return sum(int(x.size) * x.dtype.itemsize for x in leaves)


def run_ours() -> Dict[str, Any]:
  import jax
  import numpy as np
  import specdec_jax as sj
  from specdec_jax.families.t5 import embed
  from specdec_jax.tools import hlo_ops
  from specdec_jax.tools import methods as methods_lib
  from specdec_jax.tools import profiling
  from specdec_jax.tools import testing
  from specdec_jax.core import theory
  from specdec_jax.families.t5 import decode as t5_decode

  wall = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - wall:6.1f}s] {msg}", flush=True)
  pair = sj.load_demo_pair()
  as_dtype = lambda m: sj.Model(m.config.replace(dtype=DTYPE.value), jax.tree_util.tree_map(
      lambda x: x.astype(DTYPE.value), m.params))
  target_config = _shape_config(pair.target.config, TARGET_SHAPE.value, "target")
  target = sj.Model(target_config, embed.embed_params(pair.target.params, pair.target.config,
                                                      target_config))
  small_large_config = _shape_config(pair.drafts["small"].config, DRAFT_SHAPE, "draft")
  drafts = {
      f"demo small embedded at {DRAFT_SHAPE}": sj.Model(small_large_config, embed.embed_params(
          pair.drafts["small"].params, pair.drafts["small"].config, small_large_config)),
  }
  if not DRY_RUN.value:
    drafts["demo small (1.1M)"] = as_dtype(pair.drafts["small"])
    drafts["demo tiny (0.2M)"] = as_dtype(pair.drafts["tiny"])
  random_small = sj.get_config("t5_small", vocab_size=target_config.vocab_size,
                               dtype=DTYPE.value)
  if DRY_RUN.value:
    random_small = random_small.replace(num_encoder_layers=1, num_decoder_layers=2)
  cost_only = {"random t5_small shape (cost only)": sj.load_model(random_small)}
  log(f"built target {target_config.num_params / 1e9:.2f}B params "
      f"({'tiny dry-run' if DRY_RUN.value else TARGET_SHAPE.value} shape), drafts {list(drafts)}")

  # Target-only decoding and the bandwidth floor.
  enc = testing.random_encoder_tokens(1, ENC_LEN.value, target_config.vocab_size, seed=0,
                                      min_length=ENC_LEN.value)
  kwargs = dict(max_decode_steps=NEW_TOKENS.value, eos_id=-1, block_width=1)

  def generate_seconds():
    start = time.perf_counter()
    jax.block_until_ready(sj.generate(target, enc, **kwargs).sequences)
    return time.perf_counter() - start

  generate_seconds()
  ms_per_token = statistics.median(generate_seconds() for _ in range(REPEATS.value)) * 1e3 / (
      NEW_TOKENS.value)
  bandwidth = _copy_bandwidth_gbs(1 << 26 if jax.default_backend() == "cpu" else 1 << 31)
  floor_ms = _decoder_bytes(target) / (bandwidth * 1e9) * 1e3
  log(f"target-only {ms_per_token:.3f} ms/token; floor {floor_ms:.3f} ms "
      f"({_decoder_bytes(target) / 1e9:.2f} GB at {bandwidth:.0f} GB/s)")

  # Cost curve C(k) and c.
  ks = [1, 2] if DRY_RUN.value else [1, 2, 3, 5, 8, 16]
  max_len = 2 * max(ks) + 2 if DRY_RUN.value else 128
  target_ms = profiling.time_block_calls({"target": target}, enc, max_len, ks,
                                         REPEATS.value)["target"]
  cost_curve = {k: target_ms[k] / target_ms[1] for k in ks}
  draft_ms = profiling.time_block_calls({**drafts, **cost_only}, enc, max_len, [1],
                                        REPEATS.value)
  c = {name: ms[1] / target_ms[1] for name, ms in draft_ms.items()}
  log(f"C(k) {cost_curve}; c {c}")

  # Both attention formulations of the decode step on this device (the
  # head-major cache lets batched dots read it without a copy, so 'dots' may
  # now suit accelerators too): operations per decoder layer as compiled here,
  # and step times of the target and the T5-small-shaped draft.
  formulation_ks = [1] if DRY_RUN.value else [1, 5]
  formulations = {}
  for attention in ("in_layout", "dots"):
    block_fn_for = lambda cfg: (lambda p: t5_decode.block_fn(p, cfg, attention))
    ops = {k: hlo_ops.ops_per_layer(target_config, k, block_fn_for)["total"]
           for k in formulation_ks}
    models = {"target": target} if DRY_RUN.value else {"target": target, **cost_only}
    step_ms = profiling.time_block_calls(models, enc, max_len, formulation_ks, REPEATS.value,
                                         block_fn_for=block_fn_for)
    formulations[attention] = dict(
        ops_per_layer={str(k): v for k, v in ops.items()},
        step_ms={name: {str(k): v for k, v in ms.items()} for name, ms in step_ms.items()})
  log(f"formulations {formulations}")

  # The cost-realistic pair.
  inputs = pair.heldout_inputs(NUM_INPUTS.value)
  steps = min(pair.max_decode_steps, NEW_TOKENS.value) if DRY_RUN.value else pair.max_decode_steps
  # The measured curve, interpolated where a k was not timed (flat past the last).
  curve = list(np.interp(np.arange(1, 9), ks, [cost_curve[k] for k in ks]))
  pairs = {}
  for name, draft in drafts.items():
    # alpha first, at gamma 4, to choose gamma by the theory (unless fixed); at
    # width 5, so that when gamma 4 is chosen (always in a dry run) the timed
    # pair reuses the probe's compiled program.
    probe = sj.generate(target, inputs, max_decode_steps=steps, draft=draft, gamma=4,
                        block_width=5)
    alpha = probe.stats.alpha
    gamma = GAMMA.value or max(range(1, 8), key=lambda g: (
        theory.predicted_speedup_with_cost_curve(alpha, g, c[name], curve), -g))
    width = gamma + 1  # the narrowest exact width (wider blocks cost more on some devices)
    timing = profiling.time_generate_pairs(
        target, inputs, REPEATS.value, dict(max_decode_steps=steps, block_width=width),
        dict(max_decode_steps=steps, draft=draft, gamma=gamma, block_width=width))
    alpha = methods_lib.pooled_stats([o.stats for o in timing.spec_outputs])["alpha"]
    pairs[name] = dict(
        gamma=gamma, block_width=width, alpha=alpha, c=c[name],
        **methods_lib.paired_speedup(timing),
        predicted_theorem_3_8=theory.walltime_improvement(alpha, gamma, c[name]),
        predicted_cost_curve=theory.predicted_speedup_with_cost_curve(
            alpha, gamma, c[name], curve + [curve[-1]] * max(0, gamma + 1 - len(curve))),
        target_ms_per_input=[s * 1e3 for s in timing.base_seconds],
        spec_ms_per_input=[s * 1e3 for s in timing.spec_seconds])
    log(f"pair with {name}: gamma {gamma}, alpha {alpha:.3f}, speedup "
        f"{pairs[name]['speedup']:.2f}X, identical {pairs[name]['identical_rows']}/{len(inputs)}")
  return dict(
      part="ours", machine=_machine(), dtype=DTYPE.value, dry_run=DRY_RUN.value,
      target_note=TARGET_NOTE.format(
          shape="tiny dry-run" if DRY_RUN.value else TARGET_SHAPE.value),
      target_config=str(target_config),
      target_params=target_config.num_params, new_tokens=NEW_TOKENS.value,
      encoder_length=ENC_LEN.value, target_only_ms_per_token=ms_per_token,
      copy_bandwidth_gbs=bandwidth, decoder_bytes=_decoder_bytes(target),
      bandwidth_floor_ms=floor_ms, floor_ratio=ms_per_token / floor_ms,
      target_block_ms={str(k): v for k, v in target_ms.items()},
      cost_curve={str(k): v for k, v in cost_curve.items()},
      draft_step_ms={name: ms[1] for name, ms in draft_ms.items()}, c=c,
      default_attention=t5_decode.default_attention(), formulations=formulations,
      pair_inputs=len(inputs), pair_new_tokens=steps, pairs=pairs,
      seconds=time.perf_counter() - wall)


def _embedded_pair():
  """(demo pair, its target embedded at TARGET_SHAPE, its 'small' draft at DRAFT_SHAPE)."""
  import specdec_jax as sj
  from specdec_jax.families.t5 import embed
  pair = sj.load_demo_pair()
  target_config = _shape_config(pair.target.config, TARGET_SHAPE.value, "target")
  target = sj.Model(target_config, embed.embed_params(pair.target.params, pair.target.config,
                                                      target_config))
  draft_config = _shape_config(pair.drafts["small"].config, DRAFT_SHAPE, "draft")
  small = sj.Model(draft_config, embed.embed_params(pair.drafts["small"].params,
                                                    pair.drafts["small"].config, draft_config))
  return pair, target, small


def run_methods() -> Dict[str, Any]:
  """Issue 22: chain (token / block), static and dynamic tree at each --method_widths W,
  the demo 'small' draft embedded at DRAFT_SHAPE against the embedded target (as in `ours`)."""
  from specdec_jax.tools import methods as methods_lib
  from specdec_jax.tools import profiling
  from specdec_jax.tools import testing

  wall = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - wall:6.1f}s] {msg}", flush=True)  # noqa
  pair, target, draft = _embedded_pair()
  target_config = target.config
  enc = testing.random_encoder_tokens(1, ENC_LEN.value, target_config.vocab_size, seed=0,
                                      min_length=ENC_LEN.value)
  inputs = pair.heldout_inputs(METHOD_INPUTS.value)
  steps = min(pair.max_decode_steps, NEW_TOKENS.value) if DRY_RUN.value else pair.max_decode_steps
  cost = profiling.time_block_calls({"target": target, "draft": draft}, enc, 128 if not
                                    DRY_RUN.value else 8, [1], max(REPEATS.value, 3))
  c = cost["draft"][1] / cost["target"][1]
  log(f"built; c = {c:.3f}")
  out = {}
  widths = [int(w) for w in METHOD_WIDTHS.value]
  for width in widths:
    ms = profiling.time_block_calls({"target": target}, enc, max(128, 2 * width + 2), [1, width],
                                    REPEATS.value)["target"]
    verify_cost = ms[width] / ms[1]
    gamma = min(7, width - 1)
    branching = TREES.get(width) or next(b for w, b in sorted(TREES.items(), reverse=True)
                                         if w <= width)
    topk, depth, budget = DYNAMIC_TREES.get(width, (4, 4, width))
    methods = [
        methods_lib.chain(draft, gamma, "token", f"chain gamma={gamma} (token)"),
        methods_lib.chain(draft, gamma, "block", f"chain gamma={gamma} (block)"),
        methods_lib.tree(draft, branching, name=f"tree {branching}"),
        methods_lib.dynamic_tree(draft, topk, depth, budget,
                                 f"dynamic tree k={topk} d={depth} n={budget}"),
    ]
    if DRY_RUN.value:  # token-wise chains run in `ours` already: keep the test short
      methods = methods[1:]
    rows = {}
    for method in methods:
      timing = profiling.time_generate_pairs(
          target, inputs, REPEATS.value, dict(max_decode_steps=steps),
          dict(max_decode_steps=steps, block_width=width, **method.kwargs))
      row = rows[method.name] = methods_lib.paired_row(method, timing, c, verify_cost)
      log(f"W={width} {method.name}: {row['tokens_per_iteration']:.2f} tokens/iteration, "
          f"speedup {row['speedup']:.2f}X, identical {row['identical_rows']}/{len(inputs)}")
    out[str(width)] = dict(verify_cost=verify_cost, c=c, target_block_ms={
        str(k): v for k, v in ms.items()}, rows=rows)
  return dict(part="methods", machine=_machine(), dtype=DTYPE.value, dry_run=DRY_RUN.value,
              draft=f"demo small embedded at {DRAFT_SHAPE}", c=c, inputs=len(inputs),
              new_tokens=steps, widths=out, seconds=time.perf_counter() - wall)


def run_features() -> Dict[str, Any]:
  """Issue 23: the demo feature head embedded with the target, against the embedded 'small'
  draft (module docstring)."""
  import jax
  import specdec_jax as sj
  from specdec_jax.families.t5 import embed
  from specdec_jax.tools import methods as methods_lib
  from specdec_jax.tools import profiling
  from specdec_jax.tools import testing

  wall = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - wall:6.1f}s] {msg}", flush=True)  # noqa
  pair, target, small = _embedded_pair()
  target_config = target.config
  shipped = pair.drafts.get("feature")
  small_head = shipped if shipped is not None else sj.FeatureDraft(pair.target, seed=0)
  head = sj.FeatureDraft(target, head_params=jax.tree_util.tree_map(
      lambda x: x.astype(target_config.dtype), embed.embed_feature_head_params(
          small_head.head_params, pair.target.config, target_config)))
  head_name = ("demo feature head" if shipped is not None else "RANDOM feature head (no "
               "demo_pair/feature_head.npz)") + f" embedded at {TARGET_SHAPE.value}"
  enc = testing.random_encoder_tokens(1, ENC_LEN.value, target_config.vocab_size, seed=0,
                                      min_length=ENC_LEN.value)
  gamma = 4
  max_len = 128 if not DRY_RUN.value else 16
  # Issue 32: the one-call drafters the pair ships, at the large cost: Medusa heads and the
  # DFlash drafter grown with the target (`Draft.grown_params`), the PARD drafter's model
  # embedded at the 'small' draft's shape (it reads nothing of the target).
  parallel = _grown_parallel_drafts(pair, target, small.config)
  proposal_ms = profiling.time_proposals(
      target, {"feature head": head, "small": small, **parallel}, enc, max_len, gamma,
      max(REPEATS.value, 3))
  target_ms = profiling.time_block_calls({"target": target}, enc, max_len, [1],
                                         max(REPEATS.value, 3))["target"][1]
  c = {name: ms / gamma / target_ms for name, ms in proposal_ms.items()}
  log(f"built; target step {target_ms:.3f} ms; c per drafted token {c}")
  inputs = pair.heldout_inputs(METHOD_INPUTS.value)
  steps = min(pair.max_decode_steps, NEW_TOKENS.value) if DRY_RUN.value else pair.max_decode_steps
  width = 8 if DRY_RUN.value else 16
  ms = profiling.time_block_calls({"target": target}, enc, max(max_len, 2 * width + 2),
                                  sorted({1, gamma + 1, width}), REPEATS.value)["target"]
  verify_cost = ms[width] / ms[1]
  branching = TREES.get(width) or (2, 1, 1)
  topk, depth, budget = DYNAMIC_TREES.get(width, (2, 4, width))
  methods = [  # (method, its block width, its c)
      (methods_lib.chain(small, gamma, name=f"small chain gamma={gamma}"), gamma + 1,
       c["small"]),
      (methods_lib.chain(head, gamma, name=f"feature chain gamma={gamma}"), gamma + 1,
       c["feature head"]),
      (methods_lib.tree(head, branching, name=f"feature tree {branching}"), width,
       c["feature head"]),
      (methods_lib.dynamic_tree(head, topk, depth, budget,
                                f"feature dynamic tree k={topk} d={depth} n={budget}"), width,
       c["feature head"]),
  ]
  for name, draft in parallel.items():
    methods.append((methods_lib.chain(draft, gamma, name=f"{name} chain gamma={gamma}"),
                    gamma + 1, c[name]))
    # The same tree as the feature head's (it fits `width`), cut to the levels a
    # one-call drafter scores.
    levels = branching[:draft.max_tree_depth or len(branching)]
    methods.append((methods_lib.tree(draft, levels, name=f"{name} tree {levels}"), width,
                    c[name]))
  rows = {}
  for method, block_width, cost in methods:
    timing = profiling.time_generate_pairs(
        target, inputs, REPEATS.value, dict(max_decode_steps=steps),
        dict(max_decode_steps=steps, block_width=block_width, **method.kwargs))
    verify = ms[block_width] / ms[1] if block_width in ms else verify_cost
    row = rows[method.name] = dict(methods_lib.paired_row(method, timing, cost, verify), c=cost,
                                   block_width=block_width)
    log(f"{method.name}: alpha {row['alpha']:.2f}, {row['tokens_per_iteration']:.2f} "
        f"tokens/iteration, speedup {row['speedup']:.2f}X, identical "
        f"{row['identical_rows']}/{len(inputs)}")
  return dict(part="features", machine=_machine(), dtype=DTYPE.value, dry_run=DRY_RUN.value,
              head=head_name, small=f"demo small embedded at {DRAFT_SHAPE}", gamma=gamma,
              target_step_ms=target_ms, proposal_ms=proposal_ms, c=c, width=width,
              verify_cost=verify_cost, inputs=len(inputs), new_tokens=steps, rows=rows,
              seconds=time.perf_counter() - wall)


def _grown_parallel_drafts(pair, target, small_config) -> Dict[str, Any]:
  """The pair's shipped one-call drafters (issue 32) fit to drive the embedded target:
  {name: draft} for those it ships ('medusa', 'dflash', 'parallel')."""
  import jax
  import specdec_jax as sj
  from specdec_jax.families.t5 import embed
  from specdec_jax.scaled_pair import embed_draft
  out = {}
  for name in ("medusa", "dflash"):
    if name in pair.drafts:
      out[name] = embed_draft(pair.drafts[name], pair.target, target)
  if "parallel" in pair.drafts:
    pard = pair.drafts["parallel"]
    config = small_config.replace(vocab_size=pard.model.config.vocab_size)
    model = sj.Model(config, embed.embed_params(pard.model.params, pard.model.config, config))
    model = sj.Model(config.replace(dtype=target.config.dtype), jax.tree_util.tree_map(
        lambda x: x.astype(target.config.dtype), model.params))
    out["parallel"] = sj.ParallelDraft(model, mask_token_id=pard.mask_token_id,
                                       gamma=pard.gamma)
  return out


# ---------------------------------------------------------------------------
# The evaluation harness on the mini-benchmark (the evaluate part).


def _evaluate_scale_to() -> str:
  """The harness's --scale_to: TARGET_SHAPE/DRAFT_SHAPE, in a dry run DRY_SHAPES spelt as
  overrides of those names (`scaled_pair.shape_config`)."""
  if not DRY_RUN.value:
    return f"{TARGET_SHAPE.value}/{DRAFT_SHAPE}"
  spell = lambda name, role: name + ":" + ",".join(  # noqa: E731
      f"{k}={v}" for k, v in DRY_SHAPES[role].items())
  return f"{spell(TARGET_SHAPE.value, 'target')}/{spell(DRAFT_SHAPE, 'draft')}"


def _records_summary(root: str) -> Dict[str, Any]:
  """{method: questions, equal, tau} over the harness's finished records (one file per
  method and question, `specdec_jax.evaluation.store`)."""
  out = {}
  for method in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    records = []
    for name in sorted(os.listdir(os.path.join(root, method))):
      with open(os.path.join(root, method, name)) as f:
        records.append(json.load(f))
    runs = [run for r in records for run in r["runs"]]
    calls = sum(sum(run["target_calls"]) for run in runs)
    out[method] = dict(questions=len(records), equal=sum(bool(r.get("equal")) for r in records),
                       tau=sum(sum(run["new_tokens"]) for run in runs) / calls if calls else None)
  return out


def run_evaluate() -> Dict[str, Any]:
  """The harness in its own process (its flags are the launcher's, not these), then a
  summary of its results.json: every method's overall speedup, tau, alpha, equality."""
  out = os.path.join(OUTPUT_DIR.value, "evaluate")
  categories, per_category = list(EVALUATE_CATEGORIES.value), EVALUATE_PER_CATEGORY.value
  if DRY_RUN.value:  # every method on one question: the paths, not the figures
    if not flags.FLAGS["evaluate_categories"].present:
      categories = categories[:1]
    if not flags.FLAGS["evaluate_per_category"].present:
      per_category = 1
  command = [sys.executable, "-m", "experiments.evaluate", "--pair=demo_t5", "--benchmark=demo",
             "--methods=all", f"--scale_to={_evaluate_scale_to()}", "--temperature=0",
             "--batch_size=1", "--chat_template=plain", f"--runs={REPEATS.value}",
             f"--limit_per_category={per_category}", f"--output_dir={out}"]
  if categories != ["all"]:
    command.append(f"--categories={','.join(categories)}")
  print(" ".join(command), flush=True)
  start = time.perf_counter()
  try:
    returncode = subprocess.run(command, timeout=EVALUATE_TIMEOUT.value).returncode
  except subprocess.TimeoutExpired:
    returncode = None
  seconds = time.perf_counter() - start
  path = os.path.join(out, "results.json")
  result = None
  if returncode is not None and os.path.exists(path):
    with open(path) as f:
      result = json.load(f)
  summary = dict(part="evaluate", machine=_machine(), dry_run=DRY_RUN.value,
                 scale_to=_evaluate_scale_to(), command=command, returncode=returncode,
                 timed_out=returncode is None, seconds=seconds, output_dir=out)
  if result is not None:
    summary.update(
        equality=result["equality"], questions=result["benchmark"]["questions"],
        categories=result["benchmark"]["categories"], target=result["methods"]["vanilla"][
            "description"],
        methods={name: dict(speedup=m["overall"]["speedup"], tau=m["overall"]["tau"],
                            alpha=m["overall"]["alpha"], block_width=m["block_width"],
                            compile_seconds=m["compile_seconds"], equal=m["overall"]["equal"],
                            total=m["overall"]["total"], c=m.get("c"),
                            verify_cost=m.get("verify_cost"),
                            predicted_speedup=m.get("predicted_speedup"))
                 for name, m in result["methods"].items()})
  else:  # stopped or failed: what the records it finished say (tau, equal outputs)
    summary["finished_records"] = _records_summary(os.path.join(out, "records"))
  print(f"evaluate: {'timed out' if returncode is None else f'exit {returncode}'} after "
        f"{seconds:.0f} s; {out}", flush=True)
  return summary


# ---------------------------------------------------------------------------
# Report.


def report() -> str:
  def load(name):
    path = os.path.join(OUTPUT_DIR.value, f"{name}.json")
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  ours, hf, methods, features = load("ours"), load("hf"), load("methods"), load("features")
  if ours is None:
    raise FileNotFoundError(f"no ours.json in {OUTPUT_DIR.value}: run --part=ours first")
  cpu = ours["machine"]["backend"] == "cpu"
  lines = [f"**{ours['target_note']}** Machine: {', '.join(ours['machine']['devices'])}, "
           f"jax {ours['machine']['jax']}, {ours['dtype']}, batch 1, {ours['machine']['date']}"
           f"{' (DRY RUN: tiny shapes on CPU, numbers meaningless)' if ours['dry_run'] else ''}.",
           "", "| figure | value |", "|---|---|",
           f"| our target-only `generate` ({ours['new_tokens']} tokens, {ours['encoder_length']}"
           f"-token input) | {ours['target_only_ms_per_token']:.2f} ms/token |",
           f"| bandwidth floor ({ours['decoder_bytes'] / 1e9:.1f} GB at "
           f"{ours['copy_bandwidth_gbs']:.0f} GB/s) | {ours['bandwidth_floor_ms']:.2f} ms/token "
           f"(ours = {ours['floor_ratio']:.2f}x the floor)"
           f"{'; on a CPU caches and a loaded machine make this no floor' if cpu else ''} |"]
  if hf is not None:
    lines.append(f"| transformers {hf['transformers']} `generate`, same shape, {hf['device']} "
                 f"{hf['dtype']} | {hf['ms_per_token']:.2f} ms/token (ours "
                 f"{hf['ms_per_token'] / ours['target_only_ms_per_token']:.1f}x faster) |")
  curve = ", ".join(f"{v:.2f} (k={k})" for k, v in ours["cost_curve"].items() if k != "1")
  lines.append(f"| C(k) = target call scoring k tokens / 1 | {curve} |")
  for name, value in ours["c"].items():
    lines.append(f"| c, {name} | {value:.3f} ({ours['draft_step_ms'][name]:.3f} ms/step) |")
  lines += ["", f"Attention formulations of the decode step (default here: "
            f"{ours['default_attention']}): operations per decoder layer as compiled on this "
            "device, and step ms.", "", "| formulation | ops/layer | step ms |", "|---|---|---|"]
  for attention, f in ours["formulations"].items():
    ops = ", ".join(f"{v} (k={k})" for k, v in f["ops_per_layer"].items())
    steps = "; ".join(f"{name}: " + ", ".join(f"{v:.3f} (k={k})" for k, v in ms.items())
                      for name, ms in f["step_ms"].items())
    lines.append(f"| {attention} | {ops} | {steps} |")
  lines += ["", f"Cost-realistic pair: {ours['pair_inputs']} held-out demo inputs, greedy, "
            f"{ours['pair_new_tokens']} new tokens max, paired interleaved repeats.", "",
            "| draft | γ | α | c | predicted (Thm 3.8) | predicted (C(k)) | speedup | identical |",
            "|---|---|---|---|---|---|---|---|"]
  for name, p in ours["pairs"].items():
    lines.append(f"| {name} | {p['gamma']} | {p['alpha']:.2f} | {p['c']:.3f} | "
                 f"{p['predicted_theorem_3_8']:.2f}X | {p['predicted_cost_curve']:.2f}X | "
                 f"{p['speedup']:.2f}X [{p['speedup_min']:.2f}, {p['speedup_max']:.2f}] | "
                 f"{p['identical_rows']}/{p['rows']} |")
  if methods:
    lines += ["", "Block verification and token trees (issue 22), the demo 'small' draft embedded "
              f"at {DRAFT_SHAPE}, greedy, all methods at one width W; pred = tokens / (draft calls"
              " c + C(W)); baseline the fastest exact target-only decoding (width 1 or W).", "",
              "| W | C(W) | method | tokens/iter | α | pred | speedup | baseline W | identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    for width, block in methods["widths"].items():
      for name, r in block["rows"].items():
        lines.append(f"| {width} | {block['verify_cost']:.2f} | {name} | "
                     f"{r['tokens_per_iteration']:.2f} | {r['alpha']:.2f} | {r['predicted']:.2f}X | "
                     f"{r['speedup']:.2f}X [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | "
                     f"{r['baseline_width']} | {r['identical_rows']}/{r['rows']} |")
  if features:
    lines += ["", f"Feature drafts (issue 23): the {features['head']} against the "
              f"{features['small']}, greedy; c per drafted token from whole {features['gamma']}"
              f"-token proposals ({', '.join(f'{k} {v:.3f}' for k, v in features['c'].items())})"
              f"; C({features['width']}) = {features['verify_cost']:.2f}; baseline the fastest "
              "exact target-only decoding.", "",
              "| method | W | α | c | tokens/iter | pred | speedup | baseline W | identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in features["rows"].items():
      lines.append(f"| {name} | {r['block_width']} | {r['alpha']:.2f} | {r['c']:.3f} | "
                   f"{r['tokens_per_iteration']:.2f} | {r['predicted']:.2f}X | "
                   f"{r['speedup']:.2f}X [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | "
                   f"{r['baseline_width']} | {r['identical_rows']}/{r['rows']} |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(OUTPUT_DIR.value, "gpu_benchmarks.md"), "w") as f:
    f.write(text)
  _write("gpu_benchmarks", dict(ours=ours, hf=hf, methods=methods, features=features))
  return text


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if DRY_RUN.value:
    # Every code path at tiny cost: the shapes above, two inputs, one repeat.
    for flag, value in (("new_tokens", 8), ("encoder_length", 8), ("num_inputs", 2),
                        ("repeats", 1), ("gamma", 4), ("method_widths", ["8"]),
                        ("method_inputs", 2)):
      if not flags.FLAGS[flag].present:
        flags.FLAGS[flag].value = value
  if PART.value == "hf":
    _write("hf", run_hf())
  elif PART.value == "ours":
    _write("ours", run_ours())
  elif PART.value == "methods":
    _write("methods", run_methods())
  elif PART.value == "features":
    _write("features", run_features())
  elif PART.value == "evaluate":
    summary = run_evaluate()
    _write("evaluate", summary)
    if summary["returncode"] != 0:  # the harness failed, timed out or found outputs differ
      sys.exit(1)
  else:
    print(report())


if __name__ == "__main__":
  app.run(main)
