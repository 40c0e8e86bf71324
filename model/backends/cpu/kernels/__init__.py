"""kvserve's CPU kernels: C sources compiled for this machine on first use (build.py) and
the Python side of each:

    build.py      compiling, caching and loading a source; the ctypes prototypes
    attention.py  paged attention (paged_attention.c)
    fused.py      add + RMSNorm, RoPE + KV write, greedy argmax (fused.c)
    linear.py     the linears, bf16 and int8, and their weight layouts (linear_*.c)
    stack.py      the decoder layers as one call (stack.c)
    experts.py    a mixture's routed experts as one call (experts.c)
"""
