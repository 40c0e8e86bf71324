"""Tensor parallelism over torch.distributed (Megatron-style): which share of every weight
a rank holds, and the collectives that join the shares.

Per block, QKV and the FFN's input projection (gate | up) are column-parallel: a rank
holds the output rows of its query heads, their K/V heads and its share of the FFN
features. The attention output and the FFN's down projection are row-parallel: the
matching input columns, then one all-reduce each. The embedding and the LM head are
vocab-parallel (rows padded to a multiple of the world size; the lookup is one all-reduce,
the logits one all-gather). When there are fewer K/V heads than ranks, each rank holds a
replica of the one K/V head its query heads read. Norms and position tables are
replicated, but for OLMo 2's q/k norms over every head together: a rank holds the weights
of its heads, and the sum of squares is all-reduced before each rank scales its own. A
row-parallel bias is held by rank 0 alone, so the all-reduce adds it once. A mixture of
experts splits like the FFN it replaces: every rank holds each expert's share of its
features (no expert parallelism), the router is replicated.
NCCL on CUDA, gloo on the CPU: nothing else is needed to run on 2-8 devices or hosts.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from model.config import ModelConfig

# how each parameter is split (by its name inside a block, or at the top level); every
# other parameter (norms, position embeddings) is replicated
SPLITS: dict[str, str] = {
    "embed.weight": "vocab",
    "lm_head.weight": "vocab",
    "attn.wqkv.weight": "column",
    "attn.wqkv.bias": "column",
    "attn.wo.weight": "row",
    "attn.wo.bias": "row_bias",
    "ffn.w_in.weight": "column",
    "ffn.w_in.bias": "column",
    "ffn.w_out.weight": "row",
    "ffn.w_out.bias": "row_bias",
    # a mixture of experts (model/moe.py): every expert's share of its features
    "ffn.experts.w_in": "column",
    "ffn.experts.w_out": "row",
    "ffn.experts.b_in": "column",
    "ffn.experts.b_out": "row_bias",
    "attn.sinks": "sinks",  # one per head
    "ffn.shared.w_in.weight": "column",
    "ffn.shared.w_out.weight": "row",
}


def unsplittable(cfg: ModelConfig, world: int) -> str | None:
    """Why `cfg` cannot be split over `world` ranks (None: it can)."""
    if world < 1:
        return f"tensor_parallel_size must be >= 1, got {world}"
    kv = cfg.kv_heads
    if cfg.n_heads % world:
        return f"{cfg.n_heads} attention heads do not split over {world} ranks"
    if kv % world and world % kv:
        return f"{kv} K/V heads do not split over {world} ranks (nor {world} over them)"
    if cfg.d_ff % world:
        return f"d_ff {cfg.d_ff} does not split over {world} ranks"
    if (e := cfg.experts) is not None:
        for name, size in (("experts' d_ff", e.d_ff), ("the shared expert's d_ff", e.shared_d_ff)):
            if size % world:
                return f"{name} {size} does not split over {world} ranks"
    return None


@dataclass(frozen=True, slots=True)
class Shares:
    """One rank's share of a model (TensorParallel.shares): its query and K/V heads, its
    FFN features, its vocab rows, and the shapes its blocks have (`local`, what its KV
    cache is laid out by)."""

    rank: int
    heads: range
    kv_heads: range
    ffn: range
    vocab_rows: int  # rows of the embedding and head every rank holds (the vocab padded)
    vocab: range  # the vocab ids among them
    local: ModelConfig
    qk_widths: tuple[int, int, int]
    qk_norm_all: bool  # q/k norms over every head together (OLMo 2)

    def split(self, name: str) -> str:
        """vocab, column, row, row_bias, heads (a norm's weight over every head's
        features: the rank's heads' share), sinks (one value per head: the rank's heads')
        or replicated, for a parameter name with its `layers.{i}.` prefix taken off."""
        if self.qk_norm_all and name in ("attn.q_norm.weight", "attn.k_norm.weight"):
            return "heads"
        return SPLITS.get(name, "replicated")

    def head_features(self, name: str) -> range:
        """The features of a `heads` parameter this rank holds."""
        heads = self.heads if name.startswith("attn.q_") else self.kv_heads
        return _scaled(heads, self.local.head_dim)

    def segments(self, name: str) -> list[range]:
        """A column-parallel parameter's rows this rank holds, within each of its fused
        segments (q | k | v, or gate | up): weights.FUSED_ROWS gives the segments."""
        dh = self.local.head_dim
        if name.startswith("attn.wqkv"):
            q, kv = _scaled(self.heads, dh), _scaled(self.kv_heads, dh)
            return [q, kv, kv]
        features = self.features(name)
        return [features] * (2 if self.local.gated else 1)

    def columns(self, name: str) -> range:
        """A row-parallel weight's input columns this rank holds."""
        if name.startswith("attn.wo"):
            return _scaled(self.heads, self.local.head_dim)
        return self.features(name)

    def features(self, name: str) -> range:
        """The FFN features this rank holds of an FFN parameter: of the dense FFN, of
        each routed expert, or of the shared expert."""
        experts = self.local.experts
        if experts is None or not name.startswith(("ffn.experts.", "ffn.shared.")):
            return self.ffn
        size = experts.d_ff if name.startswith("ffn.experts.") else experts.shared_d_ff
        return range(self.rank * size, (self.rank + 1) * size)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int
    world: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    # ---- the shares ------------------------------------------------------------------

    def shares(self, cfg: ModelConfig) -> Shares:
        """This rank's share of every weight of `cfg`'s model, decided here once: the
        model's layers and the weight loader read them from the record."""
        per, kv = cfg.n_heads // self.world, cfg.kv_heads
        heads = range(self.rank * per, (self.rank + 1) * per)
        if kv >= self.world:
            n = kv // self.world
            kv_heads = range(self.rank * n, (self.rank + 1) * n)
        else:  # a replica of the one K/V head its query heads read
            first = heads.start // (cfg.n_heads // kv)
            kv_heads = range(first, first + 1)
        f = cfg.d_ff // self.world
        rows = -(-cfg.vocab_size // self.world)  # the vocab padded to every rank's rows
        experts = cfg.experts
        if experts is not None:  # every expert's share of its features
            experts = dataclasses.replace(
                experts,
                d_ff=experts.d_ff // self.world,
                shared_d_ff=experts.shared_d_ff // self.world,
            )
        local = cfg.replace(
            n_heads=len(heads),
            n_kv_heads=len(kv_heads),
            d_head=cfg.head_dim,
            d_ff=f,
            experts=experts,
        )
        return Shares(
            rank=self.rank,
            heads=heads,
            kv_heads=kv_heads,
            ffn=range(self.rank * f, (self.rank + 1) * f),
            vocab_rows=rows,
            vocab=range(self.rank * rows, min((self.rank + 1) * rows, cfg.vocab_size)),
            local=local,
            # norms over every head together: the whole q's and k's widths, and how many
            # ranks hold each K/V head (1, or a replica each when fewer heads than ranks)
            qk_widths=(
                cfg.n_heads * cfg.head_dim,
                kv * cfg.head_dim,
                self.world // kv if kv < self.world else 1,
            ),
            qk_norm_all=cfg.qk_norm == "all",
        )

    # ---- the collectives -------------------------------------------------------------

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def norm_qk(
        self, q: Tensor, k: Tensor, q_norm: Any, k_norm: Any, widths: tuple[int, int, int]
    ) -> tuple[Tensor, Tensor]:
        """RMSNorms over the whole q and the whole k (widths: qk_widths) of which this
        rank holds q and k: one all-reduce of both sums of squares, each K/V head's
        counted once, then each rank scales its own features (in fp32, as RMSNorm)."""
        q_width, k_width, replicas = widths
        sums = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=1)
        sums = self.all_reduce(sums)
        q_ms, k_ms = sums[:, :1] / q_width, sums[:, 1:] / (k_width * replicas)
        q_out = q_norm.weight * (q.float() * torch.rsqrt(q_ms + q_norm.eps)).to(q.dtype)
        k_out = k_norm.weight * (k.float() * torch.rsqrt(k_ms + k_norm.eps)).to(k.dtype)
        return q_out, k_out

    def embed(self, table: Tensor, tokens: Tensor) -> Tensor:
        """(T,) token ids -> (T, d): each rank looks up the ids in its rows, zeros for
        the rest, and the sum over ranks is the embedding."""
        n = table.shape[0]
        local = tokens - self.rank * n
        inside = (local >= 0) & (local < n)
        x = F.embedding(local.clamp(0, n - 1), table) * inside[:, None].to(table.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: Tensor, vocab_size: int) -> Tensor:
        """(T, rows) of this rank's vocab -> (T, vocab_size) on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def _scaled(heads: range, size: int) -> range:
    return range(heads.start * size, heads.stop * size)


# ---- joining the ranks -----------------------------------------------------------------


def env_rank() -> int:
    """This process's rank as torchrun (or kvserve's own launcher) set it; 0 alone."""
    return int(os.environ.get("RANK", "0"))


# how long a rank waits for every other rank to join the group: ranks start side by side
# but reach the join apart by their start-up (imports, a loaded host), which is not what
# --rank-timeout bounds; a rank that never arrives still fails the join
JOIN_TIMEOUT_FLOOR_S = 60.0


def _store(rank: int, world: int, timeout: timedelta) -> tuple[dist.Store, int]:
    """Where the ranks meet: served by rank 0 on MASTER_ADDR:MASTER_PORT and that address
    alone (torch's env:// rendezvous listens on every interface, for as long as the
    group lives); under torchrun, its agent's store, as env:// finds it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store, rank, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        return store, rank
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout=timeout), rank
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    fd = listener.detach()  # the store's from here on
    return dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=fd), rank


