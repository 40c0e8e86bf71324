"""The `torch` backend: plain PyTorch ops, the readable reference every other backend is
tested against. Its KV layout is the one GPU paged kernels read, per layer K and V of
(num_blocks, block_size, KV, D); attention gathers each sequence's blocks and runs SDPA
with a dense mask. The other backends subclass it and override what they do faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.adapters import add_delta
from model.backends.base import flag_non_finite
from model.backends.fp8 import Fp8Linear, to_fp8
from model.backends.int4 import Int4Linear, Int4Stack, to_int4
from model.config import ModelConfig
from model.layers import RMSNorm, apply_rope
from model.metadata import AttentionMetadata


def fusable_rms_norm(norm: nn.Module, x: Tensor, delta: Tensor | None) -> bool:
    """Whether a backend's one-pass add + RMSNorm kernel takes this add_norm: an RMSNorm
    over a contiguous x, the weight and delta (if any) in x's dtype (the kernels read all
    three as one type and update x in place)."""
    same = norm.weight.dtype == x.dtype and (delta is None or delta.dtype == x.dtype)
    return isinstance(norm, RMSNorm) and x.is_contiguous() and same


def beyond_window(meta: AttentionMetadata, window: int | None) -> bool:
    """Whether some query of the step has keys outside its window: only then does
    sliding-window attention differ from full attention (below it the kernels run the
    windowed layers as global ones)."""
    return window is not None and meta.max_seq_len > window


def split_heads(qkv: Tensor, n_heads: int, n_kv: int, d_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """(T, (H + 2KV) * dh) -> views q (T, H, dh), k and v (T, KV, dh)."""
    qkv = qkv.view(qkv.shape[0], n_heads + 2 * n_kv, d_head)
    return qkv[:, :n_heads], qkv[:, n_heads : n_heads + n_kv], qkv[:, n_heads + n_kv :]


HELD_LINEARS = (nn.Linear, Fp8Linear, Int4Linear)


def _kind_of(linear: nn.Module) -> str:
    """What a linear holds: 'fp8', 'int4', or 'torch' (its weight as loaded)."""
    return {Fp8Linear: "fp8", Int4Linear: "int4"}.get(type(linear), "torch")


class TorchBackend:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu", reason: str = "") -> None:
        self.device = torch.device(device)
        self.reason = reason  # why it was chosen, for the start-up log
        self.linears: dict[str, int] = {}  # prepare() counts what each linear holds

    def describe(self) -> dict[str, Any]:
        """What /v1/models/{id} and the start-up log line report."""
        layout = "blocks, block_size, kv_heads, head_dim"
        return {"name": self.name, "kv_layout": layout} | (
            {"linears": self.linears} if self.linears else {}
        )

    # ---- set-up ----------------------------------------------------------------------

    def check_cache(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        """Raise ValueError if this backend's cache cannot take this shape."""

    def kv_pool(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> Tensor:
        """The zeroed KV pool (2, layers, blocks, elements) the cache views."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def kv_views(
        self, data: Tensor, cfg: ModelConfig, num_blocks: int, block_size: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Per layer K and V views of the pool `data` (2, layers, num_blocks, elements)."""
        shape = (num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
        return [(data[0, i].view(shape), data[1, i].view(shape)) for i in range(data.shape[1])]

    def prepare(self, model: nn.Module, quantization: str = "none") -> bool:
        """Put the weights in the layouts this backend's linears read (none here but FP8's
        and int4's: model/backends/fp8.py, int4.py), in `quantization` ('none'; 'fp8';
        'int4'; 'auto': a checkpoint's 4-bit groups in int4, every other weight as
        loaded); whether it repacked them."""
        if quantization == "fp8":
            repacked = to_fp8(model) > 0
        elif quantization in ("int4", "auto"):
            repacked = to_int4(model, quantization) > 0
        elif quantization == "none":
            repacked = False
        else:
            raise ValueError(
                f"quantization {quantization} runs on the cpu backend's C kernels, "
                f"not on the {self.name} backend"
            )
        kinds = [_kind_of(m) for m in model.modules() if isinstance(m, HELD_LINEARS)]
        self.linears = {k: kinds.count(k) for k in sorted(set(kinds))} if repacked else {}
        return repacked

    def prepare_layer(self, block: nn.Module, quantization: str = "none") -> None:
        """Nothing: the reference's layouts are the checkpoint's (FP8 is converted whole)."""

    def held_bytes(self, model: nn.Module) -> int:
        """The parameters' bytes, and the quantized linears' and expert stacks' codes and
        scales."""
        total = sum(p.nbytes for p in model.parameters() if not p.is_meta)
        for m in model.modules():
            if isinstance(m, (Fp8Linear, Int4Linear, Int4Stack)):
                total += sum(b.nbytes for b in m.buffers(recurse=False))
        return total

    # ---- per step --------------------------------------------------------------------

    def metadata(
        self,
        block_tables: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device | str,
        pad_block: int,
        window_tables: Sequence[Sequence[int]] | None = None,
        window_pad: int = 0,
    ) -> AttentionMetadata:
        meta = AttentionMetadata.paged(
            block_tables, cached_lens, query_lens, block_size, device, pad_block=pad_block
        )
        if window_tables is not None:
            meta.window = AttentionMetadata.paged(
                window_tables, cached_lens, query_lens, block_size, device, pad_block=window_pad
            )
        return meta

    def lora_add(self, x: Tensor, a: Tensor, bt: Tensor, slots: Tensor, y: Tensor) -> Tensor:
        return add_delta(x, a, bt, slots, y)

    def greedy(self, logits: Tensor) -> list[int]:
        """(B, V) logits -> each row's first argmax, or NON_FINITE (-1) for a row whose
        maximum is not finite; one device -> host transfer."""
        best = logits.max(dim=-1)  # max, not argmax: faster on the CPU, and no fp32 copy
        return flag_non_finite(best.indices, best.values)

    def softcap(self, logits: Tensor, cap: float) -> Tensor:
        """Gemma 2's final logit soft-capping: cap * tanh(logits / cap) (may be in place)."""
        return torch.tanh(logits / cap) * cap

    def add_norm(self, norm: nn.Module, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """The pre-norm residual step: x + delta (the residual stream) and its norm."""
        if delta is not None:
            x = x + delta
        return x, norm(x)

    def norm_heads(
        self,
        qkv: Tensor,
        q_norm: nn.Module,
        k_norm: nn.Module,
        n_heads: int,
        n_kv: int,
        whole: bool = False,
    ) -> Tensor:
        """q/k norms before RoPE: Qwen3's, each query head of qkv (T, (H + 2KV) * dh)
        through q_norm and each key head through k_norm (weights of dh); OLMo 2's (whole),
        all of q through q_norm and all of k through k_norm (weights of H * dh, KV * dh)."""
        t = qkv.shape[0]
        if whole:
            d_head = q_norm.weight.shape[0] // n_heads
            q, k, v = qkv.split([n_heads * d_head, n_kv * d_head, n_kv * d_head], dim=1)
            return torch.cat([q_norm(q), k_norm(k), v], dim=1)
        d_head = q_norm.weight.shape[0]
        heads = qkv.view(t, n_heads + 2 * n_kv, d_head)
        q, k, v = heads[:, :n_heads], heads[:, n_heads : n_heads + n_kv], heads[:, n_heads + n_kv :]
        return torch.cat([q_norm(q), k_norm(k), v], dim=1).view(t, -1)

    def rope_store(
        self,
        qkv: Tensor,  # (T, (H + 2KV) * dh)
        rope: tuple[Tensor, Tensor] | None,
        n_heads: int,
        n_kv: int,
        d_head: int,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Rotate q and k, write the new K/V into their cache slots -> q (T, H, dh),
        k and v (T, KV, dh)."""
        t, h, kv = qkv.shape[0], n_heads, n_kv
        qkv = qkv.view(t, h + 2 * kv, d_head)
        qk, v = qkv[:, : h + kv], qkv[:, h + kv :]
        if rope is not None:  # one rotation for the query and key heads together
            qk = apply_rope(qk, *rope)
        q, k = qk[:, :h], qk[:, h:]
        if cache is not None:
            keep = meta.slot_mapping >= 0  # -1: a padding row stores nothing
            slots = meta.slot_mapping[keep]
            cache[0].view(-1, kv, d_head)[slots] = k[keep]
            cache[1].view(-1, kv, d_head)[slots] = v[keep]
        return q, k, v

    def attend(
        self,
        q: Tensor,  # (T, H, dh)
        k: Tensor,  # (T, KV, dh) the new tokens' keys (read only without a cache)
        v: Tensor,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
        scale: float,
        alibi: Tensor | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """-> (T, H * dh). `window`: each query sees only the keys of the `window`
        positions ending at its own (sliding-window attention); None: every earlier one.
        `softcap`: each score becomes softcap * tanh(score / softcap) (Gemma 2). `sinks`
        (H,): a logit per head in each softmax beside the scores, attending nothing
        (gpt-oss)."""
        how = (scale, alibi, window, softcap, sinks)
        if cache is None:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            return _sdpa(q, keys, values, meta, *how)
        if meta.q_index is not None:  # mixed query lengths: pad within groups only
            out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
            block_size = self.block_size_of(cache)
            for rows, sub in meta.groups(block_size):
                keys, values = self.gather(cache, sub)
                out[rows] = _sdpa(q.index_select(0, rows), keys, values, sub, *how)
            return out
        return _sdpa(q, *self.gather(cache, meta), meta, *how)

    def block_size_of(self, cache: tuple[Tensor, Tensor]) -> int:
        return cache[0].shape[1]

    def gather(
        self, cache: tuple[Tensor, Tensor], meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """Each sequence's cached K and V, contiguous: (B, KV, max_seq_len, dh) each."""
        k_cache, v_cache = cache
        b, s = meta.num_seqs, meta.max_seq_len
        kv, d = k_cache.shape[2:]
        flat = meta.block_tables.view(-1)  # index_select copies whole contiguous blocks
        keys = k_cache.index_select(0, flat).view(b, -1, kv, d)[:, :s]  # (B, S, KV, dh)
        values = v_cache.index_select(0, flat).view(b, -1, kv, d)[:, :s]
        return keys.transpose(1, 2), values.transpose(1, 2)


def _sdpa(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    meta: AttentionMetadata,
    scale: float,
    alibi: Tensor | None,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """q (T, H, dh) of meta's sequences, padded to its longest query, against keys and
    values (B, KV, max_seq_len, dh) -> (T, H * dh)."""
    h, dh = q.shape[1], q.shape[2]
    n_kv = keys.shape[1]
    b, max_q, group = meta.num_seqs, meta.max_query_len, h // n_kv
    if meta.q_index is None:
        qp = q.reshape(b, max_q, h, dh)
    else:
        qp = q.new_zeros(b * max_q, h, dh)
        qp.index_copy_(0, meta.q_index, q)
        qp = qp.view(b, max_q, h, dh)
    # Fold the query heads that share a K/V head into the row axis, so K/V are never
    # repeated: (B, max_q, KV*G, dh) -> (B, KV, G*max_q, dh).
    qg = qp.view(b, max_q, n_kv, group, dh).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(b, n_kv, group * max_q, dh)
    seen = meta.mask  # (B, max_q, S)
    if window is not None:  # and within the window ending at the query's position
        k_pos = torch.arange(meta.max_seq_len, device=seen.device)
        last = torch.tensor(meta.seq_lens, device=seen.device)[:, None] - 1
        q_pos = torch.minimum(meta.q_pos, last)  # a padding row: the last key's window
        seen = seen & (k_pos[None, None, :] > q_pos[:, :, None] - window)
    if alibi is None:
        mask = seen[:, None, None].expand(b, 1, group, max_q, meta.max_seq_len)
        mask = mask.reshape(b, 1, group * max_q, meta.max_seq_len)
    else:  # (B, H, max_q, S) -> (B, KV, G*max_q, S)
        bias = meta.alibi(alibi).to(q.dtype).masked_fill(~seen[:, None], float("-inf"))
        mask = bias.reshape(b, n_kv, group * max_q, meta.max_seq_len)
    if softcap is None and sinks is None:  # (B, KV, G*max_q, dh)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    else:  # SDPA has neither: the scores by hand, as transformers' eager attention
        out = _scored(qg, keys, values, mask, scale, softcap, sinks, max_q)
    out = out.view(b, n_kv, group, max_q, dh).permute(0, 3, 1, 2, 4)
    out = out.reshape(b * max_q, h * dh)
    return out if meta.q_index is None else out.index_select(0, meta.q_index)


def _scored(
    qg: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    max_q: int,
) -> Tensor:
    """_sdpa's attention with the scores by hand: soft-capped (Gemma 2), and with a sink
    column per head (gpt-oss: the softmax over the scores and the sink, the sink's share
    dropped). qg (B, KV, G*max_q, dh) -> (B, KV, G*max_q, dh)."""
    scores = (qg @ keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    boolean = mask.dtype == torch.bool
    scores = scores.masked_fill(~mask, float("-inf")) if boolean else scores + mask
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1).to(qg.dtype) @ values
    b, n_kv, rows, _ = scores.shape  # each head's sink on each of its query rows
    sink = sinks.to(scores.dtype).view(n_kv, -1, 1, 1).expand(-1, -1, max_q, 1)
    both = torch.cat([scores, sink.reshape(1, n_kv, rows, 1).expand(b, -1, -1, -1)], dim=-1)
    probs = torch.softmax(both.float(), dim=-1)[..., :-1]
    return probs.to(qg.dtype) @ values


REFERENCE = TorchBackend()  # a forward with no cache (one sequence, plain causal) uses it
