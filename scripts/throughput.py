r"""Throughput at any batch size (issue 33): fixed batches against slots, fixed gamma against
gamma='auto', over the same inputs.

For each pair and batch size B, over the same inputs (`--num_inputs`, or
`--inputs_per_slot` x B), greedy or sampled, each mode called once untimed (compiles),
then timed in `--repeats` rounds of every mode, the order rotating (the least per mode:
a slow spell of the machine only adds time; the median is kept too):

    target, batches     `generate` target-only on consecutive chunks of B inputs
    target, slots       `generate_many` target-only, B slots
    spec, batches       `generate` with the pair's draft at --gamma, chunks of B
    spec, slots         `generate_many` with the draft at --gamma, B slots
    auto, slots         `generate_many(gamma='auto')`, B slots, each call given what
                        the one before it measured (`prior=out.slots.measured`, the
                        first from its untimed call): chunks of one long stream, as the
                        launcher gives each chunk what the chunks before it measured

Target-only decodes one token per call (block width 1, the fastest exact baseline on
CPU); the fixed-gamma modes verify at width gamma + 1; auto at each phase's own.

It reports tokens/s (tokens emitted, EOS included, over wall seconds), each mode's speedup
against the faster target-only mode, and the efficiency of the speculative modes: measured
speedup against target-only of the same scheduling / the theory's prediction E[tokens] /
(gamma c + C(gamma + 1)), with alpha pooled from that mode's own decode, E[tokens] that of
outputs of the mode's lengths (`theory.expected_tokens_per_iteration(..., length=)`: each
output's last iteration cut; eq. 1's unbounded E[tokens] is kept in the JSON) and c, C(k)
measured at batch B (`tools.profiling`; C(1) is the one-token step target-only runs). A
fixed batch waits for its slowest row (stragglers); slots refill, so their efficiency
should approach 1. Greedy rows also count the outputs equal to target-only's. The loop's
own theory (each plan's whole loop iteration timed at B) is taken apart into four factors
whose product is that efficiency (`_loop_factors`: acceptance, occupancy, starts, the
rest), and each mode's speedup is also given round by round against the faster
target-only mode of the same round (`_paired`: on a machine whose speed drifts, the
rounds' spread says how far a least time can be trusted).

Pairs: 't5' and 'decoder_only' (the shipped demo pairs) and 'scaled' (the T5 demo target
embedded at t5_1_1_base, `sj.scale_pair`: the same function at a cost whose steps are
memory-bound on this CPU; its drafts as shipped).

  python scripts/throughput.py --pairs=t5,decoder_only,scaled --batch_sizes=1,4,16,64 \
      --temperatures=0,1 --output_json=benchmarks/cpu/issue33/throughput.json
"""

import dataclasses
import gc
import itertools
import json
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any, Dict, List

from absl import app, flags
import jax
import numpy as np

import specdec_jax as sj
from specdec_jax.core import theory
from specdec_jax.programs import PROGRAMS
from specdec_jax.results import write_json_atomic
from specdec_jax.tools import profiling

PAIRS = flags.DEFINE_list("pairs", ["t5", "decoder_only", "scaled"], "t5, decoder_only, scaled.")
BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "Batch sizes B.")
TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")
NUM_INPUTS = flags.DEFINE_integer("num_inputs", 64, "Held-out inputs decoded by every mode.")
INPUTS_PER_SLOT = flags.DEFINE_integer(
    "inputs_per_slot", 0, "At batch B, decode max(num_inputs, this x B) inputs (held-out rows "
    "repeated if there are fewer): a stream long enough that its tail is a small part.")
GAMMA = flags.DEFINE_integer("gamma", 4, "The fixed gamma.")
DRAFT = flags.DEFINE_string("draft", "", "The pair's draft (default: its first).")
TREE = flags.DEFINE_list("tree", [], "Branching per level (e.g. 2,2,1): the speculative "
                         "modes draft this static tree of the pair's draft (its own block "
                         "width; gamma='auto' chooses between it and target-only); the "
                         "theory's columns are a chain's and are left out.")