def join(world: int, device: torch.device, timeout_s: float) -> TensorParallel:
    """Join the process group of `world` ranks (from RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT): NCCL on CUDA, gloo on the CPU. A collective that waits longer than
    `timeout_s` for a rank raises, so a dead or hung rank cannot hang the others; the
    join itself waits max(timeout_s, JOIN_TIMEOUT_FLOOR_S) for the last rank."""
    given = int(os.environ.get("WORLD_SIZE", world))
    if given != world:
        raise ValueError(f"tensor_parallel_size is {world} but WORLD_SIZE is {given}")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"tensor_parallel_size {world} needs {' and '.join(missing)} (set by torchrun, "
            "or by `kvserve serve` when it starts the ranks itself)"
        )
    if not dist.is_initialized():
        # torch.distributed.nn takes the default group as its functions' default argument
        # when it is first imported, and the first module built on the meta device
        # imports it (through torch._dynamo): imported after the group exists, it would
        # keep the group alive past destroy_process_group, its gloo threads would outlive
        # the interpreter, and a rank could abort as it exits. Imported here, it holds None.
        import torch.distributed.nn  # noqa: F401

        joining = timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_FLOOR_S))
        store, rank = _store(env_rank(), world, joining)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return TensorParallel(dist.get_rank(), world)
