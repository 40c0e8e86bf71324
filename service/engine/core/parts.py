"""The engine's parts, assembled once from the model and the engine's config: the execution
backend, the KV pool sized to the memory budget (agreed between tensor-parallel ranks),
the block manager with its prefix-cache namespace, the scheduler, and the model runner
with its CUDA graphs, grammar masks and speculative draft model. The device's defaults
(sequences per step, the mixed-prefill cap) are resolved here; LLMEngine
(service/engine/core/engine.py) keeps these parts and drives them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.adapters import Adapters, LoraBank, attach
from model.backends import Backend, select_backend
from model.config import ModelConfig
from model.kv_cache import PagedKVCache
from model.moe import count_experts
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from service.config import EngineConfig, GiB, LoadConfig, LoraConfig
from service.engine.core.adapter_slots import AdapterSlots
from service.engine.core.scheduler import Scheduler
from service.engine.exec.cuda_graphs import decode_graphs
from service.engine.exec.draft import DraftModel, blocks_per_proposal
from service.engine.exec.ranks import Ranks
from service.engine.exec.runner import ModelRunner
from service.engine.exec.speculative import Speculator
from service.engine.kv.blocks import BlockManager
from service.engine.kv.disk_tier import DiskTier
from service.engine.kv.host_tier import HostTier
from service.engine.kv.kv_events import QUIET, KVEvents, Quiet
from service.engine.kv.memory import available_ram, kv_block_budget
from service.engine.kv.window_blocks import WindowBlocks
from service.engine.sample.structured import Grammars, Masks


@dataclass(frozen=True, slots=True)
class EngineParts:
    model: Transformer
    tokenizer: Tokenizer
    max_num_seqs: int  # sequences a step may hold (the device's default unless set)
    max_model_len: int  # the context a request may fill: --max-model-len, at most the model's
    backend: Backend
    ranks: Ranks | None  # with tensor parallelism: every rank builds the parts, rank 0 steps
    kv_cache: PagedKVCache
    blocks: BlockManager
    scheduler: Scheduler
    eos_ids: frozenset[int]  # the tokenizer's and the checkpoint's
    grammars: Grammars  # structured outputs: nothing is built until a request asks
    runner: ModelRunner
    speculator: Speculator
    async_scheduling: bool  # queue a step before reading the last one's tokens (engine.py)
    # a mixture's tokens routed to each expert, (layer, counter) in layer order, where
    # --expert-metrics counts them (model/moe.py's count_experts)
    expert_load: tuple[tuple[int, Tensor], ...] = ()
    adapters: AdapterSlots | None = None  # the LoRA adapters served (--lora-modules)


def engine_backend(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, cfg: ModelConfig
) -> Backend:
    """The backend an engine of `config` runs a model of `cfg` (a rank's share: its
    local_cfg) on, chosen before the load so that it prepares each layer as it is read
    (Backend.prepare_layer); assemble() chooses the same where it is not given one."""
    return _backend(config.load, config.cache.block_size, device, dtype, cfg)


def _backend(
    load: LoadConfig, block_size: int, device: torch.device, dtype: torch.dtype, cfg: ModelConfig
) -> Backend:
    """The attention backend asked for. int8 weights run on the cpu backend's kernels
    alone, and int4's on the CPU (a GPU's backends have their own int4 kernels), so with
    them `auto` means cpu: where it cannot run, the reason is the error (not torch's
    refusal of the weights after it was picked instead)."""
    name = load.attention_backend
    cpu_kernels = load.quantization == "int8" or (
        load.quantization == "int4" and device.type == "cpu"
    )
    if not cpu_kernels or name != "auto":
        return select_backend(name, device, dtype, cfg, block_size)
    try:
        return select_backend("cpu", device, dtype, cfg, block_size)
    except ValueError as exc:
        raise ValueError(f"quantization {load.quantization}: {exc}") from None


def _host_slots(
    config: EngineConfig, kv_cache: PagedKVCache, prefix: bool, windows: bool, draft: bool
) -> int:
    """The blocks the prefix cache's host tier holds (service/engine/kv/host_tier.py),
    its host memory on this rank added to the pool; 0: no tier. Not without the prefix
    cache, beside a window pool, or with a draft model (whose own K/V of a block it would
    not restore): asked for there, a start-up error."""
    budget = config.host_tier_bytes(kv_cache.data.device.type, available_ram())
    if budget <= 0:
        return 0
    why = (
        "the prefix cache is off" if not prefix
        else "the model's windowed layers keep a pool of their own" if windows
        else "a draft model keeps K/V the tier does not hold" if draft
        else "it holds less than one block" if budget < kv_cache.block_nbytes else None
    )  # fmt: skip
    if why is not None:
        if config.cache.kv_host_gib is not None:
            raise ValueError(f"kv_host_gib: no host tier can be kept: {why}")
        return 0
    slots = budget // kv_cache.block_nbytes
    kv_cache.add_host_pool(slots)
    return slots


def assemble(
    model: Transformer,
    tokenizer: Tokenizer,
    config: EngineConfig,
    draft: Transformer | None,
    backend: Backend | None = None,
) -> EngineParts:
    """draft: the speculative draft model (--speculative-method draft), else None;
    backend: engine_backend's, where the load prepared the layers for it."""
    if (config.speculative.speculative_method == "draft") != (draft is not None):
        raise ValueError("speculative_model: a draft model goes with --speculative-method draft")
    device = model.device.type
    max_num_seqs = config.scheduler.seqs_per_step(device)
    max_model_len = min(
        config.scheduler.max_model_len or model.cfg.max_position, model.cfg.max_position
    )
    backend = backend or _backend(
        config.load, config.cache.block_size, model.device, model.dtype, model.local_cfg
    )
    ranks = Ranks(model.tp, model.device) if model.tp is not None else None
    # the LoRA bank before the KV pool, whose CUDA budget counts what is allocated
    adapters = _adapters(model, config.lora, config.load.download_dir)
    kv_cache, blocks, disk = _kv(model, config, max_num_seqs, draft, backend, ranks)
    scheduler = Scheduler(
        blocks,
        max_num_seqs,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.mixed_prefill_cap(device),
        adapters,
        config.scheduler.scheduling_policy,
    )
    eos_ids = frozenset(tokenizer.eos_ids) | frozenset(model.cfg.eos_token_ids)
    drafter = (
        _draft_model(draft, config, blocks.num_blocks, model.cfg.vocab_size) if draft else None
    )
    grammars = Grammars(tokenizer, model.cfg.vocab_size, sorted(eos_ids))
    runner = _runner(
        model, config, kv_cache, backend, ranks, grammars, drafter, max_num_seqs,
        max_model_len, disk, adapters,
    )  # fmt: skip
    speculator = Speculator(config.speculative, max_model_len, drafter)
    # counted from before the first step (the CPU's decoder stack takes the counters'
    # addresses when it first meets the KV cache)
    load = count_experts(model, model.device) if config.load.expert_metrics else []
    counted = tuple(zip(model.cfg.sparse_layers, load, strict=True)) if load else ()
    return EngineParts(
        model, tokenizer, max_num_seqs, max_model_len, backend, ranks, kv_cache, blocks,
        scheduler, eos_ids, grammars, runner, speculator,
        config.async_steps(device) and ranks is None and speculator.method == "none",
        counted, adapters,
    )  # fmt: skip


