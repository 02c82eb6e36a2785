r"""The paper's Table 2 on the shipped demo pair, on this machine (CPU, batch 1).

For each draft (the ~10x 'small' and ~50x 'tiny' T5 drafts, the bigram and
unigram drafts) and temperature (0 and 1):
  alpha  measured with `generate(..., draft=...)` statistics on held-out inputs;
  c      draft decode-step time / target decode-step time (one token, batch 1);
  gamma  chosen by the theory (Theorem 3.8 with the measured alpha and c, and
         again with the measured cost of verifying gamma + 1 tokens in one target call);
  speed  target-only time / speculative time (sum over inputs of the median of repeats
         after warm-up; target-only and speculative calls interleaved so load changes on a
         shared machine hit both), at the theory's gamma and at every gamma of the sweep;
         the best measured gamma is reported too.
Greedy outputs are checked token-for-token against target-only decoding at the
speculative loop's block width W (here gamma + 1, the narrowest exact width);
speeds are against the fastest exact target-only decoding (width 1 or W,
whichever was faster here).

c of the n-gram drafts is taken as 0 (a table lookup next to a T5 step), which
is why the theory picks the largest gamma for them; on CPU their proposal loop
still costs a little per token, so the best measured gamma is smaller.
Timings on a CPU shared with other jobs move by a few tenths of X between runs.

  python -m experiments.mini_table2 --output_dir=results/mini_table2 [--num_inputs=12]

Writes results.json and results.md (atomically) and prints the table beside the paper's.
Resumable: each finished row is written to rows/<draft>_T<temperature>.json
(atomically) and read back instead of measured again, by a run of the same flags on
the same pair's files only (each row carries that identity's digest; another's is
refused); one run at a time holds the output directory.

`--target_shape=t5_1_1_base` (or `gpt2_medium` with `--demo_pair_dir=decoder_only`)
first embeds the target function-preservingly in that shape (`sj.scale_pair`,
`make demo`'s act 2): the same drafts and alpha at a large model's cost, the
regime the paper is about.
"""

from typing import Dict, List

from absl import app, flags, logging
import jax
import numpy as np

import json
import os
import sys

from experiments.output_lock import OutputLock
from experiments.paper_tables import TABLE2
from experiments.run_identity import file_fingerprints, identity_digest
# experiments.run defines --output_dir (and its other flags) at import; we share it.
from experiments.run import OUTPUT_DIR
from specdec_jax.compile_cache import enable_compile_cache
from specdec_jax.families.registry import is_model
from specdec_jax.tools.profiling import block_step_seconds, time_generate_pairs, time_proposals
from specdec_jax.tools.speedup import pooled_alpha
from specdec_jax import results as results_lib
from specdec_jax.core import theory
from specdec_jax.demo_pair import DIRS as DEMO_PAIR_DIRS, load_demo_pair
from specdec_jax.scaled_pair import scale_pair

FLAGS = flags.FLAGS
flags.DEFINE_string("demo_pair_dir", None, "Demo pair directory, or a family name (t5, "
                    "decoder_only) for its shipped pair (default: the T5 pair).")
flags.DEFINE_integer("num_inputs", 12, "Held-out inputs, each decoded at batch 1.")
flags.DEFINE_integer("repeats", 3, "Timed repeats per input (median taken).")
flags.DEFINE_list("drafts", ["small", "tiny", "bigram", "unigram"], "Drafts to run.")
flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures.")
flags.DEFINE_list("gammas", ["1", "2", "3", "4", "5", "7"], "Gamma sweep for the T5 drafts.")
flags.DEFINE_list("ngram_gammas", ["1", "2", "3"], "Gamma sweep for the n-gram drafts.")
flags.DEFINE_integer("max_gamma", 8, "Largest gamma the theory may choose.")
flags.DEFINE_string("target_shape", None, "Embed the pair's target function-preservingly in "
                    "this shape first (`sj.scale_pair`: e.g. t5_1_1_base, gpt2_medium), with its "
                    "heads grown: the same drafts and alpha at a large model's cost.")
flags.DEFINE_float("memory_budget_gb", 4.0, "--target_shape: the embedding's memory budget.")


def paper_rows_markdown() -> str:
  lines = [results_lib.TABLE2_HEADER]
  for r in TABLE2:
    lines.append(results_lib.table2_row(r.task.upper(), r.draft, r.temperature, r.gamma,
                                        r.alpha, r.speedup, r.predicted, r.c))
  return "\n".join(lines)


# The flags a row's figures depend on (--drafts and --temperatures pick the rows).
ROW_FLAGS = ("demo_pair_dir", "num_inputs", "repeats", "gammas", "ngram_gammas", "max_gamma",
             "target_shape", "memory_budget_gb")


def row_identity() -> str:
  """The digest every stored row carries: the flags above, the backend and the pair's
  files (`experiments.run_identity`): a row is read back only by the run that would
  measure it again."""
  directory = DEMO_PAIR_DIRS.get(FLAGS.demo_pair_dir or "t5", FLAGS.demo_pair_dir)
  return identity_digest(dict(flags={name: FLAGS[name].value for name in ROW_FLAGS},
                              backend=jax.default_backend(),
                              files=file_fingerprints({"pair": directory})))


