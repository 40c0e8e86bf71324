"""PEFT LoRA adapter folders read onto kvserve's linears (model/adapters.py serves them).

An adapter folder as `peft` writes it (adapter_config.json, adapter_model.safetensors)
adapts some of a decoder layer's projections: q, k, v, o, gate, up, down. kvserve fuses
q/k/v into one linear and gate/up into another (model/weights.py's name tables say which
checkpoint tensors make each), so an adapter becomes, for each of our linears it touches,
one low-rank pair: A (R, in) stacking the adapted projections' A matrices, and B (out, R)
placing each projection's B (its scaling folded in) at that projection's rows, zero
elsewhere. The delta of a row x is then B @ (A @ x) for any mix of adapted projections.
What kvserve cannot serve is refused naming it (AdapterError).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load
from torch import Tensor

from model.adapters import LoraAdapter, adapted_linears, linear_shape
from model.config import ModelConfig
from model.parallel import Shares
from model.weights import FUSED_ROWS, NAME_TABLES

PREFIX = "base_model.model."  # peft's name for the model it wraps


class AdapterError(ValueError):
    """An adapter kvserve cannot serve on this model, with the reason."""


def read_adapter(path: str | Path, cfg: ModelConfig, name: str, max_rank: int) -> LoraAdapter:
    """The PEFT adapter at `path` (a folder) for a model of `cfg`, as float32 pairs on our
    linears; AdapterError naming what it asks that kvserve cannot serve."""
    root = Path(path)
    config, config_bytes = _config(root)
    tensors, tensor_bytes = _tensors(root)
    used: set[str] = set()
    linears: dict[str, tuple[Tensor, Tensor]] = {}
    rank = 0
    for i, linear in adapted_linears(cfg):
        pair = _pair(_parts(cfg, i, linear), linear_shape(cfg, linear)[1], tensors, config, used)
        if pair is not None:
            linears[f"layers.{i}.{linear}"] = pair[0]
            rank = max(rank, pair[1])
    _check(root, tensors, used, linears, rank, max_rank, cfg)
    digest = hashlib.sha256(config_bytes + tensor_bytes).hexdigest()  # of the bytes read
    return LoraAdapter(name, rank, linears, digest)


def _config(root: Path) -> tuple[dict[str, Any], bytes]:
    """The adapter's config checked for what kvserve cannot serve, and its file's bytes."""
    file = root / "adapter_config.json"
    if not file.is_file():
        raise AdapterError(f"{root}: no adapter_config.json (a PEFT adapter folder is needed)")
    raw = file.read_bytes()
    config = json.loads(raw)
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
    return config, raw


def _tensors(root: Path) -> tuple[dict[str, Tensor], bytes]:
    """The adapter's tensors in float32, and their file's bytes (read once)."""
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{root}: no adapter_model.safetensors")
    raw = file.read_bytes()
    return {k: v.float() for k, v in load(raw).items()}, raw


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


def rank_share(
    linears: dict[str, tuple[Tensor, Tensor]], cfg: ModelConfig, shares: Shares
) -> dict[str, tuple[Tensor, Tensor]]:
    """One tensor-parallel rank's share of an adapter's pairs (model/parallel.py): of a
    column-parallel linear (q|k|v, gate|up) B's rows the rank's outputs, of a
    row-parallel one (o, down) A's columns the rank's inputs, whose partial deltas the
    layer's all-reduce sums with its output's."""
    out = {}
    for key, (a, b) in linears.items():
        linear = key.split(".", 2)[2]  # layers.3.attn.wqkv -> attn.wqkv
        if shares.split(f"{linear}.weight") == "row":
            columns = shares.columns(linear)
            out[key] = (a[:, columns.start : columns.stop], b)
            continue
        sizes = FUSED_ROWS[linear](cfg)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        rows = [range(o + r.start, o + r.stop) for o, r in zip(starts, shares.segments(linear), strict=True)]  # fmt: skip
        out[key] = (a, b[[i for r in rows for i in r]])
    return out
