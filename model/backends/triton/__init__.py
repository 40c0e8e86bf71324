"""The `triton` backend (backend.py) and its kernels (kernels.py, imported only once the
backend is built: Triton's interpreter is chosen when the kernels are defined)."""

from model.backends.triton.backend import TritonBackend, unsupported

__all__ = ["TritonBackend", "unsupported"]
