"""int4 weights on the torch and Triton backends (model/backends/int4.py): the codes and
scales are the cpu backend's, the Triton W4A16 kernel (int4_linear.py, in the
interpreter here) is the dequantized weight's linear at every row count it branches on,
and a model prepared with int4 or with `auto` on a 4-bit checkpoint gives the torch
reference's logits and tokens."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.audit import weight_bytes
from model.backends.int4 import Int4Experts, Int4Linear, Int4Stack, takes_int4, to_int4
from model.backends.reference import TorchBackend
from model.config import Experts as ExpertSpec
from model.generate import generate
from model.grouped import GROUP, int4_dequantize
from model.int_weights import mark_stored_kind
from model.kv_cache import PagedKVCache
from model.moe import Experts, MoE
from tests.factories import small_model
from tests.model.backends import make_backend

pytestmark = pytest.mark.interpreter


def test_the_codes_are_the_cpu_backends_int4() -> None:
    """Int4Linear's codes, steps and minimums are the cpu backend's quantizer's (its C
    where built) for the same weight, and read back to the same values."""
    from model.backends.cpu.kernels.linear import int4_quantize

    weight = torch.randn(96, 160) * 0.05
    linear = Int4Linear(weight)
    q, d, m = int4_quantize(weight)
    assert linear.codes.shape == (96, 80) and linear.codes.dtype == torch.uint8
    assert torch.equal(linear.codes & 0xF, q[:, 0::2]) and torch.equal(
        linear.codes >> 4, q[:, 1::2]
    )
    assert torch.equal(linear.steps, d) and torch.equal(linear.minimums, m)
    assert torch.equal(linear.dequantized(), int4_dequantize(q, d, m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_triton_kernel_is_the_dequantized_linear(dtype, rows, bias) -> None:
    """One row (the CUDA-core sums), a decode batch and a prefill's rows (tensor-core
    tiles): x times the codes widened, as F.linear of the dequantized weight (the tiles'
    rounded once to x's dtype, the tensor cores' operands); K over two of the kernels'
    reduction steps with a ragged last one, N not a whole tile."""
    from model.backends.triton import int4_linear as kernels

    k = GROUP * (2 * kernels.ROW_TILE[1] + 3)
    n = 2 * kernels.GEMM_TILE[1] + 5
    weight = Int4Linear(torch.randn(n, k) * 0.05, torch.randn(n).to(dtype) if bias else None)
    x = torch.randn(rows, k).to(dtype)
    got = kernels.int4_linear(x, weight.codes, weight.steps, weight.minimums, weight.bias)
    w = weight.dequantized() if rows == 1 else weight.dequantized().to(dtype).float()
    want = F.linear(x.float(), w, weight.bias.float() if bias else None)
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one rounding of an fp32 sum to bf16
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)


def test_int4_takes_the_linears_and_a_tied_head_and_auto_only_4_bit_ones() -> None:
    """--quantization int4: every linear whose in features are whole groups and a tied
    head (a copy: the lookup keeps its table); auto: the weights a checkpoint stores in
    4-bit groups, nothing of a float checkpoint."""
    model = small_model(vocab=96, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, tie_embeddings=True)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert to_int4(model, "auto") == 0
    assert to_int4(model, "int4") == len(linears) + 1
    assert isinstance(model.lm_head, Int4Linear) and model.embed.weight.dtype == torch.float32
    odd = torch.zeros(8, 40)
    mark_stored_kind(odd, "int4")
    assert not takes_int4(odd, "auto")  # 40 in features: not whole groups
    marked = torch.zeros(8, 64)
    mark_stored_kind(marked, "int8")
    assert not takes_int4(marked, "auto") and takes_int4(marked, "int4")
    mark_stored_kind(marked, "int4")
    assert takes_int4(marked, "auto")


def _logits(model, backend, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill of ids then one decode on backend, in a fresh paged cache: both logits."""
    cfg = model.cfg
    cache = PagedKVCache(cfg, 8, 16, torch.float32, "cpu", backend)
    table = [[3, 5]]
    meta = backend.metadata(table, [0], [len(ids)], 16, "cpu", cache.null_block)
    first = model(torch.tensor(ids), meta, cache)
    meta = backend.metadata(table, [len(ids)], [1], 16, "cpu", cache.null_block)
    return first, model(torch.tensor([7]), meta, cache)


