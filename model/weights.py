"""Checkpoint loading: Hugging Face model directories and kvserve's native format.

Each supported family is a NameTable: for every parameter of ours, the checkpoint tensors
it is made of (concatenated along dim 0: q|k|v into one fused projection, gate|up into
one) and whether they are stored transposed (GPT-2's Conv1D). Weights are read one tensor
at a time from the memory-mapped safetensors files and copied straight into a parameter
of the target dtype and device, so no second full copy of the model is ever held. A
mixture's experts are stacked parameters (E, out, in), filled one expert at a time from
each expert's own tensors or from one tensor that stacks them all (gpt-oss's, whose
release stores them in MXFP4: model/mxfp4.py). AWQ, GPTQ and compressed-tensors'
integer weights are unpacked to their real values (model/int_weights.py). A GGUF file (model/gguf.py) is read by
the Hugging Face names of the family it was converted from.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from model import mxfp4
from model.config import ModelConfig
from model.fp8 import SCALE_SUFFIXES, checkpoint_block, dequantize
from model.gguf import GgufFile, is_gguf, open_gguf, served_name
from model.int_weights import Packing, finest_kind, mark_stored_kind, packing_of
from model.layers import rotary_order
from model.parallel import Shares, TensorParallel
from model.transformer import Transformer

NATIVE_CONFIG = "kvserve_config.json"
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class NameTable:
    names: dict[str, tuple[str, ...]]  # our name ({i} = layer) -> checkpoint names, dim-0 concat
    transposed: frozenset[str] = frozenset()  # our names whose sources are stored (in, out)
    optional_prefixes: tuple[str, ...] = ()  # also accept checkpoint names without these
    plus_one: frozenset[str] = frozenset()  # our names stored as w of a (1 + w) norm (Gemma)
    # our (gate | up) names whose one source alternates gate and up outputs (gpt-oss)
    interleaved: frozenset[str] = frozenset()


def _llama_names() -> dict[str, tuple[str, ...]]:
    layer = "model.layers.{i}."
    attn = layer + "self_attn."
    mlp = layer + "mlp."
    return {
        "embed.weight": ("model.embed_tokens.weight",),
        "norm.weight": ("model.norm.weight",),
        "lm_head.weight": ("lm_head.weight",),
        "layers.{i}.attn_norm.weight": (layer + "input_layernorm.weight",),
        "layers.{i}.ffn_norm.weight": (layer + "post_attention_layernorm.weight",),
        "layers.{i}.attn.wqkv.weight": tuple(attn + p + "_proj.weight" for p in "qkv"),
        "layers.{i}.attn.wqkv.bias": tuple(attn + p + "_proj.bias" for p in "qkv"),
        "layers.{i}.attn.wo.weight": (attn + "o_proj.weight",),
        "layers.{i}.attn.wo.bias": (attn + "o_proj.bias",),
        "layers.{i}.ffn.w_in.weight": (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
        "layers.{i}.ffn.w_in.bias": (mlp + "gate_proj.bias", mlp + "up_proj.bias"),
        "layers.{i}.ffn.w_out.weight": (mlp + "down_proj.weight",),
        "layers.{i}.ffn.w_out.bias": (mlp + "down_proj.bias",),
    }


def _gpt2_names() -> dict[str, tuple[str, ...]]:
    h = "transformer.h.{i}."
    names = {
        "embed.weight": ("transformer.wte.weight",),
        "pos_embed.weight": ("transformer.wpe.weight",),
        "norm.weight": ("transformer.ln_f.weight",),
        "norm.bias": ("transformer.ln_f.bias",),
        "lm_head.weight": ("lm_head.weight",),
    }
    for ours, theirs in (
        ("attn_norm", "ln_1"),
        ("ffn_norm", "ln_2"),
        ("attn.wqkv", "attn.c_attn"),
        ("attn.wo", "attn.c_proj"),
        ("ffn.w_in", "mlp.c_fc"),
        ("ffn.w_out", "mlp.c_proj"),
    ):
        for kind in ("weight", "bias"):
            names[f"layers.{{i}}.{ours}.{kind}"] = (f"{h}{theirs}.{kind}",)
    return names


LLAMA = NameTable(names=_llama_names())
QWEN3 = NameTable(
    names=_llama_names()
    | {
        f"layers.{{i}}.attn.{n}.weight": (f"model.layers.{{i}}.self_attn.{n}.weight",)
        for n in ("q_norm", "k_norm")
    }
)
PHI3 = NameTable(  # q|k|v and gate|up each stored as one tensor, in our order
    names=_llama_names()
    | {
        "layers.{i}.attn.wqkv.weight": ("model.layers.{i}.self_attn.qkv_proj.weight",),
        "layers.{i}.ffn.w_in.weight": ("model.layers.{i}.mlp.gate_up_proj.weight",),
    }
)
OLMO2 = NameTable(  # the block's two norms are on the sublayers' outputs
    names=QWEN3.names
    | {
        "layers.{i}.attn_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
        "layers.{i}.ffn_norm.weight": ("model.layers.{i}.post_feedforward_layernorm.weight",),
    }
)
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}
GEMMA3 = NameTable(  # four norms a block and the q/k norms, each stored as w of (1 + w)
    names=QWEN3.names
    | {
        f"layers.{{i}}.{ours}.weight": (f"model.layers.{{i}}.{theirs}.weight",)
        for ours, theirs in _GEMMA_NORMS.items()
    },
    plus_one=frozenset(
        ["norm.weight", "layers.{i}.attn.q_norm.weight", "layers.{i}.attn.k_norm.weight"]
        + [f"layers.{{i}}.{ours}.weight" for ours in _GEMMA_NORMS]
    ),
)
GEMMA3_MULTIMODAL = NameTable(  # the text model inside an image-and-text checkpoint
    names={
        ours: tuple("language_model." + t for t in theirs) for ours, theirs in GEMMA3.names.items()
    },
    plus_one=GEMMA3.plus_one,
)
GPT2 = NameTable(
    names=_gpt2_names(),
    transposed=frozenset(
        f"layers.{{i}}.{n}.weight" for n in ("attn.wqkv", "attn.wo", "ffn.w_in", "ffn.w_out")
    ),
    optional_prefixes=("transformer.",),
)


def _moe_names(
    base: dict[str, tuple[str, ...]], block: str, gate: str, up: str, down: str, router: str
) -> dict[str, tuple[str, ...]]:
    """`base` with a mixture of experts in place of the FFN: each expert's gate, up and
    down projections ({e}: the expert) stacked into our (E, ...) parameters, the router,
    and Qwen2-MoE's shared expert and its gate where a checkpoint has them."""
    moe = f"model.layers.{{i}}.{block}."
    expert = moe + "experts.{e}."
    shared = moe + "shared_expert."
    return base | {
        "layers.{i}.ffn.router.weight": (moe + router + ".weight",),
        "layers.{i}.ffn.experts.w_in": (expert + gate + ".weight", expert + up + ".weight"),
        "layers.{i}.ffn.experts.w_out": (expert + down + ".weight",),
        "layers.{i}.ffn.shared.w_in.weight": (
            shared + "gate_proj.weight",
            shared + "up_proj.weight",
        ),
        "layers.{i}.ffn.shared.w_out.weight": (shared + "down_proj.weight",),
        "layers.{i}.ffn.shared_gate.weight": (moe + "shared_expert_gate.weight",),
    }


