"""Compile every Triton kernel of model/backends/triton/ (kernels.py, pointwise.py,
fp8_gemv.py, int4_linear.py, moe.py) for an H100 (sm_90) with Triton's own compiler and ptxas, no GPU needed:
the interpreter that the CPU tests run the kernels in accepts code the GPU compiler
rejects, and this catches it. Each variant is a launch the backend makes (dtype, GQA
group, head size, the constexpr branches), written the way the launchers call the
kernels.

    python -m tests.model.triton_sm90     # TRITON_INTERPRET unset; one line per variant

tests/model/test_triton_compile.py runs it in a subprocess (the test session itself has
the interpreter on).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model.backends.triton import fp8_gemv as G
from model.backends.triton import int4_linear as I
from model.backends.triton import kernels as K
from model.backends.triton import moe as M
from model.backends.triton import pointwise as P

H100 = GPUTarget("cuda", 90, 32)


def _rope(dt: str, d: int, rope: bool, cache: bool) -> tuple:
    ptr = f"*{dt}"
    types = dict(qkv_ptr=ptr, cos_ptr=ptr, sin_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr,
                 slot_ptr="*i32" if cache else ptr, n_tokens="i32", stride_t="i32")  # fmt: skip
    consts = dict(H=9, KV=3, D=d, HALF_PAD=triton.next_power_of_2(d // 2), ROWS=K.ROPE_ROWS,
                  HAS_ROPE=rope, HAS_CACHE=cache)  # fmt: skip
    return K._rope_store_kernel, types, consts, 4


def _attention_consts(dt: str, group: int, d: int, alibi: bool, window: bool, cap=False) -> dict:
    upcast = dt == "fp32"
    return dict(G=group, KV=2, D=d, D_PAD=max(16, triton.next_power_of_2(d)), BS=16,
                TILE=K.KEY_TILE, BLOCK_G=triton.next_power_of_2(group), HAS_ALIBI=alibi,
                WINDOWED=window, SOFTCAP=cap, UPCAST=upcast,
                PRECISION="ieee" if upcast else "tf32")  # fmt: skip


def _paged(
    dt: str, group: int, d: int, alibi: bool, block_q: int, window=False, cap=False, sinks=False
) -> tuple:
    ptr = f"*{dt}"
    types = dict(q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, out_ptr=ptr,
                 block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32",
                 alibi_ptr="*fp32" if alibi else ptr, sinks_ptr="*fp32" if sinks else ptr,
                 scale="fp32", window="i32", softcap="fp32", stride_qt="i32",
                 stride_qh="i32", stride_bt="i32")  # fmt: skip
    consts = _attention_consts(dt, group, d, alibi, window, cap) | dict(BLOCK_Q=block_q)
    return K._paged_attention_kernel, types, consts | dict(SINKS=sinks), 4


def _split(dt: str, group: int, d: int, alibi: bool, splits: int, window=False, cap=False) -> tuple:
    ptr = f"*{dt}"
    types = dict(q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, part_ptr="*fp32",
                 lse_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                 alibi_ptr="*fp32" if alibi else ptr, scale="fp32", window="i32",
                 softcap="fp32", stride_qt="i32", stride_qh="i32", stride_bt="i32")  # fmt: skip
    consts = _attention_consts(dt, group, d, alibi, window, cap)
    consts |= dict(BLOCK_G=max(16, consts["BLOCK_G"]), SPLITS=splits)
    return K._decode_split_kernel, types, consts, 4


def _combine(dt: str, d: int, splits: int, sinks=False) -> tuple:
    types = dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{dt}", sinks_ptr="*fp32")
    consts = dict(H=6, D=d, D_PAD=max(16, triton.next_power_of_2(d)), SPLITS=splits,
                  SPLITS_PAD=triton.next_power_of_2(splits), SINKS=sinks)  # fmt: skip
    return K._combine_splits_kernel, types, consts, 4


def _norm(dt: str, d: int, delta: bool) -> tuple:
    ptr = f"*{dt}"
    types = dict(x_ptr=ptr, delta_ptr=ptr, w_ptr=ptr, out_ptr=ptr, n_rows="i32", eps="fp32")
    consts = dict(D=d, D_PAD=triton.next_power_of_2(d), ROWS=K.NORM_ROWS, HAS_DELTA=delta)
    return K._add_rms_norm_kernel, types, consts, K.norm_warps(d)


def _silu_mul(dt: str, f: int) -> tuple:
    types = dict(gate_up_ptr=f"*{dt}", out_ptr=f"*{dt}", n_rows="i32")
    return P._silu_mul_kernel, types, dict(F=f, ROWS=P.GATE_ROWS, BLOCK=P.GATE_BLOCK), 4


def _quantize(dt: str, k: int) -> tuple:
    types = dict(x_ptr=f"*{dt}", q_ptr="*fp8e4nv", scale_ptr="*fp32")
    block = min(P.QUANT_BLOCK, triton.next_power_of_2(k))
    consts = dict(K=k, BLOCK=block, FP8_MAX=448.0)
    return P._quantize_rows_fp8_kernel, types, consts, 4 if block <= 1024 else 8


def _gemv(bias: bool) -> tuple:
    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16" if bias else "*fp32",
                 out_ptr="*bf16", M="i32", N="i32", K="i32")  # fmt: skip
    bn, bk, warps, _ = G.DOT_TILE
    consts = dict(BLOCK_M=G.ROWS, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias, UPCAST=False)
    return G._fp8_gemv_kernel, types, consts, warps


def _gemv_row(bias: bool) -> tuple:
    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16" if bias else "*fp32",
                 out_ptr="*bf16", N="i32", K="i32")  # fmt: skip
    bn, bk, warps = G.ROW_TILE
    return G._fp8_gemv_row_kernel, types, dict(BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias), warps


def _int4_row(bias: bool) -> tuple:
    types = dict(x_ptr="*bf16", q_ptr="*u8", d_ptr="*bf16", m_ptr="*bf16",
                 b_ptr="*bf16", out_ptr="*bf16", N="i32", KG="i32")  # fmt: skip
    bn, gb, warps = I.ROW_TILE
    return I._int4_row_kernel, types, dict(BLOCK_N=bn, GB=gb, HAS_BIAS=bias), warps


def _int4_dot(prefill: bool, bias: bool) -> tuple:
    types = dict(x_ptr="*bf16", q_ptr="*u8", d_ptr="*bf16", m_ptr="*bf16",
                 b_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", KG="i32")  # fmt: skip
    if prefill:
        bm, bn, gb, warps, _ = I.GEMM_TILE
    else:
        (bn, gb, warps), bm = I.DOT_TILE, I.ROWS
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, GB=gb, HAS_BIAS=bias, UPCAST=False)
    return I._int4_dot_kernel, types, consts, warps


def _stack_types(int4: bool) -> dict[str, str]:
    """An expert stack's operands: its bf16 weights, or int4 codes, steps and minimums."""
    if int4:
        return dict(w_ptr="*u8", ws_ptr="*bf16", wm_ptr="*bf16")
    return dict(w_ptr="*bf16", ws_ptr="*bf16", wm_ptr="*bf16")


