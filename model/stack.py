"""The decoder layers as one C call, for the case this CPU path is built around: a
pre-norm RoPE/RMSNorm/SwiGLU model in bf16 whose linears all took kvserve's kernel layout
(bf16, or all int8), over a bf16 paged cache (model/kernels/stack.c), at every
instruction-set level. Same kernels, same
order, same bits as the modules; it drops the per-layer Python between them (over a
quarter of a batch-1 decode step here) and holds no GIL while the layers run.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import Tensor, nn

from model.attention import AttentionMetadata, PagedKVCache
from model.config import ModelConfig
from model.kernels.build import data_ptr
from model.kernels.stack import stack_forward, stack_kernels
from model.layers import Linear, RMSNorm, SwiGLU

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
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
        )
    ]


_DIMS = ("layers", "rows", "d", "heads", "kv", "head_dim", "ff", "block_size", "max_blocks")
_STEP = ("cos_t", "sin_t", "slot_blocks", "slot_offsets", "tables", "row_seq", "lens")
_BUFFERS = ("x", "h", "qkv", "attn", "o", "act", "gate", "delta")


class _Args(ctypes.Structure):
    _fields_ = [
        *[(name, _P) for name in ("norm", "linear", "rope", "attend")],
        *[(name, _I) for name in (*_DIMS, "nthreads")],
        ("eps", _F),
        ("scale", _F),
        ("w", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        *[(name, _P) for name in (*_STEP, *_BUFFERS)],
    ]


class DecoderStack:
    """Built by Transformer.pack_weights where the model qualifies (build() returns None
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

    @classmethod
    def build(
        cls, cfg: ModelConfig, layers: nn.ModuleList, final_norm: nn.Module
    ) -> DecoderStack | None:
        if (
            cfg.norm_placement != "pre"
            or cfg.position != "rope"
            or not isinstance(final_norm, RMSNorm)
        ):
            return None
        for block in layers:
            linears = (block.attn.wqkv, block.attn.wo, block.ffn.w_in, block.ffn.w_out)
            if not (
                isinstance(block.attn_norm, RMSNorm)
                and isinstance(block.ffn_norm, RMSNorm)
                and isinstance(block.ffn, SwiGLU)
                and block.ffn.w_in.gated
                and all(
                    isinstance(m, Linear) and m._tiles is not None and not m.pad for m in linears
                )
                and len({m.int8 for m in linears}) == 1
            ):
                return None
        return cls(cfg, layers, final_norm)

    @property
    def kind(self) -> str:
        """Which linear kernel the layers' weights are packed for."""
        return "int8" if self.layers[0].attn.wqkv.int8 else "bf16"

    def takes(self, kv_cache: PagedKVCache | None, meta: AttentionMetadata) -> bool:
        if kv_cache is None or kv_cache.backend.name != "cpu" or meta.slot_blocks is None:
            return False
        if kv_cache.data.dtype != torch.bfloat16 or kv_cache.data.device.type != "cpu":
            return False
        if self._cache is None or self._cache() is not kv_cache:
            cfg = self.cfg
            group = cfg.n_heads // cfg.kv_heads
            self._kernels = stack_kernels(cfg.head_dim, kv_cache.block_size, group, self.kind)
            self._weights = self._layer_args(kv_cache) if self._kernels else None
            self._cache, self._block_size = weakref.ref(kv_cache), kv_cache.block_size
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
                ffn.w_in._tiles.data_ptr(),
                data_ptr(ffn.w_in._bias32),
                ffn.w_out._tiles.data_ptr(),
                data_ptr(ffn.w_out._bias32),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
            )
        return out

    def forward(
        self,
        x: Tensor,  # (T, d) embeddings, bf16: updated in place into the residual stream
        meta: AttentionMetadata,
        rope: tuple[Tensor, Tensor],  # cos, sin (T, head_dim) at the tokens' positions
    ) -> Tensor:
        """-> the final norm's output (T, d), as the module path's add_norm gives it.
        Call takes() with this step's cache first."""
        cfg, t = self.cfg, x.shape[0]
        h, kv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim

        def buf(width: int) -> Tensor:
            return torch.empty((t, width), dtype=torch.bfloat16)

        tables = meta.block_tables.contiguous()
        buffers = {
            "x": x,
            "h": buf(cfg.d_model),
            "qkv": buf((h + 2 * kv) * dh),
            "attn": buf(h * dh),
            "o": buf(cfg.d_model),
            "act": buf(cfg.d_ff),
            "gate": buf(cfg.d_ff),
            "delta": buf(cfg.d_model),
        }
        step = {  # held here until the call returns: contiguous() may copy
            "cos_t": rope[0].contiguous(),
            "sin_t": rope[1].contiguous(),
            "slot_blocks": meta.slot_blocks.contiguous(),
            "slot_offsets": meta.slot_offsets.contiguous(),
            "tables": tables,
            "row_seq": meta.row_seq.contiguous() if meta.row_seq is not None else None,
            "lens": meta.row_lens.contiguous(),
        }
        dims = (len(self.layers), t, cfg.d_model, h, kv, dh, cfg.d_ff)
        args = _Args(
            **self._kernels,
            **dict(zip(_DIMS, (*dims, self._block_size, tables.shape[1]), strict=True)),
            nthreads=torch.get_num_threads(),
            eps=cfg.norm_eps,
            scale=dh**-0.5,
            w=self._weights,
            final_norm=self.final_norm.weight.data_ptr(),
            **{k: data_ptr(v) for k, v in step.items()},
            **{k: v.data_ptr() for k, v in buffers.items()},
        )
        stack_forward(args)
        return buffers["h"]
