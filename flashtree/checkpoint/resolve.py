"""Model references -> paths on disk: a local directory, a .gguf file, or a Hugging Face repo id.

Repo ids are resolved by huggingface_hub, so flashtree shares the cache, the login token, the
mirror (HF_ENDPOINT) and the offline switch of the rest of the ecosystem: a model fetched by
transformers, vLLM or `hf download` is found here, and one fetched here is found there. Online,
the Hub is asked for the repo's current revision and missing files are downloaded with
huggingface_hub's progress bars; offline (`--offline`, or HF_HUB_OFFLINE=1) only the local cache
is read, and a repo missing from it is an error that says how to fetch it. A caller that reads the
configuration alone (`flashtree plan`) asks for config.json only: that is all it downloads, and
all its offline error tells the user to fetch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError

GGUF_SUFFIX = ".gguf"
# What a safetensors checkpoint needs: configs, tokenizer, chat template, weights. Repos often
# carry the same weights again as .bin, .pth or .gguf, which would multiply the download.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
CONFIG_FILE = "config.json"


def _looks_like_repo_id(text: str) -> bool:
    """`org/name`: exactly one slash and not written as a path (./x, /x, ~/x)."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~"))


def resolve_model(ref: str | os.PathLike, offline: bool = False, config_only: bool = False) -> Path:
    """A local directory or .gguf file as given, else the local snapshot of an HF repo id
    (downloaded first unless offline): the whole checkpoint, or with `config_only` its
    config.json alone."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == GGUF_SUFFIX:
            return path
        raise CheckpointError(f"{ref} is a file; expected a model directory, a .gguf file or an HF repo id")
    text = str(ref)
    if os.path.lexists(path):  # a FIFO, a device, a broken link: reading one would hang or fail
        raise CheckpointError(f"{text} is neither a directory nor a regular file")
    if path.suffix == GGUF_SUFFIX:
        raise CheckpointError(f"GGUF file {text} does not exist")
    if _looks_like_repo_id(text):
        return _hub_snapshot(text, offline, config_only)
    raise CheckpointError(f"model directory {text} does not exist")


def _hub_snapshot(repo_id: str, offline: bool, config_only: bool) -> Path:
    # imported here: only repo ids need the Hub client, and it costs a noticeable import time
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError)

    offline = offline or constants.HF_HUB_OFFLINE
    patterns = [CONFIG_FILE] if config_only else HUB_PATTERNS
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except HFValidationError:
        raise CheckpointError(f"model {repo_id!r} is neither a local directory nor a valid HF repo id") from None
    except GatedRepoError:
        raise CheckpointError(f"model {repo_id} is gated on the Hugging Face Hub: accept its terms on "
                              "its page, then log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"model {repo_id!r} is not a local directory and not a repository on the "
                              "Hugging Face Hub (a private one needs `hf auth login` or HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:
        where = f"the local HF cache at {constants.HF_HUB_CACHE}"
        if offline:
            fetch = f"hf download {repo_id}" + (f" {CONFIG_FILE}" if config_only else "")
            raise CheckpointError(
                f"model {repo_id} is not (completely) in {where}, and offline mode (--offline or "
                f"HF_HUB_OFFLINE=1) forbids downloading it: fetch it first with `{fetch}`, "
                "or run without offline mode") from None
        raise CheckpointError(f"model {repo_id} is not in {where} and cannot be downloaded: {e}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"cannot download model {repo_id}: {e}") from None


EMBEDDED = Path(__file__).resolve().parent.parent / "assets"


def model_refs(target: Optional[str], draft: Optional[str]) -> tuple[str, Optional[str]]:
    """The references to load: as given, or with no target the embedded pair (its draft unless
    one is named); the engine and `flashtree plan` read the same models."""
    if target is not None:
        return target, draft
    if not (EMBEDDED / "target").is_dir():
        raise CheckpointError("no embedded model in this install; pass --target DIR")
    return str(EMBEDDED / "target"), draft or (str(EMBEDDED / "draft") if (EMBEDDED / "draft").is_dir() else None)
