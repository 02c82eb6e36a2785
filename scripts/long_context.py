r"""Long context (issue 52, part 5): what a decode step costs against the written and the
allocated length, what each cache layout holds, and what speculation gains at long contexts.

The model. The decoder-only demo target is GPT-2 (learned positions, a table of 128 rows),
which cannot reach these contexts, so the script builds a Llama-layout config of its width
and depth (192 wide, 4 layers, 3 heads of 64, MLP 768, its 2048-piece vocabulary and token
ids; RMSNorm, SwiGLU, rotary positions with rope_theta 5e5, an untied LM head) with
max_positions raised to hold the longest allocation, and **random weights**
(`init_decoder_only_params`, seed 0). The "model draft" of part 3 is built the same way
from the demo draft's shape (64 wide, 1 layer; seed 1): the trained GPT-2 draft's 128
positions cannot reach these contexts either. Both being random and unrelated, the model
draft's alpha is near zero; the sparse-cache drafts are the target itself, but with random
weights attention moves the output little, so their alpha says little about a trained
model's: at this size the part measures costs. (A rotary demo target would keep its
trained weights: `long_context_target` raises its max_positions instead.) `--scale_to`
embeds the target function-preservingly in a larger Llama shape (`sj.embed_model`, out_in
kernels), e.g. `--scale_to=llama_3_2_1b`: the same outputs at a memory-bound cost. The
inputs are real text: the demo pair's held-out rows (prompt and reference, 12k tokens of
Python source) concatenated, row b of a batch starting at b/B of the way through the
stream, cycled past its end. Parts prefix (per its --attention_chunks) and speedup (the
config's default, 256) run the target as `DecoderOnlyConfig.attention_chunk` says.

Part `prefix`: target-only greedy decoding at batch 1 for written (prompt) lengths L = 512,
1024, ..., --max_context, with the cache allocated (a) at L + 2N - 1 (the prompt's own
width and the decode's 2N steps) and (b) at --allocated = 32768 positions. ms/token is
(T(2N) - T(N)) / N, T the fastest of --repeats calls decoding N or 2N tokens, the four calls of
a length interleaved, so the prefill, the cache's copy and the dispatch cancel. The timed
program (`--prefix_timing=loop`, the default) is the family's start (`family.start`, the
prefill `generate` runs, writing L positions into a cache of the allocated length) and then
a compiled loop of one-token greedy block calls (`family.block_fn`, what `generate`'s
target-only loop calls at width 1, the CPU default): (b) through `sj.generate` itself needs a
prompt padded to 32k, whose prefill scores every padded slot (50 s a call on this CPU).
`--prefix_timing=generate` times `sj.generate` (right-padded prompts of width A - n + 1 for
(b), prompt_lengths L) the same way, for machines where that is cheap. Each row checks that
(a), (b) and `sj.generate` at (a) emit the same tokens. Each of --attention_chunks runs
(`DecoderOnlyConfig.attention_chunk`: 256, the default, reads the cache in chunks up to its
last write, `prefix_attention`; 0 reads the whole allocation, as before that change): with
0, (b) costs more than (a) and stays near its 32k cost at every L; with chunks, (b) / (a)
should be about 1.

Part `memory`: cache bytes per row (batch 1, bfloat16, mesh 1 x 1) at contexts 4k ... 128k
from `sj.plan_memory` (abstract shapes: nothing allocated) for Llama-3.1-8B (full cache),
Mistral-7B (a 4k window on every layer), Gemma-2-9B (a 4k window on every other layer) and
DeepSeek-V3 (latent attention), beside the full-length reference 2 * layers * kv_heads *
head_dim * positions * bytes (DeepSeek-V3: layers * heads * (qk_nope + qk_rope + v)) and the
layout's own formula: a window layer holding min(W, positions) positions, a latent layer
kv_lora_rank + qk_rope_head_dim per position. Until window layers keep rings and DeepSeek a
latent cache, plan_memory reports the full length for every layout.

Part `speedup`: for contexts 1k and 2k (`--speedup_contexts=1024,2048,4096` adds 4k: about
4 minutes more on a 2-core CPU) at batch 1 and 8, --speedup_steps new tokens per row,
`sj.generate` target-only (width 1), its start alone (max_decode_steps=1: prefill and first
token) and speculative decoding (gamma --gamma) with (i) the model draft and (ii) the target
drafting for itself from a sparse cache, `sj.SparseCacheDraft(target, budget=--budget,
policy="window")` and `policy="retrieval"`, all interleaved, fastest of --speedup_repeats;
speedup = target-only seconds / speculative seconds (whole calls, prefill included: the
start column says how much of a call that is), alpha and
tokens per iteration from the output's stats, and whether the greedy outputs are equal.
Where `sj.SparseCacheDraft` does not exist yet the sparse rows say "skipped".

The JSON is written atomically after every row; a rerun with the same settings (all but the
lists choosing rows, `SELECTION`) keeps the rows it holds and adds the ones it names (a
speedup row with a skipped or failed draft is rerun). Markdown tables go to stdout.

  python scripts/long_context.py --output_json=benchmarks/cpu/issue52/long_context.json
"""
import functools
import os
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax as sj
from specdec_jax.families.base import shift_block_fn
from specdec_jax.families.decoder_only.model import init_decoder_only_params
from specdec_jax.results import read_json, write_json_atomic

