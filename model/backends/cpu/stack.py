"""The decoder layers as one C call (kernels/stack.c), for the case the CPU path is built
around: a pre-norm RoPE/RMSNorm/SwiGLU model in bf16 whose linears all took kvserve's
kernel layouts (bf16, int8, int8g, int4 or int5, each linear its own), over a bf16
paged cache, at every instruction-set level; its layers' FFNs may be mixtures of experts
routed and run by kernels/experts.c (not Qwen2-MoE's shared expert). Same kernels, same
order, same bits as the modules; it drops the per-layer Python between them and holds
no GIL while the layers run. The model calls it through model.backends.base.FusedLayers.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model.adapters import LINEARS, Adapters
from model.backends.cpu.kernels.attention import step_window
from model.backends.cpu.kernels.build import data_ptr
from model.backends.cpu.kernels.experts import route as c_route
from model.backends.cpu.kernels.linear import linear_address
from model.backends.cpu.kernels.stack import stack_forward, stack_kernels
from model.backends.cpu.packed import GatedSwiGLU, PackedExperts, PackedGeGLU, PackedLinear
from model.backends.cpu.pages import HugeArena
from model.config import ModelConfig
from model.layers import RMSNorm
from model.metadata import AttentionMetadata
from model.moe import MoE

if TYPE_CHECKING:  # the cache imports the backends' package, which imports this
    from model.kv_cache import PagedKVCache

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        *[
            (name, _P)
            for name in (
                "attn_norm",
                "wqkv",
                "bqkv",
                "wo",
                "bo",
                "ffn_norm",
                "w_in",
                "b_in",
                "w_out",
                "b_out",
                "k_cache",
                "v_cache",
                "q_norm",
                "k_norm",
                "post_attn_norm",
                "post_ffn_norm",
            )
        ],
        ("rotate", _I),
        ("windowed", _I),
        ("router", _P),
        ("expert_w_in", _P),
        ("expert_w_out", _P),
        ("expert_load", _P),
        # each linear's kernel (kernels/linear.py's linear_address of its kind)
        *[
            (name, _P)
            for name in (
                "qkv_linear",
                "o_linear",
                "in_linear",
                "out_linear",
                "router_linear",
                "expert_in_linear",
                "expert_out_linear",
            )
        ],
        # LoRA: the bank's A and B stacks of each linear of adapters.LINEARS, widths,
        # and where they are not zero (LoraBank's ranks and spans)
        ("lora_a", _P * 4),
        ("lora_b", _P * 4),
        ("lora_width", _I * 4),
        ("lora_ranks", _P * 4),
        ("lora_spans", _P * 4),
    ]


_DIMS = ("layers", "rows", "d", "heads", "kv", "head_dim", "ff", "block_size", "max_blocks")
_STEP = ("cos_t", "sin_t", "slot_blocks", "slot_offsets", "tables", "row_seq", "lens")
# the windowed layers' own: their pool's slots, RoPE tables and attention rows
_WINDOW = (
    "win_slot_blocks",
    "win_slot_offsets",
    "win_cos_t",
    "win_sin_t",
    "win_tables",
    "win_row_seq",
    "win_lens",
    "win_skip",
)
_BUFFERS = ("x", "h", "qkv", "attn", "o", "act", "gate", "delta", "gate_up")
# a mixture of experts' buffers (experts.c): bf16, the choices' ids, the grouping's int32
_MIXTURE = ("logits", "choice_weights", "xs", "e_act", "e_gate", "ys", "choice_ids")
_GROUPING = ("order", "starts", "cursor")
_EXPERT_DIMS = ("experts", "router_rows", "top_k", "expert_ff", "normalize")


class _Args(ctypes.Structure):
    _fields_ = [
        *[(name, _P) for name in ("norm", "qk_norm", "rope", "attend", "geglu")],
        *[(name, _P) for name in ("route", "run_experts")],
        *[(name, _I) for name in _EXPERT_DIMS],
        *[(name, _I) for name in (*_DIMS, "nthreads")],
        ("eps", _F),
        ("scale", _F),
        ("softcap", _F),
        ("residual", _F),
        ("output_norms", _I),
        ("w", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        *[(name, _P) for name in (*_STEP, *_WINDOW)],
        ("win_max_blocks", _I),
        *[(name, _P) for name in _BUFFERS],
        ("lora_rows", _P),
        ("lora_slots", _I),
        ("lora_low", _P),
        ("lora_order", _P),
        ("lora_starts", _P),
        *[(name, _P) for name in (*_MIXTURE, *_GROUPING)],
    ]


class DecoderStack:
    """Installed by the backend's prepare where the model qualifies (build() returns None
    otherwise); forward() where the step qualifies (takes())."""

    def __init__(self, cfg: ModelConfig, layers: nn.ModuleList, final_norm: RMSNorm) -> None:
        self.cfg = cfg
        self.layers = layers
        self.final_norm = final_norm
        # the cache the layer arguments point into; weak, so a model outliving its engine
        # does not keep the engine's KV pool alive
        self._cache: weakref.ref[PagedKVCache] | None = None
        self._block_size = 0
        self._weights: ctypes.Array[_Layer] | None = None
        self._kernels: dict[str, int] | None = None
        self._rows: tuple[int, dict[str, Tensor], _Args] | None = None  # see _buffers()
        self._mixtures = [(i, b.ffn) for i, b in enumerate(layers) if isinstance(b.ffn, MoE)]
        self.adapters: Adapters | None = None  # LoRA (adapt())

    @classmethod
    def build(
        cls, cfg: ModelConfig, layers: nn.ModuleList, final_norm: nn.Module
    ) -> DecoderStack | None:
        if (
            cfg.norm_placement not in ("pre", "output", "sandwich")
            or cfg.position != "rope"
            or cfg.attn_sinks  # attention with sinks runs as torch ops
            or not isinstance(final_norm, RMSNorm)
        ):
            return None
        for block in layers:
            if isinstance(block.ffn, MoE) and _stackable_mixture(cfg, block.ffn):
                ffn_linears: tuple[nn.Module, ...] = ()  # the router: _stackable_mixture
            elif isinstance(block.ffn, GatedSwiGLU | PackedGeGLU):
                ffn_linears = (block.ffn.w_in, block.ffn.w_out)
            else:
                return None
            linears = (block.attn.wqkv, block.attn.wo, *ffn_linears)
            if not (
                isinstance(block.attn_norm, RMSNorm)
                and isinstance(block.ffn_norm, RMSNorm)
                and all(
                    isinstance(getattr(block, n, None), RMSNorm)
                    for n in ("post_attn_norm", "post_ffn_norm")
                    if cfg.norm_placement == "sandwich"
                )
                and all(
                    isinstance(m, PackedLinear) and m._tiles is not None and not m.pad
                    for m in linears
                )
            ):
                return None
        return cls(cfg, layers, final_norm)

    @property
    def mixtures(self) -> list[MoE]:
        """The layers' mixtures of experts (empty for a dense model)."""
        return [moe for _, moe in self._mixtures]

    @property
    def kinds(self) -> frozenset[str]:
        """Which linear kernels the layers' weights are packed for."""
        return frozenset(k for block in self.layers for k in _kinds(block) if k is not None)

    def adapt(self, adapters: Adapters) -> None:
        """Take the bank's stacks into huge pages (a step streams them: pages.py) and
        the layers' arguments with them."""
        bank = adapters.bank
        stacks = [*bank.a.values(), *bank.bt.values()]
        arena = HugeArena(HugeArena.size_of(stacks))
        for table in (bank.a, bank.bt):
            for key, stack in table.items():
                table[key] = arena.take(stack)
        self.adapters = adapters
        self._cache = None  # the layers' arguments are made again, with the bank's stacks

    def takes(self, kv_cache: PagedKVCache | None, meta: AttentionMetadata) -> bool:
        if kv_cache is None or kv_cache.backend.name != "cpu" or meta.slot_blocks is None:
            return False
        if kv_cache.data.dtype != torch.bfloat16 or kv_cache.data.device.type != "cpu":
            return False
        if self._cache is None or self._cache() is not kv_cache:
            cfg = self.cfg
            group = cfg.n_heads // cfg.kv_heads
            self._kernels = stack_kernels(
                cfg.head_dim,
                kv_cache.block_size,
                group,
                self.kinds,
                whole_qk_norm=cfg.qk_norm == "all",
                geglu=cfg.ffn == "geglu",
                experts=bool(self.mixtures),
            )
            self._weights = self._layer_args(kv_cache) if self._kernels else None
            self._cache, self._block_size = weakref.ref(kv_cache), kv_cache.block_size
            self._rows = None  # their arguments point at the old cache's layers
        return self._kernels is not None

    def _layer_args(self, kv_cache: PagedKVCache) -> ctypes.Array[_Layer]:
        out = (_Layer * len(self.layers))()
        for i, block in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            attn, ffn = block.attn, block.ffn
            out[i] = _Layer(
                block.attn_norm.weight.data_ptr(),
                attn.wqkv._tiles.data_ptr(),
                data_ptr(attn.wqkv._bias32),
                attn.wo._tiles.data_ptr(),
                data_ptr(attn.wo._bias32),
                block.ffn_norm.weight.data_ptr(),
                *_dense_args(ffn),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                data_ptr(attn.q_norm.weight if attn.q_norm is not None else None),
                data_ptr(attn.k_norm.weight if attn.k_norm is not None else None),
                *(
                    data_ptr(norm.weight if norm is not None else None)
                    for norm in (
                        getattr(block, "post_attn_norm", None),
                        getattr(block, "post_ffn_norm", None),
                    )
                ),
                int(i not in self.cfg.nope_layers),
                int(self.cfg.window(i) is not None),
                *_mixture_args(ffn),
                *_kernels(block),
                *self._lora_args(i),
            )
        return out

    def _lora_args(self, layer: int) -> tuple[ctypes.Array, ...]:
        """A layer's LoRA stacks (adapters.LINEARS' order, NULL where none), widths,
        ranks and spans."""
        a, b, width, ranks, spans = (_P * 4)(), (_P * 4)(), (_I * 4)(), (_P * 4)(), (_P * 4)()
        if self.adapters is not None:
            bank = self.adapters.bank
            for j, linear in enumerate(LINEARS):
                key = f"layers.{layer}.{linear}"
                if key in bank.a:
                    a[j], b[j] = bank.a[key].data_ptr(), bank.bt[key].data_ptr()
                    width[j] = bank.a[key].shape[1]
                    ranks[j], spans[j] = bank.ranks[key].data_ptr(), bank.spans[key].data_ptr()
        return a, b, width, ranks, spans

    def forward(
        self,
        x: Tensor,  # (T, d) embeddings, bf16: updated in place into the residual stream
        meta: AttentionMetadata,
        rope: tuple[Tensor, Tensor],  # cos, sin (T, head_dim) at the tokens' positions
        local: tuple[Tensor, Tensor] | None = None,  # the windowed layers' own (Gemma 3)
    ) -> Tensor:
        """-> the final norm's output (T, d), as the module path's add_norm gives it; a
        buffer of this stack's that the next call overwrites. Call takes() with this
        step's cache first."""
        t = x.shape[0]
        if self._rows is None or self._rows[0] != t:
            self._rows = self._buffers(t)
        _, buffers, args = self._rows
        step = {  # held here until the call returns: contiguous() may copy
            "cos_t": rope[0].contiguous(),
            "sin_t": rope[1].contiguous(),
            "slot_blocks": meta.slot_blocks.contiguous(),
            "slot_offsets": meta.slot_offsets.contiguous(),
            "tables": meta.block_tables.contiguous(),
            "row_seq": meta.row_seq.contiguous() if meta.row_seq is not None else None,
            "lens": meta.row_lens.contiguous(),
        }
        step.update(self._windowed(meta, local))
        args.win_max_blocks = step["win_tables"].shape[1] if step["win_tables"] is not None else 0
        for name, value in step.items():
            setattr(args, name, data_ptr(value))
        args.x, args.max_blocks = x.data_ptr(), step["tables"].shape[1]
        args.nthreads = torch.get_num_threads()
        for i, moe in self._mixtures:  # counters may be set (count_experts) at any time
            self._weights[i].expert_load = data_ptr(moe.load)
        rows = self.adapters.rows if self.adapters is not None else None
        args.lora_rows = data_ptr(rows)
        stack_forward(args)
        return buffers["h"]

    def _lora_buffers(self, t: int) -> dict[str, Tensor]:
        """stack.c's LoRA work buffers for a call of t rows (none without adapters)."""
        if self.adapters is None:
            return {}
        bank = self.adapters.bank
        widest = max(a.shape[1] for a in bank.a.values())
        return {
            "lora_low": torch.empty((t, widest), dtype=torch.float32),
            "lora_order": torch.empty(t, dtype=torch.int32),
            "lora_starts": torch.empty(bank.slots + 1, dtype=torch.int32),
        }

    def _windowed(
        self, meta: AttentionMetadata, local: tuple[Tensor, Tensor] | None
    ) -> dict[str, Tensor | None]:
        """The windowed layers' arguments (None: they read the step's own): their pool's
        slots where they have one (meta.window), their RoPE tables, and their attention's
        tables, rows and skips (the window's view where a row has keys outside it, else
        their pool's tables)."""
        own = meta.window
        out: dict[str, Tensor | None] = dict.fromkeys(_WINDOW)
        if own is not None:
            out["win_slot_blocks"] = own.slot_blocks.contiguous()
            out["win_slot_offsets"] = own.slot_offsets.contiguous()
        if local is not None:
            out["win_cos_t"], out["win_sin_t"] = local[0].contiguous(), local[1].contiguous()
        wmeta = own if own is not None else meta
        view = step_window(wmeta, self.cfg.sliding_window, self._block_size)
        if view is None and own is not None:
            view = (own.block_tables, own.row_lens, own.row_seq, None)
        if view is not None:
            tables, lens, row_seq, skip = view
            out |= {"win_tables": tables.contiguous(), "win_lens": lens.contiguous()}
            out["win_row_seq"] = row_seq.contiguous() if row_seq is not None else None
            out["win_skip"] = skip
        return out

    def _buffers(self, t: int) -> tuple[int, dict[str, Tensor], _Args]:
        """The work buffers of a call of t rows and the arguments that point at them (the
        step's own fields are filled per call). Kept from one call to the next: a decode
        batch's row count repeats step after step."""
        cfg = self.cfg
        h, kv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        widths = {
            "h": cfg.d_model,
            "qkv": (h + 2 * kv) * dh,
            "attn": h * dh,
            "o": cfg.d_model,
            "act": cfg.d_ff,
            "gate": cfg.d_ff,
            "delta": cfg.d_model,
        }
        if cfg.ffn == "geglu" or self.adapters is not None:  # SwiGLU's, before its gate
            widths["gate_up"] = 2 * cfg.d_ff
        buffers = {k: torch.empty((t, n), dtype=torch.bfloat16) for k, n in widths.items()}
        lora = self._lora_buffers(t)
        buffers |= lora
        mixture = self.mixtures[0] if self.mixtures else None
        expert_dims = dict.fromkeys(_EXPERT_DIMS, 0)
        if mixture is not None:
            expert_dims = _expert_dims(mixture)
            buffers |= _mixture_buffers(t, cfg.d_model, expert_dims)
        dims = (len(self.layers), t, cfg.d_model, h, kv, dh, cfg.d_ff, self._block_size)
        args = _Args(
            **self._kernels,
            **expert_dims,
            **dict(zip(_DIMS, (*dims, 0), strict=True)),
            eps=cfg.norm_eps,
            scale=self.layers[0].attn.scale,  # Granite's attention_multiplier, or 1/sqrt(dh)
            softcap=cfg.attn_logit_softcap or 0.0,
            residual=cfg.residual_multiplier,
            output_norms=int(cfg.norm_placement == "output"),
            w=self._weights,
            lora_slots=self.adapters.bank.slots if self.adapters is not None else 0,
            final_norm=self.final_norm.weight.data_ptr(),
            **{k: v.data_ptr() for k, v in buffers.items()},
        )  # a buffer not made (gate_up for SwiGLU) stays NULL
        return t, buffers, args


