"""FP8 weights (model/fp8.py, model/backends/fp8.py) on the CPU: the per-row quantization
and its scale layout against a reference written here in plain torch; the Hub's FP8
checkpoint layouts (transformers' FineGrainedFP8 with block scales, `weight_scale_inv`;
per-row `weight_scale`, as FBGEMM's and compressed-tensors' FP8 checkpoints) load to the
weights their scales say; a quantization kvserve cannot read, or FP8 values without
scales, stop the load naming them; a model with FP8 linears (the dequantizing path the
CPU runs) stays close to bf16's logits. The CUDA path (`torch._scaled_mm`) is
tests/engine/exec/test_gpu.py's."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.backends.fp8 import Fp8Linear
from model.backends.reference import TorchBackend
from model.fp8 import dequantize, quantize
from model.weights import CheckpointError, load_model
from tests.factories import write_llama

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def reference_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: scale = the row's largest magnitude / 448."""
    scale = w.abs().max(dim=1, keepdim=True).values / 448.0
    return (w / scale).to(torch.float8_e4m3fn), scale


def test_quantize_is_per_row_and_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen) * torch.logspace(-3, 1, 96)[:, None]
    values, scale = quantize(w)
    want_values, want_scale = reference_rows(w)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (96, 1)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((96,), 448.0))
    back = dequantize(values, scale)
    # 3 mantissa bits: within half a step (2^-4 of the value) where normal, and the
    # subnormal step (2^-9 of the scale) below
    assert ((back - w).abs() <= w.abs() / 16 + scale * 2.0**-9).all()
    zeros = quantize(torch.zeros(2, 4))
    assert torch.equal(zeros[1], torch.ones(2, 1)) and not zeros[0].float().any()


def _as_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] | None) -> dict:
    """src's linears as the Hub ships FP8: e4m3 values and their scales beside them
    (block: FineGrainedFP8's `weight_scale_inv` per block; None: `weight_scale` per row).
    Returns the real values each weight stands for."""
    tensors = load_file(str(src / "model.safetensors"))
    real = {}
    for name in list(tensors):
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEARS:
            continue
        w = tensors[name].float()
        if block is None:
            values, scale = reference_rows(w)
            tensors[name + "_scale"] = scale
            real[name] = values.float() * scale
            tensors[name] = values
            continue
        r, c = block
        rows, cols = math.ceil(w.shape[0] / r), math.ceil(w.shape[1] / c)
        scale = torch.empty(rows, cols)
        values = torch.empty_like(w, dtype=torch.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                part = w[i * r : (i + 1) * r, j * c : (j + 1) * c]
                scale[i, j] = part.abs().max() / 448.0
                values[i * r : (i + 1) * r, j * c : (j + 1) * c] = (part / scale[i, j]).to(
                    torch.float8_e4m3fn
                )
                real_part = values[i * r : (i + 1) * r, j * c : (j + 1) * c].float() * scale[i, j]
                real.setdefault(name, torch.empty_like(w))[
                    i * r : (i + 1) * r, j * c : (j + 1) * c
                ] = real_part
        tensors[name], tensors[name + "_scale_inv"] = values, scale
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        if block is not None
        else {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    )
    (dst / "config.json").write_text(json.dumps(config))
    return real


@pytest.mark.parametrize("block", [(16, 24), None], ids=["block-scale-inv", "row-scale"])
def test_hub_fp8_checkpoints_load_to_the_weights_their_scales_say(
    tmp_path: Path, block: tuple[int, int] | None
) -> None:
    write_llama(tmp_path / "bf16", tied=False)
    real = _as_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8", block)
    model = load_model(tmp_path / "fp8")
    layer = model.layers[1]
    prefix = "model.layers.1."
    q, k, v = (real[f"{prefix}self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    torch.testing.assert_close(layer.attn.wqkv.weight, torch.cat([q, k, v]), rtol=0, atol=0)
    gate, up = real[f"{prefix}mlp.gate_proj.weight"], real[f"{prefix}mlp.up_proj.weight"]
    torch.testing.assert_close(layer.ffn.w_in.weight, torch.cat([gate, up]), rtol=0, atol=0)
    torch.testing.assert_close(
        layer.ffn.w_out.weight, real[f"{prefix}mlp.down_proj.weight"], rtol=0, atol=0
    )


def test_unreadable_quantizations_stop_the_load_naming_them(tmp_path: Path) -> None:
    write_llama(tmp_path / "bf16", tied=False)
    _as_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8", (16, 16))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes", "bits": 4}})
    )
    with pytest.raises(CheckpointError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(tmp_path / "fp8")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"FP8 tensor '{name}' has no scales"):
        load_model(tmp_path / "fp8")


def test_fp8_linears_stay_close_to_bf16(tmp_path: Path) -> None:
    """The decoder layers' linears as Fp8Linear (TorchBackend.prepare): the weights
    each dequantizes to are within FP8's rounding of bf16's, and the logits close (the
    agreement over generated tokens is benchmarks/fp8_quality.py's table)."""
    write_llama(tmp_path, tied=False)
    bf16 = load_model(tmp_path, torch.bfloat16)
    fp8 = load_model(tmp_path, torch.bfloat16)
    assert TorchBackend().prepare(fp8, "fp8")
    linears = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * len(fp8.layers)  # wqkv, wo, w_in, w_out
    assert fp8.lm_head.weight.dtype == torch.bfloat16  # the head stays
    tokens = torch.randint(
        0, bf16.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want, got = bf16(tokens).float(), fp8(tokens).float()
    spread = want.std()
    assert (got - want).abs().mean() < 0.1 * spread
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
