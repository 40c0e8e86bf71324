"""The `cpu` backend: kvserve's C kernels (kernels/), compiled for this CPU on first use;
the instruction set (AMX tiles, AVX-512, AVX2) is chosen inside them (isa.py). Its
prepare swaps the linears for packed ones (packed.py) and installs the one-call decoder
stack (stack.py); the KV pool and the packed weights live in huge pages (pages.py).

Its KV layout, per layer, with P = 1 for float32 and 2 for bfloat16 (elements per 32-bit
lane): K (num_blocks, KV, D / P, BS, P) and V (num_blocks, KV, BS / P, D, P). Keys are
channel-major inside a block so that the attention kernel scores a whole block of tokens
with one vector instruction per channel; values token-major so that it accumulates them
along the channel. In bfloat16, pairs of channels (K) and of tokens (V) share a lane:
that is the AMX tile unit's B operand for q.k and p.v.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor, nn

from model.backends.cpu.kernels.attention import (
    attention_isa,
    paged_attention,
    paged_attention_supported,
    step_window,
)
from model.backends.cpu.kernels.fused import (
    add_rms_norm,
    fused_supported,
    greedy_tokens,
    qk_norm,
    rope_store,
    softcap_,
)
from model.backends.cpu.kernels.linear import linear_isa
from model.backends.cpu.packed import (
    PACK_QUANTIZATIONS,
    PACKS,
    can_pack,
    held_bytes,
    linear_kernels,
    pack_model,
    swap_linears,
)
from model.backends.cpu.pages import HugeArena, release_free_heap
from model.backends.cpu.stack import DecoderStack
from model.backends.reference import (
    TorchBackend,
    fusable_rms_norm,
    split_heads,
)
from model.config import ModelConfig
from model.metadata import AttentionMetadata


def unsupported(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> str | None:
    """Why the C kernels cannot run this model on this machine, or None if they can."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the C kernels compute in float32 or bfloat16, not {dtype}"
    if not fused_supported(torch.empty(1, dtype=dtype)):
        return "the C kernels did not build (no C compiler, or KVSERVE_DISABLE_KERNELS)"
    k = torch.empty(1, cfg.kv_heads, 1, block_size, 1, dtype=dtype)  # only shape and dtype
    if not paged_attention_supported(k, cfg.n_heads, cfg.kv_heads, cfg.head_dim):
        return (
            f"no C attention kernel for head_dim {cfg.head_dim}, block_size {block_size}, "
            f"{cfg.n_heads // cfg.kv_heads} query heads per K/V head"
        )
    return None