def _stored_row(row_path: str, digest: str):
  """A finished row of this very run, else None; another run's is a ValueError."""
  if not os.path.exists(row_path):
    return None
  with open(row_path) as f:
    row = json.load(f)
  if row.get("identity_sha256") != digest:
    raise ValueError(f"{row_path} was measured with other flags or another pair's files (one "
                     f"of --{', --'.join(ROW_FLAGS)}, or a retrained pair): delete "
                     f"{os.path.dirname(row_path)} to measure afresh, or choose another "
                     "--output_dir")
  return row


def run(output_dir: str) -> Dict:
  """The table, one (draft, temperature) row at a time, each stored as it finishes; one
  run at a time in output_dir (`experiments.output_lock`)."""
  with OutputLock(output_dir):
    return _run(output_dir)


def _run(output_dir: str) -> Dict:
  digest = row_identity()
  rows_dir = os.path.join(output_dir, "rows")
  for name in sorted(os.listdir(rows_dir)) if os.path.isdir(rows_dir) else []:
    _stored_row(os.path.join(rows_dir, name), digest)  # Another run's rows: refused now.
  pair = load_demo_pair(FLAGS.demo_pair_dir)
  inputs, lengths = pair.inputs(FLAGS.num_inputs)
  first = None if lengths is None else lengths[:1]
  steps = pair.max_decode_steps
  target, model_drafts = pair.target, pair.drafts
  if FLAGS.target_shape:
    scaled = scale_pair(pair, FLAGS.target_shape,
                        memory_budget_bytes=int(FLAGS.memory_budget_gb * 1024 ** 3))
    target, model_drafts = scaled.target, scaled.drafts
  drafts = {**model_drafts, **pair.ngrams}
  unknown = [d for d in FLAGS.drafts if d not in drafts]
  if unknown:
    raise ValueError(f"unknown drafts {unknown}; the pair has {sorted(drafts)}")

  # Cost curve: one target call scoring k tokens, relative to k = 1.
  max_k = FLAGS.max_gamma + 1
  target_step = [block_step_seconds(target, inputs[:1], k, steps, 20, lengths=first)
                 for k in range(1, max_k + 1)]
  block_cost = [t / target_step[0] for t in target_step]
  # Models: one k=1 call; a feature head (a Draft, not a model): a whole 4-token proposal
  # per token (`profiling.time_proposals`: its own calls and sampling).
  c = {name: block_step_seconds(m, inputs[:1], 1, steps, 20, lengths=first) / target_step[0]
       for name, m in model_drafts.items() if is_model(m)}
  heads = {name: m for name, m in model_drafts.items()
           if not is_model(m) and name in FLAGS.drafts}
  if heads:
    ms = time_proposals(target, heads, inputs[:1], steps, 4, 20, lengths=first)
    c.update({name: ms[name] / 4 / (1e3 * target_step[0]) for name in heads})
  logging.info("block cost %s, c %s", block_cost, c)

  rows: List[Dict] = []
  for temperature in [float(t) for t in FLAGS.temperatures]:
    kwargs = dict(max_decode_steps=steps, temperature=temperature, rng=jax.random.PRNGKey(0))
    for name in FLAGS.drafts:
      draft = drafts[name]
      row_path = os.path.join(output_dir, "rows", f"{name}_T{temperature:g}.json")
      stored = _stored_row(row_path, digest)
      if stored is not None:  # resumed: a finished row (written atomically)
        rows.append(stored)
        continue
      row = {"draft": name, "temperature": temperature,
             **_measure_row(target, inputs, lengths, kwargs, draft, name in model_drafts,
                            c.get(name, 0.0), block_cost), "identity_sha256": digest}
      rows.append(row)
      results_lib.write_json_atomic(row_path, row)
      logging.info("%s", {k: v for k, v in row.items() if k != "sweep"})

  result = dict(num_inputs=len(inputs), repeats=FLAGS.repeats, max_decode_steps=steps,
                block_cost=block_cost, target_step_seconds=target_step[0], c=c, rows=rows,
                params=pair.info.get("params"), device=jax.devices()[0].device_kind,
                target_shape=FLAGS.target_shape, target_params=target.config.num_params)
  md = markdown(result)
  results_lib.write_json_atomic(f"{output_dir}/results.json", result)
  results_lib.write_text_atomic(f"{output_dir}/results.md", md)
  print(md)
  return result


