r"""specdec_jax next to Hugging Face transformers on the same weights (batch 1), any family.

Builds a random target (and draft) of one family from our named configs,
writes them as Hugging Face directories (`specdec_jax.export_hf`) and loads
those files in transformers (PyTorch), so both frameworks run identical
weights. Then, in one process and interleaved repeats, times:

  ours AR        specdec_jax.generate(target)                       (greedy)
  ours SD        specdec_jax.generate(target, draft=draft, gamma=g)  (greedy)
  HF greedy      target.generate(do_sample=False)
  HF assisted    target.generate(assistant_model=draft), g assistant tokens,
                 constant schedule, no confidence early stop

All four generate exactly `--new_tokens` tokens: HF with min_new_tokens =
max_new_tokens, ours with an EOS id that never fires. Before timing, checks
that our greedy tokens equal HF's (same weights, same argmax). Random weights
make alpha meaningless for a separately initialised draft; the default draft
is a perturbed copy of the target (w -> w * (1 + s * N(0, 1))), whose alpha
`--draft_noise` sets. A perturbed copy is as expensive as the target (c = 1),
so it shows overheads and exactness, not a speedup; pass --draft_config for a
smaller draft. Needs the `parity` extra (torch, transformers, safetensors).

  python scripts/hf_peer.py --family=t5 --config=t5_1_1_small --draft_noise=0.1 --gamma=4 \
    --new_tokens=64 --repeats=5 --output_json=/tmp/hf_peer.json
  python scripts/hf_peer.py --family=decoder_only --config=gpt2 --draft_noise=0.02 --gamma=4 \
    --new_tokens=32 --input_length=32 --repeats=3 --torch_threads=1
"""

import dataclasses
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, Optional

from absl import app
from absl import flags
import jax
import numpy as np

from specdec_jax import generation
from specdec_jax.results import write_json_atomic
from specdec_jax.loading import export_hf, load_model
from specdec_jax.perturbation import perturbed_model


@dataclasses.dataclass(frozen=True)
class Peer:
  """What differs between families on the two sides.

  config / draft_noise: the defaults of --config / --draft_noise.
  auto_class: the transformers Auto class that loads it.
  lowest_id: random input ids lie in [lowest_id, vocab) (T5: 0 pads the
    encoder input, 1 is EOS).
  input_field: the JSON name of the input length.
  hf_skip: input length -> leading ids of HF's output that are not new tokens
    (T5: the decoder start token; decoder-only: the prompt).
  """
  config: str
  draft_noise: float
  auto_class: str
  lowest_id: int
  input_field: str
  hf_skip: Callable[[int], int]


PEERS = {
    "t5": Peer("t5_1_1_small", 0.1, "AutoModelForSeq2SeqLM", 2, "encoder_length",
               lambda length: 1),
    "decoder_only": Peer("gpt2", 0.05, "AutoModelForCausalLM", 0, "prompt_length",
                         lambda length: length),
}

FLAGS = flags.FLAGS
flags.DEFINE_enum("family", "t5", sorted(PEERS), "Model family of the pair.")
flags.DEFINE_string("config", "", "Target shape (a config name of --family; empty: "
                    + ", ".join(f"{p.config} for {f}" for f, p in PEERS.items()) + ").")
flags.DEFINE_string("draft_config", "", "Draft shape (config name, target's vocabulary). "
                    "Empty: a perturbed copy of the target (--draft_noise).")
flags.DEFINE_float("draft_noise", None, "Perturbed-copy draft: w -> w * (1 + s * N(0, 1)) "
                   "(default: " + ", ".join(f"{p.draft_noise} for {f}"
                                            for f, p in PEERS.items()) + ").")