QWEN_MOE = NameTable(
    names=_moe_names(QWEN3.names, "mlp", "gate_proj", "up_proj", "down_proj", "gate")
)
MIXTRAL = NameTable(names=_moe_names(LLAMA.names, "block_sparse_moe", "w1", "w3", "w2", "gate"))


def _gpt_oss_names() -> dict[str, tuple[str, ...]]:
    """gpt-oss: Llama's names with biases, a sink per head, the router and every
    expert's weights and biases stacked in one tensor each (MXFP4 in the release's
    files: `_blocks` and `_scales` beside each name, model/mxfp4.py)."""
    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    return _llama_names() | {
        "layers.{i}.attn.sinks": (attn + "sinks",),
        "layers.{i}.ffn.router.weight": (mlp + "router.weight",),
        "layers.{i}.ffn.router.bias": (mlp + "router.bias",),
        "layers.{i}.ffn.experts.w_in": (mlp + "experts.gate_up_proj",),
        "layers.{i}.ffn.experts.b_in": (mlp + "experts.gate_up_proj_bias",),
        "layers.{i}.ffn.experts.w_out": (mlp + "experts.down_proj",),
        "layers.{i}.ffn.experts.b_out": (mlp + "experts.down_proj_bias",),
    }


GPT_OSS = NameTable(  # each expert's weights stored (in, out), its gate and up interleaved
    names=_gpt_oss_names(),
    transposed=frozenset({"layers.{i}.ffn.experts.w_in", "layers.{i}.ffn.experts.w_out"}),
    interleaved=frozenset({"layers.{i}.ffn.experts.w_in", "layers.{i}.ffn.experts.b_in"}),
)


