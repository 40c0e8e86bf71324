"""--quantization int8 and int4 through the engine: a request's tokens do not depend on
what it is batched with, the logits stay close to bf16's on a checkpoint transformers
wrote, and the settings they cannot run are refused with a reason."""

from pathlib import Path

import pytest
import torch

from model.backends.cpu.kernels.linear import linear_isa
from model.backends.cpu.packed import PackedLinear
from model.loader import load
from service.config import Settings
from service.engine.core.engine import LLMEngine
from tests.engine.core.test_engine import mixed_requests
from tests.engine.helpers import run_all, tokens_of
from tests.factories import make_engine, small_model, write_llama, write_tokenizer

# linears in whole 64-feature blocks, so every one of them is int8, and of whole 256-feature
# K-quant blocks, so int4 holds them in 4 bits but where its mix takes 8 (model/int4_mix.py)
SHAPE = dict(vocab=320, d_model=256, n_heads=4, n_kv_heads=2, d_ff=256)


QUANTIZED = ["int8", "int4"]
# the kinds each holds: int4 its mix, the head and a more-bits layer's q|k|v and down in
# int8g (model/int4_mix.py; layer 1 of 2 takes more bits)
KINDS = {"int8": {"int8"}, "int4": {"int4", "int8g"}}


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_quantized_requests_batched_give_the_tokens_each_gets_alone(quantization: str) -> None:
    model = small_model(**SHAPE).to(torch.bfloat16)
    requests = mixed_requests(10)
    engine = make_engine(model, block_size=16, attention_backend="cpu", quantization=quantization)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert {m.quant for m in packed} == KINDS[quantization]
    assert model.fused_layers is not None and model.fused_layers.kinds == KINDS[quantization]
    # /v1/models/{id} names what the quantized linears run, not the bf16 kernels' level
    card = engine.backend.describe()
    assert card["linear_isa"] == linear_isa(quantization)
    assert set(card["linears"]) == KINDS[quantization]
    assert sum(card["linears"].values()) == len(packed)
    batched = {rid: tokens_of(outs) for rid, outs in run_all(engine, requests).items()}
    for rid, request in list(requests.items())[:4]:
        alone = make_engine(
            model, block_size=16, attention_backend="cpu", quantization=quantization
        )
        assert tokens_of(run_all(alone, {rid: request})[rid]) == batched[rid]
    assert engine.blocks.num_used == 0


# the mean top-1 agreement with bf16 and the mean |logit error| as a share of the logits'
# spread each must reach (benchmarks/int8_quality.py measures them on more checkpoints)
CLOSE = {"int8": (0.9, 0.05), "int4": (0.75, 0.15)}


@pytest.mark.parametrize("quantization", QUANTIZED)
@torch.no_grad()
def test_quantized_logits_stay_close_to_bf16(quantization: str, tmp_path: Path) -> None:
    # 256 wide (q | k | v and (gate | up) in 4 bits under int4), 8 heads of 8 features
    write_llama(tmp_path, tied=False, hidden_size=256, head_dim=8, intermediate_size=128)
    write_tokenizer(tmp_path)
    models, engines = {}, {}
    for q in ("none", quantization):
        loaded = load(tmp_path, torch.bfloat16, torch.device("cpu"))
        settings = Settings(num_kv_blocks=64, attention_backend="cpu", quantization=q)
        engines[q] = LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)
        models[q] = engines[q].model
    assert models[quantization].layers[0].ffn.w_in.quant == quantization
    qkv = models[quantization].layers[0].attn.wqkv  # 96 rows: padded to two 64-feature blocks
    assert qkv.kernel == quantization and qkv.pad == 32
    card = engines[quantization].backend.describe()
    # int4 holds the 64-wide attention output (rows not whole K-quant blocks) in int5
    assert set(card["linears"]) == KINDS[quantization] | (
        {"int5"} if quantization == "int4" else set()
    )
    assert card["linear_isa"] == linear_isa(quantization)
    gen = torch.Generator().manual_seed(0)
    agree, err, scale = [], [], []
    for _ in range(4):
        ids = torch.randint(0, 384, (64,), generator=gen)
        ref, got = models["none"](ids).float(), models[quantization](ids).float()
        agree.append((ref.argmax(-1) == got.argmax(-1)).float().mean().item())
        err.append((ref - got).abs().mean().item())
        scale.append(ref.std().item())
    least_agreement, most_error = CLOSE[quantization]
    assert sum(agree) / len(agree) > least_agreement
    assert sum(err) / len(err) < most_error * sum(scale) / len(scale)


def test_int8_refuses_fp32_activations_and_other_backends() -> None:
    with pytest.raises(ValueError, match="int8 computes with bfloat16 activations"):
        make_engine(small_model(**SHAPE), attention_backend="cpu", quantization="int8")
    bf16 = small_model(**SHAPE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="runs on the cpu backend's C kernels, not on the torch"):
        make_engine(bf16, attention_backend="torch", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine(bf16, attention_backend="cpu", quantization="fp4")


def test_int8_with_the_auto_backend_names_why_the_cpu_backend_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With int8 weights `auto` is the cpu backend: where its kernels cannot run, the
    error says why, instead of torch (auto's fallback) refusing the weights."""
    import model.backends.cpu as cpu

    monkeypatch.setattr(cpu, "unsupported", lambda *_: "the C kernels did not build (test)")
    bf16 = small_model(**SHAPE).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"quantization int8: .*did not build \(test\)"):
        make_engine(bf16, attention_backend="auto", quantization="int8")
    assert make_engine(bf16, attention_backend="auto").backend.name == "torch"  # no int8
