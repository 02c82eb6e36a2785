"""A researcher's first hour (issue 31, the library API): every mistake is caught before
any work, by a plain error or one warning that names the fix.

Validation tests never compile a decode (they fail in the host-side checks, or call
them directly); the few that decode use one-layer models of a few dims.
"""

import inspect
import logging as pylogging
import re
import time
import warnings

import jax
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax import memory, settings
from specdec_jax.core.sampling import Sampling, adjust_probs
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig, get_decoder_config
from specdec_jax.families.registry import family_of

VOCAB = 97  # The tiny decoder-only configs' (ids: bos 1, eos 2, pad 0).


def _decoder(name="llama_tiny", **overrides):
  """A one-layer random model of a tiny named config (cheap to build and to compile)."""
  return sj.load_model(name, dtype="float32", num_layers=1, **overrides)


def _abstract(config):
  """A model of `config` whose params are shapes only: enough for every check `generate`
  makes before work, and proof that the checks touch no weights (nothing compiles)."""
  family = family_of(config)
  return family.model_type(config, family.abstract_params(config))


def _tiny(name="llama_tiny", **overrides):
  return _abstract(get_decoder_config(name, num_layers=1, **overrides))


@pytest.fixture(scope="module")
def llama():
  return _decoder()


@pytest.fixture
def fresh_warnings(monkeypatch):
  """`settings.warn_once` as in a new process (other tests may have warned already)."""
  monkeypatch.setattr(settings, "_WARNED", set())


