r"""Decoder-only specdec_jax next to Hugging Face transformers on the same weights (batch 1).

The decoder-only counterpart of scripts/hf_peer.py. Builds a random target
(and draft) from our named configs (`gpt2`, `qwen2_0_5b`, `llama_tiny`, ...),
writes them as Hugging Face directories (`export_hf_decoder_only`) and loads
those files in transformers, so both frameworks run identical weights. Then,
in one process and interleaved repeats, times:

  ours AR        decoder_only_generate(target)                        (greedy)
  ours SD        decoder_only_generate(target, draft=draft, gamma=g)   (greedy)
  HF greedy      target.generate(do_sample=False)
  HF assisted    target.generate(assistant_model=draft), g assistant tokens,
                 constant schedule, no confidence early stop

All four generate exactly `--new_tokens` tokens (HF with min_new_tokens =
max_new_tokens, ours with an EOS that never fires). Before timing, checks that
our greedy tokens equal HF's. Random weights make alpha meaningless for a
separately initialised draft; the default draft is a perturbed copy of the
target (w -> w * (1 + s * N(0, 1))), whose alpha `--draft_noise` sets.

  python scripts/hf_peer_decoder_only.py --config=gpt2 --draft_noise=0.02 --gamma=4 \
    --new_tokens=32 --prompt_length=32 --repeats=3 --torch_threads=1

A perturbed copy is as expensive as the target (c = 1), so it shows overheads
and exactness, not a speedup; pass --draft_config for a smaller draft.
"""

import os
import statistics
import tempfile
import time
from typing import Any, Dict, Optional

from absl import app
from absl import flags
import jax
import numpy as np

from specdec_jax.families.decoder_only.checkpoints import export_hf_decoder_only
from specdec_jax.decoder_only_generation import decoder_only_generate
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.loading import load_decoder_only_model
from specdec_jax.core.results import write_json_atomic

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "gpt2", "Target shape (a decoder-only config name).")
flags.DEFINE_string("draft_config", "", "Draft shape (config name; the target's vocabulary). "
                    "Empty: a perturbed copy of the target (--draft_noise).")
flags.DEFINE_float("draft_noise", 0.05, "Perturbed-copy draft: w -> w * (1 + s * N(0, 1)).")
flags.DEFINE_integer("gamma", 4, "Drafted tokens per iteration (HF num_assistant_tokens).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per call.")
flags.DEFINE_integer("prompt_length", 32, "Prompt length (random tokens).")
flags.DEFINE_integer("repeats", 5, "Timed repeats (after a warm-up call of each).")
flags.DEFINE_integer("block_width", 0, "Our target block width in both loops (0 = decoding's "
                     "default, 8); at least gamma + 1.")
