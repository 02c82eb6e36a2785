"""The sampling adjustment: logits -> the distribution a decoder draws from.

Speculative decoding is exact only if the draft's q and the target's p are the
distributions *after* the same adjustment (temperature, top-k, nucleus), so
both go through `adjust_probs`, and every decoder samples with `sample`.
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# T5X takes argmax below this temperature.
MIN_TEMPERATURE = 1e-4

# Values per block in `argmax`'s first pass.
_ARGMAX_BLOCK = 128


def argmax(x: Array) -> Array:
  """`jnp.argmax(x, axis=-1)` as int32, in two passes on CPU: [..., n] -> [...].

  The same answer, always: the first index of the maximum, and a NaN counts
  as the maximum (the first NaN wins). XLA CPU runs `jnp.argmax` as a
  two-operand reduction that it does not vectorise: about 145 us for one row
  of a 32k-token vocabulary, as long as a small model's logits projection.
  Here a first pass of plain (vectorised) reductions takes each block of 128
  values' maximum and whether it holds a NaN; the block holding the answer
  is the first with a NaN if there is one, else the first whose maximum is
  the row's; `jnp.argmax` inside that block finds the index. NaNs are looked
  for explicitly because XLA CPU's vectorised max reduction does not always
  propagate them. Padding is the lowest value of the dtype, at the end, so it
  never comes before an equal real value. Off CPU this is `jnp.argmax`.
  """
  n = x.shape[-1]
  if jax.default_backend() != "cpu" or n <= 2 * _ARGMAX_BLOCK:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  floating = jnp.issubdtype(x.dtype, jnp.floating)
  pad = -n % _ARGMAX_BLOCK
  if pad:
    lowest = (-jnp.inf if floating else False if x.dtype == jnp.bool_ else
              np.iinfo(x.dtype).min)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=lowest)
  blocks = x.reshape(x.shape[:-1] + (-1, _ARGMAX_BLOCK))  # [..., n / 128, 128]
  if floating:
    nan = jnp.isnan(blocks)
    block_max = jnp.max(jnp.where(nan, -jnp.inf, blocks), axis=-1)
    block_nan = jnp.any(nan, axis=-1)
    block = jnp.where(jnp.any(block_nan, axis=-1), jnp.argmax(block_nan, axis=-1),
                      jnp.argmax(block_max, axis=-1))
  else:
    block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inside = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
  return (block * _ARGMAX_BLOCK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How every decoder of one decode turns logits into a token: validated once, static.

  temperature: 0 (or below MIN_TEMPERATURE) means greedy, a one-hot on the
    first maximum.
  topk: keep exactly the k most likely tokens (0 = off).
  topp: keep the smallest set of most likely tokens with mass >= topp, a mass
    in (0, 1] (None = off; 0 is also read as off and stored as None).

  The target and every draft use the same object, so q and p are adjusted
  alike (the condition for exactness). Hashable: equal settings share a
  compiled program.
  """
  temperature: float = 0.0
  topk: int = 0
  topp: Optional[float] = None

  def __post_init__(self):
    validate_sampling(self.temperature, self.topk, self.topp)
    # Canonical types, so Sampling(1, 0, 0), Sampling(1.0, 0, 0.0) and Sampling(1.0) share
    # a compile. (The user-facing settings warn about an explicit topp=0:
    # `settings.plan_settings`; this is also built from internal defaults.)
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "topk", int(self.topk))
    object.__setattr__(self, "topp", None if topp_off(self.topp) else float(self.topp))

  @property
  def greedy(self) -> bool:
    return self.temperature < MIN_TEMPERATURE

  def check_vocab(self, vocab_size: int) -> "Sampling":
    """Returns self, or raises ValueError when topk exceeds the vocabulary."""
    validate_sampling(self.temperature, self.topk, self.topp, vocab_size)
    return self

  def probs(self, logits: Array) -> Array:
    """`adjust_probs` with these settings: logits [..., vocab] -> probs [..., vocab] float32."""
    return adjust_probs(logits, self.temperature, self.topk, self.topp)

  def draw(self, rng: Array, probs: Array) -> Array:
    """`sample` from probs [..., vocab] this object's `probs` made: token ids [...] int32."""
    return sample(rng, probs, greedy=self.greedy)