def _stackable_mixture(cfg: ModelConfig, moe: MoE) -> bool:
    """Whether stack.c runs this mixture: a pre-norm layer's, routed by experts.c (as the
    module path routes it), every expert in the one C call, the router a packed linear
    without bias, and no shared expert (Qwen2-MoE's runs as modules)."""
    router = moe.router
    return (
        cfg.norm_placement == "pre"
        and moe.shared is None
        and moe.route_fn is c_route
        and isinstance(moe.experts, PackedExperts)
        and moe.experts.kernels is not None
        and isinstance(router, PackedLinear)
        and router._tiles is not None
        and router.bias is None
    )


def _dense_args(ffn: nn.Module) -> tuple[int | None, ...]:
    """A layer's w_in, b_in, w_out, b_out (NULL for a mixture of experts)."""
    if isinstance(ffn, MoE):
        return (None, None, None, None)
    return (
        ffn.w_in._tiles.data_ptr(),
        data_ptr(ffn.w_in._bias32),
        ffn.w_out._tiles.data_ptr(),
        data_ptr(ffn.w_out._bias32),
    )


def _mixture_args(ffn: nn.Module) -> tuple[int | None, ...]:
    """A layer's router and expert pointer tables (NULL for a dense FFN), and a NULL
    counter, set per call."""
    if not isinstance(ffn, MoE):
        return (None, None, None, None)
    kernels = ffn.experts.kernels
    return (
        ffn.router._tiles.data_ptr(),
        ctypes.addressof(kernels._w_in),
        ctypes.addressof(kernels._w_out),
        None,  # the counter: set before each call (DecoderStack.forward)
    )


