"""A budgeted view of a target's own cache: what a family gives a self-speculating draft.

`drafts.sparse_cache.SparseCacheDraft` drafts with the target's own weights, reading only
a few of the positions its cache holds (MagicDec's StreamingLLM window, TriForce's
retrieved chunks). A family serves it through `Family.sparse_view(config, params)`, a
`SparseView` of four pure functions over the target's cache as the decode loop holds it
(read only: the draft copies the positions it reads into a compact cache of its own):

* `chunk_keys(cache, chunk) -> [batch, L // chunk, f] float32`: each whole chunk's mean
  key, every layer's concatenated (what a retrieval policy scores);
* `key_at(cache, index [batch]) -> [batch, f] float32`: the keys at one cache index, in
  the same layout (a retrieval probe: the last written key);
* `gather(cache, index [batch, S], valid [batch, S], room) -> view`: a compact cache of
  the S positions `index` names (an invalid entry is never attended to) plus `room`
  empty slots for the draft's own tokens;
* `step(view, tokens [batch], positions [batch], slot) -> (logits [batch, vocab] float32,
  view)`: one token per row at absolute position `positions`, its keys written at the
  view's slot S + slot, attending to the valid gathered positions and the draft's own
  earlier slots (causally, and by the family's own rules: windows, relative positions).

Cache indices are absolute positions (a family whose loop positions are shifted says so
through `DecodeStart.offset`, which the draft adds). A family that cannot give a view
raises from `sparse_view` with the reason, before any work.
"""

from typing import Callable, NamedTuple


class SparseView(NamedTuple):
  """The four functions of a family's budgeted cache view (module docstring)."""
  chunk_keys: Callable
  key_at: Callable
  gather: Callable
  step: Callable