REPEATS = flags.DEFINE_integer("repeats", 1, "Timed runs per mode (the least counts).")
SCALED_SHAPE = flags.DEFINE_string("scaled_shape", "t5_1_1_base", "The 'scaled' pair's shape.")
MAX_DECODE_STEPS = flags.DEFINE_integer("max_decode_steps", 0, "0: the pair's own.")
OUTPUT_JSON = flags.DEFINE_string("output_json", "", "Write the results here (atomically).")
DTYPE = flags.DEFINE_string("dtype", "", "The models' dtype (default: the pairs' float32).")
MARKDOWN_FROM = flags.DEFINE_list("markdown_from", [], "Print these result files as "
                                   "BENCHMARKS.md tables and run nothing.")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "Tiny and short: the 'scaled' pair at "
                            "t5_1_1_small, 8 inputs, 8 steps (the GPU script's CPU test).")


def _pair(name: str):
  """(target, draft, inputs, lengths, steps, label)."""
  dtype = DTYPE.value or "float32"
  if name == "scaled":
    pair = sj.load_demo_pair("t5", dtype=dtype)
    shape = "t5_1_1_small" if DRY_RUN.value else SCALED_SHAPE.value
    scaled = sj.scale_pair(pair, shape, log=None, memory_budget_bytes=None)
    target, drafts, label = scaled.target, scaled.drafts, f"t5 demo at {shape}"
  else:
    pair = sj.load_demo_pair(name, dtype=dtype)
    target, drafts, label = pair.target, pair.drafts, f"{name} demo pair"
  draft_name = DRAFT.value or next(iter(drafts))  # the pair's first: its model draft
  inputs, lengths = pair.inputs()
  steps = 8 if DRY_RUN.value else (MAX_DECODE_STEPS.value or pair.max_decode_steps)
  draft, label = drafts[draft_name], f"{label}, draft {draft_name!r}"
  if TREE.value:
    draft = sj.TreeDraft(draft, tuple(int(v) for v in TREE.value))
    label += f" as a tree {tuple(int(v) for v in TREE.value)} ({draft.num_nodes} nodes)"
  return target, draft, inputs, lengths, steps, label


def _stream(inputs, lengths, b: int):
  """The inputs decoded at batch b: num_inputs of them, or inputs_per_slot x b (held-out
  rows cycled when there are fewer)."""
  n = 8 if DRY_RUN.value else max(NUM_INPUTS.value, INPUTS_PER_SLOT.value * b)
  rows = np.arange(n) % len(inputs)
  return inputs[rows], None if lengths is None else lengths[rows]


def _iteration_ms(target, draft, x, lengths, b, steps, temperature):
  """({0: ms of one target-only slot-loop iteration at width 1, gamma: at width gamma + 1},
  {the same plans: ms of one input's start (refill)}) at batch b (`sj.slots`' timing of
  whole iterations, which gamma='auto' decides by)."""
  from specdec_jax import slots, settings
  draft = settings.check_draft(target.config, draft, x, lengths, steps)

  def settings_for(g):
    return settings.plan_settings(target.config, draft if g else None, max_decode_steps=steps,
                                  temperature=temperature, gamma=max(g, 1),
                                  block_width=g + 1)
  timed = slots._iteration_ms(target, draft, x, lengths, b, settings_for, [0, GAMMA.value])
  return {g: ms for g, (ms, _) in timed.items()}, {g: ms for g, (_, ms) in timed.items()}


def _paired(r, results):
  """r's speedup round by round: each round's time against the faster target-only mode of
  the same round (the modes of a round run back to back, so a slow spell of the machine
  that lasts a round falls on both sides), and their median: `speedup_paired`."""
  rounds = [min(a, b) / t for a, b, t in zip(results["target, batches"]["seconds_rounds"],
                                            results["target, slots"]["seconds_rounds"],
                                            r["seconds_rounds"])]
  r["speedup_rounds"] = rounds
  r["speedup_paired"] = statistics.median(rounds)


