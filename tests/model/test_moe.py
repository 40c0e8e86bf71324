"""A mixture of experts (model/moe.py): the router's choice, and the CPU's experts as one
C call (kernels/experts.c) giving the bits of the grouped loop over the same packed
kernels, at every instruction-set level the CPU runs (the `isa` fixture), with bf16 and
int8 weights."""

import pytest
import torch

from model.backends.cpu.packed import GatedSwiGLU, PackedExperts, SplitSwiGLU
from model.config import Experts as ExpertSpec
from model.int_weights import mark_stored_kind
from model.moe import Experts, GroupedExperts, route


def experts(n: int, d: int, ff: int) -> Experts:
    torch.manual_seed(0)
    e = Experts(ExpertSpec(n, 1, ff), d)
    with torch.no_grad():
        e.w_in.normal_(0, d**-0.5)
        e.w_out.normal_(0, ff**-0.5)
    return e.to(torch.bfloat16)


def routed(rows: int, n: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(rows)
    x = torch.randn(rows, 192).to(torch.bfloat16)
    weights, ids = route(torch.randn(rows, n).to(torch.bfloat16), top_k, normalize=True)
    return x, weights, ids


def test_route_is_the_softmax_at_the_top_k() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 1.0]])
    weights, ids = route(logits, 2, normalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [0, 3]]
    assert torch.allclose(weights, probs.gather(1, ids))
    normalized, _ = route(logits, 2, normalize=True)
    assert torch.allclose(normalized.sum(-1), torch.ones(2))
    assert torch.allclose(normalized, weights / weights.sum(-1, keepdim=True))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_one_call_gives_the_grouped_loops_bits(isa: str, quantization: str) -> None:
    """Decode-sized and prefill-sized steps, experts hit by many rows and by none."""
    ref = experts(8, 192, 128)
    packed = PackedExperts(ref, quantization)
    packed.bind()
    assert packed.kernels is not None, "the experts kernel did not build"
    kind = "int8" if quantization == "int8" else "bf16"
    assert packed.kinds == (kind, kind)
    assert all(isinstance(f, GatedSwiGLU) for f in packed.ffns)
    for rows in (1, 3, 40):
        x, weights, ids = routed(rows, 8, 3)
        got = packed(x, weights, ids)
        loop = GroupedExperts.forward(packed, x, weights, ids)  # the same kernels, in Python
        assert torch.equal(got, loop), rows
        if quantization == "none":  # and the packed kernels are the reference's linears
            want = ref(x, weights, ids).float()
            assert (got.float() - want).abs().max().item() <= 0.03 * want.abs().max().item()


@pytest.mark.parametrize(
    ("stored", "kinds"),
    [(("int4", "int8"), ("int4", "int8g")), (("int8", "int4"), ("int8g", "int4"))],
)
def test_experts_of_two_kinds_give_the_grouped_loops_bits(
    isa: str, stored: tuple, kinds: tuple
) -> None:
    """A GGUF Q4_K_M's experts: (gate | up) in one stored kind, down in another
    (model.int_weights.stored_kind); --quantization auto packs each in the kind that
    keeps it (int8 as int8g), one C call."""
    ref = experts(8, 192, 128)
    for param, kind in zip((ref.w_in, ref.w_out), stored, strict=True):
        mark_stored_kind(param, kind)
    packed = PackedExperts(ref, "auto")
    packed.bind()
    assert packed.kinds == kinds and packed.kernels is not None
    for rows in (1, 40):
        x, weights, ids = routed(rows, 8, 3)
        loop = GroupedExperts.forward(packed, x, weights, ids)
        assert torch.equal(packed(x, weights, ids), loop), rows


def test_experts_whose_rows_do_not_take_the_gated_layout_run_the_loop() -> None:
    """32 features an expert: (gate | up) is not whole 128-row blocks, so its kernel
    cannot apply the gate; each expert is packed linears with torch's gate between."""
    ref = experts(4, 192, 32)
    packed = PackedExperts(ref)
    packed.bind()
    assert packed.kernels is None and all(isinstance(f, SplitSwiGLU) for f in packed.ffns)
    x, weights, ids = routed(5, 4, 2)
    want = ref(x, weights, ids).float()
    got = packed(x, weights, ids).float()
    assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()


def test_gpt_oss_experts_with_biases_and_the_clamped_gate_run_the_loop() -> None:
    """gpt-oss's experts (biases, the clamped SwiGLU) packed: each expert's linears
    carry their biases, torch's clamped gate between them, close to the reference."""
    torch.manual_seed(0)
    spec = ExpertSpec(4, 2, 128, bias=True, clamped=(1.702, 7.0))
    ref = Experts(spec, 192)
    with torch.no_grad():
        for p in (ref.w_in, ref.w_out):
            p.normal_(0, 0.1)  # wide enough that the clamp bites
        ref.b_in.normal_(0, 0.5)
        ref.b_out.normal_(0, 0.5)
    ref = ref.to(torch.bfloat16)
    packed = PackedExperts(ref)
    packed.bind()
    assert packed.kernels is None and all(isinstance(f, SplitSwiGLU) for f in packed.ffns)
    x, weights, ids = routed(6, 4, 2)
    want = ref(x * 4, weights, ids).float()
    got = packed(x * 4, weights, ids).float()
    assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
    h = torch.nn.functional.linear(x * 4, ref.w_in[0], ref.b_in[0]).float()
    assert h.max() > 7.0  # the clamp bites


@torch.no_grad()
def test_a_routers_weights_are_not_rounded_again() -> None:
    """--quantization int4 and int8 on the cpu backend, int4 on the torch backend and fp8
    hold every linear of a mixture quantized but its router, which stays in the model's
    dtype (model.moe.linear_quantization); `auto` keeps a checkpoint's integer router
    as stored."""
    from torch import nn

    from model.backends.cpu import prepare_model
    from model.backends.fp8 import to_fp8
    from model.backends.int4 import Int4Linear, to_int4
    from model.moe import MoE
    from tests.factories import small_model

    spec = ExpertSpec(n_experts=4, top_k=2, d_ff=256)  # rows of whole K-quant blocks

    def model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
        m = small_model(vocab=96, d_model=256, n_heads=4, d_ff=96, experts=spec)
        return m.to(dtype)

    def mixtures(m: nn.Module) -> list[MoE]:
        return [b.ffn for b in m.layers if isinstance(b.ffn, MoE)]

    for quantization in ("int4", "int8"):
        m = model()
        prepare_model(m, quantization)
        for i, moe in enumerate(mixtures(m)):  # int4's down in 8 bits in layer 1 of 2
            down = "int8g" if quantization == "int4" and i == 1 else quantization
            assert moe.router.quant == "bf16" and moe.experts.kinds == (quantization, down)
            assert moe.experts.ffns[0].w_out.quant == down
    m = model(torch.float32)
    to_int4(m, "int4")
    assert all(type(moe.router) is nn.Linear for moe in mixtures(m))
    assert isinstance(m.layers[0].attn.wo, Int4Linear)
    m = model(torch.float32)
    assert to_fp8(m) > 0 and all(type(moe.router) is nn.Linear for moe in mixtures(m))
    m = model()
    for moe in mixtures(m):
        mark_stored_kind(moe.router.weight, "int4")
    prepare_model(m, "auto")
    assert {moe.router.quant for moe in mixtures(m)} == {"int4"}
