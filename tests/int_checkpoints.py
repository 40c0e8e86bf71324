"""AWQ, GPTQ and compressed-tensors integer checkpoints written from a transformers
checkpoint, for the tests of model/int_weights.py.

AWQ and GPTQ are packed here as their own quantizers pack (AutoAWQ's
`WQLinear_GEMM.from_linear`, AutoGPTQ's `QuantLinear.pack`: loops over the integers, not
the loader's vectorized unpacking), from round-to-nearest integers that the writer keeps
as the reference: each weight's real value (u - z) * s, with s rounded to float16 first
as those formats store it. compressed-tensors checkpoints are written by the
`compressed-tensors` library itself (its quantization config, qparams and
ModelCompressor) and read back by its own decompression."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # from_linear's order_map


def quantized(name: str) -> bool:
    """The checkpoint weights quantized: the decoder layers' linears, not the routers."""
    return ".layers." in name and name.endswith("proj.weight")


def round_to_grid(
    w: torch.Tensor, bits: int, sym: bool, g_idx: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) -> unsigned u (out, in), zero points z (out, G), scales s (out, G) in
    scale_dtype, round to nearest over each group's range; input feature i in group
    g_idx[i]."""
    out = w.shape[0]
    n_groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    z = torch.zeros(out, n_groups, dtype=torch.int32)
    s = torch.zeros(out, n_groups)
    for g in range(n_groups):
        cols = w[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(dim=1) / ((top + 1) / 2 - 0.5)
            zero = torch.full((out,), (top + 1) // 2, dtype=torch.int32)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = (hi - lo) / top
            zero = torch.round(-lo / scale).clamp(0, top).to(torch.int32)
        s[:, g] = scale.to(scale_dtype).float()
        z[:, g] = zero
    s_i, z_i = s[:, g_idx], z[:, g_idx]
    u = torch.round(w / s_i + z_i).clamp(0, top).to(torch.int32)
    return u, z, s.to(scale_dtype)


def pack_awq(u: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing of u (out, in), z and s (out, G)."""
    intweight, zeros = u.T.contiguous(), z.T.contiguous()  # (in, out), (G, out)
    tensors = {"scales": s.T.contiguous().half()}
    for key, ints in (("qweight", intweight), ("qzeros", zeros)):
        packed = torch.zeros(ints.shape[0], ints.shape[1] // 8, dtype=torch.int32)
        for col in range(ints.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= ints[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
        tensors[key] = packed
    return tensors


def pack_gptq(
    u: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor, bits: int, v1: bool
) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing: qweight along the input features, qzeros (one below the zero
    point in the original format) along the output ones."""
    per = 32 // bits
    intweight, zeros = u.T.contiguous(), (z.T - (1 if v1 else 0)).contiguous()
    qweight = torch.zeros(intweight.shape[0] // per, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= (intweight[row * per + j].to(torch.int64) & ((1 << bits) - 1)) << (
                bits * j
            )
    qzeros = torch.zeros(zeros.shape[0], -(-zeros.shape[1] // per), dtype=torch.int64)
    for col in range(zeros.shape[1]):
        qzeros[:, col // per] |= (zeros[:, col].to(torch.int64) & ((1 << bits) - 1)) << (
            bits * (col % per)
        )
    as_int32 = lambda t: (t - ((t >> 31) << 32)).to(torch.int32)  # noqa: E731 (two's complement)
    return {
        "qweight": as_int32(qweight),
        "qzeros": as_int32(qzeros),
        "scales": s.T.contiguous().half(),
        "g_idx": g_idx.to(torch.int32),
    }


def write_packed(
    source: Path,
    target: Path,
    method: str,
    *,
    bits: int = 4,
    group: int = 32,
    sym: bool = False,
    desc_act: bool = False,
    v1: bool = True,
) -> dict[str, torch.Tensor]:
    """An AWQ or GPTQ checkpoint of `source`'s weights in `target`; returns each quantized
    weight's real value (float32 (out, in)) by its checkpoint name."""
    tensors = load_file(str(source / "model.safetensors"))
    out_tensors, real = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if not quantized(name):
            out_tensors[name] = w
            continue
        features = w.shape[1]
        size = features if group == -1 else group
        g_idx = torch.arange(features) // size
        if desc_act:  # the activation order: groups of features in a random order
            g_idx = g_idx[torch.randperm(features, generator=gen)]
        u, z, s = round_to_grid(w.float(), bits, sym, g_idx, torch.float16)
        real[name] = ((u - z[:, g_idx]) * s.float()[:, g_idx]).float()
        base = name.removesuffix(".weight")
        packed = pack_awq(u, z, s) if method == "awq" else pack_gptq(u, z, s, g_idx, bits, v1)
        out_tensors.update({f"{base}.{k}": v for k, v in packed.items()})
    _copy_dir(source, target)
    save_file(out_tensors, str(target / "model.safetensors"))
    q = {"quant_method": method, "bits": bits, "group_size": group}
    if method == "awq":
        q.update(version="gemm", zero_point=True)
    else:
        q.update(sym=sym, desc_act=desc_act, checkpoint_format="gptq" if v1 else "gptq_v2")
    _set_quantization(target, q)
    return real


def write_compressed(
    model, target: Path, *, bits: int = 4, group: int | None = 32, sym: bool = True
) -> dict[str, torch.Tensor]:
    """model (transformers') compressed by the `compressed-tensors` library to
    pack-quantized weights in `target` (group None: one scale per row); returns each
    quantized weight's value by the library's own decompression of the written file."""
    from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    strategy = "channel" if group is None else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=group)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=["lm_head", "re:.*mlp.gate$"])  # fmt: skip
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            groups = w.unflatten(-1, (-1, group or w.shape[1]))
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))
    stored = load_file(str(target / "model.safetensors"))
    real = {}
    for name in stored:
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            part = {k.removeprefix(base.removesuffix("weight")): v for k, v in stored.items()
                    if k.startswith(base + "_")}  # fmt: skip
            real[base] = PackedQuantizationCompressor.decompress(part, scheme)["weight"].float()
    return real


def packed_from(write, target: Path, method: str, **kw: object) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """write_packed of the checkpoint write(folder) writes (a factory of tests/factories.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))
        return write_packed(Path(tmp), target, method, **kw)


def _copy_dir(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, target / f.name)


def _set_quantization(target: Path, q: dict) -> None:
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