MEMORY_CONFIGS = ("llama_3_1_8b", "mistral_7b", "gemma2_9b", "deepseek_v3")
DRAFT_ORDER = ("model draft", "window", "retrieval")  # part speedup's drafts
MIB = 2 ** 20


def define_flags():
  """The command line (defined when run as a script only: a test that imports this module
  shares absl's one flag namespace with other scripts' flags)."""
  from absl import flags
  flags.DEFINE_list("parts", ["prefix", "memory", "speedup"], "prefix, memory, speedup.")
  flags.DEFINE_integer("max_context", 8192, "Longest written length of part prefix.")
  flags.DEFINE_integer("min_context", 512, "Shortest written length (then doubling).")
  flags.DEFINE_integer("allocated", 32768, "Part prefix's fixed allocation (b).")
  flags.DEFINE_integer("decode_steps", 32, "N: part prefix decodes N and 2N tokens.")
  flags.DEFINE_enum("prefix_timing", "loop", ["loop", "generate"], "What part prefix times.")
  flags.DEFINE_list("attention_chunks", ["256", "0"], "Part prefix runs the target with "
                    "each DecoderOnlyConfig.attention_chunk (0: reads the whole cache).")
  flags.DEFINE_list("memory_contexts", ["4096", "8192", "16384", "32768", "131072"],
                    "Part memory's contexts.")
  flags.DEFINE_list("memory_configs", list(MEMORY_CONFIGS), "Named decoder-only configs.")
  flags.DEFINE_string("memory_dtype", "bfloat16", "Part memory's cache dtype.")
  flags.DEFINE_list("speedup_contexts", ["1024", "2048"], "Part speedup's contexts (4096 "
                    "adds about 4 minutes on a 2-core CPU: its batch-8 prefill is 8 s a call).")
  flags.DEFINE_list("batch_sizes", ["1", "8"], "Part speedup's batch sizes.")
  flags.DEFINE_integer("speedup_steps", 64, "New tokens per row in part speedup.")
  flags.DEFINE_integer("budget", 256, "SparseCacheDraft's budget (positions).")
  flags.DEFINE_integer("gamma", 4, "Tokens drafted per iteration.")
  flags.DEFINE_integer("repeats", 3, "Part prefix's timed rounds (the fastest kept).")
  flags.DEFINE_integer("speedup_repeats", 1, "Part speedup's timed rounds (the fastest kept).")
  flags.DEFINE_integer("num_layers", 0, "The target's layers (0: the demo target's).")
  flags.DEFINE_string("scale_to", "", "Embed the target in this Llama shape (e.g. "
                      "llama_3_2_1b): the same function at that shape's cost.")
  flags.DEFINE_string("output_json", "benchmarks/cpu/issue52/long_context.json",
                      "Where the results go (atomically, after every row).")


# -- Timing ---------------------------------------------------------------------------------

