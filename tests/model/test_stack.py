"""The decoder stack as one C call (model/backends/cpu/stack.py) gives the module path's bits, at every
instruction-set level the CPU runs (the `isa` fixture), with bf16 and with int8 weights, and
with a checkpoint's mix of kinds (--quantization auto)."""

import weakref

import pytest
import torch

from model.backends.cpu import prepare_model
from model.backends.cpu.kernels.stack import stack_kernels
from model.config import Experts, LongRope
from model.int_weights import mark_stored_kind
from model.kv_cache import PagedKVCache
from model.metadata import AttentionMetadata
from model.moe import count_experts
from tests.factories import tiny_model
from tests.model.backends import auto_backend

# tile-friendly: linears in multiples of 64 features, head size 32, GQA groups of 3
SHAPE = dict(vocab_size=256, d_model=192, n_heads=6, n_kv_heads=2, d_ff=128, max_position=256)


def stack_model(quantization: str = "none", **overrides: object):
    model = tiny_model(seed=3, n_layers=3, **{**SHAPE, **overrides}).to(torch.bfloat16)
    prepare_model(model, quantization)
    return model


@pytest.fixture(autouse=True)
def _built(isa: str) -> None:
    assert stack_kernels(32, 16, 3) is not None, "no C compiler"


def run_steps(model, cache: PagedKVCache, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """Two sequences through whole-prompt, mixed (decode + chunk) and decode-only steps;
    with a window pool (PagedKVCache.window_blocks), the windowed layers' tables there,
    the blocks behind each step's windows released (the pool's null block)."""
    bs = cache.block_size
    tables = [[5, 0, 9, 2, 7, 10], [3, 8, 1, 6, 4, 11]]
    pooled = [[10, 4, 0, 8, 2, 6], [1, 11, 3, 9, 5, 7]]
    window = model.cfg.sliding_window
    steps = [  # (start, count) per sequence; count 0 leaves it out of the step
        [(0, 21), (0, 9)],
        [(21, 1), (9, 30)],
        [(22, 1), (39, 1)],
        [(23, 1), (40, 1)],
    ]
    outs = []
    for step in steps:
        seqs = [(i, s, n) for i, (s, n) in enumerate(step) if n]
        starts, new = [s for _, s, _ in seqs], [n for _, _, n in seqs]
        meta = AttentionMetadata.paged([tables[i] for i, _, _ in seqs], starts, new, bs)
        if cache.window_blocks:
            own = []
            for i, s, _ in seqs:
                behind = max(0, s - window + 1) // bs
                own.append([cache.window_null_block] * behind + pooled[i][behind:])
            meta.window = AttentionMetadata.paged(own, starts, new, bs)
        ids = torch.cat([tokens[i][s : s + n] for i, s, n in seqs])
        outs.append(model(ids, meta, cache))
    return outs


# Gemma 3: a norm before and after each sublayer, GeGLU, q/k norms, windowed layers with a
# RoPE base of their own beside a global one
GEMMA3 = {
    "norm_placement": "sandwich",
    "ffn": "geglu",
    "qk_norm": "head",
    "sliding_window": 5,
    "global_layers": (1,),
    "local_rope_theta": 1000.0,
}
# Gemma 2: Gemma 3's block without q/k norms, every other layer windowed, soft-capped scores
GEMMA2 = {
    "norm_placement": "sandwich",
    "ffn": "geglu",
    "sliding_window": 5,
    "global_layers": (1,),
    "attn_logit_softcap": 2.5,
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("block_size", [16, 8])
@torch.no_grad()
def test_one_call_gives_the_bits_of_the_modules(
    isa: str, bias: bool, quantization: str, block_size: int
) -> None:
    model = stack_model(quantization, qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias)
    assert model.fused_layers is not None
    assert model.fused_layers.kinds == {"int8" if quantization == "int8" else "bf16"}
    assert_stack_is_the_modules(model, block_size)


# the kinds a checkpoint's tensors keep (model.int_weights.stored_kind), layer by layer:
# qkv, o, (gate | up), down; None: a float tensor (bf16)
MIXED = [("int4",) * 4, ("int8", "int4", "int4", "int8"), (None, "int8", None, "int4")]
# and the kernel kinds auto packs them as (model.int_weights.KEEPS): int8 as int8g
PACKED = [("int4",) * 4, ("int8g", "int4", "int4", "int8g"), ("bf16", "int8g", "bf16", "int4")]


@torch.no_grad()
def test_a_checkpoints_mixed_kinds_take_the_stack(isa: str) -> None:
    """--quantization auto packs each linear in the kind its checkpoint tensor keeps
    (a GGUF Q4_K_M mixes 4-bit, 5/6-bit and float tensors in one layer): every linear
    its own kernel, in the one call, the modules' bits."""
    model = tiny_model(seed=3, n_layers=3, **SHAPE).to(torch.bfloat16)
    for block, kinds in zip(model.layers, MIXED, strict=True):
        linears = (block.attn.wqkv, block.attn.wo, block.ffn.w_in, block.ffn.w_out)
        for linear, kind in zip(linears, kinds, strict=True):
            mark_stored_kind(linear.weight, kind)
    prepare_model(model, "auto")
    got = [
        tuple(m.quant for m in (b.attn.wqkv, b.attn.wo, b.ffn.w_in, b.ffn.w_out))
        for b in model.layers
    ]
    assert got == PACKED
    assert model.fused_layers is not None
    assert model.fused_layers.kinds == {"bf16", "int8g", "int4"}
    assert_stack_is_the_modules(model, 16)


@pytest.mark.parametrize(
    "family",
    [
        {"nope_layers": (1,)},  # SmolLM3: a layer that stores K unrotated
        {"residual_multiplier": 0.22, "attention_multiplier": 0.03},  # Granite
        {"qk_norm": "head"},  # Qwen3: each head of q and k normed before RoPE
        {"norm_placement": "output", "qk_norm": "all"},  # OLMo 2
        {"sliding_window": 8},  # Mistral v0.1: every layer windowed (steps pass it)
        {"sliding_window": 5, "global_layers": (1,)},  # windowed layers beside a global one
        GEMMA3,
        GEMMA2,
    ],
)
@torch.no_grad()
def test_family_variations_take_the_stack(isa: str, family: dict) -> None:
    model = stack_model(**family)
    assert model.fused_layers is not None
    assert_stack_is_the_modules(model, 16)


@pytest.mark.parametrize("quantization", ["none", "int8"])
@torch.no_grad()
def test_gemma3_with_its_window_pool_takes_the_stack(isa: str, quantization: str) -> None:
    """The windowed layers' K/V in their own pool (PagedKVCache.window_data), blocks
    behind the windows released: the modules' bits, and the same pools."""
    model = stack_model(quantization, **GEMMA3)
    assert model.fused_layers is not None
    assert_stack_is_the_modules(model, 16, window_blocks=12)


@torch.no_grad()
def test_partial_rotary_and_long_rope_take_the_stack(isa: str) -> None:
    """Phi-4-mini's rotation (3/4 of each head, LongRoPE) is in the tables the stack
    reads: the same bits as the modules, at positions on both sides of the pretraining
    length (the steps reach 41 tokens)."""
    scaling = LongRope(
        short_factor=tuple(1.0 + 0.1 * i for i in range(12)),
        long_factor=tuple(2.0 + i for i in range(12)),
        original_max_position=24,
        attention_factor=1.1,
    )
    model = stack_model(rotary_dim=24, rope_scaling=scaling)
    assert model.fused_layers is not None
    assert_stack_is_the_modules(model, 16)


# mixtures of experts: 8 experts of 64 features (their (gate | up) in whole 128-row
# blocks), the router's 8 rows padded to a 64-row block, a dense layer among sparse ones
QWEN3_MOE = {"qk_norm": "head", "experts": Experts(8, 2, 64, norm_top_k=True, dense_layers=(1,))}
OLMOE = {"qk_norm": "all", "experts": Experts(8, 3, 64)}


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", [QWEN3_MOE, OLMOE], ids=["qwen3_moe", "olmoe"])
@torch.no_grad()
def test_mixtures_of_experts_take_the_stack(isa: str, quantization: str, family: dict) -> None:
    """Routed by experts.c as the module path routes (the same experts, the same
    weights), each expert's rows through its kernels once a step: the modules' bits."""
    model = stack_model(quantization, **family)
    assert model.fused_layers is not None and len(model.fused_layers.mixtures) in (2, 3)
    assert_stack_is_the_modules(model, 16)


@torch.no_grad()
def test_a_mixture_of_mixed_kinds_takes_the_stack(isa: str) -> None:
    """A Qwen3-MoE GGUF's kinds under --quantization auto: q/k/v int8g (one of them
    6-bit), o int4, experts' (gate | up) int4 and down int8g, the router float: each
    kernel its own in the one call, the modules' bits."""
    model = tiny_model(seed=3, n_layers=3, **{**SHAPE, **QWEN3_MOE}).to(torch.bfloat16)
    for block in model.layers:
        mark_stored_kind(block.attn.wqkv.weight, "int8")
        mark_stored_kind(block.attn.wo.weight, "int4")
        ffn = block.ffn
        experts = getattr(ffn, "experts", None)
        pairs = (experts.w_in, experts.w_out) if experts is not None else (ffn.w_in.weight,)
        for param, kind in zip(pairs, ("int4", "int8")):
            mark_stored_kind(param, kind)
    prepare_model(model, "auto")
    stack = model.fused_layers
    assert stack is not None and len(stack.mixtures) == 2
    assert [moe.experts.kinds for moe in stack.mixtures] == [("int4", "int8g")] * 2
    assert {moe.router.quant for moe in stack.mixtures} == {"bf16"}
    assert_stack_is_the_modules(model, 16)


@torch.no_grad()
def test_the_stack_counts_each_experts_tokens_as_the_modules_do(isa: str) -> None:
    """--expert-metrics' counters (model/moe.py's count_experts): stack.c adds each
    routed token to its expert's count, as the module path does; a dense layer counts
    nothing."""
    model = stack_model(**QWEN3_MOE)
    counts = []
    for fused in (model.fused_layers, None):
        counters = count_experts(model, torch.device("cpu"))
        assert len(counters) == 2  # layers 0 and 2; layer 1 is dense
        stack, model.fused_layers = model.fused_layers, fused
        backend = auto_backend(model.cfg, torch.bfloat16, 16)
        cache = PagedKVCache(model.cfg, 12, 16, torch.bfloat16, "cpu", backend)
        gen = torch.Generator().manual_seed(0)
        run_steps(model, cache, [torch.randint(0, 256, (41,), generator=gen) for _ in range(2)])
        model.fused_layers = stack
        counts.append(torch.stack(counters))
    # the steps run 21 + 9, 1 + 30, then two of 1 + 1 tokens: 65, to their top 2 each
    assert torch.equal(counts[0], counts[1]) and counts[0].sum(dim=1).tolist() == [130, 130]


@torch.no_grad()
def test_a_shared_expert_runs_as_modules(isa: str) -> None:
    """Qwen2-MoE's shared expert behind its gate is not in stack.c: the layers run as
    modules, their experts still one C call each."""
    model = stack_model(experts=Experts(8, 2, 64, shared_d_ff=64))
    assert model.fused_layers is None
    assert all(b.ffn.experts.kernels is not None for b in model.layers)


def assert_stack_is_the_modules(model, block_size: int, window_blocks: int = 0) -> None:
    gen = torch.Generator().manual_seed(0)
    for block in model.layers:  # norms that matter: not ones
        norms = (block.attn.q_norm, block.attn.k_norm, block.attn_norm, block.ffn_norm)
        for norm in (*norms, getattr(block, "post_attn_norm", None)):
            if norm is not None:
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=gen))
    tokens = [torch.randint(0, 256, (41,), generator=gen) for _ in range(2)]
    backend = auto_backend(model.cfg, torch.bfloat16, block_size)

    def cache() -> PagedKVCache:
        return PagedKVCache(
            model.cfg, 12, block_size, torch.bfloat16, "cpu", backend, window_blocks
        )

    fast_cache = cache()
    assert model.fused_layers.takes(
        fast_cache, AttentionMetadata.paged([[0]], [0], [3], block_size)
    )
    fast = run_steps(model, fast_cache, tokens)
    stack, model.fused_layers = model.fused_layers, None
    slow_cache = cache()
    slow = run_steps(model, slow_cache, tokens)
    model.fused_layers = stack
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fast_cache.data, slow_cache.data)
    if window_blocks:
        assert torch.equal(fast_cache.window_data, slow_cache.window_data)
        assert fast_cache.window_data.abs().sum() > 0
    assert fast[0].isfinite().all() and fast[0].std() > 0