def _gpt_oss_gguf_names() -> dict[str, tuple[str, ...]]:
    """gpt-oss as llama.cpp's converter stores it: each expert stack split into gate, up
    and down (E, out, in), each with its own stack of biases."""
    expert = "model.layers.{i}.mlp.experts.{e}."
    return _gpt_oss_names() | {
        "layers.{i}.ffn.experts.w_in": (expert + "gate_proj.weight", expert + "up_proj.weight"),
        "layers.{i}.ffn.experts.b_in": (expert + "gate_proj.bias", expert + "up_proj.bias"),
        "layers.{i}.ffn.experts.w_out": (expert + "down_proj.weight",),
        "layers.{i}.ffn.experts.b_out": (expert + "down_proj.bias",),
    }


# families a GGUF file stores under other names than their Hugging Face checkpoints
GGUF_NAME_TABLES = {"GptOssForCausalLM": NameTable(names=_gpt_oss_gguf_names())}

NAME_TABLES: dict[str, NameTable] = {
    "LlamaForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": QWEN3,
    "MistralForCausalLM": LLAMA,
    "SmolLM3ForCausalLM": LLAMA,
    "GraniteForCausalLM": LLAMA,
    "Phi3ForCausalLM": PHI3,
    "Olmo2ForCausalLM": OLMO2,
    "Gemma3ForCausalLM": GEMMA3,
    "Gemma3ForConditionalGeneration": GEMMA3_MULTIMODAL,
    "Gemma2ForCausalLM": GEMMA3,  # the same names; its layers have no q/k norms to read
    "GPT2LMHeadModel": GPT2,
    "Qwen3MoeForCausalLM": QWEN_MOE,
    "Qwen2MoeForCausalLM": QWEN_MOE,  # the same names; its layers have no q/k norms to read
    "OlmoeForCausalLM": QWEN_MOE,
    "MixtralForCausalLM": MIXTRAL,
    "GptOssForCausalLM": GPT_OSS,
}

# our parameters that stack every expert's weights (E, out, in): loaded one expert at a
# time, each expert's slice like a dense FFN's weight
EXPERT_STACKS = frozenset(
    {"ffn.experts.w_in", "ffn.experts.w_out", "ffn.experts.b_in", "ffn.experts.b_out"}
)


# Rows each checkpoint tensor contributes to one of our fused parameters (an expert
# stack's: to each expert's slice of it).
FUSED_ROWS: dict[str, Callable[[ModelConfig], list[int]]] = {
    "attn.wqkv": lambda c: [
        c.n_heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.kv_heads * c.head_dim,
    ],
    "ffn.w_in": lambda c: [c.d_ff, c.d_ff] if c.gated else [c.d_ff],
    "ffn.experts.w_in": lambda c: [c.experts.d_ff] * 2,
    "ffn.experts.b_in": lambda c: [c.experts.d_ff] * 2,
    "ffn.shared.w_in": lambda c: [c.experts.shared_d_ff] * 2,
}


def _fused(name: str) -> str | None:
    """The FUSED_ROWS key of parameter `name` (its `layers.{i}.` prefix off), if fused."""
    return next((k for k in FUSED_ROWS if name == k or name.startswith(k + ".")), None)