def _prompts(lengths, width, pad=0, seed=0):
  """Right-padded prompts [batch, width] of ids in [3, VOCAB), `pad` after each length."""
  rng = np.random.RandomState(seed)
  prompts = np.full((len(lengths), width), pad, np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.randint(3, VOCAB, n)
  return prompts


# -- 1. Positions: real tokens past the model's positions, every layout ---------------


@pytest.mark.parametrize("layout", ["llama", "gemma2", "gpt2"])
def test_real_positions_past_the_model_are_an_error_before_any_compile(layout):
  if layout == "gemma2":
    config = DecoderOnlyConfig(
        family="gemma2", vocab_size=VOCAB, emb_dim=16, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8, mlp_dim=32, max_positions=128, norm_offset=1.0,
        scale_embeddings=True, sandwich_norms=True, attn_logit_softcap=50.0,
        sliding_window=4, activation="gelu_new", tie_word_embeddings=True)
    model = _abstract(config)
    what = "128 positions \\(max_position_embeddings\\)"
  elif layout == "llama":
    model = _tiny()
    what = "128 positions \\(max_position_embeddings\\)"
  else:
    model = _tiny("gpt2_tiny")
    what = "128 learned positions \\(n_positions\\)"
  assert model.config.max_positions == 128
  prompts = np.full((1, 361), 5, np.int32)
  start = time.perf_counter()
  with pytest.raises(ValueError, match=(
      r"the longest prompt \(361 tokens\) plus max_decode_steps \(16\) needs 376 positions "
      rf"\(the last new token is never fed back\), but this {layout} model has {what}: "
      r"shorten the prompts or lower max_decode_steps$")):
    sj.generate(model, prompts, max_decode_steps=16)
  assert time.perf_counter() - start < 5  # Host checks only: nothing compiled.
  # The limit is exact: L + N - 1 = 128 positions fit, 129 do not.
  family = family_of(model)
  family.check_inputs(model.config, np.full((1, 113), 5, np.int32), None, 16)
  with pytest.raises(ValueError, match="needs 129 positions"):
    family.check_inputs(model.config, np.full((1, 114), 5, np.int32), None, 16)


def test_positions_count_real_tokens_not_padding():
  """The cache is P + N - 1 long whatever the model's positions, and padding slots are
  masked and overwritten: only the longest row's real tokens count."""
  for name in ("gpt2_tiny", "llama_tiny"):
    model = _tiny(name)
    family = family_of(model)
    prompts = _prompts([20, 7], width=256)  # 256 + 16 - 1 > 128, 20 + 16 - 1 <= 128.
    tokens, lengths = family.check_inputs(model.config, prompts, [20, 7], 16)
    assert tokens.shape == (2, 256) and np.asarray(lengths).tolist() == [20, 7]
    with pytest.raises(ValueError, match=r"the longest prompt \(120 tokens\) plus "
                       r"max_decode_steps \(16\) needs 135 positions"):
      family.check_inputs(model.config, prompts, [120, 7], 16)


def test_padding_past_learned_positions_decodes_as_without_it():
  """GPT-2's table has 128 rows; prompts padded to 150 decode as the same prompts padded
  to 20 (padding slots take a clipped position, are masked and overwritten)."""
  model = _decoder("gpt2_tiny")
  wide = _prompts([20, 7], width=150, seed=3)
  narrow = sj.generate(model, wide[:, :20], [20, 7], max_decode_steps=4, eos_id=-1)
  padded = sj.generate(model, wide, [20, 7], max_decode_steps=4, eos_id=-1)
  np.testing.assert_array_equal(padded.sequences, narrow.sequences)


def test_a_draft_with_fewer_positions_than_the_inputs_need_is_named(llama):
  draft = _tiny("llama_tiny_draft", max_positions=32)
  with pytest.raises(ValueError, match=r"needs 39 positions .* has 32 positions"):
    sj.generate(llama, _prompts([24], 24), max_decode_steps=16, draft=draft)


# -- 2. Right-padded prompts without prompt_lengths ------------------------------------


def test_padded_prompts_without_lengths_are_an_error_naming_prompt_lengths(llama):
  prompts = _prompts([4, 2], width=4)  # Row 1 ends in two pad ids (0).
  with pytest.raises(ValueError, match=(
      r"prompts row 1 ends in the pad id 0 and no prompt_lengths were given, so its padding "
      r"would be decoded as text: pass prompt_lengths=\[\.\.\.\] \(each row's real length\); "
      r"if the pad id is genuinely part of the text, pass prompt_lengths=np.full\(2, 4\)$")):
    sj.generate(llama, prompts, max_decode_steps=4)
  family = family_of(llama)
  # With lengths (or with rows that do not end in the pad id) the inputs are fine.
  family.check_inputs(llama.config, prompts, [4, 2], 4)
  family.check_inputs(llama.config, prompts, np.full(2, 4), 4)  # the pad id as text
  family.check_inputs(llama.config, _prompts([4, 4], width=4), None, 4)
  # A draft model reads the rows the target accepted: its own pad id is not asked.
  draft = sj.ModelDraft(_tiny("llama_tiny_draft", pad_id=7))
  draft.check_inputs(np.full((1, 3), 7, np.int32), None, 4)


def test_t5_encoder_padding_is_by_design():
  t5 = _abstract(sj.get_config("tiny"))
  tokens = np.array([[5, 6, 1, 0, 0]], np.int32)
  _, lengths = family_of(t5).check_inputs(t5.config, tokens, None, 4)
  assert np.asarray(lengths).tolist() == [3]


# -- 3 and 6. Sampling without rng warns once; a new program's compile is logged -------


def test_sampling_without_rng_warns_once_and_compiles_are_logged(llama, caplog,
                                                                 fresh_warnings):
  model = llama
  prompts = np.full((2, 3), 5, np.int32)  # Shapes no other test here compiles.
  with warnings.catch_warnings(record=True) as caught, caplog.at_level(pylogging.INFO):
    warnings.simplefilter("always")
    first = sj.generate(model, prompts, max_decode_steps=3, temperature=1.0)
    first_log = [r.getMessage() for r in caplog.records]
    caplog.clear()
    second = sj.generate(model, prompts, max_decode_steps=3, temperature=1.0)
    second_log = [r.getMessage() for r in caplog.records]
  rng_warnings = [str(w.message) for w in caught if "without rng" in str(w.message)]
  assert rng_warnings == [
      "generate(temperature=1.0) without rng samples with PRNGKey(0), so every call returns "
      "the same sample; pass rng=jax.random.PRNGKey(seed), a new key per call, for fresh "
      "samples"]
  # What the warning says: the same sample twice.
  np.testing.assert_array_equal(first.sequences, second.sequences)
  shape = ("batch 2, input width 3, max_decode_steps 3, no draft, block width 1, float32"
           if jax.default_backend() == "cpu" else None)
  compiled = [m for m in first_log if m.startswith("compiling decode for")]
  assert len(compiled) == 2, first_log
  assert re.fullmatch(r"compiling decode for .*: first call \(compile\) took \d+\.\d\d s",
                      compiled[1]), compiled
  if shape is not None:
    assert compiled[0] == f"compiling decode for {shape}"
  # The same shapes again: the program is reused, nothing compiles, nothing is logged.
  assert not [m for m in second_log if "compiling decode" in m], second_log


# -- 4. load_model of a missing path ---------------------------------------------------


@pytest.mark.parametrize("path", ["/missing/path", "./missing", "~/no_such_ckpt_dir",
                                  "no/such/ckpt"])
def test_a_missing_path_is_file_not_found(path):
  with pytest.raises(FileNotFoundError, match=rf"^checkpoint not found: '.*{path.lstrip('~.')}' "
                     r"\(no such file or directory\)$"):
    sj.load_model(path)


def test_an_unknown_name_suggests_the_nearest_and_lists_the_rest():
  with pytest.raises(ValueError, match=r"Unknown model config 'llama_tiniy' \(and no such "
                     r"checkpoint path\); did you mean 'llama_tiny'.*\? Named configs: t5:"):
    sj.load_model("llama_tiniy")
  with pytest.raises(ValueError, match=r"Unknown model config 'zzz' \(and no such checkpoint "
                     r"path\)\. Named configs: t5:.*decoder_only:"):
    sj.load_model("zzz")


# -- 5. topp: None is off; an explicit 0 warns once; outside [0, 1] is an error --------


def test_topp_none_is_the_off_default(fresh_warnings):
  assert inspect.signature(sj.generate).parameters["topp"].default is None
  assert inspect.signature(settings.plan_settings).parameters["topp"].default is None
  assert Sampling().topp is None
  # 0 is read as off and shares the compile of None.
  assert Sampling(1.0, 0, 0) == Sampling(1.0) and Sampling(1.0, 0, 0.0).topp is None
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 9))
  np.testing.assert_array_equal(adjust_probs(logits, 1.0, topp=None),
                                adjust_probs(logits, 1.0, topp=0.0))
  config = get_decoder_config("llama_tiny")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    settings.plan_settings(config, None, max_decode_steps=4, temperature=1.0)  # None: silent
    settings.plan_settings(config, None, max_decode_steps=4, temperature=0.0, topp=0)  # greedy
    for _ in range(2):
      plan = settings.plan_settings(config, None, max_decode_steps=4, temperature=1.0, topp=0)
  assert [str(w.message) for w in caught if "topp" in str(w.message)] == [
      "topp=0 is read as no top-p filtering; pass topp=None for that, or a mass in (0, 1]"]
  assert plan.sampling.topp is None
  for bad in (-0.1, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"topp must be None \(no top-p filtering\) or a mass "
                       r"in \(0, 1\]"):
      settings.plan_settings(config, None, max_decode_steps=4, temperature=1.0, topp=bad)
  with pytest.raises(ValueError, match="exclusive"):
    Sampling(1.0, 3, 0.5)
  assert Sampling(1.0, 3, None).topk == 3


