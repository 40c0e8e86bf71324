"""--quantization int8 through the engine: a request's tokens do not depend on what it is
batched with, the logits stay close to bf16's on a checkpoint transformers wrote, and the
settings it cannot run are refused with a reason."""

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

# linears in whole 64-feature blocks, so every one of them is int8
SHAPE = dict(vocab=320, d_model=192, n_heads=6, n_kv_heads=2, d_ff=128)


def test_int8_requests_batched_give_the_tokens_each_gets_alone() -> None:
    model = small_model(**SHAPE).to(torch.bfloat16)
    requests = mixed_requests(10)
    engine = make_engine(model, block_size=16, attention_backend="cpu", quantization="int8")
    assert all(m.int8 for m in model.modules() if isinstance(m, PackedLinear))
    assert model.fused_layers is not None and model.fused_layers.kind == "int8"
    # /v1/models/{id} names what the int8 linears run, not the bf16 kernels' level
    card = engine.backend.describe()
    assert card["linear_isa"] == linear_isa("int8")
    assert card["linears"] == {"int8": sum(1 for m in model.modules() if hasattr(m, "int8"))}
    batched = {rid: tokens_of(outs) for rid, outs in run_all(engine, requests).items()}
    for rid, request in list(requests.items())[:4]:
        alone = make_engine(model, block_size=16, attention_backend="cpu", quantization="int8")
        assert tokens_of(run_all(alone, {rid: request})[rid]) == batched[rid]
    assert engine.blocks.num_used == 0


@torch.no_grad()
def test_int8_logits_stay_close_to_bf16(tmp_path: Path) -> None:
    write_llama(tmp_path, tied=False, intermediate_size=128)
    write_tokenizer(tmp_path)
    models, engines = {}, {}
    for quantization in ("none", "int8"):
        loaded = load(tmp_path, torch.bfloat16, torch.device("cpu"))
        settings = Settings(num_kv_blocks=64, attention_backend="cpu", quantization=quantization)
        engines[quantization] = LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)
        models[quantization] = engines[quantization].model
    assert models["int8"].layers[0].attn.wo.int8
    qkv = models["int8"].layers[0].attn.wqkv  # 96 rows: padded to two 64-feature blocks
    assert qkv.kernel == "int8" and qkv.pad == 32
    card = engines["int8"].backend.describe()
    assert set(card["linears"]) == {"int8"} and card["linear_isa"] == linear_isa("int8")
    gen = torch.Generator().manual_seed(0)
    agree, err, scale = [], [], []
    for _ in range(4):
        ids = torch.randint(0, 384, (64,), generator=gen)
        ref, got = models["none"](ids).float(), models["int8"](ids).float()
        agree.append((ref.argmax(-1) == got.argmax(-1)).float().mean().item())
        err.append((ref - got).abs().mean().item())
        scale.append(ref.std().item())
    # benchmarks/int8_quality.py measures these on every parity checkpoint
    assert sum(agree) / len(agree) > 0.9
    assert sum(err) / len(err) < 0.05 * sum(scale) / len(scale)


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