def _part_rows(cfg: ModelConfig, name: str, n_parts: int, total: int) -> list[int]:
    key = _fused(name)
    if key is not None and len(FUSED_ROWS[key](cfg)) == n_parts:
        return FUSED_ROWS[key](cfg)
    return [total] if n_parts == 1 else [total // n_parts] * n_parts


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def load_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig of a model directory (native or Hugging Face) or GGUF file, with
    generation eos ids."""
    root = Path(model_dir)
    if is_gguf(root):
        return _gguf_config(_open_gguf(root))
    if not root.is_dir():
        raise CheckpointError(f"{root}: model directory not found")
    native = root / NATIVE_CONFIG
    try:
        if native.exists():
            return ModelConfig.from_dict(read_json(native))
        cfg = ModelConfig.from_hf_config(read_json(root / "config.json"))
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        name = NATIVE_CONFIG if native.exists() else "config.json"
        raise CheckpointError(f"{root / name}: {exc}") from None
    gen = root / "generation_config.json"
    if gen.exists():
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            ids = (eos,) if isinstance(eos, int) else tuple(eos)
            cfg = cfg.replace(eos_token_ids=tuple(dict.fromkeys((*ids, *cfg.eos_token_ids))))
    return cfg.replace(name=root.name)


def _open_gguf(path: Path) -> GgufFile:
    try:
        return open_gguf(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _gguf_config(f: GgufFile) -> ModelConfig:
    try:
        cfg = ModelConfig.from_hf_config(f.hf_config())
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{f.path}: {exc}") from None
    eos = tuple(dict.fromkeys((*f.eos_ids(), *cfg.eos_token_ids)))
    return cfg.replace(name=served_name(f.path), eos_token_ids=eos)


def _weight_files(root: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        return {name: root / fname for name, fname in weight_map.items()}
    single = root / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _open(path: Path) -> Any:
    if not path.exists():
        raise CheckpointError(f"{path}: file not found")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


class _Reader:
    """Resolves checkpoint names through a NameTable and reads tensors lazily."""

    def __init__(
        self,
        table: NameTable,
        files: dict[str, Path],
        stack: ExitStack,
        fp8_block: tuple[int, int] | None = None,
        packing: Packing | None = None,
    ) -> None:
        """fp8_block: the block of an FP8 checkpoint's scales (model/fp8.py); packing:
        how an integer checkpoint stores its weights (model/int_weights.py)."""
        self.table, self.files, self.stack = table, files, stack
        self.fp8_block, self.packing = fp8_block, packing
        self.handles: dict[Path, Any] = {}

    def _stored(self, name: str) -> str | None:
        """The stored tensor that holds tensor `name`: itself, its MXFP4 blocks or its
        packed integers (None: not in the checkpoint)."""
        packed = self.packing.marker(name) if self.packing else None
        return next((n for n in (name, name + mxfp4.BLOCKS, packed) if n in self.files), None)

    def resolve(self, name: str) -> str | None:
        if self._stored(name) is not None:
            return name
        for prefix in self.table.optional_prefixes:
            if name.startswith(prefix) and self._stored(name.removeprefix(prefix)) is not None:
                return name.removeprefix(prefix)
        return None

    def stored_kind(self, name: str) -> str | None:
        """The integer kind that keeps checkpoint tensor `name` (model.int_weights.stored_kind):
        its packing's for a packed weight, None for a float one."""
        packed = self.packing is not None and self.packing.marker(name) in self.files
        return self.packing.kind if packed else None

    def where(self, name: str) -> Path:
        """The file that holds tensor `name` (for errors)."""
        return self.files[self._stored(name) or name]

    def _handle(self, name: str) -> Any:
        path = self.where(name)
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(_open(path))
        return self.handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        if name + mxfp4.BLOCKS in self.files:  # (..., out, G, 16) blocks of (..., in, out)
            *lead, out, groups, _ = self.shape(name + mxfp4.BLOCKS)
            return (*lead, groups * 32, out)
        if name not in self.files and self.packing is not None:
            packing = self.packing
            return self._guarded(
                self._stored(name) or name, lambda: packing.shape(name, self.shape, self._whole)
            )
        return self._guarded(name, lambda: tuple(self._handle(name).get_slice(name).get_shape()))

    def _whole(self, name: str) -> torch.Tensor:
        return self._guarded(name, lambda: self._handle(name).get_tensor(name))

    def read(
        self,
        name: str,
        rows: range | None = None,
        cols: range | None = None,
        expert: int | None = None,
    ) -> torch.Tensor:
        """The tensor, or only its rows / columns in those ranges (read from the file
        alone: a tensor-parallel rank reads its share); expert: of a tensor that stacks
        every expert's (E, out, in), that expert's. An MXFP4 tensor (its `_blocks` and
        `_scales` stored) reads as the bf16 form transformers saves: (..., in, out); an
        integer checkpoint's packed weight as its real values (float32)."""
        if name + mxfp4.BLOCKS in self.files:
            return self._mxfp4(name, expert)[_index(None, rows, cols)]
        if name not in self.files:
            return self._unpacked(name)[_index(expert, rows, cols)]

        def get() -> torch.Tensor:
            if rows is None and cols is None and expert is None:
                return self._handle(name).get_tensor(name)
            part = self._handle(name).get_slice(name)
            return part[_index(expert, rows, cols)]

        if self._guarded(name, lambda: self._handle(name).get_slice(name).get_dtype()) in (
            "F8_E4M3",
            "F8_E5M2",
        ):
            whole = self._fp8(name)
            return whole[_index(expert, rows, cols)]
        return self._guarded(name, get)

    def _mxfp4(self, name: str, expert: int | None) -> torch.Tensor:
        """An MXFP4 tensor's real values (float32), of one expert where given, (in, out)."""
        blocks, scales = name + mxfp4.BLOCKS, name + mxfp4.SCALES
        if scales not in self.files:
            raise CheckpointError(f"{self.files[blocks]}: MXFP4 tensor {blocks!r} has no scales")
        at = (expert,) if expert is not None else ()
        b = self._guarded(blocks, lambda: self._handle(blocks).get_slice(blocks)[at])
        s = self._guarded(scales, lambda: self._handle(scales).get_slice(scales)[at])
        return self._guarded(blocks, lambda: mxfp4.dequantize(b, s)).transpose(-1, -2)

    def _unpacked(self, name: str) -> torch.Tensor:
        """An integer checkpoint's weight, its real values (float32)."""
        assert self.packing is not None
        packing = self.packing
        stored = self._stored(name) or name
        return self._guarded(
            stored,
            lambda: packing.dequantize(name, lambda n: self._whole(n) if n in self.files else None),
        )

    def _fp8(self, name: str) -> torch.Tensor:
        """An FP8 tensor's real values (float32), by the scales stored beside it."""
        scale = next((name + s for s in SCALE_SUFFIXES if name + s in self.files), None)
        if scale is None:
            raise CheckpointError(f"{self.files[name]}: FP8 tensor {name!r} has no scales")
        block = self.fp8_block if scale.endswith("_scale_inv") else None
        values = self._guarded(name, lambda: self._handle(name).get_tensor(name))
        scales = self._guarded(scale, lambda: self._handle(scale).get_tensor(scale))
        return self._guarded(name, lambda: dequantize(values, scales, block))

    def _guarded(self, name: str, fn: Callable[[], Any]) -> Any:
        """fn(), its failure a CheckpointError naming the file and tensor."""
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"{self.files[name]}: cannot read tensor {name!r} ({exc})"
            ) from None


