"""Which share of every weight a tensor-parallel rank holds (model/parallel.py), checked
without a process group: each rank's parameters, loaded from the checkpoint (its share of
each tensor only), are the right slices of the whole model's."""

from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.parallel import TensorParallel, unsplittable
from model.weights import load_model, share_of
from tests.factories import (
    write_gpt2,
    write_gpt_oss,
    write_llama,
    write_olmo2,
    write_qwen2,
    write_qwen2_moe,
)

WRITERS = {
    "llama": lambda p: write_llama(p, tied=False),  # 8 heads, 2 K/V heads
    "qwen2": write_qwen2,
    "gpt2": write_gpt2,  # Conv1D weights stored transposed, q|k|v in one tensor
    "olmo2": write_olmo2,  # q/k norms' weights over every head: each rank its heads'
    "qwen2_moe": write_qwen2_moe,  # each expert's features and the shared expert's split
    # experts stored (in, out) with gate and up interleaved, biases, a sink per head
    "gpt_oss": write_gpt_oss,
}


def cfg(**kw: object) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 101, "d_model": 64, "n_layers": 1, "n_heads": 8,
                          "n_kv_heads": 2, "d_ff": 96} | kw)  # fmt: skip


def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks() -> None:
    c = cfg()
    assert [TensorParallel(r, 2).shares(c).kv_heads for r in range(2)] == [
        range(0, 1),
        range(1, 2),
    ]
    # 4 ranks, 2 K/V heads: ranks 0-1 read K/V head 0, ranks 2-3 head 1
    assert [TensorParallel(r, 4).shares(c).kv_heads.start for r in range(4)] == [0, 0, 1, 1]
    last = TensorParallel(3, 4).shares(c)
    local = last.local
    assert (local.n_heads, local.kv_heads, local.head_dim, local.d_ff) == (2, 1, 8, 24)
    # the vocab padded to a multiple of the ranks: 101 -> 4 x 26, the last rank 23 real rows
    assert last.vocab == range(78, 101) and last.vocab_rows == 26


@pytest.mark.parametrize(
    ("kw", "world", "why"),
    [
        ({}, 3, "8 attention heads do not split over 3 ranks"),
        ({"n_kv_heads": 4, "n_heads": 12, "d_model": 96}, 6, "4 K/V heads do not split over 6"),
        ({"d_ff": 90}, 4, "d_ff 90 does not split over 4 ranks"),
        ({}, 0, "must be >= 1"),
    ],
)
def test_a_model_that_does_not_split_says_why(kw: dict, world: int, why: str) -> None:
    assert why in (unsplittable(cfg(**kw), world) or "")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", list(WRITERS))
@torch.no_grad()
def test_each_rank_loads_its_slices_of_the_checkpoint(
    family: str, world: int, tmp_path: Path
) -> None:
    WRITERS[family](tmp_path)
    whole = load_model(tmp_path)
    c = whole.cfg
    dh = c.head_dim
    for rank in range(world):
        tp = TensorParallel(rank, world)
        share = load_model(tmp_path, tp=tp)
        assert share_of(whole, tp).state_dict().keys() == share.state_dict().keys()
        for name, p in share_of(whole, tp).named_parameters():  # the in-memory cut agrees
            assert torch.equal(p, dict(share.named_parameters())[name]), name
        shares = tp.shares(c)
        heads, kv, ff = shares.heads, shares.kv_heads, shares.ffn
        w, s = whole.layers[1], share.layers[1]
        q = w.attn.wqkv.weight[heads.start * dh : heads.stop * dh]
        k_at, v_at = c.n_heads * dh, (c.n_heads + c.kv_heads) * dh
        k = w.attn.wqkv.weight[k_at + kv.start * dh : k_at + kv.stop * dh]
        v = w.attn.wqkv.weight[v_at + kv.start * dh : v_at + kv.stop * dh]
        assert torch.equal(s.attn.wqkv.weight, torch.cat([q, k, v]))
        assert torch.equal(
            s.attn.wo.weight, w.attn.wo.weight[:, heads.start * dh : heads.stop * dh]
        )
        if c.experts is not None:
            features = shares.features("ffn.experts.w_in")
            _assert_expert_shares(w.ffn, s.ffn, features)
            if w.ffn.shared is not None:
                shared = shares.features("ffn.shared.w_in")
                _assert_expert_shares(w.ffn.shared, s.ffn.shared, shared)
            assert torch.equal(s.ffn.router.weight, w.ffn.router.weight)  # replicated
            if c.experts.bias:  # (gate | up) biases split as their rows; down's on rank 0
                b_in, f = w.ffn.experts.b_in, c.experts.d_ff
                gate = b_in[:, features.start : features.stop]
                up = b_in[:, f + features.start : f + features.stop]
                assert torch.equal(s.ffn.experts.b_in, torch.cat([gate, up], dim=1))
                b_out = w.ffn.experts.b_out
                assert torch.equal(s.ffn.experts.b_out, b_out if rank == 0 else 0 * b_out)
        else:
            assert torch.equal(s.ffn.w_out.weight, w.ffn.w_out.weight[:, ff.start : ff.stop])
        if c.attn_sinks:  # one per head: the rank's heads'
            assert torch.equal(s.attn.sinks, w.attn.sinks[heads.start : heads.stop])
        if w.attn.wo.bias is not None:  # rank 0 adds a row-parallel bias, once
            assert torch.equal(s.attn.wo.bias, w.attn.wo.bias if rank == 0 else 0 * w.attn.wo.bias)
        rows = shares.vocab
        assert torch.equal(
            share.embed.weight[: len(rows)], whole.embed.weight[rows.start : rows.stop]
        )
        assert not share.embed.weight[len(rows) :].any()  # padding rows stay zero
        assert torch.equal(s.attn_norm.weight, w.attn_norm.weight)  # replicated
        if c.qk_norm == "all":
            q_norm = w.attn.q_norm.weight[heads.start * dh : heads.stop * dh]
            assert torch.equal(s.attn.q_norm.weight, q_norm)
            assert torch.equal(
                s.attn.k_norm.weight, w.attn.k_norm.weight[kv.start * dh : kv.stop * dh]
            )


def _assert_expert_shares(whole, share, features: range) -> None:  # type: ignore[no-untyped-def]
    """A rank's (gate | up) rows and down columns of each expert (or the shared expert):
    `features` of the gate's, the same of the up's."""
    if hasattr(whole, "experts"):
        pairs = [(whole.experts.w_in[e], whole.experts.w_out[e], share.experts.w_in[e],
                  share.experts.w_out[e]) for e in range(whole.experts.n_experts)]  # fmt: skip
    else:
        pairs = [(whole.w_in.weight, whole.w_out.weight, share.w_in.weight, share.w_out.weight)]
    for w_in, w_out, s_in, s_out in pairs:
        f = w_in.shape[0] // 2
        gate, up = (
            w_in[features.start : features.stop],
            w_in[f + features.start : f + features.stop],
        )
        assert torch.equal(s_in, torch.cat([gate, up]))
        assert torch.equal(s_out, w_out[:, features.start : features.stop])