def _loop_factors(spec, target, loop, refill, inputs, gamma):
  """The loop theory's efficiency of speculation (`spec`, against `target`, the
  target-only mode of the same scheduling: slots or fixed batches), taken apart into four
  factors whose product it is (exactly: wall = loop iterations x wall per iteration, and
  loop iterations = live row iterations / (slots x occupancy)):

    acceptance  the row iterations target-only needed per row iteration speculation
                needed (with the same outputs, greedy: tokens per live row iteration),
                against E[tokens] at the decode's alpha for outputs of their lengths
                (the theory's i.i.d. law, each output's last iteration cut by its step
                limit or EOS: acceptances that come in runs give fewer)
    occupancy   the share of slot-iterations that did work, against target-only's (the
                tail of a stream, where the last rows finish while nothing waits)
    starts      each input's start (the encoder or the prompt's prefill, and the draft's),
                timed per input (`refill`), spread over the loop iterations: the timed
                iteration plus it, against the timed iteration, target-only's ratio over
                speculation's (a start costs about the same in both, but speculation runs
                fewer iterations per input: Amdahl's law over the part it does not speed up)
    iteration   the rest: wall time per loop iteration in the stream against the timed
                iteration with its starts (syncs, a start's overlap with the loop, the
                machine's spell), target-only's ratio over speculation's

  `inputs` inputs each started once. Returns {acceptance, occupancy, starts, iteration}."""
  tokens = spec["predicted_tokens_per_iteration"]
  wall = {g: 1e3 * m["seconds"] / m["iterations"] for g, m in ((0, target), (gamma, spec))}
  with_starts = {g: loop[g] + inputs * refill[g] / m["iterations"]
                 for g, m in ((0, target), (gamma, spec))}
  return dict(acceptance=target["live_iterations"] / spec["live_iterations"] / tokens,
              occupancy=spec["occupancy"] / target["occupancy"],
              starts=(with_starts[0] / loop[0]) / (with_starts[gamma] / loop[gamma]),
              iteration=(wall[0] / with_starts[0]) / (wall[gamma] / with_starts[gamma]))


def _interleaved(modes, repeats: int):
  """{mode: (each round's seconds, last output)}: every mode called once untimed (compiles; auto's
  call measures its first prior), then `repeats` rounds timing each mode once, the order
  rotating each round, so that a slow spell of the machine falls on every mode alike."""
  for fn in modes.values():
    fn()
  names = list(modes)
  seconds = {mode: [] for mode in names}
  outs = {}
  for round_index in range(repeats):
    shift = round_index % len(names)
    for mode in names[shift:] + names[:shift]:
      start = time.perf_counter()
      outs[mode] = modes[mode]()
      jax.block_until_ready(outs[mode].sequences)
      seconds[mode].append(time.perf_counter() - start)
  return {mode: (seconds[mode], outs[mode]) for mode in names}


def _chained(prior, *args, **kw):
  """`generate_many(*args, prior=prior["measured"], **kw)`, what it measured kept as the
  next call's prior."""
  out = sj.generate_many(*args, prior=prior.get("measured"), **kw)
  prior["measured"] = out.slots.measured
  return out


def _batches(target, inputs, lengths, b, **kw):
  """`generate` over consecutive chunks of b inputs, one output of every row (the last
  chunk padded with copies of its first row, dropped afterwards: one program), with the
  chunks' loop iterations (each runs until its slowest row ends) and the row iterations
  of live rows (a row's iterations: its stats', else one per token) as `iterations` and
  `live_iterations`."""
  outs = []
  for start in range(0, len(inputs), b):
    x = inputs[start:start + b]
    l = None if lengths is None else lengths[start:start + b]
    short = b - len(x)
    if short:
      x = np.concatenate([x, np.repeat(x[:1], short, 0)])
      l = None if l is None else np.concatenate([l, np.repeat(l[:1], short, 0)])
    outs.append(sj.generate(target, x, l, **kw))
  n = len(inputs)
  rows = [np.asarray(o.lengths if o.stats is None else o.stats.iterations) for o in outs]
  rows[-1] = rows[-1][:b - short]  # the padding's copies are not the stream's work
  iterations = int(sum(np.max(r) for r in rows))
  live = int(sum(np.sum(r) for r in rows))
  seqs = np.concatenate([np.asarray(o.sequences) for o in outs])[:n]
  lens = np.concatenate([np.asarray(o.lengths) for o in outs])[:n]
  stats = None
  if outs[0].stats is not None:
    stats = dataclasses.replace(outs[0].stats, **{  # the chunks' rows, padding dropped
        f.name: np.concatenate([getattr(o.stats, f.name) for o in outs])[:n]
        for f in dataclasses.fields(outs[0].stats)
        if f.name != "gamma" and getattr(outs[0].stats, f.name) is not None})
  return SimpleNamespace(sequences=seqs, lengths=lens, stats=stats, iterations=iterations,
                         live_iterations=live)