class _Tensors(_Reader):
    """A _Reader over tensors already in memory, by our own parameter names."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(NameTable(names={}), dict.fromkeys(tensors, Path("<memory>")), ExitStack())
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(
        self,
        name: str,
        rows: range | None = None,
        cols: range | None = None,
        expert: int | None = None,
    ) -> torch.Tensor:
        return self.tensors[name][_index(expert, rows, cols)]


def _index(expert: int | None, rows: range | None, cols: range | None) -> tuple[int | slice, ...]:
    """The index of a tensor's part: its expert (of a stack), rows, columns (none given:
    the whole tensor, and a 1-D one takes rows alone)."""
    index: tuple[int | slice, ...] = () if expert is None else (expert,)
    index += (slice(None) if rows is None else slice(rows.start, rows.stop),)
    if cols is not None:
        index += (slice(cols.start, cols.stop),)
    return index


# the config fields that set a parameter's shape, by a piece of its name
_SHAPE_FIELDS = (
    ("wqkv", ("n_heads", "n_kv_heads", "d_head", "d_model")),
    ("wo", ("n_heads", "d_head", "d_model")),
    ("experts", ("experts", "d_model")),
    ("ffn", ("d_ff", "d_model")),
    ("pos_embed", ("max_position", "d_model")),  # before "embed": a substring of it
    ("embed", ("vocab_size", "d_model")),
    ("lm_head", ("vocab_size", "d_model")),
)


def _shape_fields(cfg: ModelConfig, name: str) -> str:
    fields = next((f for key, f in _SHAPE_FIELDS if key in name), ("d_model",))
    return cfg.describe(*fields)


@dataclass(frozen=True, slots=True)
class _Part:
    """Rows `rows` (and columns `cols`) of checkpoint tensor `source`, in our orientation
    (out, in): one piece of a parameter, or of this rank's share of it."""

    source: str
    full: tuple[int, ...]  # the source's shape as we expect it (ours, not transposed)
    rows: range | None = None
    cols: range | None = None
    expert: int | None = None  # of a source stacking every expert's (E, out, in): this one
    interleaved: bool = False  # the source alternates gate and up outputs (gpt-oss)


