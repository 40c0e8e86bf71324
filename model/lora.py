"""PEFT LoRA adapters on kvserve's linears, and their deltas for each row of a batch.

An adapter folder as `peft` writes it (adapter_config.json, adapter_model.safetensors)
adapts some of a decoder layer's projections: q, k, v, o, gate, up, down. kvserve fuses
q/k/v into one linear and gate/up into another (model/weights.py's name tables say which
checkpoint tensors make each), so an adapter becomes, for each of our linears it touches,
one low-rank pair: A (R, in) stacking the adapted projections' A matrices, and B (out, R)
placing each projection's B (its scaling folded in) at that projection's rows, zero
elsewhere. The delta of a row x is then B @ (A @ x) for any mix of adapted projections.

A bank holds several adapters at once, each in a slot of padded stacks; the delta of a
flattened batch takes each row's slot (-1: the base model, no delta). `lora_delta` is the
torch reference of that gathered product (Punica's BGMV: a gather of each row's pair,
then two thin products).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from model.audit import layer_linear_shapes
from model.config import ModelConfig
from model.weights import FUSED_ROWS, NAME_TABLES

# our linears an adapter may adapt, in a decoder layer (audit.layer_linear_shapes' order)
LINEARS = ("attn.wqkv", "attn.wo", "ffn.w_in", "ffn.w_out")
PREFIX = "base_model.model."  # peft's name for the model it wraps


class AdapterError(ValueError):
    """An adapter kvserve cannot serve on this model, with the reason."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    rank: int  # the largest of its projections' ranks
    # our linear's name ("layers.3.attn.wqkv") -> (A (R, in), B (out, R), scaling in B)
    linears: dict[str, tuple[Tensor, Tensor]]


def read_adapter(path: str | Path, cfg: ModelConfig, name: str, max_rank: int) -> LoraAdapter:
    """The PEFT adapter at `path` (a folder) for a model of `cfg`, as float32 pairs on our
    linears; AdapterError naming what it asks that kvserve cannot serve."""
    root = Path(path)
    config = _config(root)
    tensors = _tensors(root)
    used: set[str] = set()
    linears: dict[str, tuple[Tensor, Tensor]] = {}
    rank = 0
    for i, linear in _linears(cfg):
        pair = _pair(_parts(cfg, i, linear), _shape(cfg, linear)[1], tensors, config, used)
        if pair is not None:
            linears[f"layers.{i}.{linear}"] = pair[0]
            rank = max(rank, pair[1])
    _check(root, tensors, used, linears, rank, max_rank, cfg)
    return LoraAdapter(name, rank, linears)


def _config(root: Path) -> dict[str, Any]:
    file = root / "adapter_config.json"
    if not file.is_file():
        raise AdapterError(f"{root}: no adapter_config.json (a PEFT adapter folder is needed)")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{root}: peft_type {config['peft_type']!r}; only LORA is served")
    refused = {
        "use_dora": "DoRA's magnitude vectors",
        "modules_to_save": "fully trained modules (modules_to_save)",
        "fan_in_fan_out": "weights stored (in, out) (fan_in_fan_out)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{root}: {what} are not served, only LoRA's A and B")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{root}: bias {config['bias']!r}: trained biases are not served")
    return config


def _tensors(root: Path) -> dict[str, Tensor]:
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{root}: no adapter_model.safetensors")
    return {k: v.float() for k, v in load_file(str(file)).items()}


def _linears(cfg: ModelConfig) -> list[tuple[int, str]]:
    """(layer, linear) of every linear an adapter may adapt (a mixture's layers have no
    dense FFN: their experts are not adapted)."""
    return [
        (i, linear)
        for i in range(cfg.n_layers)
        for linear in LINEARS
        if not (linear.startswith("ffn.") and cfg.sparse(i))
    ]


def _parts(cfg: ModelConfig, layer: int, linear: str) -> list[tuple[str, slice]]:
    """The checkpoint modules whose outputs make our linear in `layer`, each with its
    rows in our linear's output."""
    table = NAME_TABLES.get(cfg.architecture)
    if table is None:
        raise AdapterError(f"LoRA adapters are not served on {cfg.architecture} models yet")
    sources = table.names[f"layers.{{i}}.{linear}.weight"]
    rows = FUSED_ROWS[linear](cfg) if linear in FUSED_ROWS else [None]
    if len(rows) != len(sources):  # one tensor holds the fused rows (Phi-3's qkv_proj)
        rows = [None]
    out, start = [], 0
    for source, n in zip(sources, rows, strict=True):
        module = source.replace("{i}", str(layer)).removesuffix(".weight")
        out.append((module, slice(start, None if n is None else start + n)))
        start += n or 0
    return out


