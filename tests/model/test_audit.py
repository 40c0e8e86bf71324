import pytest
import torch

from model.audit import audit, batch_floor, count_params, kv_bytes_per_token, plan
from model.config import Experts, ModelConfig
from model.transformer import Transformer
from tests.factories import tiny_model

SPEC_123M = ModelConfig(
    vocab_size=50257,
    d_model=768,
    n_layers=12,
    n_heads=12,
    d_ff=2048,
    ffn="swiglu",
    norm="rmsnorm",
    position="rope",
    tie_embeddings=True,
)


def test_spec_123m_figures() -> None:
    p = count_params(SPEC_123M)
    assert p.total == 123_551_232
    assert p.non_embedding == 84_953_856
    assert count_params(SPEC_123M.replace(tie_embeddings=False)).total == 162_148_608
    assert p.per_block == 7_079_424
    assert p.per_block_attention == 2_359_296
    assert p.per_block_ffn == 4_718_592
    assert p.per_block_norms == 1_536


def test_byte_level_toy() -> None:
    toy = ModelConfig(
        vocab_size=256,
        d_model=64,
        n_heads=4,
        n_layers=4,
        d_ff=172,
        position="learned",
        max_position=128,
        norm="rmsnorm",
        ffn="swiglu",
        tie_embeddings=True,
    )
    assert count_params(toy).total == 222_784


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"qk_norm": "head", "d_head": 16},
        {"qk_norm": "all"},
        {"qkv_bias": True},
        {"norm_placement": "output"},
    ],
)
def test_counted_params_are_the_models(overrides: dict) -> None:
    """The count from the config is the built model's, family variations included."""
    model = tiny_model(**overrides)
    assert count_params(model.cfg).total == sum(p.numel() for p in model.parameters())


LLAMA3_70B = ModelConfig(
    vocab_size=128256,
    d_model=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    d_ff=28672,
    max_position=8192,
    rope_theta=500000.0,
    tie_embeddings=False,
)


def test_llama3_70b_kv_bytes_per_token() -> None:
    cfg = LLAMA3_70B
    assert cfg.head_dim == 128
    assert kv_bytes_per_token(cfg, "float16") == 327_680
    report = audit(cfg, "bfloat16", kv_pool_bytes=327_680 * 1000)
    assert report.kv_pool_tokens == 1000
    assert report.weight_bytes == count_params(cfg).total * 2


def test_plan_answers_the_70b_class_question_on_2_4_8_devices_of_80_gb() -> None:
    """Each device holds 1/N of everything but the (replicated) norms, and 1/N of every
    token's K/V; TP=1 does not fit, TP=2 fits 7 sequences of 8,192 tokens."""
    gpu = 80 * 10**9
    counts = count_params(LLAMA3_70B)
    answers = {}
    for n in (1, 2, 4, 8):
        r = plan(LLAMA3_70B, "bfloat16", gpu, 8192, tensor_parallel_size=n)
        assert r["weight_bytes_per_device"] == 2 * (
            (counts.total - counts.norms) // n + counts.norms
        )
        assert r["kv_bytes_per_token_per_device"] == 327_680 // n
        room = gpu - r["weight_bytes_per_device"]
        assert r["kv_tokens"] == max(0, room) // (327_680 // n)
        # per token: 161 all-reduces of 8,192 bf16 values, one all-gather of the logits
        assert r["allreduce_bytes_per_token"] == (0 if n == 1 else 161 * 8192 * 2)
        answers[n] = (r["fits"], r["sequences_of_seq_len"])
    assert answers[1] == (False, 0) and answers[2] == (True, 7)
    assert answers[4][1] == 66 and answers[8][1] == 185