def _parts(
    cfg: ModelConfig,
    key: str,
    sources: list[str],
    full: tuple[int, ...],
    shares: Shares | None,
    expert: int | None = None,
    interleaved: bool = False,
) -> list[_Part]:
    """The pieces of parameter `key` (its `layers.{i}.` prefix off; full: its unsplit
    shape) that this process holds, in row order. Fused parameters concatenate their
    sources' rows; a rank takes its rows of every fused segment (q | k | v, gate | up),
    its columns of a row-parallel weight, its rows of the vocab. expert: the index of
    the parameter's expert in sources that stack every expert's (_Part.expert);
    interleaved: the source alternates gate and up outputs (_Part.interleaved)."""
    return [
        dataclasses.replace(p, expert=expert, interleaved=interleaved)
        for p in _pieces(cfg, key, sources, full, shares)
    ]


def _pieces(
    cfg: ModelConfig, key: str, sources: list[str], full: tuple[int, ...], shares: Shares | None
) -> list[_Part]:
    rows = _part_rows(cfg, key, len(sources), full[0])
    split = shares.split(key) if shares is not None else "replicated"
    if shares is None or split in ("replicated", "row_bias"):  # the whole tensor
        return [_Part(s, (n, *full[1:])) for s, n in zip(sources, rows, strict=True)]
    if split == "column":
        segments = FUSED_ROWS[_fused(key) or key](cfg)
        if len(sources) == 1:  # one tensor holds every segment (GPT-2's c_attn)
            offsets = [sum(segments[:i]) for i in range(len(segments))]
            src = [(sources[0], (full[0], *full[1:]))] * len(segments)
        else:
            offsets = [0] * len(segments)
            src = [(s, (n, *full[1:])) for s, n in zip(sources, segments, strict=True)]
        return [
            _Part(s, shape, range(o + r.start, o + r.stop))
            for (s, shape), o, r in zip(src, offsets, shares.segments(key), strict=True)
        ]
    if split == "row":
        return [_Part(sources[0], full, None, shares.columns(key))]
    if split == "vocab":
        return [_Part(sources[0], full, shares.vocab)]
    if split == "sinks":  # one per head: the rank's heads'
        return [_Part(sources[0], full, shares.heads)]
    return [_Part(sources[0], full, shares.head_features(key))]  # "heads"


def _fill(
    target: torch.Tensor, parts: list[_Part], reader: _Reader | GgufFile, transpose: bool, hint: str
) -> None:
    """Copy the parts into consecutive rows of `target` (rows past them stay zero: the
    vocab padding of a tensor-parallel rank)."""
    start = 0
    for p in parts:
        stored = reader.shape(p.source)
        stored = stored[1:] if p.expert is not None else stored
        if (stored[::-1] if transpose else stored) != p.full:
            want = p.full[::-1] if transpose else p.full
            raise CheckpointError(
                f"{reader.where(p.source)}: tensor {p.source!r} has shape {stored}, expected "
                f"{want} from {hint}"
            )
        rows, cols = (p.cols, p.rows) if transpose else (p.rows, p.cols)
        if p.interleaved:  # the whole source, gate then up along its outputs, then the part
            whole = reader.read(p.source, None, None, p.expert)
            whole = torch.cat([whole[..., 0::2], whole[..., 1::2]], dim=-1)
            part = whole[_index(None, rows, cols)]
        else:
            part = reader.read(p.source, rows, cols, p.expert)
        if transpose:
            part = part.t()
        target[start : start + part.shape[0]].copy_(part)
        start += part.shape[0]


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> nn.Parameter:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    param = nn.Parameter(value, requires_grad=False)
    setattr(module, leaf, param)
    return param


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallel | None = None,
    on_layer: Callable[[nn.Module], None] | None = None,
) -> Transformer:
    """Load a native or Hugging Face model directory or a GGUF file; with `tp`, this
    rank's share of it, reading only that share of each tensor; on_layer(block): each
    decoder layer as soon as it is read (a backend's prepare_layer)."""
    root = Path(model_dir)
    with _checkpoint(root) as (cfg, reader, table, label):
        return _populate(cfg, reader, table, tp, dtype, torch.device(device), root, label,
                         on_layer)  # fmt: skip