def _fastest(fns: Dict[str, Callable[[], Any]], repeats: int, warmup: bool = True):
  """({name: fastest seconds}, {name: last result}) of zero-argument calls (each blocks
  until its result is ready): every call once untimed (compiles; `warmup=False`: the caller
  did that), then `repeats` >= 1 rounds, the order rotating each round, so a slow spell of
  the machine falls on every call alike."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  outs = {name: fn() for name, fn in fns.items()} if warmup else {}
  names, samples = list(fns), {name: [] for name in fns}
  for round_index in range(repeats):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      outs[name] = fns[name]()
      samples[name].append(time.perf_counter() - start)
  return {name: min(v) for name, v in samples.items()}, outs


def _ready(x):
  """x, blocked on (a GenerateOutput: its sequences), as numpy when it is an array."""
  if isinstance(x, sj.GenerateOutput):
    jax.block_until_ready(x.sequences)
    return x
  return np.asarray(jax.block_until_ready(x))


# -- Model and inputs -----------------------------------------------------------------------

def llama_layout(config, max_positions: int, num_layers: int = 0):
  """A Llama-layout `DecoderOnlyConfig` (rotary, RMSNorm, SwiGLU, rope_theta 5e5, an untied
  LM head) of `config`'s width, heads, MLP, vocabulary, token ids and dtype, with
  `num_layers` layers (0: config's) and `max_positions` positions.

  Untied: with random weights the residual stream is mostly the input token's embedding,
  so a tied head's argmax is that token, and greedy decoding repeats the prompt's last token
  (every draft then agrees, alpha 1)."""
  return sj.DecoderOnlyConfig(
      family="llama", activation="silu", vocab_size=config.vocab_size,
      emb_dim=config.emb_dim, num_layers=num_layers or config.num_layers,
      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim, mlp_dim=config.mlp_dim, max_positions=max_positions,
      norm_epsilon=config.norm_epsilon, rope_theta=500000.0, tie_word_embeddings=False,
      bos_id=config.bos_id,
      eos_id=config.eos_id, pad_id=config.pad_id, dtype=config.dtype)


def long_context_target(model, max_positions: int, num_layers: int = 0, seed: int = 0):
  """(model, how it was made): a rotary `model` (at its depth) with max_positions raised,
  its weights kept; a learned-position one as `llama_layout` with random weights."""
  config = model.config
  if config.uses_rotary and not num_layers:
    return (type(model)(config.replace(max_positions=max_positions), model.params),
            "the demo model, max_positions raised")
  large = llama_layout(config, max_positions, num_layers)
  return (sj.DecoderOnlyModel(large, init_decoder_only_params(large, seed)),
          f"llama layout of the demo {config.family} model's shape ({large.emb_dim} wide, "
          f"{large.num_layers} layer{'s' * (large.num_layers != 1)}), random weights (seed "
          f"{seed})")


def build_models(max_positions: int, num_layers: int = 0, scale_to: str = ""):
  """(pair, target, draft, notes): the decoder-only demo pair and its models made fit for
  `max_positions` (`long_context_target`; the draft at its own depth, seed 1), the target
  embedded in `scale_to` when given."""
  pair = sj.load_demo_pair("decoder_only")
  target, target_note = long_context_target(pair.target, max_positions, num_layers, seed=0)
  draft, draft_note = long_context_target(pair.drafts["draft"], max_positions, seed=1)
  if scale_to:
    small_config = target.config
    target = sj.with_kernel_layout(sj.embed_model(target, scale_to), "out_in")
    target_note += (f", embedded at {scale_to} ({target.config.emb_dim} wide, "
                    f"{target.config.num_layers} layers; {small_config.emb_dim} before)")
  return pair, target, draft, dict(target=target_note, draft=draft_note)


def corpus_stream(heldout, pad_id: int = 0) -> np.ndarray:
  """[T] int32: every held-out row's prompt then its reference (trailing pads cut),
  concatenated in order: real text, T = 12,222 tokens for the decoder-only demo pair."""
  pieces = []
  for row in heldout:
    target_ids = list(row["target_ids"])
    while target_ids and target_ids[-1] == pad_id:
      target_ids.pop()
    pieces.append(np.asarray(list(row["input_ids"]) + target_ids, np.int32))
  return np.concatenate(pieces)


def long_rows(stream: np.ndarray, batch: int, length: int) -> np.ndarray:
  """[batch, length] int32: row b is the stream from b * T // batch on, cycled (T =
  len(stream)), so rows differ and a row repeats nothing until length > T."""
  starts = np.arange(batch) * (len(stream) // batch)
  index = (starts[:, None] + np.arange(length)[None]) % len(stream)
  return stream[index].astype(np.int32)


def right_padded(rows: np.ndarray, width: int, pad_id: int) -> np.ndarray:
  """[batch, width] int32: rows [batch, L] (L <= width) then pad_id."""
  out = np.full((rows.shape[0], width), pad_id, np.int32)
  out[:, :rows.shape[1]] = rows
  return out


# -- Part prefix ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _start_program(config, allocated: int):
  """jit: (params, prompts [b, P], lengths [b]) -> the family's `DecodeStart` (what
  `generate` starts from: the prompts prefilled) in a cache of `allocated` positions."""
  family = sj.family_of(config)
  return jax.jit(lambda params, prompts, lengths: family.start(
      config, params, prompts, lengths, allocated - prompts.shape[1] + 1))


@functools.lru_cache(maxsize=None)
def _greedy_loop(config, n_max: int):
  """jit: (params, start, n) -> [b, n_max] int32, the first n greedy tokens after `start`
  (then 0): n one-token block calls of `family.block_fn` at loop positions 0..n-1, the
  cache carried, each next input the argmax (generate's target-only loop at width 1)."""
  family = sj.family_of(config)

  def loop(params, start, n):
    block_fn = shift_block_fn(family.block_fn(config, params), start.offset)

    def body(i, carry):
      cache, token, out = carry
      logits, cache = block_fn(token[:, None], jnp.full_like(start.offset, i), cache)
      token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
      return cache, token, out.at[:, i].set(token)

    out = jnp.zeros((start.offset.shape[0], n_max), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (start.cache, start.first_inputs, out))[2]

  return jax.jit(loop)


def _loop_fns(model, prompt: np.ndarray, allocations: Dict[str, int], steps: int):
  """{f'{case}_n{n}': () -> tokens [1, 2N]} for each case's allocation and n in (N, 2N):
  the start (prefilled once, untimed) and `_greedy_loop` of n tokens."""
  lengths = np.asarray([prompt.shape[1]], np.int32)
  fns = {}
  for case, allocated in allocations.items():
    start = _start_program(model.config, allocated)(model.params, prompt, lengths)
    loop = _greedy_loop(model.config, 2 * steps)
    for n in (steps, 2 * steps):
      fns[f"{case}_n{n}"] = functools.partial(
          lambda s, n: _ready(loop(model.params, s, n)), start, n)
  return fns


def _generate_fns(model, prompt: np.ndarray, allocations: Dict[str, int], steps: int):
  """{f'{case}_n{n}': () -> tokens [1, n]}: `sj.generate` of n tokens, the prompt [1, L]
  right-padded to width A - n + 1 for a case allocated A (so its cache holds A positions;
  case 'a', the prompt's own width) with prompt_lengths L."""
  length = prompt.shape[1]
  fns = {}
  for case, allocated in allocations.items():
    for n in (steps, 2 * steps):
      width = length if case == "a" else allocated - n + 1
      x = right_padded(prompt, width, model.config.pad_id)
      fns[f"{case}_n{n}"] = functools.partial(
          lambda x, n: np.asarray(_ready(sj.generate(
              model, x, np.asarray([length], np.int32), max_decode_steps=n,
              eos_id=-1)).sequences), x, n)
  return fns


def prefix_row(model, prompt: np.ndarray, allocated: int, steps: int, repeats: int,
               timing: str = "loop") -> Dict[str, Any]:
  """Part prefix at one written length L (prompt [1, L]): ms/token with the cache at (a)
  L + 2N - 1 and (b) `allocated`, their ratio, and whether (a), (b) and `sj.generate` at
  (a) emit the same 2N tokens."""
  length = prompt.shape[1]
  allocations = dict(a=length + 2 * steps - 1, b=allocated)
  make = _loop_fns if timing == "loop" else _generate_fns
  seconds, outs = _fastest(make(model, prompt, allocations, steps), repeats)
  ms = {case: (seconds[f"{case}_n{2 * steps}"] - seconds[f"{case}_n{steps}"]) * 1e3 / steps
        for case in allocations}
  reference = np.asarray(sj.generate(model, prompt, np.asarray([length], np.int32),
                                     max_decode_steps=2 * steps, eos_id=-1).sequences)
  long_ = [np.asarray(outs[f"{case}_n{2 * steps}"])[:, :2 * steps] for case in allocations]
  return dict(written=length, allocated_a=allocations["a"], allocated_b=allocated,
              ms_per_token_a=ms["a"], ms_per_token_b=ms["b"],
              ratio_b_over_a=ms["b"] / ms["a"] if ms["a"] > 0 else None,
              equal=all(np.array_equal(t, reference) for t in long_),
              seconds={k: v for k, v in seconds.items()})


def written_lengths(min_context: int, max_context: int) -> List[int]:
  """min_context, 2 min_context, ... up to max_context (and max_context itself)."""
  out, length = [], min_context
  while length < max_context:
    out.append(length)
    length *= 2
  return out + [max_context]


def with_attention_chunk(model, chunk: int):
  """`model` reading its cache `chunk` keys at a time up to the last write (0: the whole
  allocation; `DecoderOnlyConfig.attention_chunk`); ValueError where the config has no such
  field."""
  if not hasattr(model.config, "attention_chunk"):
    raise ValueError(f"{type(model.config).__name__} has no attention_chunk: this checkout "
                     "reads every cache whole")
  return type(model)(model.config.replace(attention_chunk=chunk), model.params)


def part_prefix(model, stream, opts, rows: Dict[str, Any], save) -> Dict[str, Any]:
  """{f'chunk{c}': {str(L): prefix_row}} for each of opts.attention_chunks and written
  length, rows already in `rows` kept; `save()` after each new row."""
  for chunk in opts.attention_chunks:
    chunked = with_attention_chunk(model, chunk)
    by_length = rows.setdefault(f"chunk{chunk}", {})
    for length in written_lengths(opts.min_context, opts.max_context):
      if str(length) in by_length:
        continue
      prompt = long_rows(stream, 1, length)
      r = by_length[str(length)] = prefix_row(chunked, prompt, opts.allocated,
                                              opts.decode_steps, opts.repeats,
                                              opts.prefix_timing)
      print(f"prefix chunk {chunk} L={length}: {r['ms_per_token_a']:.3f} ms/token at "
            f"{r['allocated_a']}, {r['ms_per_token_b']:.3f} at {r['allocated_b']}, equal "
            f"{r['equal']}", flush=True)
      save()
  return rows


# -- Part memory ----------------------------------------------------------------------------

def layout_name(config) -> str:
  """'latent' (multi-head latent attention), 'window W (s/L layers)' or 'full'."""
  if config.uses_mla:
    return "latent"
  if config.sliding_window is None:
    return "full"
  types = config.layer_types or ("sliding_attention",) * config.num_layers
  sliding = sum(t == "sliding_attention" for t in types)
  return f"window {config.sliding_window} ({sliding}/{config.num_layers} layers)"


def full_cache_bytes(config, positions: int, itemsize: int) -> int:
  """Every layer's keys and values at every position, per row: 2 * layers * kv_heads *
  head_dim * positions * bytes; latent attention: layers * heads * (qk_nope + qk_rope + v)
  (its keys and values expanded per head)."""
  if config.uses_mla:
    per_position = config.num_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim +
                                       config.v_head_dim)
  else:
    per_position = 2 * config.num_kv_heads * config.head_dim
  return config.num_layers * per_position * positions * itemsize