def run_pair(name: str, temperature: float) -> Dict[str, Any]:
  target, draft, heldout, heldout_lengths, steps, label = _pair(name)
  rng = jax.random.PRNGKey(0)
  sample = dict(temperature=temperature, rng=rng) if temperature > 0 else {}
  rows: List[Dict[str, Any]] = []
  for b in [int(v) for v in BATCH_SIZES.value]:
    inputs, lengths = _stream(heldout, heldout_lengths, b)
    b = min(b, len(inputs))
    kw = dict(max_decode_steps=steps, **sample)
    width = GAMMA.value + 1
    # A chain drafts GAMMA at width GAMMA + 1; a tree at its own shape and width.
    spec = (dict(draft=draft, block_width=draft.num_nodes) if TREE.value else
            dict(draft=draft, gamma=GAMMA.value, block_width=width))
    modes = {
        "target, batches": lambda: _batches(target, inputs, lengths, b, block_width=1, **kw),
        "target, slots": lambda: sj.generate_many(target, inputs, lengths, batch_size=b,
                                                  block_width=1, **kw),
        "spec, batches": lambda: _batches(target, inputs, lengths, b, **spec, **kw),
        "spec, slots": lambda: sj.generate_many(target, inputs, lengths, batch_size=b,
                                                **spec, **kw),
        # Given what the call before it measured, as the launcher gives each chunk what
        # the chunks before it measured: one long stream, probed once (untimed).
        "auto, slots": lambda: _chained(prior, target, inputs, lengths, batch_size=b,
                                        draft=draft, gamma="auto", **kw),
    }
    results, prior, sequences, output_lengths = {}, {}, {}, {}
    timings = _interleaved(modes, REPEATS.value)
    for mode in modes:
      rounds, out = timings[mode]
      output_lengths[mode] = np.asarray(out.lengths)
      seconds = min(rounds)
      tokens = int(np.sum(np.asarray(out.lengths)))
      results[mode] = dict(seconds=seconds, seconds_median=statistics.median(rounds),
                           seconds_rounds=rounds, tokens=tokens, tokens_per_s=tokens / seconds)
      if out.stats is not None:
        results[mode]["alpha"] = out.stats.alpha
      if temperature == 0:
        sequences[mode] = np.asarray(out.sequences)
        results[mode]["identical_to_target"] = float(np.mean(np.all(
            sequences[mode] == sequences["target, batches"], axis=1)))
      slots = getattr(out, "slots", None)
      if slots is not None:
        results[mode]["occupancy"] = slots.occupancy
        results[mode]["iterations"] = slots.iterations
        results[mode]["live_iterations"] = slots.live_iterations
        results[mode]["phases"] = [dict(p, cost_curve=None) for p in slots.phases]
      else:  # fixed batches: a chunk runs until its slowest row ends (stragglers)
        results[mode]["iterations"] = out.iterations
        results[mode]["live_iterations"] = out.live_iterations
        results[mode]["occupancy"] = out.live_iterations / (out.iterations * b)
    base = min(results["target, batches"]["seconds"], results["target, slots"]["seconds"])
    for r in results.values():
      r["speedup"] = base / r["seconds"]
      _paired(r, results)
    if TREE.value:  # the theory below is a chain's
      rows.append(dict(batch_size=b, inputs=len(inputs), modes=results))
      _print_row(label, temperature, b, len(inputs), results)
      continue
    # The theory at this batch size: C(gamma + 1) and c measured at batch b.
    x = inputs[:b]
    l = None if lengths is None else lengths[:b]
    # Medians of 5 samples of 16 calls: samples of 4 calls (a few ms each on the demo
    # pairs) read a slow spell of this shared VM as the cost, the theory moving with it.
    calls = 4 if DRY_RUN.value else 16
    ms = profiling.time_block_calls({"target": target}, x, steps + 1, [1, width], 5,
                                    calls=calls, lengths=l)["target"]
    proposal = profiling.time_proposals(target, {"draft": draft}, x, max(steps, 4) + 1,
                                        GAMMA.value, 5, calls=calls, lengths=l)["draft"]
    c = proposal / GAMMA.value / ms[1]
    verify = ms[width] / ms[1]
    # The loop's own theory: each plan's whole iteration (proposal, target call,
    # verification, sampling, bookkeeping) timed at batch b, as gamma='auto' times them:
    # what the slots would run at full occupancy with i.i.d. acceptance. Against it,
    # efficiency is what scheduling (stragglers, refills, syncs) leaves.
    loop, refill = _iteration_ms(target, draft, x, l, b, steps, temperature)
    for mode in ("spec, batches", "spec, slots"):
      r = results[mode]
      alpha = min(r["alpha"], 0.999)
      # E[tokens] of outputs cut at their lengths (each one's last iteration), as the
      # theory predicts for these outputs; eq. 1's unbounded decode kept beside it.
      cut = output_lengths[mode]
      r["predicted_tokens_per_iteration"] = theory.expected_tokens_per_iteration(
          alpha, GAMMA.value, cut)
      r["predicted_tokens_per_iteration_unbounded"] = theory.expected_tokens_per_iteration(
          alpha, GAMMA.value)
      predicted = theory.predicted_speedup_with_verify_cost(alpha, GAMMA.value, c, verify,
                                                            length=cut)
      # Against the target-only mode of the same scheduling (the theory has no stragglers
      # in its baseline either).
      same = results["target, " + mode.split(", ")[1]]["seconds"]
      r["predicted_speedup"] = predicted
      r["efficiency"] = (same / r["seconds"]) / predicted
      r["predicted_speedup_loop"] = (r["predicted_tokens_per_iteration"] * loop[0]
                                     / loop[GAMMA.value])
      r["efficiency_loop"] = (same / r["seconds"]) / r["predicted_speedup_loop"]
    for how in ("batches", "slots"):
      results["spec, " + how]["efficiency_loop_factors"] = _loop_factors(
          results["spec, " + how], results["target, " + how], loop, refill, len(inputs),
          GAMMA.value)
    rows.append(dict(batch_size=b, inputs=len(inputs), c=c, verify_cost=verify,
                     iteration_ms={str(g): v for g, v in loop.items()},
                     refill_ms={str(g): v for g, v in refill.items()}, modes=results))
    _print_row(label, temperature, b, len(inputs), results)
  return dict(pair=name, label=label, temperature=temperature,
              num_inputs=", ".join(f"{r['inputs']} at B = {r['batch_size']}" for r in rows),
              max_decode_steps=steps, gamma=None if TREE.value else GAMMA.value, rows=rows)


