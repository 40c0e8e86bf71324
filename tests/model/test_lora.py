"""PEFT LoRA adapters read onto kvserve's fused linears (model/lora.py): adapters written by
`peft` itself on a transformers checkpoint give peft's own logits (adapter applied, not
merged) within 1e-4 in float32 through the model's own layers (model/adapters.py's
attach), each row of a mixed batch takes its own adapter's delta,
and what kvserve cannot serve is refused naming it."""

import json

import pytest
import torch

from model.adapters import Adapters, LoraBank, attach, blocked, lora_delta
from model.lora import AdapterError, read_adapter
from model.weights import load_model
from tests.factories import write_adapter, write_llama, write_qwen2

CASES = {
    "every projection, rank 8": dict(
        r=8,
        lora_alpha=16,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "q and v, rsLoRA": dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]
    ),
    "k, up and down, per-module rank and alpha": dict(
        r=6,
        lora_alpha=12,
        target_modules=["k_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"k_proj": 3},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("writer", [write_llama, write_qwen2], ids=["llama", "qwen2"])
@torch.no_grad()
def test_an_adapter_peft_wrote_gives_peft_models_logits(case, writer, tmp_path) -> None:
    base = tmp_path / "base"
    hf = writer(base, tied=False) if writer is write_llama else writer(base)
    ids = torch.randint(0, 200, (1, 24))
    want = write_adapter(hf, tmp_path / "adapter", 1, **CASES[case])(ids).logits[0]
    model = load_model(base, dtype=torch.float32)
    adapter = read_adapter(tmp_path / "adapter", model.cfg, "a", max_rank=8)
    bank = LoraBank(model.cfg, 2, 8, "cpu", torch.float32)
    bank.load(adapter, 1)
    adapters = Adapters(bank)
    attach(model, adapters)
    adapters.rows = torch.full((24,), 1)
    got = model(ids[0]).float()
    assert (got - want).abs().max().item() < 1e-4
    adapters.rows = None
    assert (model(ids[0]).float() - want).abs().max().item() > 1e-2  # the adapter mattered


def test_the_bank_knows_where_each_slots_stacks_are_not_zero(tmp_path) -> None:
    """ranks: the rows of A up to its last nonzero one; spans: each block of B's first
    and past-last nonzero rank, so q's ranks are skipped in v's blocks, and k's blocks,
    which a q-and-v adapter leaves alone, have none (what the CPU's kernel skips)."""
    # q 4 heads of 32 (two blocks), k and v 2 heads of 32 (a block each)
    hf = write_llama(
        tmp_path / "base", tied=False, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )
    write_adapter(hf, tmp_path / "adapter", 1, **CASES["q and v, rsLoRA"])
    model = load_model(tmp_path / "base", dtype=torch.float32)
    bank = LoraBank(model.cfg, 2, 8, "cpu", torch.float32)
    bank.load(read_adapter(tmp_path / "adapter", model.cfg, "a", max_rank=8), 1)
    key = "layers.0.attn.wqkv"
    assert bank.ranks[key].tolist() == [0, 8]  # q's 4 ranks, then v's, of a width of 24
    assert bank.spans[key][1].tolist() == [[0, 4], [0, 4], [0, 0], [4, 8]]
    assert bank.spans[key][0].eq(0).all() and bank.ranks["layers.0.ffn.w_in"].eq(0).all()


def test_each_row_takes_its_own_adapters_delta() -> None:
    """A batch of rows of two adapters and the base model: each row's delta is its own
    adapter's B @ A @ x alone, zero for the base model's rows."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 16, generator=gen)
    b = torch.randn(3, 12, 5, generator=gen)
    x = torch.randn(6, 16, generator=gen)
    slots = torch.tensor([-1, 0, 2, 0, -1, 1])
    got = lora_delta(x, a, torch.stack([blocked(m.t()) for m in b]), slots, 12)
    for row, slot in enumerate(slots.tolist()):
        want = torch.zeros(12) if slot < 0 else b[slot] @ (a[slot] @ x[row])
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def test_what_kvserve_cannot_serve_is_refused_naming_it(tmp_path) -> None:
    base = tmp_path / "base"
    hf = write_llama(base, tied=False)
    cfg = load_model(base, dtype=torch.float32).cfg
    write_adapter(hf, tmp_path / "head", 0, r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match="lm_head"):
        read_adapter(tmp_path / "head", cfg, "h", max_rank=8)
    hf = write_llama(tmp_path / "base2", tied=False)
    write_adapter(hf, tmp_path / "wide", 0, r=16, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="rank 16 is over --max-lora-rank 8"):
        read_adapter(tmp_path / "wide", cfg, "w", max_rank=8)
    config = tmp_path / "wide" / "adapter_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter(tmp_path / "wide", cfg, "w", max_rank=32)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path, cfg, "none", max_rank=8)
