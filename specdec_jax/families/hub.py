"""Hugging Face hub ids: recognised, and fetched when the hub is reachable (any family)."""

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(path: str) -> bool:
  return bool(_HUB_ID.match(path)) and not path.startswith((".", "/"))


def _recipe(repo_id: str, then: str) -> str:
  return (f"Download it first where the hub is reachable, e.g. `huggingface-cli download "
          f"{repo_id} config.json model.safetensors --local-dir DIR` (add the shards and "
          f"model.safetensors.index.json for sharded models), then {then}")


def _hub(repo_id: str, how: str):
  try:
    import huggingface_hub
  except ImportError:
    raise FileNotFoundError(f"{repo_id!r} is not a local path and huggingface_hub is not "
                            f"installed. {how}") from None
  return huggingface_hub


def check_hub_id(repo_id: str, then: str = "load_model('DIR')") -> None:
  """Fetches only the repo's config.json (cheap), so that an unreachable hub, an unknown
  repo or a missing huggingface_hub is a FileNotFoundError with the download recipe
  before any other work; `then` says how the caller passes the downloaded DIR."""
  how = _recipe(repo_id, then)
  huggingface_hub = _hub(repo_id, how)
  try:
    huggingface_hub.hf_hub_download(repo_id, "config.json")
  except Exception as e:  # Offline, unknown repo, gated repo, ...
    raise FileNotFoundError(f"{repo_id!r} is not a local path and could not be fetched from the "
                            f"Hugging Face hub ({type(e).__name__}: {e}). {how}") from None


def download_from_hub(repo_id: str) -> str:
  """Downloads config + weights of a hub repo; a clear error when that is impossible."""
  how = _recipe(repo_id, "load_model('DIR')")
  huggingface_hub = _hub(repo_id, how)
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
