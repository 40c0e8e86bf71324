"""`kvserve serve` chooses the engine's backend from the checkpoint's config before it reads
the weights (service/build.py), and the CPU backend packs each decoder layer as the load
reads it (Backend.prepare_layer): the engine has the same packed model and gives the
same tokens as one whose model was loaded whole and packed after."""

from pathlib import Path

import pytest
import torch

from model.backends.cpu.backend import CpuBackend
from model.backends.cpu.packed import PackedExperts, PackedLinear
from model.loader import load
from service.build import build
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import SamplingParams
from tests.factories import write_qwen3_moe, write_tokenizer


def tokens(engine: LLMEngine) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.token_ids
    return out


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_layers_packed_as_they_load_serve_as_the_whole_model_packed_after(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_qwen3_moe(tmp_path, hidden_size=128, moe_intermediate_size=64, intermediate_size=128)
    write_tokenizer(tmp_path)
    settings = Settings(model=str(tmp_path), dtype="bfloat16", quantization=quantization,
                        attention_backend="cpu", block_size=16)  # fmt: skip
    seen: list[object] = []
    loaded = load(tmp_path, torch.bfloat16, torch.device("cpu"), on_layer=seen.append)
    assert seen == list(loaded.model.layers)  # each layer once, in order
    after = LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)
    packed_on_load = []
    prepare_layer = CpuBackend.prepare_layer

    def spy(self, block, quantization="none"):  # type: ignore[no-untyped-def]
        prepare_layer(self, block, quantization)
        packed_on_load.append(isinstance(block.attn.wqkv, PackedLinear))

    monkeypatch.setattr(CpuBackend, "prepare_layer", spy)
    streamed = build(settings).engine
    assert packed_on_load == [True] * len(after.model.layers)
    layers = streamed.model.layers
    assert isinstance(layers[0].ffn.experts, PackedExperts)
    assert isinstance(layers[1].ffn.w_out, PackedLinear)  # the dense layer among them
    assert streamed.runner.backend.linears == after.runner.backend.linears
    assert tokens(streamed) == tokens(after)