def _experts_in(bm: int, gpt_oss: bool, int4: bool = False) -> tuple:
    types = dict(x_ptr="*bf16", **_stack_types(int4), b_ptr="*bf16", pairs_ptr="*i32",
                 tile_experts_ptr="*i32", h_ptr="*bf16", P="i32", d="i32", F="i32")  # fmt: skip
    consts = dict(TOP_K=4 if gpt_oss else 8, BLOCK_M=bm, BLOCK_N=M.BLOCK_N, BLOCK_K=M.BLOCK_K,
                  HAS_BIAS=gpt_oss, CLAMPED=gpt_oss, ALPHA=1.702 if gpt_oss else 0.0,
                  LIMIT=7.0 if gpt_oss else 0.0, UPCAST=False, INT4=int4)  # fmt: skip
    return M._experts_in_kernel, types, consts, M.warps(bm)


def _experts_out(bm: int, bias: bool, int4: bool = False) -> tuple:
    types = dict(h_ptr="*bf16", **_stack_types(int4), b_ptr="*bf16", scale_ptr="*bf16",
                 pairs_ptr="*i32", tile_experts_ptr="*i32", out_ptr="*bf16", P="i32",
                 d="i32", F="i32")  # fmt: skip
    consts = dict(BLOCK_M=bm, BLOCK_N=M.BLOCK_N, BLOCK_K=M.BLOCK_K, HAS_BIAS=bias, UPCAST=False,
                  INT4=int4)  # fmt: skip
    return M._experts_out_kernel, types, consts, M.warps(bm)