flags.DEFINE_integer("seed", 0, "Seed for weights and inputs.")
flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads (0 = torch's default).")
flags.DEFINE_string("output_json", "", "Write the results here (atomically).")

NO_EOS = -1  # Never emitted: our decoders then run all new_tokens steps.


def perturbed_copy(model: DecoderOnlyModel, noise: float, seed: int) -> DecoderOnlyModel:
  leaves, treedef = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return DecoderOnlyModel(model.config, jax.tree_util.tree_unflatten(treedef, [
      x * (1 + noise * jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]))


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def run(config_name: str, draft_config_name: str, noise: float, gamma: int, new_tokens: int,
        prompt_length: int, repeats: int, seed: int, block_width: Optional[int] = None,
        torch_threads: int = 0) -> Dict[str, Any]:
  import torch
  import transformers
  if torch_threads:
    torch.set_num_threads(torch_threads)
  target = load_decoder_only_model(config_name, dtype="float32", seed=seed)
  if draft_config_name:
    draft = load_decoder_only_model(draft_config_name, dtype="float32", seed=seed + 1,
                                    vocab_size=target.config.vocab_size)
  else:
    draft = perturbed_copy(target, noise, seed + 1)
  with tempfile.TemporaryDirectory() as tmp:
    export_hf_decoder_only(target, os.path.join(tmp, "target"))
    export_hf_decoder_only(draft, os.path.join(tmp, "draft"))
    # Float32 files load as float32 (no dtype argument: its name differs
    # across transformers versions).
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(tmp, "target")).eval()
    hf_draft = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(tmp, "draft")).eval()

  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, target.config.vocab_size, (1, prompt_length)).astype(np.int32)
  torch_prompt = torch.tensor(prompt, dtype=torch.long)
  hf_draft.generation_config.num_assistant_tokens = gamma
  hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
  # transformers stops drafting early below this draft confidence by default;
  # 0 keeps gamma fixed, as in the paper and in our decoder.
  hf_draft.generation_config.assistant_confidence_threshold = 0.0
  hf_kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=target.config.pad_id)
  ours_kwargs = dict(max_decode_steps=new_tokens, eos_id=NO_EOS, block_width=block_width)

  def ours_ar():
    out = decoder_only_generate(target, prompt, **ours_kwargs)
    return np.asarray(jax.block_until_ready(out.sequences))

  def ours_sd():
    out = decoder_only_generate(target, prompt, draft=draft, gamma=gamma, **ours_kwargs)
    jax.block_until_ready(out.sequences)
    return out

  def hf_greedy():
    with torch.no_grad():
      return hf_target.generate(torch_prompt, **hf_kwargs)

  def hf_assisted():
    with torch.no_grad():
      return hf_target.generate(torch_prompt, assistant_model=hf_draft, **hf_kwargs)

  # Warm-up (compiles ours) and the parity check: same weights, same argmax.
  ours_tokens = ours_ar()[0]
  sd_out = ours_sd()
  hf_tokens = hf_greedy()[0, prompt_length:].numpy()
  hf_assisted_tokens = hf_assisted()[0, prompt_length:].numpy()
  # HF forbids EOS until new_tokens (min_new_tokens); compare up to the first
  # place either side emitted the EOS id.
  eos_id = target.config.eos_id
  eos = [i for i, t in enumerate(ours_tokens) if t == eos_id]
  compare = eos[0] if eos else new_tokens
  parity = dict(
      compared_tokens=compare,
      ours_ar_equals_hf_greedy=bool(np.array_equal(ours_tokens[:compare], hf_tokens[:compare])),
      ours_sd_equals_ours_ar=bool(np.array_equal(np.asarray(sd_out.sequences[0]), ours_tokens)),
      hf_assisted_equals_hf_greedy=bool(np.array_equal(hf_assisted_tokens, hf_tokens)),
      first_mismatch_ours_vs_hf=next((i for i in range(compare)
                                      if ours_tokens[i] != hf_tokens[i]), None))

  jobs = dict(ours_ar=ours_ar, ours_sd=ours_sd, hf_greedy=hf_greedy, hf_assisted=hf_assisted)
  seconds = {name: [] for name in jobs}
  for repeat in range(repeats):
    names = list(jobs) if repeat % 2 == 0 else list(jobs)[::-1]
    for name in names:
      seconds[name].append(_seconds(jobs[name]))

  def ratio(a, b):
    ratios = [x / y for x, y in zip(seconds[a], seconds[b])]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))

  timings = {name: dict(ms_per_token=statistics.median(s) * 1e3 / new_tokens,
                        tokens_per_s=new_tokens / statistics.median(s),
                        ms_all=[x * 1e3 for x in s]) for name, s in seconds.items()}
  return dict(
      config=config_name, draft=draft_config_name or f"target*(1+{noise:g}N)",
      vocab_size=target.config.vocab_size, gamma=gamma, new_tokens=new_tokens,
      prompt_length=prompt_length, repeats=repeats, batch_size=1, block_width=block_width,
      torch_threads=torch.get_num_threads(), torch=torch.__version__,
      transformers=transformers.__version__, jax=jax.__version__, nproc=os.cpu_count(),
      load_average=os.getloadavg(), parity=parity, timings=timings,
      alpha=sd_out.stats.alpha, mean_tokens_per_iteration=sd_out.stats.mean_tokens_per_iteration,
      # > 1 means ours is faster (ratio of HF time to ours, paired per repeat).
      ar_speed_ratio_vs_hf_greedy=ratio("hf_greedy", "ours_ar"),
      sd_speed_ratio_vs_hf_assisted=ratio("hf_assisted", "ours_sd"),
      ours_sd_speedup=ratio("ours_ar", "ours_sd"),
      hf_assisted_speedup=ratio("hf_greedy", "hf_assisted"))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  result = run(FLAGS.config, FLAGS.draft_config, FLAGS.draft_noise, FLAGS.gamma,
               FLAGS.new_tokens, FLAGS.prompt_length, FLAGS.repeats, FLAGS.seed,
               FLAGS.block_width or None, FLAGS.torch_threads)
  print(f"{result['config']} target, draft {result['draft']}, batch 1, gamma {result['gamma']}, "
        f"{result['new_tokens']} new tokens after {result['prompt_length']}, alpha "
        f"{result['alpha']:.2f}, tokens/iteration {result['mean_tokens_per_iteration']:.2f}")
  print(f"parity: {result['parity']}")
  for name, t in result["timings"].items():
    print(f"  {name:12s} {t['ms_per_token']:8.2f} ms/token {t['tokens_per_s']:8.1f} tokens/s")
  for key in ("ar_speed_ratio_vs_hf_greedy", "sd_speed_ratio_vs_hf_assisted", "ours_sd_speedup",
              "hf_assisted_speedup"):
    r = result[key]
    print(f"  {key:30s} {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
  if FLAGS.output_json:
    write_json_atomic(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
  app.run(main)