def test_plan_counts_gemma3_windows_as_the_server_holds_them() -> None:
    """Gemma 3 1B at 32,768 tokens: its 4 global layers keep K/V of every token (1 KV
    head of 256: 1,024 bytes a layer and token in bf16), its 22 windowed layers the
    33 blocks of 16 its 512-token window touches; 6x the sequences of global KV."""
    from tests.model.test_config import GEMMA3_1B

    cfg = ModelConfig.from_hf_config(GEMMA3_1B)
    r = plan(cfg, "bfloat16", 24 << 30, 32768)
    assert r["kv_bytes_per_sequence_of_seq_len"] == 4 * 32768 * 1024 + 22 * 33 * 16 * 1024
    assert r["kv_bytes_per_token"] == 26 * 1024
    assert r["sequences_of_seq_len_global_kv"] == r["kv_tokens"] // 32768 == 27
    assert r["sequences_of_seq_len"] == r["kv_room_bytes"] // (4 * 32768 * 1024 + 22 * 528 * 1024)
    assert r["sequences_of_seq_len"] >= 6 * r["sequences_of_seq_len_global_kv"]


MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def test_plan_counts_a_window_in_every_layer_as_the_server_holds_it() -> None:
    """Mistral 7B v0.1 at 32,768 tokens on 80 GB: every layer windowed (4,096), so a
    sequence holds the 257 blocks of 16 its window touches (131,072 bytes a token in
    bf16), 7x the sequences of global KV."""
    cfg = ModelConfig.from_hf_config(MISTRAL_7B_V01)
    r = plan(cfg, "bfloat16", 80 * 10**9, 32768)
    assert r["kv_bytes_per_token"] == 131_072
    assert r["kv_bytes_per_sequence_of_seq_len"] == 257 * 16 * 131_072
    assert r["sequences_of_seq_len_global_kv"] == r["kv_tokens"] // 32768 > 0
    assert r["sequences_of_seq_len"] >= 7 * r["sequences_of_seq_len_global_kv"]


def test_plan_refuses_a_split_the_model_cannot_take() -> None:
    with pytest.raises(ValueError, match="64 attention heads do not split over 3 ranks"):
        plan(LLAMA3_70B, "bfloat16", 80 * 10**9, 8192, tensor_parallel_size=3)


def test_counts_match_real_modules() -> None:
    """The audit's arithmetic equals the parameters the model actually allocates."""
    for cfg in [
        ModelConfig(
            vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, qkv_bias=True
        ),
        ModelConfig(
            vocab_size=97,
            d_model=32,
            n_layers=3,
            n_heads=4,
            d_ff=64,
            norm="layernorm",
            ffn="gelu_tanh",
            position="learned",
            qkv_bias=True,
            attn_out_bias=True,
            mlp_bias=True,
            tie_embeddings=False,
            norm_placement="post",
            max_position=50,
        ),
    ]:
        with torch.device("meta"):
            model = Transformer(cfg)
        assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total