VARIANTS = {
    "rope_store bf16 d64": _rope("bf16", 64, True, True),
    "rope_store fp32 d80 no-rope": _rope("fp32", 80, False, True),
    "rope_store bf16 d128 no-cache": _rope("bf16", 128, True, False),
    "paged_attention bf16 g4 d64 decode": _paged("bf16", 4, 64, False, 4),
    "paged_attention bf16 g3 d64 prefill": _paged("bf16", 3, 64, False, 16),
    "paged_attention fp32 g1 d80 alibi": _paged("fp32", 1, 80, True, 16),
    "paged_attention bf16 g2 d256 window": _paged("bf16", 2, 256, False, 16, window=True),
    "paged_attention bf16 g2 d256 softcap": _paged("bf16", 2, 256, False, 16, True, True),
    "paged_attention bf16 g8 d64 window sinks": _paged("bf16", 8, 64, False, 16, True, sinks=True),
    "decode_split bf16 g4 d128": _split("bf16", 4, 128, False, 16),
    "decode_split bf16 g4 d128 window": _split("bf16", 4, 128, False, 16, window=True),
    "decode_split bf16 g2 d256 softcap": _split("bf16", 2, 256, False, 8, True, True),
    "decode_split fp32 g3 d80 alibi": _split("fp32", 3, 80, True, 4),
    "combine_splits bf16 d64": _combine("bf16", 64, 16),
    "combine_splits bf16 d64 sinks": _combine("bf16", 64, 16, sinks=True),
    "add_rms_norm bf16 d576": _norm("bf16", 576, True),
    "add_rms_norm fp32 d2048 no-add": _norm("fp32", 2048, False),
    "add_rms_norm bf16 d4096": _norm("bf16", 4096, True),
    "silu_mul bf16 f8192": _silu_mul("bf16", 8192),
    "silu_mul fp32 f1536": _silu_mul("fp32", 1536),
    "quantize_rows_fp8 bf16 k2048": _quantize("bf16", 2048),
    "quantize_rows_fp8 bf16 k14336": _quantize("bf16", 14336),
    "quantize_rows_fp8 bf16 k576": _quantize("bf16", 576),
    "fp8_gemv bf16": _gemv(False),
    "fp8_gemv bf16 bias": _gemv(True),
    "fp8_gemv_row bf16": _gemv_row(False),
    "fp8_gemv_row bf16 bias": _gemv_row(True),
    "int4_row bf16": _int4_row(False),
    "int4_row bf16 bias": _int4_row(True),
    "int4_dot bf16 decode": _int4_dot(False, False),
    "int4_dot bf16 prefill bias": _int4_dot(True, True),
    "experts_in bf16 decode": _experts_in(16, False),
    "experts_in bf16 prefill": _experts_in(64, False),
    "experts_in bf16 gpt-oss": _experts_in(16, True),
    "experts_out bf16 decode": _experts_out(16, False),
    "experts_out bf16 prefill bias": _experts_out(64, True),
    "experts_in int4 decode": _experts_in(16, False, True),
    "experts_in int4 prefill gpt-oss": _experts_in(64, True, True),
    "experts_out int4 decode": _experts_out(16, False, True),
    "experts_out int4 prefill bias": _experts_out(64, True, True),
}


def compile_variant(fn, types: dict[str, str], consts: dict, num_warps: int) -> bytes:
    """The kernel's cubin for the H100; every parameter typed or given, or a ValueError
    naming the one that is not (the table above has drifted from the kernel)."""
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            if p.name not in consts:
                raise ValueError(f"{fn.__name__}: no value for constexpr {p.name}")
            signature[p.name] = "constexpr"
        elif p.name in types:
            signature[p.name] = types[p.name]
        else:
            raise ValueError(f"{fn.__name__}: no type for argument {p.name}")
    extra = (set(types) | set(consts)) - {p.name for p in fn.params}
    if extra:
        raise ValueError(f"{fn.__name__}: no parameters named {sorted(extra)}")
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    kernel = triton.compile(src, target=H100, options={"num_warps": num_warps})
    return kernel.asm["cubin"]


def resources(cubin: bytes) -> str:
    """Registers and stack (spills) per thread, from the cuobjdump Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    fields = next((ln.split() for ln in out.splitlines() if "REG:" in ln), [])
    return " ".join(f for f in fields if f.startswith(("REG:", "STACK:"))) or "no usage line"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the kernels are the interpreter's, not compilable")
        return 2
    failed = 0
    for name, (fn, types, consts, warps) in VARIANTS.items():
        t0 = time.perf_counter()
        try:
            cubin = compile_variant(fn, types, consts, warps)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        took = time.perf_counter() - t0
        print(f"ok {name}: {len(cubin)} bytes of sm_90 code, {resources(cubin)}, {took:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
