"""Integer weight checkpoints as vLLM users download them: AWQ, GPTQ and
compressed-tensors' `pack-quantized` (llm-compressor's W4A16), read back to real values.

Every format stores a linear's weight as unsigned integers u of `bits` bits packed into
int32 words (the low bits first), a zero point z and a scale s per group of consecutive
input features, and means w = (u - z) * s:
- AWQ (`quant_method: awq`, its GEMM layout): `qweight` (in, out / 8), each word eight
  output features in the order AWQ_ORDER; `qzeros` (in / group, out / 8) packed the same
  way; `scales` (in / group, out) float16.
- GPTQ (`quant_method: gptq`): `qweight` (in * bits / 32, out), each word consecutive
  input features; `qzeros` (groups, out * bits / 32), consecutive output features, stored
  one below the zero point by the original format (`checkpoint_format: gptq`) and as it
  is by `gptq_v2`; `scales` (groups, out); `g_idx` (in,) the group of each input feature
  (not consecutive with `desc_act`).
- compressed-tensors (`format: pack-quantized`): `weight_packed` (out, in * bits / 32),
  consecutive input features; values and zero points stored with 2^(bits-1) added to
  their signed values (no zero point stored: a symmetric scheme, z = 2^(bits-1));
  `weight_zero_point` (out * bits / 32, groups) packed along the output features;
  `weight_scale` (out, groups), one per row for the channel strategy; `weight_shape`;
  `weight_g_idx` where an activation order was used.
The real values are exact in float32; the load rounds them once, to the serving dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

METHODS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output feature (of eight) in each nibble
BITS = (4, 8)  # widths whose fields never straddle two int32 words
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what its zeros lack


@dataclass(frozen=True, slots=True)
class Packing:
    """How a checkpoint's integer weights are stored (the module docstring)."""

    method: str
    bits: int
    group: int  # input features a scale covers (0: all of them)
    zero_offset: int = 0  # added to the stored zero points (GPTQ's original format)

    def stored(self, name: str) -> dict[str, str]:
        """A weight's stored tensors by role (empty: `name` is not a weight)."""
        if not name.endswith(".weight"):
            return {}
        if self.method == "compressed-tensors":
            roles = ("packed", "scale", "zero_point", "shape", "g_idx")
            return {role: f"{name}_{role}" for role in roles}
        base = name.removesuffix(".weight")
        return {role: f"{base}.{role}" for role in ("qweight", "qzeros", "scales", "g_idx")}

    @property
    def kind(self) -> str:
        """What the cpu backend keeps this packing's weights as (stored_kind)."""
        return "int4" if self.bits == 4 else "int8"

    def marker(self, name: str) -> str | None:
        """The stored tensor whose presence says `name` is packed."""
        stored = self.stored(name)
        return stored.get("packed") or stored.get("qweight")

    def shape(
        self, name: str, shape_of: Callable[[str], tuple[int, ...]], read: Callable[[str], Tensor]
    ) -> tuple[int, int]:
        """The (out, in) shape of packed weight `name`."""
        per = 32 // self.bits
        stored = self.stored(name)
        if self.method == "awq":
            rows, cols = shape_of(stored["qweight"])
            return cols * per, rows
        if self.method == "gptq":
            rows, cols = shape_of(stored["qweight"])
            return cols, rows * per
        out, features = (int(v) for v in read(stored["shape"]).tolist())
        return out, features

    def dequantize(self, name: str, read: Callable[[str], Tensor | None]) -> Tensor:
        """Packed weight `name`'s real values, float32 (out, in); read(tensor name) gives
        a stored tensor, None where the checkpoint has none by that name."""
        stored = {role: read(n) for role, n in self.stored(name).items()}
        if self.method == "awq":
            return self._awq(stored)
        if self.method == "gptq":
            return self._gptq(stored)
        return self._compressed(stored)

    def _awq(self, t: dict[str, Tensor | None]) -> Tensor:
        qweight, qzeros, scales = _need(t, "qweight", "qzeros", "scales")
        order = torch.tensor(AWQ_ORDER).argsort()  # nibble of each output feature
        blocks = torch.arange(0, qweight.shape[1] * 8, 8)[:, None]
        columns = (blocks + order[None, :]).flatten()
        u = unpack(qweight, self.bits, dim=1)[:, columns]
        z = unpack(qzeros, self.bits, dim=1)[:, columns]
        groups = _groups(u.shape[0], scales.shape[0], self.group, None)
        return ((u - z[groups]) * scales.float()[groups]).T.contiguous()

    def _gptq(self, t: dict[str, Tensor | None]) -> Tensor:
        qweight, qzeros, scales = _need(t, "qweight", "qzeros", "scales")
        u = unpack(qweight, self.bits, dim=0)
        z = unpack(qzeros, self.bits, dim=1)[:, : u.shape[1]] + self.zero_offset
        groups = _groups(u.shape[0], scales.shape[0], self.group, t["g_idx"])
        return ((u - z[groups]) * scales.float()[groups]).T.contiguous()

    def _compressed(self, t: dict[str, Tensor | None]) -> Tensor:
        packed, scale, shape = _need(t, "packed", "scale", "shape")
        out, features = (int(v) for v in shape.tolist())
        u = unpack(packed, self.bits, dim=1)[:, :features]
        s = scale.float().reshape(1, 1).expand(out, 1) if scale.numel() == 1 else scale.float()
        z = torch.full(s.shape, 1 << (self.bits - 1), dtype=torch.int32)
        if t["zero_point"] is not None:
            z = unpack(t["zero_point"], self.bits, dim=0)[:out]
        groups = _groups(features, s.shape[1], self.group, t["g_idx"])
        return (u - z[:, groups]) * s[:, groups]