def _measure_row(target, inputs, lengths, kwargs, draft, neural: bool, draft_c: float,
                 block_cost) -> Dict:
  """One draft's row at one temperature: alpha (probed at gamma 4), the theory's and the
  cost curve's gamma, and the timed sweep (`draft_c`: its c; n-gram drafts 0, a table
  lookup next to a target step)."""
  temperature = kwargs["temperature"]
  # Model drafts and feature heads sweep --gammas; n-gram drafts --ngram_gammas.
  sweep = [int(g) for g in (FLAGS.gammas if neural else FLAGS.ngram_gammas)]
  # alpha does not depend on gamma (per-position acceptance); measure it at gamma = 4.
  probe = time_generate_pairs(target, inputs, 0, kwargs, dict(kwargs, draft=draft, gamma=4),
                              prompt_lengths=lengths).spec_outputs
  alpha = pooled_alpha(probe)
  gamma_theory = theory.optimal_gamma(min(alpha, 0.999), draft_c, FLAGS.max_gamma)
  verify = {g: theory.predicted_speedup_with_cost_curve(alpha, g, draft_c, block_cost)
            for g in range(1, FLAGS.max_gamma + 1)}
  gamma_curve = max(verify, key=lambda g: (verify[g], -g))
  measured = {}
  identical = True
  for g in sorted(set(sweep) | {gamma_theory, gamma_curve}):
    if g > FLAGS.max_gamma:
      continue
    # Summed per-input medians: the time to complete all inputs.
    # block_width g + 1: the narrowest exact width, the cheapest on CPU.
    timing = time_generate_pairs(target, inputs, FLAGS.repeats, kwargs,
                                 dict(kwargs, draft=draft, gamma=g, block_width=g + 1),
                                 prompt_lengths=lengths)
    outs = timing.spec_outputs
    base_time, seconds = sum(timing.base_seconds), sum(timing.spec_seconds)
    base_tokens = sum(int(o.lengths[0]) for o in timing.reference_outputs)
    measured[g] = dict(seconds=seconds, target_seconds=base_time,
                       speedup=base_time / seconds, baseline_block_width=timing.base_width,
                       reference_block_width=timing.reference_width,
                       target_ms_per_token=1e3 * base_time / max(base_tokens, 1),
                       alpha=pooled_alpha(outs),
                       tokens_per_iteration=float(np.mean(
                           [o.stats.mean_tokens_per_iteration for o in outs])))
    if temperature == 0.0:
      identical &= timing.identical
  best = max(measured, key=lambda g: measured[g]["speedup"])
  return dict(alpha=alpha, c=draft_c,
              gamma_theory=gamma_theory,
              predicted_theory=theory.walltime_improvement(alpha, gamma_theory, draft_c),
              speedup_theory_gamma=measured[gamma_theory]["speedup"],
              gamma_cost_curve=gamma_curve, predicted_cost_curve=verify[gamma_curve],
              speedup_cost_curve_gamma=measured[gamma_curve]["speedup"],
              gamma_best=best, speedup_best=measured[best]["speedup"],
              target_ms_per_token=measured[best]["target_ms_per_token"],
              identical_outputs=identical if temperature == 0.0 else None,
              sweep=measured)


def markdown(result: Dict) -> str:
  shape = result.get("target_shape")
  title = ("## Table 2 on the demo pair (code completion, CPU, batch 1)" if not shape else
           f"## Table 2 on the demo pair, its target embedded at {shape} "
           f"({result['target_params'] / 1e6:.0f}M params; code completion, CPU, batch 1)")
  lines = [title, "",
           f"{result['num_inputs']} held-out inputs, {result['max_decode_steps']} new tokens max, "
           f"median of {result['repeats']} repeats. Target step "
           f"{1e3 * result['target_step_seconds']:.2f} ms; verifying k tokens costs "
           + ", ".join(f"k={k + 1}: {v:.2f}x" for k, v in enumerate(result["block_cost"]))
           + " of one token.", "",
           "Thm 3.8 assumes verifying γ+1 tokens costs one target step (TPU-like); the cost-curve "
           "columns use the measured verification cost above (CPU). Speeds are measured; "
           "'identical' compares greedy outputs with target-only decoding at the speculative "
           "loop's block width W; speeds are against the fastest exact target-only decoding "
           "(width 1 or W).", "",
           "| draft | temp | α | c | γ (Thm 3.8) | predicted | speed at that γ | "
           "γ (cost curve) | predicted | speed | best γ | best speed | identical |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    same = {True: "yes", False: "NO", None: "n/a (sampling)"}[r.get("identical_outputs")]
    lines.append(
        f"| {r['draft']} | {r['temperature']:g} | {r['alpha']:.2f} | {r['c']:.3f} | "
        f"{r['gamma_theory']} | {r['predicted_theory']:.2f}X | {r['speedup_theory_gamma']:.2f}X | "
        f"{r['gamma_cost_curve']} | {r['predicted_cost_curve']:.2f}X | "
        f"{r['speedup_cost_curve_gamma']:.2f}X | {r['gamma_best']} | {r['speedup_best']:.2f}X | "
        f"{same} |")
  lines += ["", "The paper's Table 2 (T5-XXL target on TPU-v4, batch 1):", "",
            paper_rows_markdown()]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  enable_compile_cache()
  try:
    run(OUTPUT_DIR.value or "results/mini_table2")
  except (ValueError, FileNotFoundError) as e:  # A clear line, not a traceback.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  app.run(main)