def layout_cache_bytes(config, positions: int, itemsize: int) -> int:
  """What the layout needs per row: a window layer min(W, positions) positions of keys and
  values (a ring), a full layer all of them; a latent layer kv_lora_rank + qk_rope_head_dim
  per position (the latent and the shared rotary key)."""
  if config.uses_mla:
    return (config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * positions *
            itemsize)
  types = config.layer_types or (("sliding_attention" if config.sliding_window else
                                  "full_attention"),) * config.num_layers
  per_layer = 2 * config.num_kv_heads * config.head_dim * itemsize
  return sum(per_layer * (min(config.sliding_window, positions)
                          if t == "sliding_attention" else positions) for t in types)


def memory_row(config, context: int, dtype: str, steps: int = 1) -> Dict[str, Any]:
  """One config at one context (prompt width `context`, `steps` new tokens, batch 1): the
  plan's cache bytes, the full-length reference and the layout's formula, at the
  positions the family allocates (`cache_length`: context + steps - 1)."""
  family = sj.family_of(config)
  positions = family.cache_length(config, context, steps)
  itemsize = jnp.dtype(dtype).itemsize
  plan = sj.plan_memory(config, batch=1, context_len=context, max_decode_len=steps,
                        mesh_shape=(1, 1), dtype=dtype)
  full = full_cache_bytes(config, positions, itemsize)
  return dict(context=context, positions=positions, layout=layout_name(config),
              plan_bytes=plan.cache_bytes, full_bytes=full,
              layout_bytes=layout_cache_bytes(config, positions, itemsize),
              plan_over_full=plan.cache_bytes / full)


