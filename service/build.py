"""The served engine, built from Settings in one place: load the model (a directory or a
Hugging Face repo id), pick the device and dtype, build the engine (its execution backend
and KV pool), and describe what was built. The API runs build() on the engine thread
(service/api/app.py) and imports no torch itself: every tensor-side step of serving is
here or below. This machine's floors (bandwidth and matmul runs, ~0.5 s) are measured on
demand, not at every start."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.audit import Held, audit, floors
from model.backends import Backend
from model.backends.device import dtype_name, pick_device, pick_dtype
from model.backends.machine import matmul_throughput, memory_bandwidth
from model.hub import ModelNotFound, ModelSource, resolve
from model.loader import LoadedModel, load
from model.moe import MoE
from model.parallel import TensorParallel, join, unsplittable
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from model.weights import load_config
from service.config import Settings, quantization_conflict
from service.engine.core.engine import LLMEngine
from service.engine.core.parts import engine_backend
from service.engine.core.stats import EngineObserver
from service.engine.kv.blocks import BlockManager
from service.engine.process import core
from service.engine.process.attach import Attach
from service.engine.process.core import Observers
from service.engine.process.transport import CoreSide, InProcess, InThread, Link

log = logging.getLogger("kvserve.build")


@dataclass(frozen=True, slots=True)
class Built:
    engine: LLMEngine
    tokenizer: Tokenizer
    model_id: str
    model_dir: Path | None
    audit: dict[str, Any]  # model/audit.py's report and how this engine was built
    info: dict[str, str]  # kvserve_model_info's labels
    floors: Callable[[], dict[str, Any]]  # measures this machine's floors (torch work)
    device_memory: Callable[[], tuple[int, int] | None]  # CUDA allocated, reserved


def build(
    settings: Settings, observer: Callable[[str], EngineObserver | None] = lambda _: None
) -> Built:
    """Load and build; `observer(model_id)` gives the engine's observer (the metrics).
    With tensor_parallel_size > 1 every rank calls this (rank 0 then serves, the others
    follow its steps: service/engine/exec/ranks.py)."""
    device = pick_device(settings.device)
    why = quantization_conflict(
        settings.quantization, settings.attention_backend, settings.dtype, device.type
    )
    if why is not None:  # `--device auto` found a GPU
        raise ValueError(why)
    dtype = pick_dtype(settings.dtype, device, settings.quantization)
    # a local directory, or a Hub repo id from the cache (downloaded when reachable)
    source = resolve(settings.model, settings.revision, settings.download_dir)
    draft_source = _draft_source(settings)  # found before either model is read
    tp = _join_ranks(settings, device, source.path if source else None)
    if tp is not None and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", tp.rank)))
    loaded, backend = _load_prepared(settings, source, device, dtype, tp)
    model_id = settings.served_model_name or (source.model_id if source else loaded.model_id)
    draft = _load_draft(draft_source, dtype, device, loaded.tokenizer)
    engine = LLMEngine.build(
        loaded.model, loaded.tokenizer, settings.engine, draft, observer(model_id), backend
    )
    world = tp.world if tp is not None else 1
    held = _held_as(settings.quantization, engine)
    report = _report(settings, engine, dtype, device, world, held)
    _log_ready(settings, engine, report, tp)
    cfg, name = loaded.model.cfg, dtype_name(dtype)
    quantization, held_weights = held

    def measure_floors() -> dict[str, Any]:  # small buffers: ~0.5 s
        bandwidth = memory_bandwidth(device, mib=256)
        flops = matmul_throughput(dtype, device, n=1024)
        return floors(cfg, name, bandwidth, flops, quantization, held_weights)

    def device_memory() -> tuple[int, int] | None:
        if device.type != "cuda":
            return None
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    return Built(
        engine=engine,
        tokenizer=loaded.tokenizer,
        model_id=model_id,
        model_dir=source.path if source else None,
        audit=report,
        info={
            "dtype": name,
            "quantization": quantization,
            "device": device.type,
            "attention_backend": report["attention_backend"]["name"],
            "block_size": str(settings.block_size),
            "max_model_len": str(engine.max_model_len),
            "tensor_parallel_size": str(world),
        },
        floors=measure_floors,
        device_memory=device_memory,
    )


def _load_prepared(
    settings: Settings,
    source: ModelSource | None,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None,
) -> tuple[LoadedModel, Backend | None]:
    """The model, and the engine's backend chosen from the checkpoint's config before
    its weights are read, so that it prepares each layer as the load reads it (the CPU
    packs a layer's linears: the load then holds one layer unpacked, not the model);
    the demo model without one."""
    if source is None:
        return load(None, dtype, device, tp), None
    cfg = load_config(source.path)
    backend = engine_backend(settings.engine, device, dtype, tp.shares(cfg).local if tp else cfg)
    prepare = functools.partial(backend.prepare_layer, quantization=settings.quantization)
    return load(source.path, dtype, device, tp, prepare), backend


def _held_as(quantization: str, engine: LLMEngine) -> tuple[str, Held | None]:
    """--quantization as the engine holds the weights, and what they take where the
    config cannot give it (model.audit.Held: as loaded): auto stays auto where a linear
    kept a checkpoint's integer kind, else is none (a float checkpoint, or a backend or
    dtype that computes the checkpoint's values as loaded); int4's as loaded too (its
    routers stay in the model's dtype, its mix is the backend's)."""
    if quantization not in ("int4", "auto"):
        return quantization, None
    kinds = engine.backend.describe().get("linears", {})
    if quantization == "auto" and not any(k in ("int8", "int8g", "int4") for k in kinds):
        return "none", None
    model, measure = engine.model, engine.backend.held_bytes
    experts = sum(measure(m.experts) for m in model.modules() if isinstance(m, MoE))
    return quantization, Held(measure(model), experts, model.lm_head is not None)


def _report(
    settings: Settings,
    engine: LLMEngine,
    dtype: torch.dtype,
    device: torch.device,
    world: int,
    held: tuple[str, Held | None],
) -> dict[str, Any]:
    """model/audit.py's report of the model and how this engine was built (/v1/models,
    the start-up line, the admission's KV figures); held: _held_as's."""
    cfg = engine.model.cfg
    quantization, held_weights = held
    report = audit(
        cfg, dtype_name(dtype), kv_pool_bytes=engine.kv_cache.nbytes, quantization=quantization,
        held_bytes=held_weights.total if held_weights is not None else None,
    ).as_dict()  # fmt: skip
    return report | {
        "architecture": cfg.architecture,
        "features": cfg.features,
        "hidden_size": cfg.d_model,  # an embedding's length (/v1/embeddings)
        "tensor_parallel_size": world,
        "kv_pool_bytes": engine.kv_cache.nbytes * world,  # every rank's share
        # the tokens the block ids name (window_only: no K/V under them, the window
        # pool holds it)
        "kv_pool_tokens": engine.blocks.num_blocks * settings.block_size,
        "device": str(device),
        "attention_backend": engine.backend.describe(),
        "quantization": quantization,
        "cuda_graphs": engine.runner.graphs is not None,
        "async_scheduling": engine.async_scheduling,
        "block_size": settings.block_size,
        "kv_blocks": engine.blocks.num_blocks,
        # the windowed layers' own pool, 0: none
        "kv_window_blocks": engine.kv_cache.window_blocks,
        "kv_pool_sequences_of_max_len": _sequences_of(
            engine.blocks, engine.max_model_len, engine.kv_cache.window_only
        ),
        "speculative_method": settings.speculative_method,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "lora": _lora(engine, settings, world),
    }


def _lora(engine: LLMEngine, settings: Settings, world: int) -> dict[str, int] | None:
    """The LoRA bank's slots, rank and bytes on the device (every rank's share), where
    the engine serves adapters."""
    if engine.adapters is None:
        return None
    bank = engine.adapters.adapters.bank
    return {"max_loras": bank.slots, "max_lora_rank": settings.max_lora_rank,
            "bank_bytes": bank.nbytes * world}  # fmt: skip


def _log_ready(
    settings: Settings, engine: LLMEngine, report: dict[str, Any], tp: TensorParallel | None
) -> None:
    backend, name = report["attention_backend"], report["dtype"]
    log.info(
        "engine ready%s: device %s, dtype %s, weights %s, attention backend %s%s, CUDA graphs "
        "%s, async scheduling %s, %d KV blocks of %d tokens (%s%.1f MiB), max_model_len %d",
        f" (rank {tp.rank} of {tp.world})" if tp is not None else "",
        report["device"],
        name,
        report["quantization"] if report["quantization"] != "none" else name,
        backend["name"],
        f" (ISA {backend['isa']}, linears {backend['linear_isa']})" if "isa" in backend else "",
        "on" if engine.runner.graphs is not None else "off",
        "on" if engine.async_scheduling else "off",
        engine.blocks.num_blocks,
        settings.block_size,
        f"{engine.kv_cache.window_blocks} more for the windowed layers, "
        if engine.kv_cache.window_blocks
        else "",
        engine.kv_cache.nbytes / (1 << 20),
        engine.max_model_len,
    )


def engine_link(settings: Settings, attach: Attach | None = None) -> Link:
    """How the fronts reach the engine core: a process of its own (engine_apart), and
    always for one of several fronts (attach); else a thread of this process."""
    if engine_apart(settings) or attach is not None:
        return InProcess(functools.partial(engine_process, settings), attach)
    return InThread(functools.partial(_serve_in_thread, settings))


def engine_apart(settings: Settings) -> bool:
    """`--engine-process`: on, off, or auto, which is on where the model runs on CUDA (the
    engine's host work and the fronts' text then run side by side, not in turn) and off
    on the CPU (whose cores the forward takes). docs/operations.md has both measurements."""
    if settings.engine_process != "auto":
        return settings.engine_process == "on"
    device = settings.device
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def engine_process(
    settings: Settings,
    inputs: list[str],
    outputs: list[str],
    parent: int,
    observer: Observers | None = None,
) -> None:
    """The engine process's main (multiprocessing's spawn target)."""
    core.run(functools.partial(build, settings), inputs, outputs, parent, observer)


def _serve_in_thread(settings: Settings, side: CoreSide, keep: Callable[[Any], None]) -> int:
    return core.serve(functools.partial(build, settings), side, keep=keep)


def _draft_source(settings: Settings) -> ModelSource | None:
    """Where the speculative draft model (--speculative-model) is (None: no draft)."""
    if settings.speculative_model is None:
        return None
    try:
        return resolve(settings.speculative_model, None, settings.download_dir)
    except ModelNotFound as e:
        raise ModelNotFound(f"speculative_model: {e}") from None


def _load_draft(
    source: ModelSource | None, dtype: torch.dtype, device: torch.device, tokenizer: Tokenizer
) -> Transformer | None:
    """The speculative draft model, which must tokenize as the served model does: its
    proposals are token ids of the same vocabulary."""
    if source is None:
        return None
    draft = load(source.path, dtype, device)
    probe = "Speculative decoding: the draft's ids must be the model's. 12345 ünïcödé"
    theirs = draft.tokenizer
    if theirs.vocab_size != tokenizer.vocab_size or theirs.encode(probe) != tokenizer.encode(probe):
        raise ValueError(
            f"speculative_model: its tokenizer ({theirs.name}, {theirs.vocab_size} tokens) "
            f"is not the served model's ({tokenizer.name}, {tokenizer.vocab_size} tokens)"
        )
    log.info("speculative draft model %s loaded", source.model_id)
    return draft.model


def _join_ranks(
    settings: Settings, device: torch.device, model_dir: Path | None
) -> TensorParallel | None:
    """Join the tensor-parallel ranks (None: one rank). The split is checked before any
    weight is read; on the CPU the ranks of one host share its cores."""
    world = settings.tensor_parallel_size
    if world == 1:
        return None
    check_split(settings, model_dir)
    tp = join(world, device, settings.rank_timeout)
    if device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return tp


def check_split(settings: Settings, model_dir: Path | None) -> None:
    """A ValueError when the model (its config.json; None: the demo model) does not split
    over tensor_parallel_size ranks: checked by `kvserve serve` before it starts its
    ranks, and by each rank before it joins them."""
    from model.demo import demo_config

    cfg = load_config(model_dir) if model_dir is not None else demo_config()
    why = unsplittable(cfg, settings.tensor_parallel_size)
    if why is not None:
        raise ValueError(f"tensor_parallel_size: {why}")


def served_model_dir(settings: Settings) -> Path | None:
    """The served model's directory (a Hub model's from the cache, downloaded when
    missing and reachable; None: the demo model)."""
    source = resolve(settings.model, settings.revision, settings.download_dir)
    return source.path if source else None


def _sequences_of(blocks: BlockManager, num_tokens: int, window_only: bool) -> int:
    """How many sequences of num_tokens the pools hold at once (window_only: every
    layer's K/V is in the window pool, none under the block pool's ids)."""
    n = blocks.num_blocks // blocks.blocks_for(num_tokens)
    if blocks.windows is not None:
        held = blocks.windows.num_blocks // blocks.windows.held_by(num_tokens)
        n = held if window_only else min(n, held)
    return n
