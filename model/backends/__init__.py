"""Execution backends: the one place that decides how this machine runs the model.

`select_backend` is called once at load (the engine does it); the backend it returns owns
the KV-cache layout, the step metadata, and the RoPE/KV-store, attention and norm
functions. The model and the runner call it and ask nothing else about the hardware.

- `cpu`: kvserve's C kernels (AMX tiles, AVX-512 or AVX2 chosen inside them);
- `torch`: plain PyTorch ops, the readable reference the others are tested against;
- `triton`: kvserve's Triton kernels, for CUDA; on the CPU through Triton's interpreter.

`auto` is triton on CUDA and cpu on the CPU, each falling back to torch (with the reason
logged) where it cannot run.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from model.backends import cpu as cpu_backend
from model.backends import triton as triton_backend
from model.backends.base import Backend
from model.backends.reference import REFERENCE, TorchBackend
from model.config import ModelConfig

log = logging.getLogger("kvserve.backend")

BACKEND_NAMES = ("auto", "cpu", "triton", "torch")

__all__ = ["BACKEND_NAMES", "REFERENCE", "Backend", "select_backend"]


def _triton_missing(device: torch.device) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type not in ("cuda", "cpu"):
        return f"the Triton kernels run on CUDA (or the CPU's interpreter), not {device.type}"
    return None


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, cfg: ModelConfig, block_size: int
) -> Backend:
    """The backend `name` asks for, or the reason it cannot run here as a ValueError;
    'auto' falls back to torch rather than failing."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {list(BACKEND_NAMES)}, got {name!r}")
    if name == "torch":
        return TorchBackend(device, "asked for")
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        why = (
            f"the C kernels run on the CPU, not {device.type}"
            if device.type != "cpu"
            else cpu_backend.unsupported(cfg, block_size, dtype)
        )
        if why is None:
            return cpu_backend.CpuBackend(cfg, block_size, dtype, name)
        if name == "cpu":
            raise ValueError(f"attention_backend cpu: {why}")
        log.warning("attention backend torch: %s", why)
        return TorchBackend(device, why)
    why = _triton_missing(device) or triton_backend.unsupported(cfg, block_size, dtype)
    if why is not None:
        if name == "triton":
            raise ValueError(f"attention_backend triton: {why}")
        log.warning("attention backend torch: %s", why)
        return TorchBackend(device, why)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter is chosen when the kernels are defined, so before their import
        os.environ["TRITON_INTERPRET"] = "1"
        log.warning("attention backend triton on the CPU: Triton's interpreter (slow)")
    return triton_backend.TritonBackend(device, name)