def unpack(words: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words -> their 32 / bits fields (int32, low bits first), each word's fields
    consecutive along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    w = words.to(torch.int32)
    if dim == 0:
        fields = (w[:, None, :] >> shifts[None, :, None]) & mask
        return fields.reshape(w.shape[0] * len(shifts), w.shape[1])
    fields = (w[:, :, None] >> shifts[None, None, :]) & mask
    return fields.reshape(w.shape[0], w.shape[1] * len(shifts))


def _groups(features: int, n_groups: int, group: int, g_idx: Tensor | None) -> Tensor:
    """The group of each input feature: g_idx where stored, else consecutive runs of
    `group` (one run for the whole row when group is 0 or there is one group)."""
    if g_idx is not None:
        groups = g_idx.to(torch.long)
    elif n_groups == 1:
        groups = torch.zeros(features, dtype=torch.long)
    else:
        size = group or -(-features // n_groups)
        groups = torch.arange(features) // size
    if groups.numel() != features or int(groups.max()) >= n_groups or int(groups.min()) < 0:
        raise ValueError(
            f"{n_groups} groups of scales do not cover {features} input features "
            f"(group size {group or 'per row'})"
        )
    return groups


def _need(t: dict[str, Tensor | None], *roles: str) -> list[Tensor]:
    missing = [role for role in roles if t[role] is None]
    if missing:
        raise ValueError(f"packed weight has no {missing[0]!r} tensor")
    return [t[role] for role in roles]  # type: ignore[misc]


def packing_of(hf_config: dict[str, Any]) -> Packing | None:
    """The integer packing a config.json's quantization_config names (None: none of
    METHODS, or compressed-tensors' float formats); a variant kvserve cannot read is a
    ValueError naming it."""
    q = hf_config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method == "awq":
        return _awq_packing(q)
    if method == "gptq":
        return _gptq_packing(q)
    if method == "compressed-tensors" and q.get("format") == "pack-quantized":
        return _compressed_packing(q)
    return None


def _awq_packing(q: dict[str, Any]) -> Packing:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (AWQ checkpoints are: gemm)")
    if not q.get("zero_point", True):
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    bits = _bits(q.get("bits", q.get("w_bit")), (4,), "AWQ")
    return Packing("awq", bits, _group(q.get("group_size", q.get("q_group_size")), "AWQ"))


def _gptq_packing(q: dict[str, Any]) -> Packing:
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(
            f"GPTQ checkpoint_format {fmt!r} is not supported (GPTQ checkpoints are: "
            f"{', '.join(GPTQ_FORMATS)})"
        )
    bits = _bits(q.get("bits"), BITS, "GPTQ")
    return Packing("gptq", bits, _group(q.get("group_size"), "GPTQ"), GPTQ_FORMATS[fmt])


def _compressed_packing(q: dict[str, Any]) -> Packing:
    groups = q.get("config_groups") or {}
    schemes = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
    if not schemes:
        raise ValueError("compressed-tensors pack-quantized config has no config_groups")
    kinds = {(s.get("type"), s.get("num_bits"), s.get("group_size")) for s in schemes}
    if len(kinds) > 1:
        raise ValueError(f"compressed-tensors config groups differ in their weights: {kinds}")
    kind, bits, group = kinds.pop()
    if kind != "int":
        raise ValueError(f"compressed-tensors pack-quantized weights of type {kind!r}")
    strategy = schemes[0].get("strategy")
    if strategy not in ("group", "channel", "tensor"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    size = _group(group, "compressed-tensors") if strategy == "group" else 0
    return Packing("compressed-tensors", _bits(bits, BITS, "compressed-tensors"), size)


def _bits(bits: Any, allowed: tuple[int, ...], what: str) -> int:
    if bits not in allowed:
        raise ValueError(
            f"{what} weights of {bits} bits are not supported ({what}: "
            f"{' or '.join(map(str, allowed))} bits)"
        )
    return int(bits)


def _group(group: Any, what: str) -> int:
    if type(group) is not int or not (group == -1 or group > 0):
        raise ValueError(f"{what} group_size {group!r} is not a positive size or -1")
    return max(group, 0)


# ---- what the cpu backend keeps a stored weight as ---------------------------------
# A weight a checkpoint stores as integers carries the integer kind that keeps its values
# (the load marks the parameter; the cpu backend's --quantization auto packs it so):
# 'int4' where 4-bit groups of 32 with a scale and a minimum hold them (AWQ, GPTQ,
# compressed-tensors 4-bit; GGUF Q4_0, Q4_1, Q4_K), 'int5' where 5-bit ones do (GGUF
# Q5_0, Q5_1, Q5_K), 'int8' for every other integer type.
# A float weight carries none. A parameter fused from several tensors takes the finest
# kind among them (a float part: none).
STORED_KIND = "stored_kind"
# the cpu backend's kernel kinds that keep a stored kind's values, the closest first (the
# first a weight's shape takes is packed): int4, int5 (float16 step and minimum each 32),
# int8g (int8 with a float16 scale each 32 in features: GGUF Q8_0's blocks as they are),
# int8 (a scale a row)
KEEPS = {
    "int4": ("int4", "int8g", "int8"),
    "int5": ("int5", "int8g", "int8"),
    "int8": ("int8g", "int8"),
}
# the stored kinds from coarsest to finest: a fused parameter keeps the finest of its parts'
_FINER = ("int4", "int5", "int8")


def stored_kind(weight: Tensor) -> str | None:
    """The integer kind the load marked `weight` with, or None."""
    return getattr(weight, STORED_KIND, None)


def mark_stored_kind(param: Tensor, kind: str | None) -> None:
    if kind is not None:
        setattr(param, STORED_KIND, kind)


def finest_kind(kinds: list[str | None]) -> str | None:
    """The kind a parameter fused from tensors of `kinds` keeps."""
    if not kinds or None in kinds:
        return None
    return max(kinds, key=_FINER.index)
