"""The CPU backend's linears: `pack_model` swaps each nn.Linear of a loaded model for a
PackedLinear holding its weight in the layout a CPU matmul kernel reads, the way
gpt-fast's quantize.py swaps modules, then gathers those weights into one huge-page arena.

The layouts, by what the weight allows (bf16 on the CPU):
- kvserve's kernels (AMX tiles, kernels/linear_bf16.c, or vector code, linear_vec.c),
  where the in features are a multiple of 32: one layout for every batch size and
  instruction set, each row computed the same way whatever the batch. Out features that
  are not whole 64-feature blocks (a GPT-2 head's 50,257) get zero rows up to the next
  block, and the output is cut back.
- quantization='int8': int8 weights with a float32 scale per output feature
  (linear_vec.c), where the in features are a multiple of 4; quantization='int4': 4-bit
  weights in groups of 32 in features, each group with a float16 scale and minimum
  (linear_vec.c), where the in features are a multiple of 32, but the head and the
  layers' weights llama.cpp's Q4_K_M gives more bits in int8g (8-bit groups, below;
  model/int4_mix.py); quantization='auto': each weight a checkpoint stores as integers
  in the kind that keeps its values (model.int_weights.stored_kind): its 4-bit groups
  in int4, its 5-bit ones in int5 (a float16 step and minimum each 32 in features:
  GGUF Q5_0's, Q5_1's and Q5_K's), its 6 to 8-bit types in int8g (int8 with a float16
  scale each 32 in features: GGUF Q8_0's blocks as they are), int8 where none takes
  the shape; the float ones in bf16, so a layer may hold several kinds.
- oneDNN's prepacked layout where the CPU lets oneDNN pack bf16 (isa.onednn_packs_bf16);
  else the nn.Linear stays.

A SwiGLU whose (gate | up) projection takes kvserve's layout becomes a GatedSwiGLU: the
kernel applies silu(gate) * up in the same pass; so does each expert of a mixture
(PackedExperts). A GeGLU (Gemma) becomes a PackedGeGLU:
gelu_tanh(gate) * up in a C pass of its own. Packing keeps only the packed copy, so it is
the last thing done to a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import int4_mix
from model.backends.cpu.isa import onednn_packs_bf16
from model.backends.cpu.kernels.experts import ExpertKernels, experts_library, route
from model.backends.cpu.kernels.fused import fused_library, geglu
from model.backends.cpu.kernels.linear import (
    TILE_N,
    grouped_supported,
    int4_pack,
    int5_pack,
    int8_pack,
    int8_supported,
    int8g_pack,
    swiglu_layout,
    tile_layout,
    tile_linear,
    tile_linear_supported,
)
from model.backends.cpu.pages import HugeArena
from model.int_weights import KEEPS, mark_stored_kind, stored_kind
from model.layers import GeGLU, SwiGLU
from model.moe import Experts, GroupedExperts, MoE, gated, linear_quantization

if TYPE_CHECKING:
    from model.adapters import LayerAdapters


class PackedLinear(nn.Module):
    """A linear whose weight lives in a CPU kernel's layout. `weight` is a meta tensor
    that still reports the (out, in) shape; `bias` stays as loaded."""

    _packed: Tensor | None = None  # oneDNN's layout
    _tiles: Tensor | None = None  # tile_layout(), or the blob of a PACKS packing
    _bias32: Tensor | None = None
    quant = "bf16"  # what _tiles holds: a PACKS kind
    gated = False  # a SwiGLU's (gate | up) in swiglu_layout: forward gives silu(g) * u
    pad = 0  # zero output rows in _tiles past the weight's

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), False)
        self.bias = linear.bias

    @property
    def kernel(self) -> str:
        """What forward() runs: kvserve's kernel of a PACKS kind, or 'onednn'."""
        return self.quant if self._tiles is not None else "onednn"

    def forward(self, x: Tensor) -> Tensor:
        if self._tiles is not None:
            n, k = self.out_features, self.in_features
            shape = (n + self.pad, k) if self.quant != "bf16" else None
            out = tile_linear(x, self._tiles, self._bias32, self.gated, shape, self.quant)
            return out[..., :n].contiguous() if self.pad else out
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def ungated(self, x: Tensor) -> Tensor:
        """A gated (gate | up) linear's output before the gate, (..., 2F) in that order
        (a LoRA delta is added there, model/adapters.py)."""
        shape = (self.out_features, self.in_features) if self.quant != "bf16" else None
        out = tile_linear(x, self._tiles, self._bias32, False, shape, self.quant)
        blocks = out.unflatten(-1, (-1, 2, TILE_N)).transpose(-3, -2)  # swiglu_layout's
        return blocks.flatten(-3)


