"""Where a model comes from: a local directory, or a Hugging Face Hub repo id resolved
through huggingface_hub's cache (HF_TOKEN, HF_HUB_OFFLINE, HF_ENDPOINT and HF_HOME apply
as huggingface_hub defines them). Only the files kvserve reads are downloaded."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from model.gguf import first_shard, is_gguf, served_name

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


# a PEFT LoRA adapter's (model/lora.py)
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


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
    .gguf); anything else from the Hub (download()), from the cache, or downloaded into
    it when the Hub can be reached. None (the demo model) stays None."""
    if model is None:
        return None
    local = Path(model).expanduser()
    if local.is_dir():
        return ModelSource(local, local.name)
    if is_gguf(local):
        return ModelSource(local, served_name(local))
    if model.startswith((".", "/", "~")):
        raise ModelNotFound(f"model directory not found: {model}")
    path = download(model, revision, download_dir)
    return ModelSource(path, served_name(path) if path.is_file() else model)


def adapter_folder(adapter: str, download_dir: str | None = None) -> Path:
    """A LoRA adapter's folder: a local one as it is, else a Hub repo id's snapshot of
    the adapter's files."""
    local = Path(adapter).expanduser()
    if local.is_dir():
        return local
    if adapter.startswith((".", "/", "~")):
        raise ModelNotFound(f"adapter directory not found: {adapter}")
    return _snapshot(adapter, None, download_dir, ADAPTER_FILES)


def download(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """From the Hub, downloading what is missing: a repo id's snapshot directory
    (kvserve's files only); one GGUF file of a repo, named as `org/repo/file.gguf` or as
    llama.cpp and Ollama name it, `org/repo:QUANT` (the one file whose name ends in
    QUANT.gguf, any case), its path."""
    repo, _, quant = model.partition(":")
    parts = repo.split("/", 2)
    repo_id, file = "/".join(parts[:2]), parts[2] if len(parts) > 2 else None
    if file is not None and not file.endswith(".gguf"):
        raise ModelNotFound(f"model directory not found: {model}")
    if file is not None:
        import huggingface_hub as hub

        with _hub_errors(repo_id, revision, cache_dir):
            path = hub.hf_hub_download(repo_id, file, revision=revision, cache_dir=cache_dir)
        return Path(path)
    if quant:
        return _gguf_of(repo_id, quant, revision, cache_dir)
    return _snapshot(repo_id, revision, cache_dir, ALLOW)


def _gguf_of(repo_id: str, quant: str, revision: str | None, cache_dir: str | None) -> Path:
    """The GGUF file of `repo_id` named for `quant`: the one whose name ends in
    QUANT.gguf, or a split one's first shard (NAME-QUANT-00001-of-0000N.gguf, or any in a
    QUANT folder), its shards downloaded with it."""
    variants = {quant, quant.upper(), quant.lower()}
    patterns = [p for v in variants for p in (f"*{v}.gguf", f"*{v}-*-of-*.gguf", f"*{v}/*.gguf")]
    snapshot = _snapshot(repo_id, revision, cache_dir, patterns)
    ends = re.compile(rf"(^|[-_.]){re.escape(quant)}$", re.IGNORECASE)
    files = sorted(
        p
        for p in snapshot.rglob("*.gguf")
        if first_shard(p)
        and (ends.search(served_name(p)) or p.parent.name.lower() == quant.lower())
    )
    if len(files) != 1:
        names = ", ".join(p.name for p in files)
        raise ModelNotFound(
            f"model {repo_id!r} has {'several' if files else 'no'} GGUF files ending in "
            f"{quant}.gguf{': ' + names if files else ''} (name one as {repo_id}/FILE.gguf)"
        )
    return files[0]


def _snapshot(
    repo_id: str, revision: str | None, cache_dir: str | None, patterns: list[str]
) -> Path:
    """The repo's snapshot directory with the files matching `patterns`."""
    import huggingface_hub as hub

    with _hub_errors(repo_id, revision, cache_dir):
        path = hub.snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns
        )
    return Path(path)


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, cache_dir: str | None) -> Iterator[None]:
    """huggingface_hub's failures as one-line ModelNotFound reasons."""
    from huggingface_hub import constants, errors

    try:
        yield
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
    except errors.EntryNotFoundError:
        raise ModelNotFound(f"model {repo_id!r} has no such file") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"model {repo_id!r}: the Hub answered {exc}") from None
