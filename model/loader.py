"""One call from a model path (or none: the demo model) to a model and its tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model.demo import DEMO_MODEL_ID, build_demo_model
from model.gguf import is_gguf, served_name
from model.parallel import TensorParallel
from model.tokenizer import Tokenizer, TokenizerError
from model.transformer import Transformer
from model.weights import NATIVE_CONFIG, CheckpointError, load_model, share_of


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    model_id: str


def load(
    model_path: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    on_layer: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """tp: load this tensor-parallel rank's share (model/parallel.py); on_layer(block):
    each decoder layer of a checkpoint as soon as it is read (a backend's prepare_layer)."""
    if model_path is None:
        demo = build_demo_model(dtype, device)
        demo = share_of(demo, tp) if tp is not None else demo
        return LoadedModel(demo, Tokenizer.default(), DEMO_MODEL_ID)
    root = Path(model_path)
    model = load_model(root, dtype=dtype, device=device, tp=tp, on_layer=on_layer)
    source = Tokenizer.file_in(root)
    tokenizer = tokenizer_for(root)
    vocab = model.cfg.vocab_size
    if tokenizer.vocab_size > vocab:
        config = NATIVE_CONFIG if (root / NATIVE_CONFIG).exists() else "config.json"
        where = source or f"{root} (no tokenizer file: the default cl100k_base)"
        raise TokenizerError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but {config} "
            f"vocab_size is {vocab}"
        )
    if not tokenizer.eos_ids and model.cfg.eos_token_ids:
        tokenizer.eos_ids = model.cfg.eos_token_ids
    return LoadedModel(model, tokenizer, served_name(root) if is_gguf(root) else root.name)


def tokenizer_for(root: Path | None) -> Tokenizer:
    """A model directory's tokenizer file (model/tokenizer.py reads it), or the default
    cl100k_base where it has none (and for the demo model, root None)."""
    return Tokenizer.from_dir(root) if root and Tokenizer.file_in(root) else Tokenizer.default()


__all__ = ["CheckpointError", "LoadedModel", "TokenizerError", "load", "tokenizer_for"]