# -- 7. A draft with a smaller vocabulary names ModelDraft(target_vocab_size=...) ------


def test_a_smaller_draft_vocabulary_names_the_padding_fix(llama):
  small = _tiny("llama_tiny_draft", vocab_size=50)
  prompts = _prompts([4, 2], width=4)
  with pytest.raises(ValueError, match=re.escape(
      "the draft's vocabulary size 50 is smaller than the target's 97: if its ids are the "
      "target's first 50 (one tokenizer, tables padded to different sizes), pass draft="
      "sj.ModelDraft(draft, target_vocab_size=97)")):
    sj.generate(llama, prompts, [4, 2], max_decode_steps=3, draft=small)
  # The named fix passes the checks (its prompts within the draft's 50 ids).
  padded = sj.ModelDraft(small, target_vocab_size=97)
  settings.check_draft(llama.config, padded, np.full((1, 3), 5, np.int32), None, 3)
  with pytest.raises(ValueError, match="differs from the target's 97"):  # larger: no fix
    settings.check_draft(llama.config, _tiny("llama_tiny_draft", vocab_size=120),
                         prompts, [4, 2], 3)


# -- 8. A draft of another layout with the same vocabulary -----------------------------


def test_a_draft_of_another_layout_is_exact(llama):
  """A GPT-2-layout draft (learned positions, LayerNorm, tied head) for a Llama-layout
  target of one vocabulary: one decoder-only family, one cache contract, so the
  rejection rule keeps the target's outputs; greedy outputs are the target's bit for
  bit. Only the target's EOS ends rows (the draft's ids only index its tables)."""
  draft = _decoder("gpt2_tiny_draft", seed=1)
  assert (draft.config.vocab_size, draft.config.family) == (VOCAB, "gpt2")
  prompts = _prompts([5, 3, 4], width=5, seed=2)
  lengths = [5, 3, 4]
  target_only = sj.generate(llama, prompts, lengths, max_decode_steps=6, eos_id=-1,
                            block_width=4)
  spec = sj.generate(llama, prompts, lengths, max_decode_steps=6, eos_id=-1, draft=draft,
                     gamma=3, block_width=4)
  np.testing.assert_array_equal(spec.sequences, target_only.sequences)
  assert spec.stats is not None
  # Another family (T5 for a decoder-only target) is refused before any work, by name.
  t5 = _abstract(sj.get_config("tiny", vocab_size=VOCAB))
  with pytest.raises(ValueError, match="a t5 draft cannot serve a decoder_only target"):
    sj.generate(llama, prompts, lengths, max_decode_steps=3, draft=t5)