def test_batch_floor_adds_the_prefill_and_each_steps_slower_limit() -> None:
    """SPEC_123M, 4 requests of 10 tokens in and 3 out, bf16: the figures by hand."""
    linear = 2 * 12 * (2_359_296 + 4_718_592)  # the layers' FLOPs per token
    head, per_key = 2 * 50257 * 768, 4 * 12 * 64 * 12
    weights = 2 * (12 * (2_359_296 + 4_718_592 + 1_536) + 768 + 50257 * 768)
    kv = kv_bytes_per_token(SPEC_123M, "bfloat16")
    prefill = 4 * (10 * linear + head + per_key * 55)  # keys: 1 + 2 + ... + 10
    steps = [(4 * (linear + head + per_key * c), weights + 4 * c * kv) for c in (11, 12)]
    for bandwidth, flops in ((1e9, 1e15), (1e15, 1e9), (30e9, 400e9)):
        got = batch_floor(SPEC_123M, "bfloat16", 4, 10, 3, bandwidth, flops)
        want = max(prefill / flops, weights / bandwidth)
        want += sum(max(f / flops, r / bandwidth) for f, r in steps)
        assert got["seconds"] == pytest.approx(want, rel=1e-12)
        assert got["ceiling_tok_s"] == pytest.approx(12 / want, rel=1e-12)
        assert got["prefill_gflop"] == pytest.approx(prefill / 1e9)
        assert got["decode_mb_per_step"] == pytest.approx(steps[0][1] / 1e6)
    # slow reads: every step (the prefill too) takes its reads' time; slow compute: FLOPs'
    reads = batch_floor(SPEC_123M, "bfloat16", 4, 10, 3, 1e9, 1e15)["seconds"]
    assert reads == pytest.approx((weights + sum(r for _, r in steps)) / 1e9)
    compute = batch_floor(SPEC_123M, "bfloat16", 4, 10, 3, 1e15, 1e9)["seconds"]
    assert compute == pytest.approx((prefill + sum(f for f, _ in steps)) / 1e9)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"qkv_bias": True, "tie_embeddings": False}, {"ffn": "gelu", "norm": "layernorm"}],
    ids=["tied", "untied-biased", "mlp"],
)
def test_quantized_weight_bytes_are_the_models(overrides: dict) -> None:
    """--quantization's weight bytes: fp8's are the bytes the torch backend's prepared
    model holds (e4m3 linears, a float32 scale a row, the rest in bf16); int8's are the
    layers' linears and the LM head (for a tied head, a copy) at one byte a weight and
    eight a row (the scale and the VNNI offset int8_pack stores), counted from the
    model's own modules."""
    from torch import nn

    from model.audit import weight_bytes
    from model.backends.reference import TorchBackend

    model = tiny_model(**overrides).to(torch.bfloat16)
    cfg = model.cfg
    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, nn.Linear)]
    weights = sum(m.weight.numel() for m in linears)
    rows = sum(m.out_features for m in linears)
    params = sum(p.numel() for p in model.parameters())
    head = cfg.vocab_size * cfg.d_model
    rest = params - weights - (0 if cfg.tie_embeddings else head)
    int8 = 2 * rest + weights + 8 * rows + head + 8 * cfg.vocab_size
    assert weight_bytes(cfg, "bfloat16", "int8") == int8

    assert TorchBackend().prepare(model, "fp8")
    held = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values()
    fp8 = sum(t.numel() * t.element_size() for t in held)
    assert weight_bytes(cfg, "bfloat16", "fp8") == fp8 < weight_bytes(cfg, "bfloat16")
    assert audit(cfg, "bfloat16", quantization="fp8").as_dict()["weight_bytes"] == fp8


MOE = ModelConfig(
    vocab_size=97,
    d_model=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    d_ff=96,
    experts=Experts(n_experts=8, top_k=2, d_ff=64, shared_d_ff=32, dense_layers=(1,)),
    tie_embeddings=False,
)


def test_a_mixtures_counts_are_its_modules_and_a_token_runs_its_experts() -> None:
    """Two sparse layers (router, 8 experts, a shared expert and its gate) and one dense:
    the total is the built model's; one token runs 2 of the 8 experts of each."""
    with torch.device("meta"):
        model = Transformer(MOE)
    p = count_params(MOE)
    assert p.total == sum(t.numel() for t in model.parameters())
    expert = 3 * 64 * 64
    assert p.total - p.active == 2 * 6 * expert  # the 6 experts a token skips, 2 layers
    assert (
        count_params(MOE.replace(experts=None)).active
        == count_params(MOE.replace(experts=None)).total
    )


