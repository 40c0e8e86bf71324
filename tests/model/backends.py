"""The execution backends this machine runs, for tests that run the same case on each.

A backend named in KVSERVE_REQUIRE (comma-separated; CI sets it) that cannot run here
fails the test instead of skipping it, so missing coverage is never silent.
"""

import torch

from model.backends import Backend, select_backend
from model.config import ModelConfig
from model.generate import generate
from tests.require import missing

BACKENDS = ("cpu", "torch", "triton")


def make_backend(
    name: str, cfg: ModelConfig, block_size: int = 16, dtype: torch.dtype = torch.float32
) -> Backend:
    """The backend on the CPU, or skip (fail where KVSERVE_REQUIRE names it) saying why
    it cannot run here."""
    try:
        return select_backend(name, torch.device("cpu"), dtype, cfg, block_size)
    except ValueError as e:
        missing(name, f"backend {name} cannot run here: {e}")


def auto_backend(cfg: ModelConfig, dtype: torch.dtype, block_size: int = 16) -> Backend:
    """What the engine chooses on this CPU for this shape (`auto`)."""
    return select_backend("auto", torch.device("cpu"), dtype, cfg, block_size)


def generate_auto(model, prompt_ids: list[int], max_new_tokens: int, **kw: object) -> list[int]:
    """model/generate.py's tokens on the backend `auto` chooses here, its default block size."""
    backend = auto_backend(model.cfg, model.dtype)
    return list(generate(model, prompt_ids, max_new_tokens, backend=backend, **kw))


def block_size_for(name: str, wanted: int) -> int:
    """The Triton kernels take power-of-two blocks of at least 16 tokens."""
    return max(wanted, 16) if name == "triton" else wanted
