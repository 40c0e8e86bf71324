"""The `cpu` backend and what only it uses:

backend.py  CpuBackend: the KV layout, the step's kernels, prepare()
packed.py   the linears' packed layouts, swapped in for nn.Linear by prepare()
stack.py    the decoder layers as one C call
pages.py    huge-page memory for the packed weights and the KV pool
isa.py      the CPU's instruction-set levels and the compiler flags for each
kernels/    the C sources, compiled on first use, and their Python side
"""

from model.backends.cpu.backend import CpuBackend, prepare_model, unsupported

__all__ = ["CpuBackend", "prepare_model", "unsupported"]