def _pair(
    parts: list[tuple[str, slice]],
    out: int,
    tensors: dict[str, Tensor],
    config: dict[str, Any],
    used: set[str],
) -> tuple[tuple[Tensor, Tensor], int] | None:
    """Our linear's (A, B), B of its `out` rows, from its adapted parts, and their largest
    rank (None: none adapted)."""
    found = []
    for module, rows in parts:
        a_key, b_key = (f"{PREFIX}{module}.lora_{x}.weight" for x in "AB")
        if a_key in tensors and b_key in tensors:
            used.update((a_key, b_key))
            a, b = tensors[a_key], tensors[b_key]
            found.append((rows, a, b * _scaling(module, a.shape[0], config)))
    if not found:
        return None
    width = found[0][1].shape[1]
    total = sum(a.shape[0] for _, a, _ in found)
    a_all, b_all = torch.zeros(total, width), torch.zeros(out, total)
    at = 0
    for rows, a, b in found:
        r = a.shape[0]
        a_all[at : at + r] = a
        b_all[rows.start : rows.start + b.shape[0], at : at + r] = b
        at += r
    return (a_all, b_all), max(a.shape[0] for _, a, _ in found)


def _scaling(module: str, rank: int, config: dict[str, Any]) -> float:
    """peft's scaling of one module: its alpha (alpha_pattern's where a key matches the
    module's name) over its rank, or over the rank's root under rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            alpha = value
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check(
    root: Path,
    tensors: dict[str, Tensor],
    used: set[str],
    linears: dict[str, tuple[Tensor, Tensor]],
    rank: int,
    max_rank: int,
    cfg: ModelConfig,
) -> None:
    left = sorted(set(tensors) - used)
    if left:
        raise AdapterError(
            f"{root}: {left[0]} adapts a module kvserve does not serve adapters on (the "
            "decoder layers' q, k, v, o, gate, up and down projections are)"
        )
    if not linears:
        raise AdapterError(f"{root}: the adapter adapts none of the model's projections")
    if rank > max_rank:
        raise AdapterError(f"{root}: rank {rank} is over --max-lora-rank {max_rank}")
    reordered = cfg.rotary < cfg.head_dim  # q/k rows in kvserve's order (_reorder_rotary)
    if reordered and any(name.endswith("attn.wqkv") for name in linears):
        raise AdapterError(f"{root}: q/k/v adapters on a partially rotated model are not served")


class LoraBank:
    """Adapters in `slots` slots, each linear's pairs in padded stacks (S, R, in) and
    (S, out, R), R the widest pair an adapter of --max-lora-rank can have there."""

    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, device, dtype) -> None:
        self.a: dict[str, Tensor] = {}
        self.b: dict[str, Tensor] = {}
        self.names: list[str | None] = [None] * slots
        for i, linear in _linears(cfg):
            n_in, n_out = _shape(cfg, linear)
            width = len(_parts(cfg, i, linear)) * max_rank
            key = f"layers.{i}.{linear}"
            self.a[key] = torch.zeros(slots, width, n_in, device=device, dtype=dtype)
            self.b[key] = torch.zeros(slots, n_out, width, device=device, dtype=dtype)

    def load(self, adapter: LoraAdapter, slot: int) -> None:
        """`adapter` into `slot`, every linear it leaves alone zero there."""
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][slot].zero_()
            if key in adapter.linears:
                pa, pb = adapter.linears[key]
                a[slot, : pa.shape[0]] = pa
                self.b[key][slot, :, : pb.shape[1]] = pb
        self.names[slot] = adapter.name

    def delta(self, linear: str, x: Tensor, slots: Tensor) -> Tensor:
        return lora_delta(x, self.a[linear], self.b[linear], slots)


def _shape(cfg: ModelConfig, linear: str) -> tuple[int, int]:
    """(in, out) features of our linear."""
    return dict(zip(LINEARS, layer_linear_shapes(cfg), strict=True))[linear]


def lora_delta(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    """Each row's delta, B[slot] @ (A[slot] @ x) (a row of slot -1: zero), for x (T, in),
    stacks a (S, R, in) and b (S, out, R), slots (T,): the gathered product, in float32,
    returned in x's dtype."""
    take = slots.clamp(min=0)
    low = torch.einsum("tri,ti->tr", a[take].float(), x.float())
    out = torch.einsum("tor,tr->to", b[take].float(), low)
    return (out * (slots >= 0).unsqueeze(1)).to(x.dtype)