def part_memory(names, contexts, dtype: str) -> Dict[str, Dict[str, Any]]:
  """{config name: {str(context): memory_row}} (named decoder-only configs: shapes only)."""
  out = {}
  for name in names:
    config = sj.get_decoder_config(name)
    out[name] = {str(c): memory_row(config, c, dtype) for c in contexts}
  return out


# -- Part speedup ---------------------------------------------------------------------------

def sparse_drafts(target, budget: int) -> Dict[str, Any]:
  """{'window', 'retrieval'}: `sj.SparseCacheDraft(target, budget, policy)`, or for each a
  {'skipped': why} (the class does not exist) or {'error': its constructor's error}."""
  cls = getattr(sj, "SparseCacheDraft", None)
  if cls is None:
    return {p: dict(skipped="sj.SparseCacheDraft does not exist yet "
                            "(specdec_jax/drafts/sparse_cache.py)")
            for p in ("window", "retrieval")}
  out = {}
  for policy in ("window", "retrieval"):
    try:
      out[policy] = cls(target, budget=budget, policy=policy)
    except Exception as e:  # noqa: BLE001 -- the draft is being written: record, go on
      out[policy] = dict(error=f"SparseCacheDraft(policy={policy!r}) failed: "
                               f"{type(e).__name__}: {e}")
  return out