def topp_off(topp) -> bool:
  """Whether a (validated) topp means no top-p filtering: None, or 0."""
  return topp is None or float(topp) == 0.0


def validate_sampling(temperature, topk, topp, vocab_size=None):
  """Raises ValueError for settings that have no meaning."""
  if temperature is None or not float(temperature) >= 0.0:
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  if int(topk) != topk or topk < 0:
    raise ValueError(f"topk must be a non-negative int, got {topk!r}")
  if topp is not None and (isinstance(topp, bool) or not 0.0 <= float(topp) <= 1.0):
    raise ValueError(f"topp must be None (no top-p filtering) or a mass in (0, 1], got "
                     f"{topp!r}")
  if topk > 0 and not topp_off(topp):
    raise ValueError(f"topk ({topk}) and topp ({topp}) are exclusive: set one of them")
  if vocab_size is not None and topk > vocab_size:
    raise ValueError(f"topk ({topk}) exceeds the vocabulary size ({vocab_size})")


def adjust_probs(logits: Array, temperature: float = 1.0, topk: int = 0,
                 topp: Optional[float] = None) -> Array:
  """Turns logits [..., vocab] into adjusted probabilities [..., vocab] float32.

  Greedy (temperature < 1e-4) returns a one-hot on the first maximum. Otherwise
  logits are divided by the temperature, then truncated to the top k tokens
  (exactly k, ties broken towards lower ids) or to the nucleus of mass topp
  (None or 0: no nucleus), and renormalised. Settings are static Python numbers.
  """
  validate_sampling(temperature, topk, topp, logits.shape[-1])
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if temperature < MIN_TEMPERATURE:
    return jax.nn.one_hot(argmax(logits), vocab, dtype=jnp.float32)
  logits = logits / temperature
  if topk > 0 and topk < vocab:
    _, top_ids = jax.lax.top_k(logits, topk)
    keep = jnp.sum(jax.nn.one_hot(top_ids, vocab, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)
    logits = jnp.where(keep, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if not topp_off(topp) and topp < 1.0:
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # A token is in the nucleus if the mass strictly ahead of it is < topp:
    # the smallest prefix whose mass reaches topp.
    keep_sorted = mass_before < topp
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    probs = jnp.where(keep, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


# Keys. A decode's randomness is either one key for the whole batch (what `generate` takes)
# or *row keys*, one key per row [batch] (`sj.generate_many`: each input brings its own key,
# so a row's draws never depend on which rows share its batch). Every split and draw of
# the engine goes through `split_keys` / `sample` / `row_keys`, which take either.


def is_row_keys(rng: Array) -> bool:
  """Whether rng holds one key per row (raw keys [batch, 2], typed keys [batch])."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  return rng.ndim == (1 if typed else 2)


def split_keys(rng: Array, num: int) -> Array:
  """`jax.random.split(rng, num)` for a key, or for row keys each row's own split:
  keys [num, ...] either way (indexing [i] gives a key, or row keys)."""
  if not is_row_keys(rng):
    return jax.random.split(rng, num)
  return jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, num))(rng), 0, 1)


def row_keys(rng: Array, batch: int) -> Array:
  """One key per row: a key split `batch` ways (the batch's rows draw from one key), or
  row keys as they are."""
  return rng if is_row_keys(rng) else jax.random.split(rng, batch)


def sample(rng: Array, probs: Array, greedy: bool = False) -> Array:
  """Draws token ids [...] int32 from probs [..., vocab] (zeros never drawn).

  rng: a key, or row keys [batch] for probs [batch, ..., vocab] (each row's tokens from
  its own key). `greedy` (static) promises that probs is `adjust_probs`'s one-hot at
  temperature 0: its one token is then taken by argmax, the same draw without
  generating noise over the whole vocabulary (a measurable cost per step on
  CPU with 32k-token vocabularies).
  """
  if greedy:
    return argmax(probs)
  if is_row_keys(rng):
    return jax.vmap(lambda key, p: sample(key, p))(rng, probs)
  return jax.random.categorical(rng, safe_log(probs), axis=-1).astype(jnp.int32)


def safe_log(probs: Array) -> Array:
  return jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
