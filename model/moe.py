"""A mixture of experts in place of a block's FFN (ModelConfig.experts).

A router scores every expert for each token; the token runs its `top_k` best and sums
their outputs by the router's weights. Execution reads each expert's weights once a step:
the step's (token, choice) pairs are sorted by expert, each chosen expert runs once over
all of its tokens, and the outputs are scattered back scaled by their weights. This torch
form is the reference every backend's experts are checked against; a backend's prepare
may swap `MoE.experts` for its own GroupedExperts (the CPU's packed kernels, the GPU's
Triton kernels, which read nothing on the host and so run inside CUDA graphs).

Under tensor parallelism each rank holds every expert's share of the intermediate
features (and of the shared expert's): its output is a partial sum, all-reduced by the
block with the attention's, and the router runs replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import Experts as ExpertSpec
from model.config import ModelConfig
from model.layers import SwiGLU


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits (T, E) -> the chosen experts' weights (T, k) in the logits' dtype
    and their ids (T, k): the softmax over every expert in fp32 at the top k, divided by
    their sum where `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def linear_quantization(parent: nn.Module, name: str, quantization: str) -> str:
    """What linear `name` of module `parent` is held as under `quantization`: a
    mixture's router in the serving dtype ('none') under a quantization that rounds
    weights again (int4, int8, fp8), since its few thousand weights a layer choose every
    token's experts and a rounding there swaps whole expert outputs (llama.cpp's
    quantizer keeps it in F32, vLLM's quantized mixtures leave it unquantized); under
    'auto' a checkpoint's own integer router as stored. Any other linear: `quantization`."""
    if isinstance(parent, MoE) and name == "router" and quantization != "auto":
        return "none"
    return quantization


class GroupedExperts(nn.Module):
    """Runs each chosen expert once over the tokens routed to it; `run` is one expert's
    SwiGLU over its tokens, by whatever weights a subclass holds."""

    n_experts: int

    def run(self, expert: int, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x (T, d), weights and ids (T, k) -> sum over k of weight * expert(x), (T, d)."""
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (T * k,) choices grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        tokens = order // top_k
        scale = weights.flatten().index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                y = self.run(expert, x.index_select(0, rows)) * scale[start : start + n]
                out.index_add_(0, rows, y)
                start += n
        return out


class Experts(GroupedExperts):
    """Every expert's weights stacked: w_in (E, 2 * d_ff, d) of (gate | up) rows, w_out
    (E, d, d_ff), and with `spec.bias` their biases b_in (E, 2 * d_ff), b_out (E, d)."""

    def __init__(self, spec: ExpertSpec, d_model: int) -> None:
        super().__init__()
        self.n_experts, self.d_ff, self.clamped = spec.n_experts, spec.d_ff, spec.clamped
        self.w_in = nn.Parameter(torch.empty(spec.n_experts, 2 * spec.d_ff, d_model))
        self.w_out = nn.Parameter(torch.empty(spec.n_experts, d_model, spec.d_ff))
        self.b_in = self.b_out = None
        if spec.bias:
            self.b_in = nn.Parameter(torch.zeros(spec.n_experts, 2 * spec.d_ff))
            self.b_out = nn.Parameter(torch.zeros(spec.n_experts, d_model))

    def run(self, expert: int, x: Tensor) -> Tensor:
        b_in = self.b_in[expert] if self.b_in is not None else None
        b_out = self.b_out[expert] if self.b_out is not None else None
        gate, up = F.linear(x, self.w_in[expert], b_in).split(self.d_ff, dim=-1)
        return F.linear(gated(gate, up, self.clamped), self.w_out[expert], b_out)


def gated(gate: Tensor, up: Tensor, clamped: tuple[float, float] | None) -> Tensor:
    """An expert's activation: silu(gate) * up, or gpt-oss's clamped SwiGLU (clamped:
    (alpha, limit)), gate clamped below limit and up to +-limit, then (up + 1) * gate *
    sigmoid(alpha * gate)."""
    if clamped is None:
        return F.silu(gate) * up
    alpha, limit = clamped
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoE(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a shared expert behind a sigmoid gate.
    cfg: this rank's shapes (its experts' d_ff, TensorParallel.local_config)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        spec = cfg.experts
        assert spec is not None
        self.top_k, self.normalize = spec.top_k, spec.norm_top_k
        self.router = nn.Linear(cfg.d_model, spec.n_experts, bias=spec.router_bias)
        self.experts: GroupedExperts = Experts(spec, cfg.d_model)
        self.shared: nn.Module | None = None
        if spec.shared_d_ff:
            self.shared = SwiGLU(cfg.replace(d_ff=spec.shared_d_ff, mlp_bias=False))
            self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False)

    # the routing, where a backend's prepare gives its own (the CPU's in C for a bf16
    # model, which its decoder stack routes by too); None: route() above
    route_fn: Callable[[Tensor, int, bool], tuple[Tensor, Tensor]] | None = None
    # the tokens routed to each expert so far (E,) int64, where they are counted
    # (count_experts; the CPU's decoder stack adds into it too); None: not counted
    load: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        choose = self.route_fn or route
        weights, ids = choose(self.router(x), self.top_k, self.normalize)
        if self.load is not None:  # no host sync (bincount's size would be one on CUDA)
            flat = ids.flatten()
            self.load.scatter_add_(0, flat, torch.ones_like(flat))
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


def count_experts(model: nn.Module, device: torch.device) -> list[Tensor]:
    """Count the tokens each mixture of `model` (on `device`) routes to each of its
    experts from now on: one (E,) int64 counter a mixture, in layer order (empty for a
    dense model); counting again starts the same counters from zero."""
    counters = []
    for module in model.modules():
        if isinstance(module, MoE):
            if module.load is None:
                experts = module.router.out_features
                module.load = torch.zeros(experts, dtype=torch.int64, device=device)
            counters.append(module.load.zero_())
    return counters