def _adapters(
    model: Transformer, config: LoraConfig, download_dir: str | None
) -> AdapterSlots | None:
    """The adapters of --lora-modules read (each refused by name where it cannot be
    served), and a bank of --max-loras slots on the model's device."""
    if not config.enabled:
        return None
    rank = config.max_lora_rank
    bank = LoraBank(model.local_cfg, config.max_loras, rank, model.device, model.dtype)
    adapters = AdapterSlots(Adapters(bank), model.cfg, rank, download_dir, model.shares)
    for name, path in config.modules.items():
        adapters.add(adapters.read(name, path))
    return adapters


def _kv(
    model: Transformer,
    config: EngineConfig,
    max_num_seqs: int,
    draft: Transformer | None,
    backend: Backend,
    ranks: Ranks | None,
) -> tuple[PagedKVCache, BlockManager, DiskTier | None]:
    """The KV pool as large as the budget allows (every rank agreeing), its block manager
    with the prefix cache, the window pool, the host and disk tiers and the events asked
    for, each built whole; and the disk tier, whose reads and writes the runner runs."""
    local = model.local_cfg  # the shapes this rank holds (the model's, on one rank)
    num_blocks, window_blocks = kv_block_budget(model, config, max_num_seqs, draft)
    if ranks is not None:
        num_blocks = ranks.agree_min(num_blocks)
        window_blocks = ranks.agree_min(window_blocks)
    kv_cache = PagedKVCache(
        local,
        num_blocks,
        config.cache.block_size,
        model.dtype,
        model.device,
        backend,
        window_blocks,
    )
    # the model is part of every prefix-cache key (with each request's cache_salt)
    namespace = f"{model.cfg!r}|{model.dtype}|{config.load.quantization}"
    prefix = not config.cache.disable_prefix_caching
    windows = None
    if window_blocks:
        assert local.sliding_window is not None
        windows = WindowBlocks(window_blocks, config.cache.block_size, local.sliding_window, prefix)
    slots = _host_slots(config, kv_cache, prefix, windows is not None, draft is not None)
    disk = None
    if config.cache.kv_disk_path is not None:
        if not slots or model.tp is not None:
            raise ValueError("kv_disk_path: the disk tier goes behind a host tier, on one rank")
        disk = DiskTier(
            config.cache.kv_disk_path, int(config.cache.kv_disk_gib * GiB),
            f"{namespace}|{config.cache.block_size}", model.dtype, kv_cache.block_nbytes,
        )  # fmt: skip
    events = _kv_events(config, model)  # opened last: nothing above fails after it
    tier = HostTier(slots, disk, events) if slots else None
    blocks = BlockManager(
        num_blocks, config.cache.block_size, prefix, namespace, windows, tier, events
    )
    return kv_cache, blocks, disk