SHAPES = {
    "dense": dict(vocab=96, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, tie_embeddings=True),
    "experts": dict(
        vocab=96,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        experts=ExpertSpec(n_experts=4, top_k=2, d_ff=64),
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@torch.no_grad()
def test_a_model_in_int4_gives_the_references_logits_on_triton(shape: str) -> None:
    """The same int4 model (a tied head; a mixture) on the Triton backend, its int4
    linears on int4_linear (a prefill's rows and a decode's one) and its int4 experts in
    the experts' kernels, and on the torch reference's dequantized F.linear and experts:
    the same logits in float32, and the tokens model/generate.py gives on each."""
    torch.manual_seed(0)
    model = small_model(**SHAPES[shape])
    triton = make_backend("triton", model.cfg)
    reference = TorchBackend("cpu")
    ids = [5, 17, 33, 2, 90, 41, 8, 64, 12, 3, 77, 30, 19, 55, 1, 6, 22, 49, 71, 10]
    triton_model = small_model(**SHAPES[shape])
    triton_model.load_state_dict(model.state_dict())
    assert reference.prepare(model, "int4") and triton.prepare(triton_model, "int4")
    for moe in (m for m in triton_model.modules() if isinstance(m, MoE)):
        assert isinstance(moe.experts, triton.moe.TritonExperts)
        assert isinstance(moe.experts.w_in, Int4Stack) and isinstance(moe.experts.w_out, Int4Stack)
    assert reference.describe()["linears"] == triton.describe()["linears"]
    routers = {"torch"} if shape == "experts" else set()  # a mixture's router not rounded
    assert set(triton.describe()["linears"]) == {"int4"} | routers
    kernels = {m.kernel for m in triton_model.modules() if isinstance(m, Int4Linear)}
    assert kernels == {triton.int4_linear.int4_linear}
    for want, got in zip(_logits(model, reference, ids), _logits(triton_model, triton, ids)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    tokens = [
        list(generate(m, ids, 6, backend=b))
        for m, b in ((model, reference), (triton_model, triton))
    ]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_held_bytes_count_the_codes_and_scales(shape: str) -> None:
    """The torch backend's held_bytes, under int4: 5/8 of a byte a quantized weight (its
    codes, float16 step and minimum each 32: the linears, a mixture's expert stacks, not its
    routers), every other parameter as it is."""
    model = small_model(**(SHAPES[shape] | dict(tie_embeddings=False)))
    backend = TorchBackend("cpu")
    routers = {id(m.router) for m in model.modules() if isinstance(m, MoE)}
    weights = sum(m.weight.numel() for m in model.modules()
                  if type(m) is nn.Linear and id(m) not in routers)  # fmt: skip
    weights += sum(s.numel() for m in model.modules() if isinstance(m, Experts)
                   for s in (m.w_in, m.w_out))  # fmt: skip
    before = backend.held_bytes(model)
    assert backend.prepare(model, "int4")
    assert backend.held_bytes(model) == before - 4 * weights + weights * 5 // 8
    # the audit's count (kvserve plan, /v1/models) is what the GPU's backends hold
    assert backend.held_bytes(model) == weight_bytes(model.cfg, "float32", "int4", mix=False)


def test_auto_holds_a_checkpoints_4_bit_expert_stacks_in_int4() -> None:
    """Under auto a stack the checkpoint stores in 4-bit groups is int4 (a GGUF's Q4_K
    gate | up), the other kept as loaded (its Q6_K down); the reference's experts run on
    the dequantized codes, which equal the checkpoint's 4-bit values."""
    model = small_model(**SHAPES["experts"])
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    with torch.no_grad():  # 4-bit values: 16 levels a group of 32
        levels = torch.randint(0, 16, moe.experts.w_in.shape).float()
        moe.experts.w_in.copy_((levels - 8) / 128)
    w_in, w_out = moe.experts.w_in.detach().clone(), moe.experts.w_out
    mark_stored_kind(moe.experts.w_in, "int4")
    assert to_int4(model, "auto") == 1
    assert isinstance(moe.experts, Int4Experts) and moe.experts.w_out is w_out
    assert torch.equal(torch.stack([moe.experts.w_in.expert(e) for e in range(4)]), w_in)