def prepare_model(model: nn.Module, quantization: str = "none") -> bool:
    """Pack the linears (packed.pack_model) and, where every layer qualifies, install the
    layers as one C call (not under tensor parallelism: the stack has no all-reduce
    between its layers). Whether it packed."""
    if not pack_model(model, quantization):
        return False
    if model.tp is None:
        norm = getattr(model, "norm", None)
        model.fused_layers = DecoderStack.build(model.cfg, model.layers, norm)
    return True


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype, reason: str = ""):
        super().__init__("cpu", reason)
        # what the attention and the linears run (AMX tiles or a vector level)
        self.isa = attention_isa(cfg.head_dim, block_size, cfg.n_heads // cfg.kv_heads, dtype)
        self.linears: Counter[str] = Counter()  # prepare() counts what each linear runs

    @property
    def linear_isa(self) -> str:
        """What the prepared model's linears run, the most common first: a level or 'amx'
        for kvserve's kernels (model.backends.cpu.kernels.linear.linear_isa), 'onednn', 'torch'."""
        levels: Counter[str] = Counter()
        for kernel, n in self.linears.items():
            levels[linear_isa(kernel) if kernel in PACKS else kernel] += n
        return ", ".join(level for level, _ in levels.most_common()) or "torch"

    def describe(self) -> dict[str, Any]:
        layout = "K (blocks, kv_heads, head_dim/P, block_size, P), V (blocks, kv_heads, block_size/P, head_dim, P)"
        return {
            "name": self.name,
            "kv_layout": layout,
            "isa": self.isa,
            "linear_isa": self.linear_isa,
            "linears": dict(self.linears.most_common()),
        }

    def check_cache(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        pair = 2 if dtype.itemsize == 2 else 1
        if block_size % pair or cfg.head_dim % pair:
            raise ValueError(
                f"a {dtype} KV cache needs an even block size and head size, "
                f"got {block_size} and {cfg.head_dim}"
            )

    def kv_pool(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpu backend's KV cache lives on the CPU, not {device}")
        # read all over at every decode step: in huge pages
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return HugeArena(nbytes).empty(shape, dtype).zero_()

    def block_size_of(self, cache: tuple[Tensor, Tensor]) -> int:
        return cache[0].shape[3]

    def gather(
        self, cache: tuple[Tensor, Tensor], meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """(B, KV, max_seq_len, dh) K and V from this layout's blocks (kv_views)."""
        k_cache, v_cache = cache
        b, s = meta.num_seqs, meta.max_seq_len
        kv, d = k_cache.shape[1], k_cache.shape[2] * k_cache.shape[4]
        flat = meta.block_tables.view(-1)
        keys = k_cache.index_select(0, flat).view(b, -1, *k_cache.shape[1:])
        keys = keys.permute(0, 2, 1, 4, 3, 5).reshape(b, kv, -1, d)[:, :, :s]
        values = v_cache.index_select(0, flat).view(b, -1, *v_cache.shape[1:])
        values = values.permute(0, 2, 1, 3, 5, 4).reshape(b, kv, -1, d)[:, :, :s]
        return keys, values

    def kv_views(
        self, data: Tensor, cfg: ModelConfig, num_blocks: int, block_size: int
    ) -> list[tuple[Tensor, Tensor]]:
        nb, kv, bs, d = num_blocks, cfg.kv_heads, block_size, cfg.head_dim
        p = 2 if data.dtype.itemsize == 2 else 1
        return [
            (data[0, i].view(nb, kv, d // p, bs, p), data[1, i].view(nb, kv, bs // p, d, p))
            for i in range(data.shape[1])
        ]

    def prepare(self, model: nn.Module, quantization: str = "none") -> bool:
        if quantization in ("int8", "int4") and model.dtype != torch.bfloat16:
            raise ValueError(
                f"quantization {quantization} computes with bfloat16 activations and KV "
                f"cache; the model is {model.dtype} (use --dtype bfloat16 or auto)"
            )
        if quantization not in PACK_QUANTIZATIONS:
            raise ValueError(
                f"quantization {quantization} does not run on the cpu backend (none, auto, "
                f"int8 or int4 do)"
            )
        packed = prepare_model(model, quantization)
        self.linears = Counter(linear_kernels(model))
        release_free_heap()
        return packed

    def prepare_layer(self, block: nn.Module, quantization: str = "none") -> None:
        """The layer's linears packed (packed.swap_linears) where prepare() will pack the
        model: prepare() keeps them and packs the rest."""
        if quantization in PACK_QUANTIZATIONS and can_pack(block):
            swap_linears(block, quantization)
            release_free_heap()

    def held_bytes(self, model: nn.Module) -> int:
        return held_bytes(model)

    def greedy(self, logits: Tensor) -> list[int]:
        if logits.is_contiguous() and logits.dtype in (torch.float32, torch.bfloat16):
            return greedy_tokens(logits)  # one C pass over the logits
        return super().greedy(logits)

    def softcap(self, logits: Tensor, cap: float) -> Tensor:
        if logits.dim() == 2 and fused_supported(logits):
            return softcap_(logits, cap)  # one C pass, in place
        return super().softcap(logits, cap)

    def add_norm(self, norm: nn.Module, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        if fusable_rms_norm(norm, x, delta):  # x updated in place
            return x, add_rms_norm(x, delta, norm.weight, norm.eps)
        return super().add_norm(norm, x, delta)

    def norm_heads(
        self,
        qkv: Tensor,
        q_norm: nn.Module,
        k_norm: nn.Module,
        n_heads: int,
        n_kv: int,
        whole: bool = False,
    ) -> Tensor:
        # the C kernel, in place: the one the decoder stack calls, so both give one bits
        norms = (q_norm, k_norm)
        if fused_supported(qkv) and all(fusable_rms_norm(n, qkv, None) for n in norms):
            d_head = q_norm.weight.shape[0] // (n_heads if whole else 1)
            qk_norm(qkv, q_norm.weight, k_norm.weight, n_heads, n_kv, d_head, q_norm.eps, whole)
            return qkv
        return super().norm_heads(qkv, q_norm, k_norm, n_heads, n_kv, whole)

    def rope_store(
        self,
        qkv: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        n_heads: int,
        n_kv: int,
        d_head: int,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if cache is not None and meta.slot_blocks is None:
            raise ValueError("a KV cache needs paged metadata")
        # one pass: rotate q and k in place, write k and v into their slots
        rope_store(qkv, rope, n_heads, n_kv, d_head, cache, meta.slot_blocks, meta.slot_offsets)
        return split_heads(qkv, n_heads, n_kv, d_head)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
        scale: float,
        alibi: Tensor | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if cache is None or sinks is not None:  # no sinks in the C kernels: torch's
            return super().attend(q, k, v, cache, meta, scale, alibi, window, softcap, sinks)
        view = step_window(meta, window, cache[0].shape[-2])
        out = paged_attention(
            q, *cache, meta.block_tables, meta.row_lens, scale, alibi, meta.row_seq, view, softcap
        )  # (T, H, dh) in the cache's dtype
        return out.to(q.dtype).view(q.shape[0], q.shape[1] * q.shape[2])