def _draft_stats(out, reference, seconds: float, target_seconds: float) -> Dict[str, Any]:
  """One speculative side's numbers: seconds, speedup, alpha, acceptance, tokens per
  iteration, equal (its greedy outputs and lengths against target-only's)."""
  stats = out.stats
  return dict(spec_s=seconds, speedup=target_seconds / seconds, alpha=stats.alpha,
              acceptance_rate=stats.acceptance_rate,
              tokens_per_iteration=stats.mean_tokens_per_iteration,
              equal=bool(np.array_equal(np.asarray(out.sequences),
                                        np.asarray(reference.sequences)) and
                         np.array_equal(np.asarray(out.lengths),
                                        np.asarray(reference.lengths))))


def speedup_row(target, drafts: Dict[str, Any], x: np.ndarray, steps: int, gamma: int,
                repeats: int) -> Dict[str, Any]:
  """Part speedup at prompts x [batch, C] (all C long): target-only, its start (1 step) and
  each draft (a dict: skipped or failed, recorded as it is) through `sj.generate`,
  interleaved; a draft whose untimed first call raises is recorded as its error and left
  out of the timed rounds."""
  lengths = np.full((x.shape[0],), x.shape[1], np.int32)
  call = lambda **kw: _ready(sj.generate(target, x, lengths, eos_id=-1, **kw))  # noqa: E731
  fns = {"target": lambda: call(max_decode_steps=steps),
         "start": lambda: call(max_decode_steps=1)}
  for fn in fns.values():
    fn()  # compiles
  row = dict(context=x.shape[1], batch=x.shape[0], drafts={})
  for name, draft in drafts.items():
    if isinstance(draft, dict):  # skipped or failed already
      row["drafts"][name] = draft
      continue
    fn = functools.partial(lambda d: call(max_decode_steps=steps, draft=d, gamma=gamma), draft)
    try:  # compiles, and finds a draft that cannot run before the timed rounds
      fn()
      fns[name] = fn
    except Exception as e:  # noqa: BLE001 -- record the in-progress draft's failure
      traceback.print_exc(file=sys.stderr)
      row["drafts"][name] = dict(error=f"{type(e).__name__}: {e}"[:2000])
  seconds, outs = _fastest(fns, repeats, warmup=False)
  row.update(target_s=seconds["target"], start_s=seconds["start"],
             target_ms_per_step=seconds["target"] * 1e3 / steps)
  timed = {name: _draft_stats(outs[name], outs["target"], seconds[name], seconds["target"])
           for name in drafts if name in seconds}
  row["drafts"] = {name: timed.get(name, row["drafts"].get(name)) for name in drafts}
  return row


def _complete(row) -> bool:
  """A speedup row none of whose drafts was skipped or failed (kept when resuming)."""
  return all("speedup" in d for d in row["drafts"].values())


def part_speedup(target, draft, stream, opts, rows: Dict[str, Any], save) -> Dict[str, Any]:
  """{f'{C}x{B}': speedup_row} for every context C and batch B, complete rows already in
  `rows` kept; `save()` after each new row."""
  drafts = dict({DRAFT_ORDER[0]: draft}, **sparse_drafts(target, opts.budget))
  for context in opts.speedup_contexts:
    for batch in opts.batch_sizes:
      key = f"{context}x{batch}"
      if key in rows and _complete(rows[key]):
        continue
      rows[key] = speedup_row(target, drafts, long_rows(stream, batch, context),
                              opts.speedup_steps, opts.gamma, opts.speedup_repeats)
      print(f"speedup {key}: " + ", ".join(
          f"{n} {d['speedup']:.2f}x a={d['alpha']:.2f} equal {d['equal']}" if "speedup" in d
          else f"{n} {next(iter(d))}" for n, d in rows[key]["drafts"].items()), flush=True)
      save()
  return rows


