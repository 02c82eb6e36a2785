r"""How the per-token cost grows with the cache, and where the growth goes (issue 21).

Part 1, `generate`: target-only decoding of the demo T5 target (float32, batch
1, greedy, EOS off) at block widths 1, 5 and 8 for a short and a long decode;
ms per token, fastest of --repeats whole calls, interleaved.

Part 2, where a block call's time goes: one call of k tokens at the short and
the long cache, traced by the JAX profiler; XLA CPU's op durations summed by
kind (a `ynn_fusion` is a YNNPACK dot fusion, `dot` a batched dot,
`broadcast_reduce_fusion` the softmax's max-and-sum reduction, ...). The growth
of each kind from the short to the long cache says what the wider block adds.
(Microbenchmarks of attention alone mislead here: with the cache a constant,
XLA hoists its transposes out of the timing loop.)

Part 3, prefix attention side by side: the same greedy decode loop (one
block call per token, the cache carried, `families.t5.decode.decode_block`)
with self-attention over the whole cache (`prefix_chunk=0`) and over the
written prefix in chunks (the CPU default, `PREFIX_CHUNK`), compiled together
and interleaved; ms per token, fastest of --repeats.

  python scripts/cache_growth.py --output_json=benchmarks/cpu/issue21/cache_growth.json
"""
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp

FLAGS = flags.FLAGS
flags.DEFINE_list("widths", ["1", "5", "8"], "Block widths.")
flags.DEFINE_list("decode_steps", ["64", "1024"], "A short and a long decode (tokens).")
flags.DEFINE_integer("repeats", 3, "Whole-call samples per setting (fastest kept).")
flags.DEFINE_integer("calls", 20, "Block calls per compiled loop in part 2.")
flags.DEFINE_string("output_json", "", "Where to write the results (atomically).")


def _fastest(fns, repeats):
  """{name: fastest seconds} of zero-argument calls, interleaved over `repeats` rounds."""
  for fn in fns.values():
    fn()  # compile
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      samples[name].append(time.perf_counter() - start)
  return {name: min(v) for name, v in samples.items()}


def part_generate(pair, widths, steps, repeats):
  import specdec_jax as sj
  x = pair.heldout_inputs(1)
  fns = {}
  for n in steps:
    for w in widths:
      fns[f"width{w}_steps{n}"] = (lambda w=w, n=n: jax.block_until_ready(sj.generate(
          pair.target, x, max_decode_steps=n, eos_id=-1, block_width=w).sequences))
  seconds = _fastest(fns, repeats)
  return {name: s * 1e3 / int(name.split("steps")[1]) for name, s in seconds.items()}


def part_profile(pair, widths, steps, calls):
  """{width: {n: {op kind: ms per block call}}}: XLA CPU's own op times (profiler trace).

  One block call of k tokens at the cache `generate` builds for n steps
  (`profiling.time_block_calls`, loop positions half way in), traced; the
  ops' durations summed by kind (the HLO name without its .N suffix: a
  `ynn_fusion` is a YNNPACK dot, `dot` a batched dot, ...) per call.
  """
  import glob, gzip, re, shutil, tempfile
  from specdec_jax.tools import profiling
  x = pair.heldout_inputs(1)
  host_events = ("$", "Thunk", "Pjit", "Common", "Slinky", "ParseArguments", "while")  # while: holds the rest
  out = {}
  for k in widths:
    for n in steps:
      profiling.time_block_calls({"t": pair.target}, x, n + k, [k], repeats=1, calls=calls)
      trace_dir = tempfile.mkdtemp()
      jax.profiler.start_trace(trace_dir)
      repeats = 3
      profiling.time_block_calls({"t": pair.target}, x, n + k, [k], repeats=repeats, calls=calls)
      jax.profiler.stop_trace()
      path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
      kinds = {}
      for event in json.load(gzip.open(path))["traceEvents"]:
        if event.get("ph") == "X" and not event["name"].startswith(host_events):
          kind = re.sub(r"\.\d+$", "", event["name"])
          # (repeats + 1) loops of `calls` calls each: time_block_calls compiles and
          # runs each loop once before its timed repeats.
          kinds[kind] = kinds.get(kind, 0.0) + event["dur"] / 1e3 / ((repeats + 1) * calls)
      shutil.rmtree(trace_dir, ignore_errors=True)
      out.setdefault(f"width{k}", {})[f"steps{n}"] = {
          kind: round(ms, 4) for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])}
  return out