def _kinds(block: nn.Module) -> tuple[str | None, ...]:
    """The kinds of a layer's linears in _Layer's order: qkv, o, the FFN's in and out
    (None for a mixture), the router's and the experts' in and out (None for a dense FFN)."""
    attn, ffn = block.attn, block.ffn
    if isinstance(ffn, MoE):
        kinds = (None, None, ffn.router.quant, *ffn.experts.kinds)
    else:
        kinds = (ffn.w_in.quant, ffn.w_out.quant, None, None, None)
    return (attn.wqkv.quant, attn.wo.quant, *kinds)


def _kernels(block: nn.Module) -> tuple[int | None, ...]:
    """A layer's linears' kernels, _kinds' order (NULL where _kinds has None)."""
    return tuple(linear_address(k) if k is not None else None for k in _kinds(block))


def _expert_dims(moe: MoE) -> dict[str, int]:
    router = moe.router
    return {
        "experts": moe.experts.n_experts,
        "router_rows": router.out_features + router.pad,  # whole 64-row blocks
        "top_k": moe.top_k,
        "expert_ff": moe.experts.kernels.ff,
        "normalize": int(moe.normalize),
    }


def _mixture_buffers(t: int, d: int, dims: dict[str, int]) -> dict[str, Tensor]:
    """experts.c's work buffers for a call of t rows."""
    pairs, n = t * dims["top_k"], dims["experts"]
    bf16, i32 = torch.bfloat16, torch.int32
    return {
        "logits": torch.empty((t, dims["router_rows"]), dtype=bf16),
        "choice_weights": torch.empty((t, dims["top_k"]), dtype=bf16),
        "choice_ids": torch.empty((t, dims["top_k"]), dtype=torch.int64),
        "xs": torch.empty((pairs, d), dtype=bf16),
        "ys": torch.empty((pairs, d), dtype=bf16),
        "e_act": torch.empty((pairs, dims["expert_ff"]), dtype=bf16),
        "e_gate": torch.empty((pairs, dims["expert_ff"]), dtype=bf16),
        "order": torch.empty(pairs, dtype=i32),
        "starts": torch.empty(n + 1, dtype=i32),
        "cursor": torch.empty(n, dtype=i32),
    }