@contextmanager
def _checkpoint(
    root: Path,
) -> Iterator[tuple[ModelConfig, _Reader | GgufFile, NameTable | None, str]]:
    """A checkpoint opened for reading: its config, the reader of its tensors, its name
    table (None: kvserve's native names) and where its shapes come from (for errors). A
    GGUF file's: read by their Hugging Face names (model/gguf.py), its errors
    CheckpointErrors, its dequantized tensors dropped after."""
    if is_gguf(root):
        f = _open_gguf(root)
        cfg = _gguf_config(f)
        try:
            table = GGUF_NAME_TABLES.get(cfg.architecture) or NAME_TABLES[cfg.architecture]
            yield cfg, f, table, "GGUF metadata"
        except ValueError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(str(exc)) from None
        finally:
            f.release()
        return
    cfg = load_config(root)
    native = (root / NATIVE_CONFIG).exists()
    table = None if native else NAME_TABLES.get(cfg.architecture)
    if not native and table is None:
        raise CheckpointError(f"{root / 'config.json'}: unknown architecture {cfg.architecture!r}")
    files = _weight_files(root)
    block, packing = (None, None) if native else _quantization(root / "config.json")
    with ExitStack() as stack:
        reader = _Reader(table or NameTable(names={}), files, stack, block, packing)
        yield cfg, reader, table, NATIVE_CONFIG if native else "config.json"


def _quantization(config: Path) -> tuple[tuple[int, int] | None, Packing | None]:
    """A Hugging Face checkpoint's FP8 scale block and integer packing (both None: not
    quantized); a quantization kvserve cannot read stops the load naming it."""
    hf = read_json(config)
    try:
        packing = packing_of(hf)
        return (None if packing else checkpoint_block(hf)), packing
    except ValueError as exc:
        raise CheckpointError(f"{config}: {exc}") from None


def share_of(model: Transformer, tp: TensorParallel) -> Transformer:
    """This rank's share of an unsplit model in memory (the demo model), cut the way
    load_model cuts a checkpoint."""
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    reader = _Tensors(tensors)
    return _populate(model.cfg, reader, None, tp, model.dtype, model.device, "<memory>", "")


def _populate(
    cfg: ModelConfig,
    reader: _Reader | GgufFile,
    table: NameTable | None,
    tp: TensorParallel | None,
    dtype: torch.dtype,
    device: torch.device,
    root: object,
    config_name: str,
    on_layer: Callable[[nn.Module], None] | None = None,
) -> Transformer:
    """The model read through `reader`; on_layer(block): each decoder layer, once all of
    its parameters are read (a backend's prepare_layer)."""
    with torch.device("meta"):
        model = Transformer(cfg, tp)
        whole = Transformer(cfg) if tp is not None else model  # the unsplit shapes
    shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    filling: int | None = None  # the layer whose parameters are being read
    for name, param in list(model.named_parameters()):
        match = _LAYER.match(name)
        layer = int(match.group(1)) if match else None
        if filling is not None and layer != filling:
            _finish_layer(model, filling, table, on_layer)
        filling = layer
        value, kind = _read_param(model, name, param.shape, shapes[name], reader, table, dtype,
                                  device, (root, config_name))  # fmt: skip
        mark_stored_kind(_set_param(model, name, value), kind)
    if filling is not None:
        _finish_layer(model, filling, table, on_layer)
    model.rebuild_tables(device)
    return model.eval()


def _read_param(
    model: Transformer,
    name: str,
    shape: torch.Size,
    full_shape: tuple[int, ...],
    reader: _Reader | GgufFile,
    table: NameTable | None,
    dtype: torch.dtype,
    device: torch.device,
    where: tuple[object, str],
) -> tuple[torch.Tensor, str | None]:
    """Parameter `name` (this rank's `shape` of the model's `full_shape`) read from its
    checkpoint tensors, and the integer kind that keeps them (model.int_weights.finest_kind;
    None: a float parameter); where: the checkpoint and its config's name, for errors."""
    root, config_name = where
    cfg = model.cfg
    key, i, templates = _templates(name, table, root)
    target = torch.zeros(shape, dtype=dtype, device=device)
    transpose = table is not None and key in table.transposed
    hint = f"{config_name} ({_shape_fields(cfg, name)})"
    local = _LAYER.sub("", name)
    shares, kinds = model.shares, []
    if shares is None or shares.split(local) != "row_bias" or shares.rank == 0:
        # an expert stack one expert at a time; any other parameter whole
        for e in range(shape[0]) if local in EXPERT_STACKS else (None,):
            found, expert = _sources(reader, templates, i, e, root, name)
            full = full_shape[1:] if e is not None else full_shape
            mixed = table is not None and key in table.interleaved
            parts = _parts(cfg, local, found, full, shares, expert, mixed)
            _fill(target[e] if e is not None else target, parts, reader, transpose, hint)
            kinds += [reader.stored_kind(s) for s in found]
    if table is not None and key in table.plus_one:
        target += 1
    return target, finest_kind(kinds)