# -- 9. Named configs state their memory before allocating -----------------------------


def test_a_named_config_too_large_for_memory_fails_before_allocating(monkeypatch, caplog):
  gib = 2**30
  monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 20 * gib)
  start = time.perf_counter()
  with caplog.at_level(pylogging.INFO), pytest.raises(memory.InsufficientMemory, match=(
      r"^mistral_7b has 7,241,732,096 parameters: 28966928384 bytes \(26\.98 GiB\) in float32, "
      r"but only 21474836480 bytes \(20\.00 GiB\) are host memory available: load it with "
      r"dtype='bfloat16' \(14483464192 bytes, 13\.49 GiB\) or pick a smaller config \(nothing "
      r"was allocated\)$")) as error:
    sj.load_model("mistral_7b", dtype="float32")
  assert isinstance(error.value, MemoryError)
  assert time.perf_counter() - start < 20  # Shapes only, no 29 GB allocation.
  assert ("mistral_7b: 7,241,732,096 parameters, 28966928384 bytes (26.98 GiB) in float32"
          in [r.getMessage() for r in caplog.records])
  # Under budget the check passes (bfloat16 fits in 20 GiB): called directly, so nothing
  # is allocated here either.
  family = family_of(get_decoder_config("mistral_7b"))
  bf16 = get_decoder_config("mistral_7b", dtype="bfloat16")
  assert memory.check_params_memory(family, bf16, "mistral_7b") == 14483464192
  # Unknown available memory: no check.
  monkeypatch.setattr(memory, "available_memory_bytes", lambda device: None)
  assert memory.check_params_memory(family, get_decoder_config("mistral_7b"), "x") > 20 * gib


def test_small_models_pass_the_memory_check_and_log_their_size(caplog):
  config = get_decoder_config("llama_tiny_draft")
  count = config.num_params
  with caplog.at_level(pylogging.INFO):
    assert memory.check_params_memory(family_of(config), config, "llama_tiny_draft") == (
        count * 4)
  assert f"llama_tiny_draft: {count:,} parameters, {count * 4} bytes" in " ".join(
      r.getMessage() for r in caplog.records)
