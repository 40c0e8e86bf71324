"""Norms, feed-forward blocks and position encodings."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import LinearRope, LongRope, ModelConfig, RopeScaling, Yarn

if TYPE_CHECKING:
    from model.adapters import LayerAdapters


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * gamma, computed in fp32 (eps inside the root)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with bias, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, cfg.norm_eps)


class GatedFFN(nn.Module):
    """W_down(act(W_gate x) * W_up x); gate and up are one fused matmul (gate | up)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.d_ff = cfg.d_ff
        self.w_in = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=cfg.mlp_bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    # act(gate) * up from w_in's output in one kernel, where a backend's prepare() gives
    # one (the triton backend's silu_mul for SwiGLU); None: torch's ops
    gate_mul: Callable[[Tensor], Tensor] | None = None
    lora: LayerAdapters | None = None  # its layer's LoRA deltas (model/adapters.py's attach)

    def act(self, gate: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        both = self.w_in(x)
        if self.lora is not None:
            both = self.lora.add("ffn.w_in", x, both)
        if self.gate_mul is not None:
            h = self.gate_mul(both)
        else:
            gate, up = both.split(self.d_ff, dim=-1)  # (T, d_ff) each
            h = self.act(gate) * up
        if self.lora is not None:
            return self.lora.add("ffn.w_out", h, self.w_out(h))
        return self.w_out(h)


class SwiGLU(GatedFFN):
    """Llama's: silu gate (the CPU's packed linears fuse it, model/backends/cpu/packed.py)."""

    def act(self, gate: Tensor) -> Tensor:
        return F.silu(gate)


class GeGLU(GatedFFN):
    """Gemma's: tanh-GELU gate."""

    def act(self, gate: Tensor) -> Tensor:
        return F.gelu(gate, approximate="tanh")


_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """Classic two-layer MLP with GELU or ReLU."""

    lora: LayerAdapters | None = None  # its layer's LoRA deltas (model/adapters.py's attach)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[cfg.ffn]
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.lora is None:
            return self.w_out(self.act(self.w_in(x)))
        h = self.act(self.lora.add("ffn.w_in", x, self.w_in(x)))
        return self.lora.add("ffn.w_out", h, self.w_out(h))


def make_ffn(cfg: ModelConfig) -> nn.Module:
    gated = {"swiglu": SwiGLU, "geglu": GeGLU}
    return gated[cfg.ffn](cfg) if cfg.ffn in gated else MLP(cfg)


# ---- positions -------------------------------------------------------------------------


def rope_inv_freq(d_head: int, theta: float, scaling: RopeScaling | LinearRope | None) -> Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head))
    if scaling is None:
        return inv_freq.float()
    if isinstance(scaling, LinearRope):
        return (inv_freq / scaling.factor).float()
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    old = scaling.original_max_position
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    out = torch.where(wavelen < high_wavelen, inv_freq, out)
    return out.float()


def local_rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """The windowed layers' own tables (Gemma 3: another base, no scaling), or None."""
    if cfg.local_rope_theta is None:
        return None
    return rope_tables(cfg.replace(rope_theta=cfg.local_rope_theta, rope_scaling=None), device)


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin tables (max_position, d_head) in the HF "rotate half" layout (dim j
    turns with dim j + d_head/2), fp32. With partial rotary (rotary_dim r < d_head) the
    first r/2 pairs turn at the frequencies of an r-dimensional rotation and the others
    keep still (cos 1, sin 0): kvserve's layout of such a head (rotary_order). LongRoPE's
    tables are twice as long (_long_rope_freqs)."""
    t = torch.arange(cfg.max_position, device=device, dtype=torch.float32)
    scaling, half = cfg.rope_scaling, cfg.head_dim // 2
    if isinstance(scaling, LongRope):
        freqs, scale = _long_rope_freqs(cfg, scaling, t), scaling.attention_factor
    elif isinstance(scaling, Yarn):
        inv_freq = yarn_inv_freq(cfg.rotary, cfg.rope_theta, scaling).to(device)
        freqs, scale = torch.outer(t, inv_freq), scaling.attention_factor
    else:
        inv_freq = rope_inv_freq(cfg.rotary, cfg.rope_theta, scaling).to(device)
        freqs, scale = torch.outer(t, inv_freq), 1.0  # (P, rotary/2)
    rows = freqs.shape[0]
    cos, sin = torch.ones(rows, half, device=device), torch.zeros(rows, half, device=device)
    cos[:, : freqs.shape[1]], sin[:, : freqs.shape[1]] = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (rows, d_head)


def yarn_inv_freq(d_head: int, theta: float, yarn: Yarn) -> Tensor:
    """YaRN's frequencies, in float32 as transformers computes them: each pair's own
    (extrapolated) or over `factor` (interpolated), blended by a linear ramp between
    the pairs that turn beta_fast and beta_slow times over the pretraining length."""

    def pair_of(turns: float) -> float:  # the pair that turns `turns` times
        return (d_head * math.log(yarn.original_max_position / (turns * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = pair_of(yarn.beta_fast), pair_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_head - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    powers = theta ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
    ramp = ((torch.arange(d_head // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    own = 1 - ramp  # the share of each pair's own frequency
    return (1.0 / (yarn.factor * powers)) * (1 - own) + (1.0 / powers) * own


def _long_rope_freqs(cfg: ModelConfig, scaling: LongRope, t: Tensor) -> Tensor:
    """LongRoPE's angles (2P, rotary/2). transformers picks one set of factors for a
    whole sequence by its length: the short ones within the pretraining length, the long
    ones past it. Rows 0..P-1 turn a position by the short factors below the pretraining
    length and the long ones from it on (a sequence that crosses it while it generates:
    its cached K keeps its rotation, as transformers' cache does); rows P..2P-1 turn every
    position by the long ones (a sequence whose prompt is past it:
    Transformer.rope_rows)."""
    base = rope_inv_freq(cfg.rotary, cfg.rope_theta, None).to(t.device)
    short = base / torch.tensor(scaling.short_factor, device=t.device)
    long = base / torch.tensor(scaling.long_factor, device=t.device)
    inv_freq = torch.where((t < scaling.original_max_position)[:, None], short, long)
    return torch.cat((t[:, None] * inv_freq, t[:, None] * long))


def rotary_order(head_dim: int, rotary_dim: int) -> Tensor:
    """For a partially rotated head, which of the checkpoint's dimensions goes to each of
    ours. The checkpoint turns dim i with i + r/2 (i < r/2) and passes r..d-1 through;
    kvserve turns dim j with j + d/2, so its rotated pairs go to j < r/2 and the
    passed-through dims fill the rest. q and k are reordered alike (rows of the q and k
    projections), so every score q.k is unchanged; v is not."""
    r = rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))
    rest = (head_dim - rotary_dim) // 2
    return torch.tensor(list(range(r)) + passed[:rest] + list(range(r, rotary_dim)) + passed[rest:])


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (T, heads, d_head); cos/sin: (T, d_head) already gathered at the tokens' positions."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def sinusoidal_table(max_position: int, d_model: int, device: torch.device) -> Tensor:
    """The 2017 Transformer's fixed table: sin on even, cos on odd channels."""
    pos = torch.arange(max_position, dtype=torch.float64, device=device).unsqueeze(1)
    div = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
        * (-math.log(10000.0) / d_model)
    )
    table = torch.zeros(max_position, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table.float()


def alibi_slopes(n_heads: int) -> Tensor:
    """Per-head ALiBi slopes (Press et al.), including the non-power-of-two rule."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
