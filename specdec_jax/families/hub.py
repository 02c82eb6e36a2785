"""Hugging Face hub ids: recognised, and fetched when the hub is reachable (any family)."""

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(path: str) -> bool:
  return bool(_HUB_ID.match(path)) and not path.startswith((".", "/"))


def download_from_hub(repo_id: str) -> str:
  """Downloads config + weights of a hub repo; a clear error when that is impossible."""
  how = (f"Download it first where the hub is reachable, e.g. `huggingface-cli download "
         f"{repo_id} config.json model.safetensors --local-dir DIR` (add the shards and "
         f"model.safetensors.index.json for sharded models), then load_model('DIR')")
  try:
    import huggingface_hub
  except ImportError:
    raise FileNotFoundError(f"{repo_id!r} is not a local path and huggingface_hub is not "
                            f"installed. {how}") from None
  try:
    directory = huggingface_hub.snapshot_download(
        repo_id, allow_patterns=["config.json", "*.safetensors", "model.safetensors.index.json"])
    if not any(n.endswith(".safetensors") for n in os.listdir(directory)):
      directory = huggingface_hub.snapshot_download(
          repo_id, allow_patterns=["config.json", "pytorch_model*.bin",
                                   "pytorch_model.bin.index.json"])
  except Exception as e:  # Offline, unknown repo, gated repo, ...
    raise FileNotFoundError(f"{repo_id!r} is not a local path and could not be fetched from the "
                            f"Hugging Face hub ({type(e).__name__}: {e}). {how}") from None
  return directory