def _runner(
    model: Transformer,
    config: EngineConfig,
    kv_cache: PagedKVCache,
    backend: Backend,
    ranks: Ranks | None,
    grammars: Grammars,
    drafter: DraftModel | None,
    max_num_seqs: int,
    max_model_len: int,
    disk: DiskTier | None,
    adapters: AdapterSlots | None,
) -> ModelRunner:
    """The runner (its backend prepares the model's layers), then the LoRA bank put on
    the layers as prepared: those the backend swapped in add the deltas too."""
    device = model.device.type
    # not captured across ranks: a graph would replay its collectives unchecked; nor a
    # mixture of experts whose tokens are counted (--expert-metrics): the rows padding a
    # graph's batch would be counted with them
    graphs = (
        not config.load.enforce_eager
        and backend.name == "triton"
        and not model.tp
        and not (model.cfg.experts is not None and config.load.expert_metrics)
        and device == "cuda"
    )
    runner = ModelRunner(
        model,
        kv_cache,
        decode_graphs(model, kv_cache, max_num_seqs, max_model_len) if graphs else None,
        config.load.quantization,
        ranks,
        Masks(grammars),
        drafter.mirror if drafter else None,
        disk,
    )
    if adapters is not None:
        attach(model, adapters.adapters, backend.lora_add)
    return runner


def _kv_events(config: EngineConfig, model: Transformer) -> Quiet:
    """The prefix cache's events for routers, published by rank 0 where asked for."""
    if config.cache.kv_events_endpoint is None or (model.tp is not None and model.tp.rank != 0):
        return QUIET
    pool = "GPU" if model.device.type == "cuda" else None
    return KVEvents(config.cache.kv_events_endpoint, config.cache.kv_events_replay_endpoint,
                    config.cache.block_size, pool, not config.cache.kv_events_omit_token_ids)  # fmt: skip


def _draft_model(
    draft: Transformer, config: EngineConfig, num_blocks: int, target_vocab: int
) -> DraftModel:
    """The draft model's runner over its own cache: the target's blocks plus the scratch
    its proposals look ahead in."""
    k, batch = config.speculative.num_speculative_tokens, config.speculative.speculative_max_batch
    blocks = num_blocks + blocks_per_proposal(k, config.cache.block_size) * batch
    backend = select_backend(
        config.load.attention_backend, draft.device, draft.dtype, draft.cfg, config.cache.block_size
    )
    cache = PagedKVCache(
        draft.cfg, blocks, config.cache.block_size, draft.dtype, draft.device, backend
    )
    runner = ModelRunner(draft, cache, None, config.load.quantization)
    return DraftModel(runner, num_blocks, k, batch, target_vocab)
