"""LoRA adapters on a running model: a bank of adapters in slots, each row's delta, and
the model's layers adding them.

An adapter (model/lora.py reads PEFT's folders) is, for each of our linears it adapts,
one low-rank pair: A (R, in) and B (out, R), its scaling folded into B. A bank holds
several adapters at once, each in a slot of padded stacks; the delta of a flattened
batch takes each row's slot (-1: the base model, no delta). `lora_delta` is the torch
reference of that gathered product (Punica's BGMV: a gather of each row's pair, then two
thin products).

`Adapters` puts a bank on a model (`attach`): each decoder layer's attention and dense
FFN add their linears' deltas for the rows of the step being run (`Adapters.rows`, set
by the engine's runner; None while no row takes an adapter, when the layers run as
without one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.audit import layer_linear_shapes
from model.config import ModelConfig

# our linears an adapter may adapt, in a decoder layer (audit.layer_linear_shapes' order)
LINEARS = ("attn.wqkv", "attn.wo", "ffn.w_in", "ffn.w_out")
BLOCK = 64  # output features of a block of B's stacks (LoraBank)


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    rank: int  # the largest of its projections' ranks
    # our linear's name ("layers.3.attn.wqkv") -> (A (R, in), B (out, R), scaling in B)
    linears: dict[str, tuple[Tensor, Tensor]]
    # its files' SHA-256: what the prefix cache keys its K/V by (not the name, which a
    # reload may give other weights)
    digest: str = ""


def adapted_linears(cfg: ModelConfig) -> list[tuple[int, str]]:
    """(layer, linear) of every linear an adapter may adapt (a mixture's layers have no
    dense FFN: their experts are not adapted)."""
    return [
        (i, linear)
        for i in range(cfg.n_layers)
        for linear in LINEARS
        if not (linear.startswith("ffn.") and cfg.sparse(i))
    ]


def linear_shape(cfg: ModelConfig, linear: str) -> tuple[int, int]:
    """(in, out) features of our linear."""
    return dict(zip(LINEARS, layer_linear_shapes(cfg), strict=True))[linear]


def _projections(cfg: ModelConfig, linear: str) -> int:
    """How many checkpoint projections our linear fuses, each with its own rank: q, k
    and v; gate and up."""
    return {"attn.wqkv": 3, "ffn.w_in": 2 if cfg.gated else 1}.get(linear, 1)


class LoraBank:
    """Adapters in `slots` slots, each linear's pairs in padded stacks: A (S, R, in) and
    B transposed in blocks of BLOCK output features, bt (S, out / BLOCK, R, BLOCK) (what
    a block of features reads of every rank, contiguous: the CPU's kernel streams it),
    R the widest pair an adapter of --max-lora-rank can have there.

    Most of a stack is zero: the ranks past an adapter's own, and in a fused linear each
    projection's ranks outside its own features' blocks (q's ranks in k's blocks). The
    ranks that are not, on the host, let the CPU's kernel skip the rest (the sums it
    leaves out are exact zeros): ranks (S,), the rows of A up to its last nonzero one,
    and spans (S, out / BLOCK, 2), each block's first and past-last nonzero rank."""

    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, device, dtype) -> None:
        self.a: dict[str, Tensor] = {}
        self.bt: dict[str, Tensor] = {}
        self.ranks: dict[str, Tensor] = {}
        self.spans: dict[str, Tensor] = {}
        self.slots = slots
        for i, linear in adapted_linears(cfg):
            n_in, n_out = linear_shape(cfg, linear)
            width = _projections(cfg, linear) * max_rank
            key = f"layers.{i}.{linear}"
            self.a[key] = torch.zeros(slots, width, n_in, device=device, dtype=dtype)
            blocks = -(-n_out // BLOCK)
            self.bt[key] = torch.zeros(slots, blocks, width, BLOCK, device=device, dtype=dtype)
            self.ranks[key] = torch.zeros(slots, dtype=torch.int32)
            self.spans[key] = torch.zeros(slots, blocks, 2, dtype=torch.int32)

    @property
    def nbytes(self) -> int:
        """What the stacks take on the device (every slot, at the widest rank)."""
        return sum(t.nbytes for stacks in (self.a, self.bt) for t in stacks.values())

    def load(self, adapter: LoraAdapter, slot: int) -> None:
        """`adapter` into `slot`, every linear it leaves alone zero there."""
        for key, a in self.a.items():
            a[slot].zero_()
            self.bt[key][slot].zero_()
            self.ranks[key][slot], self.spans[key][slot] = 0, 0
            if key in adapter.linears:
                # where they are not zero, from the host's copy (no device work)
                pa, pb = adapter.linears[key]
                bt = blocked(pb.t())
                a[slot, : pa.shape[0]] = pa
                self.bt[key][slot, :, : pb.shape[1]] = bt
                self.ranks[key][slot] = _extent(pa.ne(0).any(-1))[1]
                self.spans[key][slot] = _extent(bt.ne(0).any(-1))


def _extent(nonzero: Tensor) -> Tensor:
    """[first, past-last) of the True entries along nonzero's last dim ([0, 0]: none)."""
    n = nonzero.shape[-1]
    first = torch.where(nonzero.any(-1), nonzero.int().argmax(-1), 0)
    last = torch.where(nonzero.any(-1), n - nonzero.flip(-1).int().argmax(-1), 0)
    return torch.stack([first, last], -1).to(torch.int32)


def blocked(bt: Tensor) -> Tensor:
    """B transposed (R, out) in LoraBank's blocks, (out / BLOCK, R, BLOCK), zero-padded."""
    padded = torch.nn.functional.pad(bt, (0, -bt.shape[1] % BLOCK))
    return padded.unflatten(1, (-1, BLOCK)).transpose(0, 1)


# y with each row's delta added: (x (T, in), a, bt, slots (T,), y (T, out)) -> y
AddDelta = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def add_delta(x: Tensor, a: Tensor, bt: Tensor, slots: Tensor, y: Tensor) -> Tensor:
    """The torch reference's AddDelta: y + each row's delta, rounded to y's dtype first."""
    return y + lora_delta(x, a, bt, slots, y.shape[-1])


def lora_delta(x: Tensor, a: Tensor, bt: Tensor, slots: Tensor, out: int) -> Tensor:
    """Each row's delta, B[slot] @ (A[slot] @ x) (a row of slot -1: zero), for x (T, in),
    stacks a (S, R, in) and bt (S, out / BLOCK, R, BLOCK) (LoraBank's), slots (T,), `out`
    features: the gathered product, in float32, returned in x's dtype."""
    take = slots.clamp(min=0)
    low = torch.einsum("tri,ti->tr", a[take].float(), x.float())
    delta = torch.einsum("tbrc,tr->tbc", bt[take].float(), low).flatten(1)[:, :out]
    return (delta * (slots >= 0).unsqueeze(1)).to(x.dtype)


class Adapters:
    """A model's adapters: those it serves, in host memory (`known`), the bank some of
    them sit in on the device, and the slot each row of the step being run takes: rows
    (T,) on the model's device, or None (no row takes an adapter: the layers add
    nothing). Under tensor parallelism each rank holds its share of every adapter."""

    def __init__(self, bank: LoraBank) -> None:
        self.bank = bank
        self.known: dict[str, LoraAdapter] = {}
        self.rows: Tensor | None = None
        self.kernel: AddDelta = add_delta  # how y gets its rows' deltas (attach sets it)

    def fill(self, name: str, slot: int) -> None:
        """The adapter `name` into the bank's `slot`."""
        self.bank.load(self.known[name], slot)

    def add(self, linear: str, x: Tensor, y: Tensor) -> Tensor:
        """y, the output of `linear` ("layers.3.attn.wqkv") for input x, with each row's
        delta added."""
        if self.rows is None or linear not in self.bank.a:
            return y
        bank = self.bank
        flat, out = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        return self.kernel(flat, bank.a[linear], bank.bt[linear], self.rows, out).view(y.shape)


@dataclass(frozen=True, slots=True)
class LayerAdapters:
    """What one decoder layer's modules call (their `lora`): Adapters.add by the
    linear's name within the layer ("attn.wqkv")."""

    adapters: Adapters
    layer: int

    @property
    def active(self) -> bool:
        return self.adapters.rows is not None

    def add(self, linear: str, x: Tensor, y: Tensor) -> Tensor:
        return self.adapters.add(f"layers.{self.layer}.{linear}", x, y)


def attach(model: nn.Module, adapters: Adapters, kernel: AddDelta | None = None) -> None:
    """Put `adapters` on a Transformer whose backend has prepared its layers: each
    layer's attention and dense FFN add their deltas (a mixture's experts are not
    adapted) by `kernel` (the backend's lora_add; None: the torch reference's), and so
    does the backend's one call for the layers where it has one."""
    model.adapters = adapters
    adapters.kernel = kernel or add_delta
    if model.fused_layers is not None:
        model.fused_layers.adapt(adapters)
    for i, block in enumerate(model.layers):
        site = LayerAdapters(adapters, i)
        block.attn.lora = site
        if not model.cfg.sparse(i):
            block.ffn.lora = site