def pack_linear(
    linear: nn.Linear, swiglu: bool = False, quantization: str = "none"
) -> nn.Linear | PackedLinear:
    """`linear` in the first layout its weight takes (see the module's docstring), or
    `linear` itself where none does (or it is packed already). swiglu: it is a SwiGLU's
    (gate | up) projection."""
    if type(linear) is not nn.Linear:
        return linear
    w = linear.weight.detach()
    pad = -w.shape[0] % TILE_N
    padded = F.pad(w, (0, 0, 0, pad)) if pad else w
    quant = _quant(int4_mix.held(linear, quantization), padded, stored_kind(linear.weight))
    if quant != "bf16" or tile_linear_supported(padded):
        out = PackedLinear(linear)
        b = linear.bias.detach().float() if linear.bias is not None else None
        if pad and b is not None:
            b = F.pad(b, (0, pad))
        out.gated = swiglu and not pad and w.shape[0] % 128 == 0
        if out.gated:
            padded, b = swiglu_layout(padded), swiglu_layout(b) if b is not None else None
        out._tiles = PACKS[quant](padded)
        out._bias32, out.quant, out.pad = b, quant, pad
        return out
    if onednn_packs_bf16():
        out = PackedLinear(linear)
        out._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return out
    return linear


# what pack_model's `quantization` takes (the module's docstring)
PACK_QUANTIZATIONS = ("none", "auto", "int8", "int4")
# each kernel kind's packing, and whether a weight takes it
PACKS = {
    "bf16": tile_layout,
    "int8": int8_pack,
    "int8g": int8g_pack,
    "int4": int4_pack,
    "int5": int5_pack,
}
SUPPORTED = {
    "int8": int8_supported,
    "int8g": lambda w: grouped_supported(w, "int8g"),
    "int4": lambda w: grouped_supported(w, "int4"),
    "int5": lambda w: grouped_supported(w, "int5"),
}


def _quant(quantization: str, weight: Tensor, stored: str | None = None) -> str:
    """The kernel kind a weight packs for under `quantization`: its own where the weight
    takes it, else bf16's. 'auto': the kind that keeps a checkpoint's integer weight
    (`stored`, model.int_weights.stored_kind), the first of KEEPS[stored] its shape takes;
    bf16 for a float weight."""
    wanted = KEEPS.get(stored, ())
    kinds = wanted if quantization == "auto" else (quantization,)
    return next((k for k in kinds if k in SUPPORTED and SUPPORTED[k](weight)), "bf16")


class GatedSwiGLU(nn.Module):
    """A SwiGLU whose (gate | up) kernel gives silu(gate) * up itself; a step with LoRA
    rows adds their deltas to gate and up before the gate, as SwiGLU does."""

    lora: LayerAdapters | None = None  # its layer's LoRA deltas (model/adapters.py's attach)

    def __init__(self, w_in: PackedLinear, w_out: nn.Module) -> None:
        super().__init__()
        self.w_in, self.w_out = w_in, w_out

    def forward(self, x: Tensor) -> Tensor:
        if self.lora is None or not self.lora.active:
            return self.w_out(self.w_in(x))
        gate, up = self.lora.add("ffn.w_in", x, self.w_in.ungated(x)).chunk(2, dim=-1)
        h = F.silu(gate) * up
        return self.lora.add("ffn.w_out", h, self.w_out(h))