@torch.no_grad()
def test_models_and_steps_it_does_not_take_run_as_modules(isa: str) -> None:
    assert stack_model(norm="layernorm").fused_layers is None
    assert stack_model(position="alibi").fused_layers is None
    assert stack_model(norm_placement="post").fused_layers is None
    # head size 32, groups of 3 as above, but 96 + 64 qkv features: padded to 192, which
    # the stack's C code does not cut back
    padded = stack_model(d_model=96, n_heads=3, n_kv_heads=1)
    assert padded.layers[0].attn.wqkv.pad == 32 and padded.fused_layers is None
    model = stack_model()
    fp32_cache = PagedKVCache(
        model.cfg, 4, 16, torch.float32, "cpu", auto_backend(model.cfg, torch.float32)
    )
    meta = AttentionMetadata.paged([[0]], [0], [3], 16)
    assert not model.fused_layers.takes(fp32_cache, meta)
    assert not model.fused_layers.takes(None, AttentionMetadata.dense(3, "cpu"))
    cache = PagedKVCache(
        model.cfg, 4, 16, torch.bfloat16, "cpu", auto_backend(model.cfg, torch.bfloat16)
    )
    assert model.fused_layers.takes(cache, meta)
    gone = weakref.ref(cache)
    del cache  # the model outlives its engine's cache without keeping it
    assert gone() is None
