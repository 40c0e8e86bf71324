"""Where a model comes from: a local directory, or a Hugging Face Hub repo id resolved
through huggingface_hub's cache (HF_TOKEN, HF_HUB_OFFLINE, HF_ENDPOINT and HF_HOME apply
as huggingface_hub defines them). Only the files kvserve reads are downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model.gguf import is_gguf

# config, weights, tokenizer and generation config: what model/ reads, nothing else
ALLOW = [
    "config.json",
    "kvserve_config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "*.tiktoken",
    "special_tokens_map.json",
]


class ModelNotFound(ValueError):
    """The model cannot be had: the one-line reason is the message."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: Path  # a directory with the checkpoint, or a GGUF file
    model_id: str  # the name the API serves it under by default


def resolve(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> ModelSource | None:
    """A local directory or GGUF file as it is (served as the file's name without
    .gguf); anything else as a Hub repo id, from the cache, or downloaded into it when the
    Hub can be reached. None (the demo model) stays None."""
    if model is None:
        return None
    local = Path(model).expanduser()
    if local.is_dir():
        return ModelSource(local, local.name)
    if is_gguf(local):
        return ModelSource(local, local.stem)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelNotFound(f"model directory not found: {model}")
    return ModelSource(download(model, revision, download_dir), model)


def download(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The repo's snapshot directory (kvserve's files only), downloading what is missing."""
    import huggingface_hub as hub
    from huggingface_hub import constants, errors

    try:
        path = hub.snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW
        )
    except errors.HFValidationError:
        raise ModelNotFound(
            f"model directory not found, and not a Hugging Face repo id: {repo_id}"
        ) from None
    except errors.GatedRepoError:
        raise ModelNotFound(
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms there "
            "and set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(
            f"model {repo_id!r}: no such repository on the Hugging Face Hub (or a private "
            "one: set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"model {repo_id!r} has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        where = cache_dir or constants.HF_HUB_CACHE
        raise ModelNotFound(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and the Hub "
            "cannot be reached (HF_HUB_OFFLINE or no network): run `kvserve download "
            f"{repo_id}` where there is a network, or pass a local directory"
        ) from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"model {repo_id!r}: the Hub answered {exc}") from None
    return Path(path)
