"""kvserve's linear kernels at every instruction-set level the CPU runs (the `isa`
fixture): AMX tiles (model/backends/cpu/kernels/linear_bf16.c) and vector code (linear_vec.c) for bf16,
int8 weights (linear_vec.c). Against fp32 matmul, bit for bit against a reference of the
vector code's arithmetic, a row's result independent of the rows beside it, and the fused
SwiGLU against the unfused ops."""

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.backends.cpu.isa import onednn_packs_bf16
from model.backends.cpu.kernels.linear import (
    int8_pack,
    int8_quantize,
    linear_isa,
    swiglu_layout,
    tile_layout,
    tile_linear,
    tile_linear_supported,
)
from model.backends.cpu.packed import GatedSwiGLU, PackedLinear, pack_linear, swap_linears
from model.config import ModelConfig
from model.layers import SwiGLU

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _built(isa: str) -> None:
    assert tile_linear_supported(torch.empty(64, 32, dtype=torch.bfloat16)), "no C compiler"
    assert linear_isa("bf16") == isa and linear_isa("int8") == isa


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    return w, torch.randn(n, generator=g)


def bf16_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The vector code's arithmetic: per output, in k-pair order, the odd k's product then
    the even one's added in float32 (each product exact), + bias, one bf16 rounding."""
    acc = bf16_sums(x, w)
    return (acc + bias if bias is not None else acc).to(torch.bfloat16)


def bf16_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16_reference's float32 sums, before the bias."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for kp in range(w.shape[1] // 2):
        acc = acc + xf[:, 2 * kp + 1, None] * wf[None, :, 2 * kp + 1]
        acc = acc + xf[:, 2 * kp, None] * wf[None, :, 2 * kp]
    return acc


def tile_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The AMX tile unit's arithmetic (tdpbf16ps), which linear_bf16.c's vector pass for
    few rows computes too: per step of 16 k pairs, the even k's products summed from zero
    in order, the odd k's likewise (each product exact in float32), and c + (even + odd);
    denormals flushed. Then + bias and one bf16 rounding."""
    acc = tile_sums(x, w)
    return (acc + bias if bias is not None else acc).to(torch.bfloat16)


def tile_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """tile_reference's float32 sums, before the bias."""
    xf, wf = flush(x.float()), flush(w.float())
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k0 in range(0, w.shape[1], 32):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for kp in range(k0 // 2, k0 // 2 + 16):
            even = flush(even + xf[:, 2 * kp, None] * wf[None, :, 2 * kp])
            odd = flush(odd + xf[:, 2 * kp + 1, None] * wf[None, :, 2 * kp + 1])
        acc = flush(acc + flush(even + odd))
    return acc


def revealing_bias(sums: torch.Tensor) -> torch.Tensor:
    """Minus `sums` (one row's float32 outputs) with their last 8 bits of mantissa cleared:
    sums + this bias is exactly those 8 bits, which bf16 holds, so a kernel's output with
    this bias shows any difference in how it summed, where a bf16 rounding of the sums
    themselves hides most."""
    return -(sums.view(torch.int32) & ~0xFF).view(torch.float32)


def flush(t: torch.Tensor) -> torch.Tensor:
    """float32 denormals to zero (of the same sign), as the tile unit stores them."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, t * 0, t)


def int8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8 weights and rows: q = rint(x * (127 / max|x|)) per row, exact integer dot
    products, float(sum) * (row scale * weight scale) + bias, one bf16 rounding."""
    q, scale = int8_quantize(w)
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    xq = torch.round(xf * inv[:, None]).clamp(-127, 127)
    acc = (xq.double() @ q.double().T).float()  # exact: |sums| < 2^24
    y = acc * ((amax / 127)[:, None] * scale[None, :])
    return (y + bias if bias is not None else y).to(torch.bfloat16)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's (and so the kernels') thread count n inside: the threads' shares of the
    weight blocks fall differently."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(x, w, bias, int8: bool, swiglu: bool = False) -> torch.Tensor:
    if int8:
        return tile_linear(x, int8_pack(w), bias, swiglu, shape=tuple(w.shape))
    return tile_linear(x, tile_layout(w), bias, swiglu)