class PackedGeGLU(nn.Module):
    """Gemma's GeGLU over packed linears: gelu_tanh(gate) * up in one C pass (fused.c's
    geglu), the pass the decoder stack makes too."""

    lora: LayerAdapters | None = None  # its layer's LoRA deltas (model/adapters.py's attach)

    def __init__(self, w_in: nn.Module, w_out: nn.Module) -> None:
        super().__init__()
        self.w_in, self.w_out = w_in, w_out

    def forward(self, x: Tensor) -> Tensor:
        if self.lora is None:
            return self.w_out(geglu(self.w_in(x)))
        h = geglu(self.lora.add("ffn.w_in", x, self.w_in(x)))
        return self.lora.add("ffn.w_out", h, self.w_out(h))


class SplitSwiGLU(nn.Module):
    """An expert's SwiGLU over packed linears whose (gate | up) kernel does not apply the
    gate itself (its rows are not whole 128-feature blocks, or gpt-oss's clamped
    activation, model.moe.gated): torch's ops between them."""

    def __init__(
        self, w_in: nn.Module, w_out: nn.Module, clamped: tuple[float, float] | None = None
    ) -> None:
        super().__init__()
        self.w_in, self.w_out, self.clamped = w_in, w_out, clamped

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(gated(gate, up, self.clamped))


class PackedExperts(GroupedExperts):
    """A mixture's experts, each a SwiGLU over packed linears (GatedSwiGLU where its
    (gate | up) rows take the gated layout). Where every expert is gated, without
    biases, and the C experts kernel is built, forward() is that one call
    (kernels/experts.c: the same grouping, kernels and roundings as the reference's
    loop); else the loop, each chosen expert's kernels run once over its tokens."""

    kinds: tuple[str, str] | None = None  # the kinds the C call takes: (gate | up), down

    def __init__(self, experts: Experts, quantization: str = "none") -> None:
        super().__init__()
        self.n_experts = experts.n_experts
        biases = experts.b_in is not None
        kept = stored_kind(experts.w_in), stored_kind(experts.w_out)
        self.ffns = nn.ModuleList(
            _expert_ffn(
                _linear(experts.w_in[e], experts.b_in[e] if biases else None, kept[0]),
                _linear(experts.w_out[e], experts.b_out[e] if biases else None, kept[1]),
                experts.clamped,
                tuple(int4_mix.held(experts, quantization, w) for w in ("w_in", "w_out")),
            )
            for e in range(experts.n_experts)
        )
        self.kernels: ExpertKernels | None = None
        gated_ffns = all(
            isinstance(f, GatedSwiGLU) and not getattr(f.w_out, "pad", 1) for f in self.ffns
        )
        if gated_ffns and not biases:
            kinds_in = {f.w_in.kernel for f in self.ffns}
            kinds_out = {f.w_out.kernel for f in self.ffns}
            if len(kinds_in) == len(kinds_out) == 1:
                kinds = (kinds_in.pop(), kinds_out.pop())
                if all(k in PACKS for k in kinds) and ExpertKernels.available(kinds):
                    self.kinds = kinds

    def bind(self) -> None:
        """Point the C call at the weights where they now live (after _gather moved them)."""
        if self.kinds is not None:
            first = self.ffns[0]
            self.kernels = ExpertKernels(
                [f.w_in._tiles for f in self.ffns],
                [f.w_out._tiles for f in self.ffns],
                first.w_out.out_features,
                first.w_out.in_features,
                self.kinds,
            )

    def run(self, expert: int, x: Tensor) -> Tensor:
        return self.ffns[expert](x)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16:
            return self.kernels.forward(x, weights, ids)
        return super().forward(x, weights, ids)


def _expert_ffn(
    w_in: nn.Linear,
    w_out: nn.Linear,
    clamped: tuple[float, float] | None,
    quantizations: tuple[str, str],
) -> nn.Module:
    """An expert's SwiGLU over packed linears; quantizations: (gate | up)'s and down's."""
    gate_up = pack_linear(w_in, swiglu=clamped is None, quantization=quantizations[0])
    down = pack_linear(w_out, quantization=quantizations[1])
    if isinstance(gate_up, PackedLinear) and gate_up.gated:
        return GatedSwiGLU(gate_up, down)
    return SplitSwiGLU(gate_up, down, clamped)


