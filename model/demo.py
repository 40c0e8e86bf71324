"""The default demo model: a small Llama-style config over the cl100k vocabulary with
deterministic, seeded random weights. It produces no meaningful text; it exists so the
service starts in seconds with no checkpoint, and its id says so."""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.transformer import Transformer

DEMO_MODEL_ID = "kvserve-demo-random"
CL100K_VOCAB = 100277  # cl100k_base: 100,256 BPE ranks + special tokens up to 100,276
CL100K_EOS = 100257  # <|endoftext|>


def demo_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=CL100K_VOCAB,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=704,
        max_position=4096,
        rope_theta=10000.0,
        tie_embeddings=True,
        name=DEMO_MODEL_ID,
        architecture="LlamaForCausalLM",
        eos_token_ids=(CL100K_EOS,),
    )


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic init: N(0, std) matrices and embeddings, zero biases, unit norms."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if param.dim() >= 2:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
        elif name.endswith("bias"):
            values = torch.zeros(param.shape)
        else:
            values = torch.ones(param.shape)
        param.copy_(values)


def build_demo_model(
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> Transformer:
    model = Transformer(demo_config())
    init_weights(model, seed)
    return model.to(dtype=dtype, device=device).eval()