flags.DEFINE_integer("vocab_size", 0, "Override the vocabulary (0 = the config's).")
flags.DEFINE_integer("gamma", 4, "Drafted tokens per iteration (HF num_assistant_tokens).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per call.")
flags.DEFINE_integer("input_length", 32, "Encoder input / prompt length (random tokens).")
flags.DEFINE_alias("encoder_length", "input_length")
flags.DEFINE_alias("prompt_length", "input_length")
flags.DEFINE_integer("repeats", 5, "Timed repeats (after a warm-up call of each).")
flags.DEFINE_integer("block_width", 0, "Our target block width in both loops (0 = decoding's "
                     "default); at least gamma + 1.")
flags.DEFINE_integer("seed", 0, "Seed for weights and inputs.")
flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads (0 = torch's default).")
flags.DEFINE_string("output_json", "", "Write the results here (atomically).")

NO_EOS = -1  # Never emitted: our decoders then run all new_tokens steps.


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def run(family: str, config_name: str, draft_config_name: str, noise: Optional[float],
        vocab_size: int, gamma: int, new_tokens: int, input_length: int, repeats: int,
        seed: int, block_width: Optional[int] = None, torch_threads: int = 0
        ) -> Dict[str, Any]:
  import torch
  import transformers
  if torch_threads:
    torch.set_num_threads(torch_threads)
  peer = PEERS[family]
  config_name = config_name or peer.config
  noise = peer.draft_noise if noise is None else noise
  overrides = dict(vocab_size=vocab_size) if vocab_size else {}
  target = load_model(config_name, dtype="float32", seed=seed, **overrides)
  if draft_config_name:
    draft = load_model(draft_config_name, dtype="float32", seed=seed + 1,
                       vocab_size=target.config.vocab_size)
  else:
    draft = perturbed_model(target, noise, seed + 1)
  auto = getattr(transformers, peer.auto_class)
  with tempfile.TemporaryDirectory() as tmp:
    export_hf(target, os.path.join(tmp, "target"))
    export_hf(draft, os.path.join(tmp, "draft"))
    # Float32 files load as float32 (no dtype argument: its name differs
    # across transformers versions).
    hf_target = auto.from_pretrained(os.path.join(tmp, "target")).eval()
    hf_draft = auto.from_pretrained(os.path.join(tmp, "draft")).eval()

  rng = np.random.default_rng(seed)
  tokens = rng.integers(peer.lowest_id, target.config.vocab_size,
                        (1, input_length)).astype(np.int32)
  torch_tokens = torch.tensor(tokens, dtype=torch.long)
  hf_draft.generation_config.num_assistant_tokens = gamma
  hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
  # transformers stops drafting early below this draft confidence by default;
  # 0 keeps gamma fixed, as in the paper and in our decoder.
  hf_draft.generation_config.assistant_confidence_threshold = 0.0
  hf_kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=target.config.pad_id)
  ours_kwargs = dict(max_decode_steps=new_tokens, eos_id=NO_EOS, block_width=block_width)

  def ours_ar():
    out = generation.generate(target, tokens, **ours_kwargs)
    return np.asarray(jax.block_until_ready(out.sequences))

  def ours_sd():
    out = generation.generate(target, tokens, draft=draft, gamma=gamma, **ours_kwargs)
    jax.block_until_ready(out.sequences)
    return out

  def hf_greedy():
    with torch.no_grad():
      return hf_target.generate(torch_tokens, **hf_kwargs)

  def hf_assisted():
    with torch.no_grad():
      return hf_target.generate(torch_tokens, assistant_model=hf_draft, **hf_kwargs)

  # Warm-up (compiles ours) and the parity check: same weights, same argmax.
  skip = peer.hf_skip(input_length)
  ours_tokens = ours_ar()[0]
  sd_out = ours_sd()
  hf_tokens = hf_greedy()[0, skip:].numpy()
  hf_assisted_tokens = hf_assisted()[0, skip:].numpy()
  # HF forbids EOS until new_tokens (min_new_tokens); compare up to the first
  # place either side emitted the EOS id.
  eos = [i for i, t in enumerate(ours_tokens) if t == target.config.eos_id]
  compare = eos[0] if eos else new_tokens
  parity = dict(
      compared_tokens=compare,
      ours_ar_equals_hf_greedy=bool(np.array_equal(ours_tokens[:compare], hf_tokens[:compare])),
      ours_sd_equals_ours_ar=bool(np.array_equal(np.asarray(sd_out.sequences[0]), ours_tokens)),
      hf_assisted_equals_hf_greedy=bool(np.array_equal(hf_assisted_tokens, hf_tokens)),
      first_mismatch_ours_vs_hf=next((i for i in range(compare)
                                      if ours_tokens[i] != hf_tokens[i]), None))

  jobs = dict(ours_ar=ours_ar, ours_sd=ours_sd, hf_greedy=hf_greedy, hf_assisted=hf_assisted)
  compiles_before = generation.compile_count()
  seconds = {name: [] for name in jobs}
  for repeat in range(repeats):
    names = list(jobs) if repeat % 2 == 0 else list(jobs)[::-1]
    for name in names:
      seconds[name].append(_seconds(jobs[name]))
  compiles_after = generation.compile_count()

  def ratio(a, b):
    ratios = [x / y for x, y in zip(seconds[a], seconds[b])]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))

  timings = {name: dict(ms_per_token=statistics.median(s) * 1e3 / new_tokens,
                        tokens_per_s=new_tokens / statistics.median(s),
                        ms_all=[x * 1e3 for x in s]) for name, s in seconds.items()}
  return {
      "family": family, "config": config_name,
      "draft": draft_config_name or f"target*(1+{noise:g}N)",
      "vocab_size": target.config.vocab_size, "gamma": gamma, "new_tokens": new_tokens,
      peer.input_field: input_length, "repeats": repeats, "batch_size": 1,
      "block_width": block_width, "torch_threads": torch.get_num_threads(),
      "torch": torch.__version__, "transformers": transformers.__version__,
      "jax": jax.__version__, "nproc": os.cpu_count(), "load_average": os.getloadavg(),
      "parity": parity, "timings": timings, "alpha": sd_out.stats.alpha,
      "mean_tokens_per_iteration": sd_out.stats.mean_tokens_per_iteration,
      # > 1 means ours is faster (ratio of HF time to ours, paired per repeat).
      "ar_speed_ratio_vs_hf_greedy": ratio("hf_greedy", "ours_ar"),
      "sd_speed_ratio_vs_hf_assisted": ratio("hf_assisted", "ours_sd"),
      "ours_sd_speedup": ratio("ours_ar", "ours_sd"),
      "hf_assisted_speedup": ratio("hf_greedy", "hf_assisted"),
      "compile_count_before": compiles_before, "compile_count_after": compiles_after}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  result = run(FLAGS.family, FLAGS.config, FLAGS.draft_config, FLAGS.draft_noise,
               FLAGS.vocab_size, FLAGS.gamma, FLAGS.new_tokens, FLAGS.input_length,
               FLAGS.repeats, FLAGS.seed, FLAGS.block_width or None, FLAGS.torch_threads)
  print(f"{result['family']} {result['config']} target, draft {result['draft']}, batch 1, "
        f"gamma {result['gamma']}, {result['new_tokens']} new tokens after "
        f"{FLAGS.input_length} input tokens, alpha {result['alpha']:.2f}, "
        f"tokens/iteration {result['mean_tokens_per_iteration']:.2f}")
  print(f"parity: {result['parity']}")
  for name, t in result["timings"].items():
    print(f"  {name:12s} {t['ms_per_token']:8.2f} ms/token {t['tokens_per_s']:8.1f} tokens/s")
  for key in ("ar_speed_ratio_vs_hf_greedy", "sd_speed_ratio_vs_hf_assisted", "ours_sd_speedup",
              "hf_assisted_speedup"):
    r = result[key]
    print(f"  {key:30s} {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
  print(f"compile count {result['compile_count_before']} -> {result['compile_count_after']}")
  if FLAGS.output_json:
    write_json_atomic(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
  app.run(main)