def _linear(weight: Tensor, bias: Tensor | None = None, kind: str | None = None) -> nn.Linear:
    """An nn.Linear over `weight` (out, in) and `bias`, for pack_linear; kind: the stored
    kind of the checkpoint tensor `weight` came from (model.int_weights.stored_kind)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    mark_stored_kind(linear.weight, kind)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return linear


def can_pack(module: nn.Module) -> bool:
    """Whether a model's (or one of its layers') linears pack: bf16 weights on the CPU."""
    weight = next(module.parameters(), None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
    )


def pack_model(model: nn.Module, quantization: str = "none") -> bool:
    """Swap every linear of a Transformer (model/transformer.py) for its packed form and
    a tied head for a packed copy of the embedding table; gather the kvserve-layout
    weights into one huge-page arena. Returns whether it packed; the model cannot be
    moved or re-typed after."""
    if not can_pack(model):
        return False
    if model.cfg.tie_embeddings and model.lm_head is None:
        # The lookup keeps the plain table; the head gets a packed copy (vocab x d more
        # bytes, less in int8) in the linears' layout.
        head = _linear(model.embed.weight, kind=stored_kind(model.embed.weight))
        held = int4_mix.held(model.embed, quantization)
        if isinstance(packed := pack_linear(head, quantization=held), PackedLinear):
            model.lm_head = packed
    swap_linears(model, quantization)
    _gather(model)
    return True


def swap_linears(module: nn.Module, quantization: str = "none") -> None:
    """Each nn.Linear under `module` for pack_linear's form of it; a SwiGLU whose
    (gate | up) packs gated for a GatedSwiGLU, a GeGLU becomes a PackedGeGLU, a
    mixture's experts PackedExperts. Packed modules stay as they are."""
    for name, child in module.named_children():
        if isinstance(child, Experts):
            setattr(module, name, PackedExperts(child, quantization))
        elif isinstance(child, MoE):
            if experts_library() is not None:  # routed in C, as the decoder stack routes
                child.route_fn = route
            swap_linears(child, quantization)
        elif isinstance(child, SwiGLU):
            w_in = pack_linear(child.w_in, swiglu=True, quantization=quantization)
            w_out = pack_linear(child.w_out, quantization=quantization)
            if isinstance(w_in, PackedLinear) and w_in.gated:
                setattr(module, name, GatedSwiGLU(w_in, w_out))
            else:
                child.w_in, child.w_out = w_in, w_out
        elif isinstance(child, GeGLU) and fused_library() is not None:
            w_in = pack_linear(child.w_in, quantization=quantization)
            setattr(
                module, name, PackedGeGLU(w_in, pack_linear(child.w_out, quantization=quantization))
            )
        elif type(child) is nn.Linear:
            held = linear_quantization(module, name, quantization)
            setattr(module, name, pack_linear(child, quantization=held))
        else:
            swap_linears(child, quantization)


def _gather(model: nn.Module) -> None:
    """Every kvserve-layout weight into one huge-page arena (pages.py), each original
    dropped as its copy lands, so the model never holds two of them all."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m._tiles is not None]
    arena = HugeArena(HugeArena.size_of([m._tiles for m in linears]))
    for m in linears:
        m._tiles = arena.take(m._tiles)
    for m in model.modules():
        if isinstance(m, PackedExperts):
            m.bind()


def held_bytes(model: nn.Module) -> int:
    """The bytes a packed model's weights take: each packed linear's layout (with its
    scales and minimums) and float32 bias, every other parameter as it is."""
    total = sum(p.nbytes for p in model.parameters() if not p.is_meta)
    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += sum(t.nbytes for t in (m._tiles, m._packed, m._bias32) if t is not None)
    return total


def linear_kernels(model: nn.Module) -> list[str]:
    """What each linear of a model runs: a PackedLinear's kernel, 'torch' for nn.Linear."""
    return [
        m.kernel if isinstance(m, PackedLinear) else "torch"
        for m in model.modules()
        if isinstance(m, PackedLinear | nn.Linear)
    ]