def _print_row(label, temperature, b, count, results):
  print(f"{label}, T={temperature}, B={b}, {count} inputs: " + ", ".join(
      f"{m} {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}X"
      + (f", eff {r['efficiency']:.2f} / loop {r['efficiency_loop']:.2f}"
         if "efficiency" in r else "") + ")"
      for m, r in results.items()), flush=True)


def markdown(document) -> str:
  """The results as BENCHMARKS.md tables: per pair and temperature, one row per batch size
  (tokens/s of each mode, speedups against the faster target-only mode, efficiencies,
  occupancy and what auto chose)."""
  lines = []
  for result in document["results"]:
    lines += ["", f"**{result['label']}, T = {result['temperature']:g}** "
              f"(inputs: {result['num_inputs']}; {result['max_decode_steps']} new tokens at most"
              + (f", fixed gamma {result['gamma']})" if result["gamma"] else ")"), "",
              "| B | target batches tok/s | target slots | spec batches (eff) | spec slots (eff) "
              "| auto slots | auto's gamma (phases) | slot occupancy (spec) |",
              "|---|---|---|---|---|---|---|---|"]
    paired, factors = [], []
    for row in result["rows"]:
      m = row["modes"]
      if "speedup_paired" in m["auto, slots"]:
        paired.append(f"| {row['batch_size']} | " + " | ".join(
            f"{m[mode]['speedup_paired']:.2f}X ({min(m[mode]['speedup_rounds']):.2f}-"
            f"{max(m[mode]['speedup_rounds']):.2f})"
            for mode in ("spec, batches", "spec, slots", "auto, slots")) + " |")
      for mode in ("spec, batches", "spec, slots"):
        f = m[mode].get("efficiency_loop_factors")
        if f:
          factors.append(f"| {row['batch_size']} | {mode.split(', ')[1]} | "
                         f"{m[mode]['efficiency_loop']:.2f} | {f['acceptance']:.2f} | "
                         f"{f['occupancy']:.2f} | {f['starts']:.2f} | {f['iteration']:.2f} |")

      def cell(mode):
        r = m[mode]
        eff = (f", eff {r['efficiency']:.2f} / {r['efficiency_loop']:.2f}"
               if "efficiency_loop" in r else
               f", eff {r['efficiency']:.2f}" if "efficiency" in r else "")
        return f"{r['tokens_per_s']:.0f} ({r['speedup']:.2f}X{eff})"

      gammas = ", ".join(f"{g} x{len(list(run))}" for g, run in itertools.groupby(
          p["gamma"] for p in m["auto, slots"].get("phases", [])))
      lines.append(
          f"| {row['batch_size']} | {cell('target, batches')} | {cell('target, slots')} | "
          f"{cell('spec, batches')} | {cell('spec, slots')} | {cell('auto, slots')} | "
          f"{gammas} | {m['spec, slots'].get('occupancy', float('nan')):.2f} |")
    if paired:
      lines += ["", "Round by round (each round's time against the faster target-only mode of "
                "that round): median (least-most)", "",
                "| B | spec batches | spec slots | auto slots |", "|---|---|---|---|"] + paired
    if factors:
      lines += ["", "The speculative modes' loop efficiency taken apart (`_loop_factors`: "
                "the product of the four, each speculation's against target-only's of the "
                "same scheduling)", "",
                "| B | spec | eff (loop) | acceptance | occupancy | starts | iteration |",
                "|---|---|---|---|---|---|---|"] + factors
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if MARKDOWN_FROM.value:  # render earlier results, run nothing
    for path in MARKDOWN_FROM.value:
      with open(path) as f:
        print(markdown(json.load(f)))
    return
  document = dict(machine=dict(backend=jax.default_backend(), devices=[str(d) for d in
                                                                      jax.devices()],
                               cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M")),
                  results=[])
  for name in PAIRS.value:
    for t in TEMPERATURES.value:
      document["results"].append(run_pair(name, float(t)))
      if OUTPUT_JSON.value:
        os.makedirs(os.path.dirname(OUTPUT_JSON.value) or ".", exist_ok=True)
        write_json_atomic(OUTPUT_JSON.value, document)
      # Each pair and temperature compiles its own programs (every mode, gamma and batch
      # size, and the timings'), and XLA's CPU backend maps each executable's code
      # separately: one pair at one temperature holds ~24,000 memory maps, and the
      # default run (three pairs, two temperatures) crashed past Linux's 65,530 ("LLVM
      # compilation error: Cannot allocate memory", then a segfault). The next pair
      # shares none of them.
      PROGRAMS.clear()
      jax.clear_caches()
      gc.collect()
  print(json.dumps({"done": len(document["results"])}))


if __name__ == "__main__":
  app.run(main)
