"""AWQ, GPTQ and compressed-tensors integer checkpoints (model/int_weights.py), written as
their own tools write them (tests/int_checkpoints.py; and AutoAWQ's own packer and
unpacking): the loaded weights are the formats' real values exactly, the logits transformers' on those values within 1e-4,
greedy tokens the same on every backend, packed by default in the kind of their bits,
and a variant kvserve cannot read is refused naming it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.backends.cpu import prepare_model
from model.weights import CheckpointError, load_model
from tests.factories import write_llama, write_qwen3_moe
from tests.int_checkpoints import packed_from, quantized, write_compressed, write_packed
from tests.model.backends import BACKENDS, make_backend

# hidden 128 and intermediate 256: groups of 32, 64 and 128 features divide every linear
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PACKED = {
    "awq-g32": ("awq", dict(group=32)),
    "awq-g128": ("awq", dict(group=128)),
    "gptq-sym-g128": ("gptq", dict(group=128, sym=True)),
    "gptq-g64": ("gptq", dict(group=64)),
    "gptq-desc-act-g32": ("gptq", dict(group=32, desc_act=True)),
    "gptq-v2-g32": ("gptq", dict(group=32, v1=False)),
    "gptq-8bit-per-row": ("gptq", dict(bits=8, group=-1, sym=True)),
}
COMPRESSED = {
    "ct-sym-g32": dict(group=32),
    "ct-g64": dict(group=64, sym=False),
    "ct-8bit-per-row": dict(bits=8, group=None),
}


def dense_reference(source: Path, real: dict[str, torch.Tensor], target: Path):  # type: ignore[no-untyped-def]
    """transformers' model of `source` with the quantized weights' real values."""
    import transformers as tf

    tensors = load_file(str(source / "model.safetensors"))
    tensors.update({name: w.contiguous() for name, w in real.items()})
    target.mkdir()
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (target / f.name).write_bytes(f.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(target / "model.safetensors"))
    return tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def packed_checkpoint(case: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """(the checkpoint's folder, the dense reference model) of a case of PACKED or
    COMPRESSED, from a Llama."""
    if case in PACKED:
        method, kw = PACKED[case]
        write_llama(tmp_path / "hf", tied=False, **WIDE)
        real = write_packed(tmp_path / "hf", tmp_path / "packed", method, **kw)
    else:
        model = write_llama(tmp_path / "hf", tied=False, **WIDE)
        real = write_compressed(model, tmp_path / "packed", **COMPRESSED[case])
    return tmp_path / "packed", dense_reference(tmp_path / "packed", real, tmp_path / "dense")


@pytest.mark.parametrize("case", [*PACKED, *COMPRESSED])
@torch.no_grad()
def test_logits_are_transformers_on_the_formats_real_values(case: str, tmp_path: Path) -> None:
    path, ref = packed_checkpoint(case, tmp_path)
    ours = load_model(path)
    down = ref.model.layers[1].mlp.down_proj.weight
    assert torch.equal(ours.layers[1].ffn.w_out.weight, down)  # exact: no rounding at load
    tokens = torch.randint(3, ref.config.vocab_size, (40,))
    assert (ref(tokens[None]).logits[0] - ours(tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ("case", "kind"), [("awq-g128", "int4"), ("gptq-8bit-per-row", "int8g"), ("ct-g64", "int4")]
)
def test_auto_keeps_the_packed_linears_in_their_own_width(
    case: str, kind: str, tmp_path: Path
) -> None:
    """--quantization auto (the server's default) in bf16 on the cpu backend: every
    packed linear in the kind of its bits, the unquantized head in bf16."""
    path, _ = packed_checkpoint(case, tmp_path)
    model = load_model(path, torch.bfloat16)
    prepare_model(model, "auto")
    for block in model.layers:
        linears = (block.attn.wqkv, block.attn.wo, block.ffn.w_in, block.ffn.w_out)
        assert {m.quant for m in linears} == {kind}
    assert model.lm_head.quant == "bf16"


@pytest.mark.parametrize("name", BACKENDS)
@torch.no_grad()
def test_a_gptq_mixture_gives_the_same_greedy_tokens_on_every_backend(
    name: str, tmp_path: Path
) -> None:
    """Qwen3-MoE with every expert GPTQ-packed (activation order): transformers' greedy
    tokens on the real values, on each backend."""
    from model.generate import generate

    real = packed_from(lambda p: write_qwen3_moe(p, mlp_only_layers=[]), tmp_path / "packed",
                       "gptq", group=32, desc_act=True)  # fmt: skip
    ref = dense_reference(tmp_path / "packed", real, tmp_path / "dense")
    assert any(".experts.3.down_proj" in n for n in real)
    ours = load_model(tmp_path / "packed")
    prompt = torch.randint(3, ref.config.vocab_size, (12,))
    ref.generation_config.eos_token_id = None
    want = ref.generate(prompt[None], max_new_tokens=16, do_sample=False,
                        attention_mask=torch.ones(1, 12, dtype=torch.long), pad_token_id=0)  # fmt: skip
    got = list(generate(ours, prompt.tolist(), 16, backend=make_backend(name, ours.cfg)))
    assert got == want[0, 12:].tolist()


REFUSED = {
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
                 "AWQ version 'gemv' is not supported"),
    "gptq 3 bits": ({"quant_method": "gptq", "bits": 3, "group_size": 32},
                    "GPTQ weights of 3 bits are not supported"),
    "gptq marlin": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                     "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
    "gptq group 0": ({"quant_method": "gptq", "bits": 4, "group_size": 0},
                     "GPTQ group_size 0 is not a positive size or -1"),
    "compressed-tensors int-quantized": (
        {"quant_method": "compressed-tensors", "format": "int-quantized"},
        "compressed-tensors format 'int-quantized' is not supported"),
    "hqq": ({"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_variant_kvserve_cannot_read_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    write_llama(tmp_path / "hf", tied=False, **WIDE)
    write_packed(tmp_path / "hf", tmp_path / "packed", "gptq", group=32)
    config_path = tmp_path / "packed" / "config.json"
    config = json.loads(config_path.read_text())
    quantization, message = REFUSED[case]
    config_path.write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(tmp_path / "packed")
    assert "config.json" in str(info.value)


def test_a_packed_weight_missing_a_part_is_refused_naming_it(tmp_path: Path) -> None:
    write_llama(tmp_path / "hf", tied=False, **WIDE)
    write_packed(tmp_path / "hf", tmp_path / "packed", "awq", group=32)
    tensors = load_file(str(tmp_path / "packed" / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.qzeros"]
    save_file(tensors, str(tmp_path / "packed" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.qweight.*no 'qzeros' tensor"):
        load_model(tmp_path / "packed")


@torch.no_grad()
def test_autoawqs_own_packer_and_unpacking_agree(tmp_path: Path) -> None:
    """Every linear packed by AutoAWQ itself (`WQLinear_GEMM.from_linear`): the loaded
    weights are AutoAWQ's own `dequantize_gemm` of the file (its scales taken in float32:
    the real values, exact), and the logits transformers' on them within 1e-4."""
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    write_llama(tmp_path / "hf", tied=False, **WIDE)
    tensors, real, group = load_file(str(tmp_path / "hf" / "model.safetensors")), {}, 64
    for name in [n for n in tensors if quantized(n)]:
        w = tensors.pop(name).float()
        groups = w.reshape(w.shape[0], -1, group)
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).half().float()
        zeros = torch.round(-lo / scales).clamp(0, 15)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.copy_(w)
        packed = WQLinear_GEMM.from_linear(linear, 4, group, scales=scales.T.contiguous(),
                                           zeros=zeros.T.contiguous())  # fmt: skip
        base = name.removesuffix(".weight")
        for part in ("qweight", "qzeros", "scales"):
            tensors[f"{base}.{part}"] = getattr(packed, part).contiguous()
        real[name] = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4,
                                     group).float().T.contiguous()  # fmt: skip
    (tmp_path / "awq").mkdir()
    save_file(tensors, str(tmp_path / "awq" / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config | {"quantization_config": awq}))
    ours = load_model(tmp_path / "awq")
    down = real["model.layers.2.mlp.down_proj.weight"]
    assert torch.equal(ours.layers[2].ffn.w_out.weight, down)
    ref = dense_reference(tmp_path / "awq", real, tmp_path / "dense")
    tokens = torch.randint(3, ref.config.vocab_size, (40,))
    assert (ref(tokens[None]).logits[0] - ours(tokens)).abs().max().item() <= 1e-4