# -- Tables ---------------------------------------------------------------------------------

def _mib(n: int) -> str:
  """Bytes as KiB, MiB or GiB."""
  if n < MIB:
    return f"{n / 1024:,.1f} KiB"
  return f"{n / MIB:,.1f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:,.2f} GiB"


def markdown_prefix(rows: Dict[str, Dict[str, Any]]) -> str:
  """| attention | written | allocated (a) | ms/token (a) | allocated (b) | ms/token (b) |
  (b)/(a) | equal |, one line per attention chunk and written length."""
  lines = ["| attention | written L | allocated (a) | ms/token (a) | allocated (b) | "
           "ms/token (b) | (b) / (a) | equal |", "|---|---|---|---|---|---|---|---|"]
  for label, by_length in sorted(rows.items(), key=lambda kv: -int(kv[0][len("chunk"):])):
    attention = "whole cache" if label == "chunk0" else f"prefix, {label}"
    for r in sorted(by_length.values(), key=lambda r: r["written"]):
      ratio = "-" if r["ratio_b_over_a"] is None else f"{r['ratio_b_over_a']:.2f}"
      lines.append(f"| {attention} | {r['written']} | {r['allocated_a']} | "
                   f"{r['ms_per_token_a']:.3f} | {r['allocated_b']} | "
                   f"{r['ms_per_token_b']:.3f} | {ratio} | {r['equal']} |")
  return "\n".join(lines)


def markdown_memory(rows: Dict[str, Dict[str, Any]]) -> str:
  """| config | layout | context | plan_memory | full length | plan / full | layout formula |"""
  lines = ["| config | layout | context | plan_memory cache | full-length | plan / full | "
           "ring / latent formula |", "|---|---|---|---|---|---|---|"]
  for name, by_context in rows.items():
    for r in sorted(by_context.values(), key=lambda r: r["context"]):
      lines.append(f"| {name} | {r['layout']} | {r['context']} | {_mib(r['plan_bytes'])} | "
                   f"{_mib(r['full_bytes'])} | {r['plan_over_full']:.3f} | "
                   f"{_mib(r['layout_bytes'])} |")
  return "\n".join(lines)


def markdown_speedup(rows: Dict[str, Any]) -> str:
  """| context | batch | draft | target s | start s | spec s | speedup | alpha | tokens/iter |
  equal |, a skipped or failed draft's reason in place of its numbers."""
  lines = ["| context | batch | draft | target s | start s | spec s | speedup | alpha | "
           "tokens / iter | equal |", "|---|---|---|---|---|---|---|---|---|---|"]
  order = {name: i for i, name in enumerate(DRAFT_ORDER)}
  for r in sorted(rows.values(), key=lambda r: (r["context"], r["batch"])):
    head = f"| {r['context']} | {r['batch']} |"
    for name, d in sorted(r["drafts"].items(), key=lambda kv: order.get(kv[0], len(order))):
      if "speedup" not in d:
        lines.append(f"{head} {name} | {r['target_s']:.3f} | {r['start_s']:.3f} | "
                     f"{next(iter(d))}: {next(iter(d.values()))[:80]} | | | | |")
        continue
      lines.append(f"{head} {name} | {r['target_s']:.3f} | {r['start_s']:.3f} | "
                   f"{d['spec_s']:.3f} | {d['speedup']:.2f} | {d['alpha']:.2f} | "
                   f"{d['tokens_per_iteration']:.2f} | {d['equal']} |")
  return "\n".join(lines)


MARKDOWN = dict(prefix=markdown_prefix, memory=markdown_memory, speedup=markdown_speedup)


# -- Driver ---------------------------------------------------------------------------------

# Options that only choose which rows run (a row's key says its length, context and batch).
SELECTION = ("output_json", "parts", "min_context", "max_context", "attention_chunks",
             "speedup_contexts", "batch_sizes", "memory_contexts", "memory_configs",
             "memory_dtype")