def _templates(
    name: str, table: NameTable | None, root: object
) -> tuple[str, str, tuple[str, ...]]:
    """Parameter `name`'s key (its layer index as `{i}`), layer index ('' outside the
    layers) and checkpoint name templates."""
    match = _LAYER.match(name)
    key = _LAYER.sub("layers.{i}.", name) if match else name
    templates = table.names.get(key) if table else (name,)
    if templates is None:
        raise CheckpointError(f"{root}: no checkpoint name known for parameter {name}")
    return key, match.group(1) if match else "", templates


def stored_kinds(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """The parameters a checkpoint stores as integers, each with its shape and the kind
    that keeps it (model.int_weights.stored_kind: what --quantization auto packs), from
    the files' headers and config alone: no tensor is read."""
    root = Path(model_dir)
    with _checkpoint(root) as (cfg, reader, table, _):
        return _kinds_of(cfg, reader, table, root) if table is not None else {}


def _kinds_of(
    cfg: ModelConfig, reader: _Reader | GgufFile, table: NameTable, root: object
) -> dict[str, tuple[tuple[int, ...], str]]:
    with torch.device("meta"):
        model = Transformer(cfg)
    out = {}
    for name, param in model.named_parameters():
        _, i, templates = _templates(name, table, root)
        stack = _LAYER.sub("", name) in EXPERT_STACKS
        kinds = [
            reader.stored_kind(source)
            for e in (range(param.shape[0]) if stack else (None,))
            for source in _sources(reader, templates, i, e, root, name)[0]
        ]
        if (kind := finest_kind(kinds)) is not None:
            out[name] = (tuple(param.shape), kind)
    return out


def _finish_layer(
    model: Transformer,
    i: int,
    table: NameTable | None,
    on_layer: Callable[[nn.Module], None] | None,
) -> None:
    """Layer i read whole: a partially rotated checkpoint's q/k rows put in kvserve's
    order, then on_layer(layer)."""
    block = model.layers[i]
    if table is not None and model.cfg.rotary < model.cfg.head_dim:
        _reorder_rotary(block, model.local_cfg)
    if on_layer is not None:
        on_layer(block)


def _sources(
    reader: _Reader | GgufFile,
    templates: tuple[str, ...],
    layer: str,
    expert: int | None,
    root: object,
    name: str,
) -> tuple[list[str], int | None]:
    """The checkpoint tensors of parameter `name` in layer `layer` (of one expert of an
    expert stack), and the index into them of that expert where one tensor stacks them
    all (None: the tensors are the expert's own, or the parameter is not a stack)."""
    names = [t.replace("{i}", layer).replace("{e}", str(expert)) for t in templates]
    sources = [reader.resolve(n) for n in names]
    missing = [n for n, s in zip(names, sources, strict=True) if s is None]
    if missing:
        raise CheckpointError(f"{root}: checkpoint has no tensor {missing[0]!r} (for {name})")
    stacked = expert is not None and not any("{e}" in t for t in templates)
    return [s for s in sources if s is not None], expert if stacked else None


def _reorder_rotary(block: nn.Module, cfg: ModelConfig) -> None:
    """A partially rotated checkpoint's q and k rows of one layer, each head put in
    kvserve's order (layers.rotary_order); cfg: the layer's (a rank's share) config."""
    dh, heads = cfg.head_dim, cfg.n_heads + cfg.kv_heads  # q's heads, then k's
    order = rotary_order(dh, cfg.rotary)
    rows = (torch.arange(heads)[:, None] * dh + order.to(torch.long)).flatten()
    for param in (block.attn.wqkv.weight, block.attn.wqkv.bias):
        if param is not None:
            param.data[: heads * dh] = param.data[rows]


def save_native(model: Transformer, model_dir: str | Path) -> None:
    """Write a model in kvserve's native format (any config, including post-norm/ALiBi)."""
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / NATIVE_CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=2))
    tensors = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    save_file(tensors, str(root / "model.safetensors"))
