"""--quantization int4's mix on the cpu backend (model/int4_mix.py): int4 for most
linears, int8g for the head and in llama.cpp's more-bits layers the (q | k | v) and down
projections, int5 for the other linears whose rows are not whole 256-feature K-quant
blocks; the audit counts what the packed model holds."""

from __future__ import annotations

import pytest
import torch

from model.audit import Held, idle_expert_bytes, read_bytes, weight_bytes
from model.backends.cpu import prepare_model
from model.backends.cpu.packed import PackedExperts, held_bytes
from model.config import Experts
from model.int4_mix import more_bits
from tests.factories import tiny_model

# every output width a whole 64-row block: the packed model holds no padding rows; every
# input width a whole K-quant block but NARROW's (64 wide: its linears' rows are not)
DENSE = dict(vocab_size=128, d_model=256, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=512)
MOE = DENSE | dict(tie_embeddings=False, experts=Experts(n_experts=64, top_k=4, d_ff=256))
NARROW = DENSE | dict(d_model=64, d_ff=256)


def test_more_bits_layers_are_llama_cpps_use_more_bits() -> None:
    """The first and last eighth of 32 layers and every third between (llama.cpp's
    use_more_bits, which gives Q4_K_M's V and down projections Q6_K); of 8 layers the
    first, the last and 3 and 6."""
    between = {6, 9, 12, 15, 18, 21, 24, 27}
    assert {i for i in range(32) if more_bits(i, 32)} == {0, 1, 2, 3, 28, 29, 30, 31} | between
    assert [i for i in range(8) if more_bits(i, 8)] == [0, 3, 6, 7]


def _kinds(block: torch.nn.Module) -> tuple[str, str, set[str], set[str]]:
    """(q | k | v)'s, the attention output's, (gate | up)'s and down's kinds."""
    ffn = block.ffn
    ffns = ffn.experts.ffns if isinstance(getattr(ffn, "experts", None), PackedExperts) else [ffn]
    ins, downs = {f.w_in.quant for f in ffns}, {f.w_out.quant for f in ffns}
    return block.attn.wqkv.quant, block.attn.wo.quant, ins, downs


@pytest.mark.parametrize(
    "fields", [DENSE, MOE, NARROW], ids=["dense-tied", "moe-untied", "narrow-rows"]
)
def test_the_mix_is_packed_and_counted(fields: dict) -> None:
    """Each layer's kinds: (q | k | v) and down int8g in the more-bits layers, int4
    elsewhere, the attention output and (gate | up) int4 everywhere, the head (a tied
    one's copy) int8g, a router in bf16; where the model is 64 wide, every linear but
    down int5 where it is not int8g (llama.cpp's Q5_0 where Q4_K's blocks do not fit); the
    packed model's bytes are the audit's, a mixture's idle experts' bytes are its
    packed experts', and a step's reads from the bytes the server measures
    (model.audit.Held) are the config's."""
    model = tiny_model(**fields).to(torch.bfloat16)
    cfg = model.cfg
    assert prepare_model(model, "int4")
    narrow = "int5" if cfg.d_model % 256 else "int4"
    for i, block in enumerate(model.layers):
        more = "int8g" if more_bits(i, cfg.n_layers) else "int4"
        qkv = more if more == "int8g" else narrow
        assert _kinds(block) == (qkv, narrow, {narrow}, {more})
    assert model.lm_head.quant == "int8g"
    assert held_bytes(model) == weight_bytes(cfg, "bfloat16", "int4")
    if cfg.experts is None:
        return
    per_expert = sum(
        f.w_in._tiles.nbytes + f.w_out._tiles.nbytes
        for block in model.layers
        for f in block.ffn.experts.ffns[:1]
    )
    touched = 64 * (1 - (1 - 4 / 64) ** 3)
    assert idle_expert_bytes(cfg, "bfloat16", "int4", 3) == pytest.approx(
        (64 - touched) * per_expert
    )
    experts = sum(held_bytes(block.ffn.experts) for block in model.layers)
    held = Held(held_bytes(model), experts, head_copy=True)  # as the server measures it
    assert read_bytes(cfg, "bfloat16", held=held) == pytest.approx(
        read_bytes(cfg, "bfloat16", "int4")
    )