def part_prefix(pair, widths, steps, repeats):
  """{f'chunk{c}_width{w}_steps{n}': ms per token}: whole-cache against prefix attention."""
  from specdec_jax.families.t5 import decode
  model = pair.target
  x = pair.heldout_inputs(1)
  prepared = decode.prepare_decode_params(model.params, model.config)

  def loop(w, n, chunk):
    cache = model.init_cache(1, n, x)

    @jax.jit
    def run(cache):
      def body(i, carry):
        cache, token = carry
        logits, cache = decode.decode_block(
            prepared, model.config, jnp.broadcast_to(token, (1, w)), jnp.full((1,), i, jnp.int32),
            cache, "dots", prefix_chunk=chunk)
        return cache, jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
      return jax.lax.fori_loop(0, n - w + 1, body, (cache, jnp.zeros((1, 1), jnp.int32)))[1]
    return lambda: jax.block_until_ready(run(cache))

  fns = {f"chunk{c}_width{w}_steps{n}": loop(w, n, c)
         for n in steps for w in widths for c in (0, decode.PREFIX_CHUNK)}
  seconds = _fastest(fns, repeats)
  return {name: s * 1e3 / (int(name.split("steps")[1]) - int(name.split("_")[1][5:]) + 1)
          for name, s in seconds.items()}


def main(argv):
  del argv
  import specdec_jax as sj
  from specdec_jax.families.t5 import decode
  widths = [int(w) for w in FLAGS.widths]
  steps = [int(n) for n in FLAGS.decode_steps]
  pair = sj.load_demo_pair()
  results = dict(generate_ms_per_token=part_generate(pair, widths, steps, FLAGS.repeats),
                 profile_ms_per_call=part_profile(pair, widths, steps, FLAGS.calls),
                 prefix_ms_per_token=part_prefix(pair, widths, steps, FLAGS.repeats),
                 load_average=list(os.getloadavg()),
                 date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 note="demo T5 target, float32, batch 1, greedy, EOS off; generate: fastest "
                      f"of {FLAGS.repeats}; profile: XLA op time per block call, by kind; "
                      f"prefix: decode loop, whole cache (chunk0) against prefix attention "
                      f"(chunk{decode.PREFIX_CHUNK}), fastest of {FLAGS.repeats}")
  short, long_ = steps[0], steps[-1]
  g, prof = results["generate_ms_per_token"], results["profile_ms_per_call"]
  for w in widths:
    a, b = prof[f"width{w}"][f"steps{short}"], prof[f"width{w}"][f"steps{long_}"]
    growth = sorted(((b.get(kind, 0) - a.get(kind, 0), kind) for kind in set(a) | set(b)),
                    reverse=True)[:4]
    print(f"width {w}: generate {g[f'width{w}_steps{short}']:.3f} -> "
          f"{g[f'width{w}_steps{long_}']:.3f} ms/token; ops per call {sum(a.values()):.2f} -> "
          f"{sum(b.values()):.2f} ms; growth by kind: "
          + ", ".join(f"{kind} +{ms:.2f}" for ms, kind in growth))
  p = results["prefix_ms_per_token"]
  for w in widths:
    print(f"width {w}: whole cache " + " -> ".join(
        f"{p[f'chunk0_width{w}_steps{n}']:.3f}" for n in (short, long_)) + " ms/token; prefix "
        + " -> ".join(f"{p[f'chunk{decode.PREFIX_CHUNK}_width{w}_steps{n}']:.3f}"
                      for n in (short, long_)))
  print(f"load {results['load_average']}")
  if FLAGS.output_json:
    sj.data.write_bytes_atomic(FLAGS.output_json, (json.dumps(results, indent=1) + "\n").encode())


if __name__ == "__main__":
  app.run(main)
