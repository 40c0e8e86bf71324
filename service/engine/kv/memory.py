"""How many KV blocks the engine's pool gets.

On the CPU the budget is a size in bytes (--kv-cache-gib). On CUDA it is what vLLM does:
the device's total memory times --gpu-memory-utilization, less the peak a worst-case
step measures (the weights, activations of max_num_batched_tokens tokens, the logits of
max_num_seqs rows), less what other processes hold, less a reserve for the sampler's
working copies of the logits and the CUDA graphs' pool (captured after the pool exists).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model.audit import kv_bytes_per_token, window_pool_blocks, window_span_blocks
from model.backends.device import dtype_name
from model.transformer import Transformer

if TYPE_CHECKING:
    from service.config import EngineConfig


def cuda_kv_budget(model: Transformer, config: EngineConfig, max_num_seqs: int) -> int:
    """Bytes the KV pool may take on the model's GPU."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # before measuring: what others hold, not our cached blocks
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    n = min(config.scheduler.max_num_batched_tokens, model.cfg.max_position)
    rows = torch.arange(min(n, max_num_seqs), device=device)
    with torch.inference_mode():  # the worst-case step, kept as the peak
        model(torch.zeros(n, dtype=torch.long, device=device), logits_indices=rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    # the sampler's fp32 copies of the logits (logits, probabilities, noise, a sort) and
    # the graphs' outputs: a reserve, since neither exists yet
    reserve = 5 * max_num_seqs * model.cfg.vocab_size * 4
    return int(total * config.cache.gpu_memory_utilization) - peak - others - reserve


def kv_block_budget(
    model: Transformer, config: EngineConfig, max_num_seqs: int, draft: Transformer | None = None
) -> tuple[int, int]:
    """Number of KV blocks of the pool, and of the windowed layers' own pool (0: none):
    num_kv_blocks, or from the memory budget of the model's device (max_num_seqs: the
    engine's, for the worst-case step on CUDA). A speculative draft model keeps its K/V
    of every block too, from the same budget.

    A model whose windowed layers sit beside global ones keeps the windowed layers' K/V
    in a pool of their own, sized to what a step's sequences can hold of it
    (window_pool_blocks), and the global layers' in the rest. A model whose every layer
    is windowed keeps all its K/V there (num_kv_blocks sizes that pool); its block
    tables then hold no K/V (PagedKVCache: no bytes), only ids that chain the prefix
    cache. Not with a draft model, which keeps its K/V of every token under those ids."""
    cfg, dtype, block_size = model.local_cfg, dtype_name(model.dtype), config.cache.block_size
    max_len = min(config.scheduler.max_model_len or model.cfg.max_position, model.cfg.max_position)
    need = -(-max_len // block_size)
    if window_pool_only(model, draft):
        window_block = block_size * kv_bytes_per_token(cfg, dtype)
        window_blocks = config.cache.num_kv_blocks
        if window_blocks is None:
            budget = _budget(model, config, max_num_seqs)
            window_blocks = max(0, budget) // window_block
            one = min(
                need, window_span_blocks(cfg, block_size, config.scheduler.max_num_batched_tokens)
            )
            _check_fits(model, budget, window_blocks, one, one * window_block, max_len, block_size)
        # ids for every token of the running sequences, and as many again as the window
        # pool has blocks for the prefix cache's chains (each id costs host memory)
        return max_num_seqs * need + window_blocks, window_blocks
    windowed = len(cfg.windowed_layers) if cfg.mixed_windows else 0
    # this rank's heads (all of them on one rank)
    per_token = kv_bytes_per_token(cfg, dtype, cfg.n_layers - windowed)
    if draft is not None:
        per_token += kv_bytes_per_token(draft.cfg, dtype_name(draft.dtype))
    per_block = block_size * per_token
    window_block = block_size * kv_bytes_per_token(cfg, dtype, windowed)
    most = 0
    if windowed:
        most = window_pool_blocks(
            cfg, block_size, max_num_seqs, config.scheduler.max_num_batched_tokens
        )
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks, min(most, config.cache.num_kv_blocks)
    budget = _budget(model, config, max_num_seqs)
    # no more window blocks than global ones: a sequence never holds more of them
    window_blocks = min(most, max(0, budget) // (per_block + window_block))
    blocks = max(0, budget - window_blocks * window_block) // per_block
    _check_fits(model, budget, blocks, need, need * per_block, max_len, block_size)
    return blocks, window_blocks


def available_ram() -> int:
    """Bytes of RAM this process may still take: the machine's MemAvailable, within the
    container's cgroup limit where one is set (a container sees the host's meminfo)."""
    free = _read_int("/proc/meminfo", "MemAvailable:") * 1024
    for limit, used in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):  # fmt: skip
        cap = _read_int(limit)
        if 0 < cap < 1 << 60:  # "max", or v1's huge number: no limit
            free = min(free, max(0, cap - _read_int(used)))
            break
    return free


def _read_int(path: str, field: str | None = None) -> int:
    """The number in a file (or on its line that starts with `field`); 0 where there is
    none."""
    try:
        with open(path) as f:
            for line in f:
                if field is None or line.startswith(field):
                    return int(line.split()[1 if field else 0])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def window_pool_only(model: Transformer, draft: Transformer | None) -> bool:
    """Whether every layer's K/V sits in the window pool (every layer windowed, no draft
    model)."""
    cfg = model.local_cfg
    return draft is None and len(cfg.windowed_layers) == cfg.n_layers


def _budget(model: Transformer, config: EngineConfig, max_num_seqs: int) -> int:
    if model.device.type == "cuda":
        return cuda_kv_budget(model, config, max_num_seqs)
    return config.cache.kv_cache_bytes


def _check_fits(
    model: Transformer,
    budget: int,
    blocks: int,
    need: int,
    need_bytes: int,
    max_len: int,
    block_size: int,
) -> None:
    """A pool of `blocks` must hold one sequence of max_len (`need` blocks of it,
    need_bytes)."""
    if blocks < need:
        source = "gpu_memory_utilization" if model.device.type == "cuda" else "kv_cache_gib"
        raise ValueError(
            f"{source}: a KV cache budget of {budget} bytes holds {blocks * block_size} "
            f"tokens, fewer than one sequence of max_model_len {max_len} ({need_bytes} "
            f"bytes); raise {source} or lower max_model_len"
        )
