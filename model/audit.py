"""Memory audit from a config alone: parameters by component, weight and KV-cache bytes."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from model.config import ModelConfig
from model.grouped import GROUP
from model.int4_mix import EIGHT_BIT, Part, layer_parts
from model.int_weights import KEEPS

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int8": 1,
}


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True, slots=True)
class ParamCounts:
    embedding: int  # token embedding (+ learned position table)
    attention: int  # all blocks
    ffn: int  # all blocks
    norms: int  # all blocks + final norm
    head: int  # 0 when tied to the embedding
    per_block: int
    per_block_attention: int
    per_block_ffn: int
    per_block_norms: int
    position_embedding: int
    # a mixture of experts: the FFN parameters one token runs (its top-k experts, the
    # shared expert and the router in each sparse layer; every dense layer's FFN)
    ffn_active: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.ffn + self.norms + self.head

    @property
    def active(self) -> int:
        """The parameters one token's forward runs: total, with only its experts' share
        of each mixture (what a model card's "A3B" names; every one for a dense model)."""
        return self.total - self.ffn + self.ffn_active

    @property
    def non_embedding(self) -> int:
        """Everything but the token and position embeddings (an untied head counts)."""
        return self.total - self.embedding

    def as_dict(self) -> dict[str, int]:
        return {
            "embedding": self.embedding,
            "attention": self.attention,
            "ffn": self.ffn,
            "norms": self.norms,
            "head": self.head,
            "total": self.total,
            "non_embedding": self.non_embedding,
            "active": self.active,
        }


def layer_linear_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """(in, out) features of a decoder layer's linears: q|k|v, the attention output,
    (gate|)up, down."""
    d, dh = cfg.d_model, cfg.head_dim
    ffn_in = (2 if cfg.gated else 1) * cfg.d_ff
    return ((d, (cfg.n_heads + 2 * cfg.kv_heads) * dh), (cfg.n_heads * dh, d), (d, ffn_in),
            (cfg.d_ff, d))  # fmt: skip


def expert_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """A sparse layer's (router, one routed expert, the shared expert and its gate)
    parameters: each expert a SwiGLU of its d_ff features."""
    e, d = cfg.experts, cfg.d_model
    assert e is not None
    shared = 3 * d * e.shared_d_ff + d if e.shared_d_ff else 0
    return d * e.n_experts, 3 * d * e.d_ff, shared


def _ffn_params(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(a dense layer's FFN, a sparse layer's mixture, what one token runs of it, the
    sparse layers)."""
    _, _, ffn_in, down = layer_linear_shapes(cfg)
    dense = ffn_in[0] * ffn_in[1] + down[0] * down[1]
    if cfg.mlp_bias:
        dense += ffn_in[1] + cfg.d_model
    if cfg.experts is None:
        return dense, 0, 0, 0
    router, expert, shared = expert_params(cfg)
    mixture = router + cfg.experts.n_experts * expert + shared
    active = router + cfg.experts.top_k * expert + shared
    return dense, mixture, active, len(cfg.sparse_layers)


def count_params(cfg: ModelConfig) -> ParamCounts:
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    qkv, out, _, _ = layer_linear_shapes(cfg)
    attn = qkv[0] * qkv[1] + out[0] * out[1]
    if cfg.qkv_bias:
        attn += qkv[1]
    if cfg.attn_out_bias:
        attn += d
    dense, mixture, active, sparse = _ffn_params(cfg)
    dense_layers = cfg.n_layers - sparse
    ffn = mixture if sparse else dense  # a block's: a sparse one's where there are any
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    qk_norms = {"none": 0, "head": 2 * dh, "all": (h + kv) * dh}[cfg.qk_norm]
    sublayer_norms = 4 if cfg.norm_placement == "sandwich" else 2  # Gemma's before and after
    block_norms = sublayer_norms * norm + qk_norms  # Qwen3's and OLMo 2's q and k norms
    pos = cfg.max_position * d if cfg.position == "learned" else 0
    per_block = attn + ffn + block_norms
    return ParamCounts(
        embedding=cfg.vocab_size * d + pos,
        attention=attn * cfg.n_layers,
        ffn=dense * dense_layers + mixture * sparse,
        ffn_active=dense * dense_layers + active * sparse,
        norms=block_norms * cfg.n_layers + (norm if cfg.norm_placement != "post" else 0),
        head=0 if cfg.tie_embeddings else cfg.vocab_size * d,
        per_block=per_block,
        per_block_attention=attn,
        per_block_ffn=ffn,
        per_block_norms=block_norms,
        position_embedding=pos,
    )


def kv_bytes_per_token(cfg: ModelConfig, dtype: str = "float16", layers: int | None = None) -> int:
    """K and V for one token across all layers (or `layers` of them)."""
    n = cfg.n_layers if layers is None else layers
    return 2 * cfg.kv_heads * cfg.head_dim * dtype_bytes(dtype) * n


def window_pool_blocks(
    cfg: ModelConfig, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """The most blocks of the windowed layers' own pool a step's sequences hold: each the
    blocks of its window and of its new tokens (service/engine/kv/window_blocks.py), which
    are at most ceil((window - 1 + new) / block_size) + 1, and at most
    max_num_batched_tokens new tokens in all."""
    per_seq = window_span_blocks(cfg, block_size, 1)
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def window_span_blocks(cfg: ModelConfig, block_size: int, new_tokens: int) -> int:
    """The most blocks of the windowed layers' pool a sequence holds in a step of
    new_tokens: those of the window of its first query and of its new tokens."""
    assert cfg.sliding_window is not None
    return -(-(cfg.sliding_window - 1) // block_size) + 1 + -(-new_tokens // block_size)


def window_sequence_bytes(cfg: ModelConfig, dtype: str, seq_len: int, block_size: int) -> int:
    """The KV of one sequence of seq_len tokens with the windowed layers in their own
    pool: the global layers' blocks for every token, the windowed layers' for the window
    (and the block it starts in)."""
    windowed = len(cfg.windowed_layers)
    assert cfg.sliding_window is not None and windowed
    every = -(-seq_len // block_size) * block_size
    seen = min(every, (-(-(cfg.sliding_window - 1) // block_size) + 1) * block_size)
    global_bytes = every * kv_bytes_per_token(cfg, dtype, cfg.n_layers - windowed)
    return global_bytes + seen * kv_bytes_per_token(cfg, dtype, windowed)


SCALE_BYTES = 4  # an fp8 linear's float32 scale per output row
INT8_ROW_BYTES = 8  # an int8 linear's per output row: its float32 scale, the int32 VNNI offset


def layer_linears(cfg: ModelConfig, experts: bool = True) -> tuple[int, int]:
    """(weights, output rows) of every decoder layer's linear matrices together
    (model/int4_mix.py's layer_parts): what --quantization int8 and fp8 hold in one byte
    a weight, with a scale a row. A mixture's shared expert is among them, its router
    not (held in the model's dtype: model.moe.linear_quantization); its routed experts
    count where `experts` (int8 packs them; fp8 keeps them in the model's dtype)."""
    parts = [p for p in _parts(cfg) if experts or p.path != "ffn.experts"]
    return _sizes(parts)


def mixed_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each kind --quantization int4 holds the decoder layers' linears in on the cpu
    backend (model/int4_mix.py: int4, int5, int8g): (weights, output rows) of them."""
    parts = _parts(cfg)
    return {kind: _sizes([p for p in parts if p.kind == kind]) for kind in {p.kind for p in parts}}


def _parts(cfg: ModelConfig) -> list[Part]:
    return [p for i in range(cfg.n_layers) for p in layer_parts(cfg, i)]


def _sizes(parts: list[Part]) -> tuple[int, int]:
    """(weights, output rows) of `parts` together."""
    weights = sum(p.in_features * p.out_features * p.count for p in parts)
    return weights, sum(p.out_features * p.count for p in parts)


def quantized_bytes(weights: int, rows: int, quantization: str) -> int:
    """The bytes `weights` linear weights of `rows` output rows take as --quantization
    holds them: int8 and fp8 a byte a weight, with INT8_ROW_BYTES or SCALE_BYTES a row;
    int4 half a byte a weight and a float16 scale and minimum each group of GROUP (5/8
    of a byte); int5 (a file's 5-bit groups) 5/8 of a byte and a float16 step and
    minimum a group (3/4 of a byte); int8g (--quantization auto's) a byte a weight and a
    float16 scale a group (17/16 of a byte)."""
    if quantization == "int4":
        return weights // 2 + weights // GROUP * 4
    if quantization == "int5":
        return weights * 5 // 8 + weights // GROUP * 4
    if quantization == "int8g":
        return weights + weights // GROUP * 2
    return weights + rows * (INT8_ROW_BYTES if quantization == "int8" else SCALE_BYTES)


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str = "none", mix: bool = True) -> int:
    """The weights' bytes as the server holds them: every parameter in `dtype`, or with
    --quantization the decoder layers' linears as quantized_bytes holds them (int8 on
    the cpu backend and int4 on every backend also its LM head: a tied one as a quantized
    copy of the embedding table, which the lookup keeps in `dtype`; and a mixture's
    experts). mix: int4 as the cpu backend holds it, the head in int8g and the layers in
    mixed_linears' kinds, not all in int4 (torch, Triton)."""
    total = count_params(cfg).total * dtype_bytes(dtype)
    if quantization == "none":
        return total
    if quantization not in ("int8", "int4", "fp8"):
        raise ValueError(f"quantization must be none, int8, int4 or fp8, got {quantization!r}")
    cpu = quantization != "fp8"
    weights, rows = layer_linears(cfg, experts=cpu)
    total -= weights * dtype_bytes(dtype)
    mixed = quantization == "int4" and mix
    kinds = mixed_linears(cfg) if mixed else {quantization: (weights, rows)}
    total += sum(quantized_bytes(w, r, kind) for kind, (w, r) in kinds.items())
    if cpu:
        head = cfg.vocab_size * cfg.d_model
        kept = head * dtype_bytes(dtype) if not cfg.tie_embeddings else 0
        held = EIGHT_BIT if mixed else quantization
        total += quantized_bytes(head, cfg.vocab_size, held) - kept
    return total


def stored_weight_bytes(
    cfg: ModelConfig, dtype: str, stored: dict[str, tuple[tuple[int, ...], str]]
) -> int:
    """The weights' bytes under --quantization auto on the cpu backend: each parameter a
    checkpoint stores as integers (`stored`: model.weights.stored_kinds) as
    quantized_bytes holds its kind, a tied head as a copy of the embedding table in the
    table's kind (the lookup keeps the table in `dtype`), every other parameter in
    `dtype`."""
    total = weight_bytes(cfg, dtype)
    for name, (shape, kind) in stored.items():
        numel = math.prod(shape)
        held = quantized_bytes(numel, numel // shape[-1], held_kind(kind, shape[-1]))
        if name == "embed.weight":
            total += held if cfg.tie_embeddings else 0
        else:
            total += held - numel * dtype_bytes(dtype)
    return total


def stored_held(
    cfg: ModelConfig, dtype: str, stored: dict[str, tuple[tuple[int, ...], str]]
) -> Held:
    """What --quantization auto holds of a checkpoint on the cpu backend (`stored`:
    model.weights.stored_kinds): stored_weight_bytes, its routed experts' part, and a
    tied table stored as integers copied as the head."""
    experts = 0
    if (e := cfg.experts) is not None:
        stacks = {"w_in": 2 * e.d_ff * cfg.d_model, "w_out": e.d_ff * cfg.d_model}
        for i, (part, weights) in itertools.product(cfg.sparse_layers, stacks.items()):
            name, numel = f"layers.{i}.ffn.experts.{part}", e.n_experts * weights
            if name not in stored:
                experts += numel * dtype_bytes(dtype)
                continue
            shape, kind = stored[name]
            experts += quantized_bytes(numel, numel // shape[-1], held_kind(kind, shape[-1]))
    copied = cfg.tie_embeddings and "embed.weight" in stored
    return Held(stored_weight_bytes(cfg, dtype, stored), experts, copied)


def held_kind(stored: str, in_features: int) -> str:
    """The kernel kind --quantization auto packs a weight of stored kind `stored` as
    (model.int_weights.KEEPS): its first, a grouped kind (int4, int5, int8g), where groups of
    GROUP divide the in features, else int8."""
    return KEEPS[stored][0] if in_features % GROUP == 0 else "int8"


def experts_touched(cfg: ModelConfig, rows: int) -> float:
    """How many of a sparse layer's experts a step of `rows` tokens runs, expected: each
    token picks top_k of n_experts, taken as uniform and independent (a balanced router,
    what load-balancing training aims at), so an expert is missed by all rows with
    probability (1 - top_k / n_experts) ** rows. One token: top_k; many: all of them."""
    e = cfg.experts
    assert e is not None
    return e.n_experts * (1 - (1 - e.top_k / e.n_experts) ** rows)


@dataclass(frozen=True, slots=True)
class Held:
    """A model's weight bytes as held where the config cannot give them (--quantization
    auto keeps each tensor of a checkpoint in its own kind): all of them, its routed
    experts' (0 for a dense model), and whether a tied table's copy is the head beside
    the table."""

    total: int
    experts: int = 0
    head_copy: bool = False

    def share(self, local: ModelConfig, cfg: ModelConfig, dtype: str) -> Held:
        """A tensor-parallel rank's share (`local`'s shapes of `cfg`), each part taken at
        its mean bytes a weight."""
        part = weight_bytes(local, dtype) / weight_bytes(cfg, dtype)
        routed = routed_expert_bytes(cfg, dtype)
        experts = self.experts * routed_expert_bytes(local, dtype) // routed if routed else 0
        return Held(int(self.total * part), experts, self.head_copy)


def routed_expert_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Every routed expert's weights in `dtype` (0 for a dense model)."""
    if cfg.experts is None:
        return 0
    n = cfg.experts.n_experts * len(cfg.sparse_layers)
    return n * expert_params(cfg)[1] * dtype_bytes(dtype)


def read_bytes(
    cfg: ModelConfig,
    dtype: str,
    quantization: str = "none",
    rows: int = 1,
    held: Held | None = None,
) -> float:
    """The weight bytes a decode step of `rows` tokens reads: every weight once, but of
    each mixture only the experts its rows run (experts_touched), and of the embedding
    table only a row a token where the head is a tensor of its own (untied, or a tied
    table's copy: weight_bytes' under int8 and int4). held: what the loaded model holds,
    where the config cannot say; its idle experts taken at its experts' mean bytes a
    weight."""
    if held is not None:
        routed = routed_expert_bytes(cfg, dtype)
        idle = held.experts / routed * idle_expert_bytes(cfg, dtype, "none", rows) if routed else 0
        return held.total - idle - unread_table_bytes(cfg, dtype, held.head_copy)
    idle = idle_expert_bytes(cfg, dtype, quantization, rows)
    copied = quantization in ("int8", "int4")
    return weight_bytes(cfg, dtype, quantization) - idle - unread_table_bytes(cfg, dtype, copied)


def unread_table_bytes(cfg: ModelConfig, dtype: str, head_copy: bool) -> int:
    """The embedding table's bytes (in `dtype`, as the lookup keeps it) a decode step
    leaves unread: all but a row a token where the head is a tensor of its own (untied,
    or `head_copy`: a tied table's copy), none where the head is the table."""
    own_head = head_copy or not cfg.tie_embeddings
    return cfg.vocab_size * cfg.d_model * dtype_bytes(dtype) if own_head else 0


def idle_expert_bytes(cfg: ModelConfig, dtype: str, quantization: str, rows: int) -> float:
    """The bytes of the experts a step of `rows` tokens leaves unread, expected, as held
    (quantized_bytes with --quantization int8, or int4 with each stack in the kind
    int4_mix gives it); 0 for a dense model."""
    e = cfg.experts
    if e is None:
        return 0.0
    _, expert, _ = expert_params(cfg)
    held = 0
    for i in cfg.sparse_layers:
        if quantization == "int8":
            held += quantized_bytes(expert, 2 * e.d_ff + cfg.d_model, quantization)
        elif quantization == "int4":
            for p in layer_parts(cfg, i):
                if p.path == "ffn.experts":
                    held += quantized_bytes(p.in_features * p.out_features, p.out_features, p.kind)
        else:
            held += expert * dtype_bytes(dtype)
    return (e.n_experts - experts_touched(cfg, rows)) * held


@dataclass(frozen=True, slots=True)
class MemoryAudit:
    params: ParamCounts
    dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: int | None = None  # what the serving KV pool holds, when known
    quantization: str = "none"  # --quantization: the linears' bytes in weight_bytes
    # auto: each of a checkpoint's linears in its own kind (weight_bytes as loaded)

    @property
    def kv_pool_tokens(self) -> int | None:
        if self.kv_pool_bytes is None:
            return None
        return self.kv_pool_bytes // self.kv_bytes_per_token

    def as_dict(self) -> dict[str, object]:
        return {
            "parameters": self.params.as_dict(),
            "dtype": self.dtype,
            "quantization": self.quantization,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_pool_bytes": self.kv_pool_bytes,
            "kv_pool_tokens": self.kv_pool_tokens,
        }


def audit(
    cfg: ModelConfig,
    dtype: str,
    kv_pool_bytes: int | None = None,
    quantization: str = "none",
    held_bytes: int | None = None,
) -> MemoryAudit:
    """held_bytes: the weights' bytes as the loaded model holds them (read_bytes), in
    place of what the config and `quantization` give."""
    return MemoryAudit(
        params=count_params(cfg),
        dtype=dtype,
        weight_bytes=held_bytes
        if held_bytes is not None
        else weight_bytes(cfg, dtype, quantization),
        kv_bytes_per_token=kv_bytes_per_token(cfg, dtype),
        kv_pool_bytes=kv_pool_bytes,
        quantization=quantization,
    )


def rank_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shapes the largest share of `world` tensor-parallel ranks holds (rank 0's: it
    also holds the row-parallel biases), its vocab the padded rows of each rank."""
    from model.parallel import TensorParallel, unsplittable

    why = unsplittable(cfg, world)
    if why is not None:
        raise ValueError(f"tensor_parallel_size: {why}")
    shares = TensorParallel(0, world).shares(cfg)
    return shares.local.replace(vocab_size=shares.vocab_rows, eos_token_ids=())


def collective_bytes(cfg: ModelConfig, dtype: str, world: int) -> dict[str, int]:
    """What tensor parallelism moves per token: one all-reduce of the hidden state per
    attention and per FFN (and one for the embedding), and with q/k norms over every
    head (OLMo 2) one of the q and k sums of squares (2 fp32) per layer; one all-gather
    of the logits. A ring all-reduce sends 2 (N-1)/N of its bytes from every device, an
    all-gather (N-1)/N."""
    hidden = dtype_bytes(dtype) * cfg.d_model
    reduce = (2 * cfg.n_layers + 1) * hidden
    if cfg.qk_norm == "all":
        reduce += cfg.n_layers * 2 * 4
    gather = -(-cfg.vocab_size // world) * world * dtype_bytes(dtype)
    return {
        "allreduce_bytes_per_token": reduce if world > 1 else 0,
        "allgather_bytes_per_token": gather if world > 1 else 0,
        "link_bytes_per_token_per_device": (2 * reduce + gather) * (world - 1) // world,
    }


def plan(
    cfg: ModelConfig,
    dtype: str,
    memory_bytes: int,
    seq_len: int,
    bandwidth: float | None = None,
    matmul_flops: float | None = None,
    tensor_parallel_size: int = 1,
    block_size: int = 16,
    quantization: str = "none",
    held: Held | None = None,
) -> dict[str, object]:
    """What fits in `memory_bytes` (of each device, with the model split over
    `tensor_parallel_size` of them) next to the weights, and the physical floors. A
    model with windowed layers counts each sequence's KV as the server holds it (the
    windowed layers' blocks of the window alone), and also as global KV would
    (`sequences_of_seq_len_global_kv`). held: the whole model's weight bytes where the
    config cannot give them (--quantization auto: stored_weight_bytes), a rank's share
    taken at their mean bytes a weight (Held.share)."""
    world = tensor_parallel_size
    local = rank_config(cfg, world) if world > 1 else cfg
    total = held.total if held is not None else None
    report = audit(cfg, dtype, quantization=quantization, held_bytes=total).as_dict()
    share = held.share(local, cfg, dtype) if held is not None else None
    weights = share.total if share is not None else weight_bytes(local, dtype, quantization)
    per_token = kv_bytes_per_token(local, dtype)
    kv_room = max(0, memory_bytes - weights)
    tokens = kv_room // per_token
    report |= {
        "tensor_parallel_size": world,
        "memory_bytes": memory_bytes,
        "weight_bytes_per_device": weights,
        "kv_bytes_per_token_per_device": per_token,
        "kv_room_bytes": kv_room,
        "kv_tokens": tokens,
        "seq_len": seq_len,
        "sequences_of_seq_len": tokens // seq_len,
        "fits": weights < memory_bytes and tokens >= seq_len,
        # what one sequence's decode step reads of them (of a mixture: its experts)
        "decode_read_bytes_per_device": read_bytes(local, dtype, quantization, held=share),
    }
    if local.windowed_layers:
        per_seq = window_sequence_bytes(local, dtype, seq_len, block_size)
        report |= {
            "kv_bytes_per_sequence_of_seq_len": per_seq,
            "sequences_of_seq_len": kv_room // per_seq,
            "sequences_of_seq_len_global_kv": tokens // seq_len,
            "fits": weights < memory_bytes and kv_room >= per_seq,
        }
    report |= collective_bytes(cfg, dtype, world)
    return report | floors(local, dtype, bandwidth, matmul_flops, quantization, share)


def floors(
    cfg: ModelConfig,
    dtype: str,
    bandwidth: float | None,
    matmul_flops: float | None,
    quantization: str = "none",
    held: Held | None = None,
) -> dict[str, float]:
    """The physical limits on a machine: one sequence's decode reads every weight once a
    step (of a mixture: its token's experts; of the embedding table a row: read_bytes),
    prefill does 2 x parameters FLOPs per token (of a mixture: the active ones)."""
    out: dict[str, float] = {}
    if bandwidth:
        out["bandwidth_gb_s"] = bandwidth / 1e9
        read = read_bytes(cfg, dtype, quantization, held=held)
        out["decode_floor_ms_per_token"] = 1000 * read / bandwidth
    if matmul_flops:
        out["matmul_tflops"] = matmul_flops / 1e12
        out["prefill_ceiling_tokens_per_s"] = matmul_flops / (2 * count_params(cfg).active)
    return out


def batch_floor(
    cfg: ModelConfig,
    dtype: str,
    batch: int,
    prompt_len: int,
    output_len: int,
    bandwidth: float,
    matmul_flops: float,
) -> dict[str, float]:
    """The least time `batch` requests arriving together (prompt_len tokens in, output_len
    out each) take on a machine of this read bandwidth and matmul rate: one prefill of
    every prompt (its multiply-adds at the matmul rate, or its weight read if longer), then
    output_len - 1 decode steps of `batch` rows, each the longer of its multiply-adds and
    its reads (every weight once, the head as a vocab x d matrix, and each row's K/V so
    far; of a mixture, the experts its rows run: experts_touched). What runs between the kernels (sampling, scheduling, HTTP) is not counted, so a
    server's tokens/s can only fall short of ceiling_tok_s."""
    p, size = count_params(cfg), dtype_bytes(dtype)
    head = cfg.vocab_size * cfg.d_model
    linear = 2 * (p.attention + p.ffn_active)  # FLOPs per token of the layers' matmuls
    per_key = 4 * cfg.n_heads * cfg.head_dim * cfg.n_layers  # q.k and p.v, per key
    weights = (p.attention + p.ffn + p.norms + head) * size
    kv = kv_bytes_per_token(cfg, dtype)
    prefill = batch * (prompt_len * linear + 2 * head + per_key * prompt_len * (prompt_len + 1) / 2)
    prefill_reads = weights - idle_expert_bytes(cfg, dtype, "none", batch * prompt_len)
    seconds = max(prefill / matmul_flops, prefill_reads / bandwidth)
    step_weights = weights - idle_expert_bytes(cfg, dtype, "none", batch)  # a mixture's experts
    steps = []
    for i in range(1, output_len):
        context = prompt_len + i  # keys a row sees at its step
        flops = batch * (linear + 2 * head + per_key * context)
        reads = step_weights + batch * context * kv
        steps.append((flops, reads))
        seconds += max(flops / matmul_flops, reads / bandwidth)
    return {
        "prefill_gflop": prefill / 1e9,
        "decode_gflop_per_step": steps[0][0] / 1e9 if steps else 0.0,
        "decode_mb_per_step": steps[0][1] / 1e6 if steps else 0.0,
        "seconds": seconds,
        "ceiling_tok_s": batch * output_len / seconds,
    }
