"""The engine built from parts a test chose: a runner that samples a script instead of
running a model, so the step's own logic (acceptance, stop conditions, finishing, the
blocks it frees) is checked on its own."""

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from service.config import Settings
from service.engine.batch import SchedulerOutput
from service.engine.core.engine import LLMEngine
from service.engine.core.parts import assemble, engine_backend
from service.engine.exec.runner import Launched
from service.engine.sample.sampler import SampleResult
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import small_model, tokenizer


class ScriptedRunner:
    """Every sampled row takes the script's next token; a forward is never run."""

    def __init__(self, script: list[int]) -> None:
        self.script: Iterator[int] = iter(script)
        self.steps = 0
        self.released: list[str] = []

    def launch(
        self, batch: SchedulerOutput, prev: Launched | None = None, read_later: bool = False
    ) -> Launched:
        self.steps += 1
        rows = sum(1 + len(s.drafts) for s in batch.seqs if s.sample)
        ids = [next(self.script) for _ in range(rows)]
        return Launched(batch, SampleResult(ids, [None] * rows))

    @staticmethod
    def read(launched: Launched) -> SampleResult:
        assert launched.result is not None
        return launched.result

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def clear_blocks(self, blocks: list[int]) -> None:
        pass


def scripted_engine(script: list[int]) -> tuple[LLMEngine, ScriptedRunner]:
    model, config = small_model(), Settings(num_kv_blocks=64, block_size=4).engine
    runner = ScriptedRunner(script)
    parts = dataclasses.replace(assemble(model, tokenizer(), config, None), runner=runner)
    return LLMEngine(parts, config), runner


def test_an_engine_from_injected_parts_steps_on_a_scripted_runner() -> None:
    engine, runner = scripted_engine([5, 6, 7, 8, 9])
    out = run_all(engine, {"a": ([1, 2, 3, 4, 5], greedy(3))})["a"]
    assert tokens_of(out) == [5, 6, 7] and out[-1].finish_reason == "length"
    assert runner.steps == 3 and runner.released == ["a"]
    assert engine.blocks.num_used == 0 and not engine.requests


def test_a_stop_token_from_the_script_finishes_the_request() -> None:
    engine, _ = scripted_engine([5, 6, 7, 8])
    out = run_all(engine, {"b": ([1, 2, 3], greedy(8, stop_token_ids=[6]))})["b"]
    assert tokens_of(out) == [5, 6] and out[-1].finish_reason == "stop"
    assert engine.stats.finished["stop"] == 1 and engine.blocks.num_used == 0


def test_int4_weights_on_a_gpu_take_its_backends_and_int8_the_cpu_kernels() -> None:
    """`--quantization int4` with the attention backend `auto` on a CUDA device goes to a
    GPU backend (Triton's W4A16 kernel there; torch's where Triton is missing, as here),
    never to the cpu backend, which refuses the device; int8's only kernels are the CPU's,
    so on a GPU their refusal is the error."""
    cfg = small_model().cfg
    cuda = torch.device("cuda")
    backend = engine_backend(Settings(quantization="int4").engine, cuda, torch.bfloat16, cfg)
    assert backend.name != "cpu"
    with pytest.raises(ValueError, match="quantization int8: attention_backend cpu"):
        engine_backend(Settings(quantization="int8").engine, cuda, torch.bfloat16, cfg)
    cpu = engine_backend(
        Settings(quantization="int4").engine, torch.device("cpu"), torch.bfloat16, cfg
    )
    assert cpu.name == "cpu"