def test_a_mixtures_reads_grow_with_the_experts_a_batch_touches() -> None:
    """One token reads its 2 experts a layer; a batch is expected to touch more (each
    expert missed by a row with probability 6/8), all 8 at many rows; the plan's floor is
    one sequence's reads."""
    from model.audit import experts_touched, read_bytes, weight_bytes

    assert experts_touched(MOE, 1) == pytest.approx(2)
    assert experts_touched(MOE, 4) == pytest.approx(8 * (1 - 0.75**4))
    held = weight_bytes(MOE, "bfloat16")
    table = 97 * 64 * 2  # untied: a step reads a row of the lookup table
    assert read_bytes(MOE, "bfloat16") == pytest.approx(held - 2 * 6 * 2 * 3 * 64 * 64 - table)
    assert read_bytes(MOE, "bfloat16", rows=4) > read_bytes(MOE, "bfloat16")
    assert read_bytes(MOE, "bfloat16", rows=1000) == pytest.approx(held - table)
    r = plan(MOE, "bfloat16", 1 << 30, 64, bandwidth=1e9, matmul_flops=1e12)
    assert r["decode_read_bytes_per_device"] == pytest.approx(read_bytes(MOE, "bfloat16"))
    assert r["decode_floor_ms_per_token"] == pytest.approx(1000 * read_bytes(MOE, "bfloat16") / 1e9)
    assert r["prefill_ceiling_tokens_per_s"] == pytest.approx(1e12 / (2 * count_params(MOE).active))


def test_a_mixtures_int8_bytes_are_its_packed_modules() -> None:
    """--quantization int8 packs the experts too (one byte a weight, a scale a row);
    fp8 leaves them in the model's dtype; both leave the routers in it."""
    from torch import nn

    from model.audit import weight_bytes
    from model.moe import Experts as ExpertWeights
    from model.moe import MoE

    with torch.device("meta"):
        model = Transformer(MOE)
    routers = {id(m.router) for m in model.modules() if isinstance(m, MoE)}
    linears = [m for layer in model.layers for m in layer.modules()
               if isinstance(m, nn.Linear) and id(m) not in routers]  # fmt: skip
    stacks = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    weights = sum(m.weight.numel() for m in linears) + sum(
        s.w_in.numel() + s.w_out.numel() for s in stacks
    )
    rows = sum(m.out_features for m in linears) + sum(
        s.w_in.shape[0] * (s.w_in.shape[1] + s.w_out.shape[1]) for s in stacks
    )
    params = sum(t.numel() for t in model.parameters())
    head = MOE.vocab_size * MOE.d_model
    int8 = 2 * (params - weights - head) + weights + 8 * rows + head + 8 * MOE.vocab_size
    assert weight_bytes(MOE, "bfloat16", "int8") == int8
    plain = sum(m.weight.numel() for m in linears)  # fp8: every other nn.Linear, no expert
    fp8 = 2 * params - plain + 4 * sum(m.out_features for m in linears)
    assert weight_bytes(MOE, "bfloat16", "fp8") == fp8


def test_a_step_reads_the_head_once_and_a_row_of_the_lookup_table() -> None:
    """The embedding table is read as the head where it is the head (tied, in bf16 or
    fp8), else a row a token: untied, or tied with a quantized copy as the head (int8 and
    int4, or held bytes that include a copy)."""
    from model.audit import Held, quantized_bytes, read_bytes, weight_bytes

    tied = MOE.replace(experts=None, tie_embeddings=True)
    table = 97 * 64 * 2
    assert read_bytes(tied, "bfloat16") == weight_bytes(tied, "bfloat16")
    assert read_bytes(tied, "bfloat16", "fp8") == weight_bytes(tied, "bfloat16", "fp8")
    int4 = read_bytes(tied, "bfloat16", "int4")
    assert int4 == weight_bytes(tied, "bfloat16", "int4") - table
    held = weight_bytes(tied, "bfloat16") + quantized_bytes(97 * 64, 97, "int4")  # and a copy
    assert read_bytes(tied, "bfloat16", "auto", held=Held(held, head_copy=True)) == held - table
    assert read_bytes(tied, "bfloat16", "auto", held=Held(held)) == held
    untied = tied.replace(tie_embeddings=False)
    assert read_bytes(untied, "bfloat16") == weight_bytes(untied, "bfloat16") - table