@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 96), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 45, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_matches_fp32_matmul(isa: str, n: int, k: int, rows: int, with_bias: bool) -> None:
    w, bias = weights(n, k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    got = run(x, w, bias if with_bias else None, int8=False)
    want = x.float() @ w.float().T + (bias if with_bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # fp32 accumulation in another order, then one bf16 rounding: within 1-2 bf16 ulps.
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=2e-3)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 70])
@pytest.mark.parametrize("k", [96, 128])  # 128: whole 64-byte tile rows for AMX int8
def test_vector_code_gives_the_bits_of_its_reference(
    isa: str, int8: bool, rows: int, k: int
) -> None:
    """Every vector level computes the same bits (vdpbf16ps and the FMA path add the same
    exact products in the same order; int8 sums are exact, on the AMX tile unit too, which
    takes int8 from 8 rows where k is a multiple of 64), so each is checked against one
    reference; at amx, bf16 against the tile unit's arithmetic (tiles from 3 rows, the
    vector pass that gives their bits below). bf16 also with the last row's
    revealing_bias, which shows its sums' last bits (int8's sums are exact)."""
    w, bias = weights(192, k, seed=rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    ref = int8_reference if int8 else tile_reference if isa == "amx" else bf16_reference
    biases = [None, bias]
    if not int8:
        sums = tile_sums if isa == "amx" else bf16_sums
        biases.append(revealing_bias(sums(x[-1:], w)[0]))
    for b in biases:
        assert torch.equal(run(x, w, b, int8), ref(x, w, b))


@pytest.mark.parametrize("isa", ["amx"], indirect=True)  # the level with the tile unit
def test_amx_rows_flush_denormals_alone_as_in_a_batch(isa: str) -> None:
    """At amx one or two rows take linear_bf16.c's vector pass and more the tiles: sums and
    products in float32's denormal range (flushed by the tile unit, and by the vector
    pass under DAZ and FTZ) give the same bits either way, and the tile reference's."""
    w, _ = weights(256, 96, seed=7)
    x = torch.randn(40, 96)
    x[:10] *= 2.0**-64  # rows 0-9 against features 0-127: products and sums near 2^-126
    w = w.float()
    w[:128] *= 2.0**-60
    w[128:, :32] *= 2.0**-125  # features 128-255: a tile step of denormal products
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    x[3, 5] = x[8, 70] = torch.tensor(2.0**-130).to(torch.bfloat16)  # denormal inputs
    w[200, 1] = torch.tensor(-(2.0**-128)).to(torch.bfloat16)
    full = run(x, w, None, int8=False)
    tiny = full[:10, :128].float().abs() < torch.finfo(torch.float32).tiny
    assert tiny.any() and not tiny.all(), "the sums should straddle float32's smallest normal"
    assert torch.equal(full, tile_reference(x, w, None))
    for n_threads in (1, 2):  # one thread's share of 8 half blocks: 3 blocks in registers
        with threads(n_threads):
            for lo, hi in ((0, 1), (3, 4), (7, 9)):
                assert torch.equal(run(x[lo:hi], w, None, int8=False), full[lo:hi])


@pytest.mark.parametrize("isa", ["amx"], indirect=True)  # the level with the tile unit
@pytest.mark.parametrize("k", [96, 128])
def test_amx_one_row_in_registers_and_in_turns_gives_the_tiles_bits(isa: str, k: int) -> None:
    """At amx one row takes three whole blocks at a time in registers (linear_bf16.c's
    vec_row) and the rest of a thread's share in turns (vec_turns): 14 blocks fall to 1, 2
    and 3 threads as 4 groups and 2 blocks; 2 groups and a block each; and shares starting
    or ending with half a block. Checked with revealing_bias, alone and in a batch (the
    tiles)."""
    w, _ = weights(896, k, seed=k)
    x = torch.randn(20, k).to(torch.bfloat16)
    for i in (0, 7):
        bias = revealing_bias(tile_sums(x[i : i + 1], w)[0])
        want = tile_reference(x[i : i + 1], w, bias)
        assert torch.equal(run(x, w, bias, int8=False)[i : i + 1], want)
        for n_threads in (1, 2, 3):
            with threads(n_threads):
                assert torch.equal(run(x[i : i + 1], w, bias, int8=False), want)


@pytest.mark.parametrize("k", [36, 100])  # 9 and 25 steps of 4: the last turn is short
@pytest.mark.parametrize("n", [128, 192])  # one row: two blocks in turns, and one alone
def test_int8_row_whose_k_is_not_whole_turns(isa: str, k: int, n: int) -> None:
    """At AVX2 a one-row pass takes its blocks in turns of 4 k quads (linear_vec.c,
    int8_row_turns); an int8 k need only be a multiple of 4."""
    w, bias = weights(n, k, seed=k)
    x = torch.randn(1, k).to(torch.bfloat16)
    for n_threads in (1, 2):  # the pairs fall differently between the threads' shares
        with threads(n_threads):
            for b in (None, bias):
                assert torch.equal(run(x, w, b, True), int8_reference(x, w, b))


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
# 576: 9 blocks, two threads share one: by passes in vector code, by halves in AMX tiles
@pytest.mark.parametrize("n", [512, 576])
@pytest.mark.parametrize("k", [96, 128])  # 128: AMX int8 takes the batches, VNNI one row
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_thread_count(
    isa: str, int8: bool, n: int, k: int
) -> None:
    w, bias = weights(n, k, seed=1)
    x = torch.randn(300, k).to(torch.bfloat16)  # passes of every height, two row chunks
    full = run(x, w, bias, int8)
    for i in (0, 1, 15, 16, 31, 33, 63, 64, 255, 256, 299):
        assert torch.equal(run(x[i : i + 1], w, bias, int8)[0], full[i])
    for lo, hi in ((5, 50), (7, 9), (298, 300)):
        assert torch.equal(run(x[lo:hi], w, bias, int8), full[lo:hi])
    # shares of whole blocks, split at their edges by passes or (AMX) half blocks
    for n_threads in (1, 3):
        with threads(n_threads):
            assert torch.equal(run(x, w, bias, int8), full)
            for lo, hi in ((0, 1), (17, 19)):
                assert torch.equal(run(x[lo:hi], w, bias, int8), full[lo:hi])


def test_int8_error_against_fp32_matmul(isa: str) -> None:
    """Per-feature int8 weights and per-row int8 inputs: about 1% of the outputs' scale."""
    w, bias = weights(576, 1536, seed=4)
    x = torch.randn(9, 1536).to(torch.bfloat16)
    got = run(x, w, bias, int8=True).float()
    want = x.float() @ w.float().T + bias
    err = (got - want).abs()
    assert err.max().item() < 0.05 * want.abs().max().item()
    assert err.mean().item() < 0.01 * want.abs().mean().item() + 1e-3


def test_leading_dimensions_and_empty_input(isa: str) -> None:
    w, _ = weights(64, 64)
    for int8 in (False, True):
        x = torch.randn(2, 3, 64).to(torch.bfloat16)
        flat = run(x.view(6, 64), w, None, int8).view(2, 3, 64)
        assert torch.equal(run(x, w, None, int8), flat)
        assert run(x[:0], w, None, int8).shape == (0, 3, 64)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no-onednn"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_linear_packs_where_the_shape_allows(
    isa: str, quantization: str, onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if onednn and not onednn_packs_bf16():
        pytest.skip(
            "oneDNN packs bf16 weights with AVX-NE-CONVERT or AVX-512 BW/VL/DQ; this CPU has neither"
        )
    # no-onednn: what an AVX2-only CPU does, on every CPU
    monkeypatch.setattr("model.backends.cpu.packed.onednn_packs_bf16", lambda: onednn)
    # whole blocks; 100 features padded to 128; 90 in features, neither kernel's
    plain = [nn.Linear(96, 128), nn.Linear(96, 100), nn.Linear(90, 100, bias=False)]
    for layer in plain:
        layer.to(torch.bfloat16)
    xs = [torch.randn(5, layer.in_features).to(torch.bfloat16) for layer in plain]
    before = [F.linear(x, layer.weight, layer.bias).float() for x, layer in zip(xs, plain)]
    layers = [pack_linear(layer, quantization=quantization) for layer in plain]
    fits, padded, odd = layers
    for layer in (fits, padded):
        assert isinstance(layer, PackedLinear) and layer._tiles is not None
        assert layer._packed is None and layer.quant == (
            "int8" if quantization == "int8" else "bf16"
        )
        assert layer.weight.device.type == "meta" and layer.weight.shape == (layer.out_features, 96)
    assert (fits.pad, padded.pad) == (0, 28)
    # oneDNN's layout, or the nn.Linear as it was (F.linear on its weight)
    if onednn:
        assert isinstance(odd, PackedLinear) and odd._tiles is None and odd.kernel == "onednn"
        assert odd.weight.device.type == "meta"
    else:
        assert odd is plain[2]
    assert pack_linear(fits, quantization=quantization) is fits  # packed once
    for layer, x, want in zip(layers, xs, before):
        got = layer(x)
        assert got.shape == want.shape and got.is_contiguous()
        tol = 3e-2 if getattr(layer, "quant", "bf16") == "int8" else 8e-3
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # with the padding, a row's result is still the same alone as in a batch
    assert torch.equal(padded(xs[1][2:3]), padded(xs[1])[2:3])


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize(("f", "k"), [(64, 32), (192, 96), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 2, 16, 45])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_matches_the_unfused_bf16_ops(
    isa: str, int8: bool, f: int, k: int, rows: int, with_bias: bool
) -> None:
    w, bias = weights(2 * f, k, seed=2)
    x = torch.randn(rows, k).to(torch.bfloat16)
    b = bias if with_bias else None
    fused_w = swiglu_layout(w)
    got = run(x, fused_w, swiglu_layout(b) if b is not None else None, int8, swiglu=True)
    gate, up = run(x, w, b, int8).split(f, dim=-1)
    want = F.silu(gate) * up  # what SwiGLU computes without the fused kernel
    assert got.dtype == torch.bfloat16 and got.shape == (rows, f)
    # the same roundings; silu's exp differs from torch's in the last float32 bits, which
    # can move a result by one bf16 ulp
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3)
    assert (got == want).float().mean().item() > 0.97
    assert torch.equal(
        run(x[-1:], fused_w, None, int8, swiglu=True), run(x, fused_w, None, int8, swiglu=True)[-1:]
    )


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_swiglu_module_packs_fused_where_the_shape_allows(isa: str, quantization: str) -> None:
    cfg = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=2, d_ff=192)
    torch.manual_seed(0)
    ffn = SwiGLU(cfg).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    holder = nn.ModuleDict({"ffn": ffn})
    with torch.no_grad():
        want = ffn(x)
        swap_linears(holder, quantization)
        fused = holder["ffn"]
        assert isinstance(fused, GatedSwiGLU) and fused.w_in.gated
        assert isinstance(fused.w_out, PackedLinear)
        assert fused.w_in.quant == ("int8" if quantization == "int8" else "bf16")
        tol = 6e-2 if quantization == "int8" else 2e-2
        torch.testing.assert_close(fused(x).float(), want.float(), rtol=tol, atol=tol / 10)
    odd = SwiGLU(ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=2, d_ff=96))
    holder = nn.ModuleDict({"ffn": odd.to(torch.bfloat16)})
    swap_linears(holder, quantization)  # 2 x 96 rows: no whole gate/up block pairs
    assert holder["ffn"] is odd and isinstance(odd.w_in, PackedLinear) and not odd.w_in.gated


def test_a_long_row_runs_on_a_small_worker_stack(isa: str) -> None:
    """A pass's rows widened to float32 live in a per-thread heap buffer: an OpenMP worker
    started with OMP_STACKSIZE=256K runs k = 28,672 (Llama-3-70B's FFN), 16 rows, where
    the widened rows on its stack (458-688 KB) overflowed it."""
    code = (
        "import torch\n"
        "from model.backends.cpu.kernels.linear import tile_layout, tile_linear\n"
        "k = 28672\n"
        "w = (torch.randn(64, k) / k**0.5).to(torch.bfloat16)\n"
        "x = torch.randn(16, k).to(torch.bfloat16)\n"
        "y = tile_linear(x, tile_layout(w), None).float()\n"
        "assert torch.allclose(y, x.float() @ w.float().T, atol=0.05, rtol=0.02)\n"
    )
    env = {**os.environ, "OMP_STACKSIZE": "256K"}  # KVSERVE_CPU_ISA: the isa fixture's
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