def settings_of(opts) -> Dict[str, Any]:
  """The options that decide a row's numbers: a rerun with the same ones keeps the rows
  the file holds and adds those its selection (`SELECTION`) names."""
  return {k: v for k, v in sorted(vars(opts).items()) if k not in SELECTION}


def _previous(path: str, settings: Dict[str, Any]) -> Dict[str, Any]:
  """The rows of an earlier run at `path` with the same settings, else {}."""
  previous = read_json(path) if path else None
  if not previous or previous.get("settings") != settings:
    return {}
  return previous


def code_state() -> Dict[str, Any]:
  """{commit, changed}: the repository's HEAD and the files changed or new beside it (the
  numbers are the working tree's), or {} outside a git checkout."""
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def git(*args):
    return subprocess.run(("git", "-C", root) + args, capture_output=True, text=True,
                          check=True, timeout=30).stdout
  try:
    return dict(commit=git("rev-parse", "HEAD").strip(),
                changed=[line[3:] for line in git("status", "--porcelain").splitlines()])
  except (OSError, subprocess.SubprocessError):
    return {}


def run(opts) -> Dict[str, Any]:
  """Every part in opts.parts (`define_flags`' names as attributes); returns the document
  written to opts.output_json (when set) after every row, and prints the tables."""
  unknown = sorted(set(opts.parts) - set(MARKDOWN))
  if unknown:
    raise ValueError(f"unknown parts {unknown}; known: {', '.join(MARKDOWN)}")
  settings = settings_of(opts)
  document = dict(_previous(opts.output_json, settings), settings=settings,
                  selection={k: getattr(opts, k) for k in SELECTION if k != "output_json"})
  longest = max([opts.allocated, opts.max_context] + list(opts.speedup_contexts))
  pair, target, draft, notes = build_models(
      longest + 2 * max(opts.decode_steps, opts.speedup_steps) + opts.gamma + 8,
      opts.num_layers, opts.scale_to)
  stream = corpus_stream(pair.heldout, pair.target.config.pad_id)
  document.update(models=notes, corpus_tokens=int(len(stream)), code=code_state(),
                  machine=dict(backend=jax.default_backend(), cpu_count=os.cpu_count(),
                               devices=[str(d) for d in jax.devices()]))

  def save():
    document.update(load_average=list(os.getloadavg()),
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if opts.output_json:
      write_json_atomic(opts.output_json, document)

  parts = dict(
      prefix=lambda: part_prefix(target, stream, opts, document.setdefault("prefix", {}),
                                 save),
      memory=lambda: document.update(memory=part_memory(
          opts.memory_configs, opts.memory_contexts, opts.memory_dtype)),
      speedup=lambda: part_speedup(target, draft, stream, opts,
                                   document.setdefault("speedup", {}), save))
  titles = dict(prefix="prefix: ms/token against the written length",
                memory=f"memory: cache bytes per row ({opts.memory_dtype})",
                speedup=f"speedup: gamma {opts.gamma}, budget {opts.budget}, "
                        f"{opts.speedup_steps} new tokens")
  tables = []
  for part in (p for p in parts if p in opts.parts):
    start = time.perf_counter()
    parts[part]()
    document.setdefault("part_seconds", {})[part] = time.perf_counter() - start
    save()
    tables.append(f"### {titles[part]}\n\n" + MARKDOWN[part](document[part]))
  save()
  print("\n\n".join(tables))
  return document


def options_from_flags():
  """`run`'s options from absl's parsed flags (lists of ints as ints)."""
  from absl import flags
  f = flags.FLAGS
  ints = lambda values: [int(v) for v in values]  # noqa: E731
  return SimpleNamespace(
      parts=list(f.parts), max_context=f.max_context, min_context=f.min_context,
      allocated=f.allocated, decode_steps=f.decode_steps, prefix_timing=f.prefix_timing,
      attention_chunks=ints(f.attention_chunks),
      memory_contexts=ints(f.memory_contexts), memory_configs=list(f.memory_configs),
      memory_dtype=f.memory_dtype, speedup_contexts=ints(f.speedup_contexts),
      batch_sizes=ints(f.batch_sizes), speedup_steps=f.speedup_steps, budget=f.budget,
      gamma=f.gamma, repeats=f.repeats, speedup_repeats=f.speedup_repeats,
      num_layers=f.num_layers, scale_to=f.scale_to,
      output_json=f.output_json)


def main(argv):
  del argv
  run(options_from_flags())


if __name__ == "__main__":
  from absl import app
  define_flags()
  app.run(main)
