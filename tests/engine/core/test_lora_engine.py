"""LoRA adapters through the engine (--lora-modules): each request runs under the adapter
its model names, in float32 with the peft library's greedy tokens (adapter applied, not
merged), whatever it is batched with (other adapters, the base model); more adapters
than slots take turns; a prefix computed under one adapter is never reused under
another or the base model, and is under the same one."""

import threading
from pathlib import Path

import pytest
import torch
import transformers as tf

from model.adapters import Adapters, LoraBank, attach
from model.backends.cpu.packed import GatedSwiGLU
from model.loader import load
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.exec.cuda_graphs import DecodeGraphs
from service.engine.request import ParamError
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import write_adapter, write_llama, write_tokenizer

PROMPTS = [[(7 * i + 5 * j) % 250 + 3 for i in range(n)] for j, n in enumerate((11, 26, 17, 9))]
ADAPTERS = {  # name: (seed, peft's LoraConfig)
    "every": (1, dict(r=8, lora_alpha=16, target_modules="all-linear")),
    "qv": (2, dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"])),
    "kud": (3, dict(r=6, lora_alpha=12, target_modules=["k_proj", "up_proj", "down_proj"],
                    rank_pattern={"down_proj": 2}, alpha_pattern={"k_proj": 3})),
    "og": (4, dict(r=8, lora_alpha=8, target_modules=["o_proj", "gate_proj"])),
}  # fmt: skip
NEW = 8
# shapes the cpu backend's kernels take whole: its decoder stack runs them (64-feature
# blocks, 32-wide heads, (gate | up) in 128-row blocks)
STACKED = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list]]:
    root = tmp_path_factory.mktemp("lora")
    return root, write_with_adapters(root)


def write_with_adapters(root: Path) -> dict[str | None, list]:
    """A Llama checkpoint at root/base, ADAPTERS as peft writes them beside it, and each
    adapter's (and the base model's, under None) greedy tokens for every prompt from
    peft's model."""
    write_llama(root / "base", tied=False)
    write_tokenizer(root / "base")
    want: dict[str | None, list] = {}
    for name, (seed, config) in ADAPTERS.items():
        hf = tf.LlamaForCausalLM.from_pretrained(root / "base").eval()
        peft_model = write_adapter(hf, root / name, seed, **config)
        want[name] = [_generate(peft_model, p) for p in PROMPTS]
        with peft_model.disable_adapter():
            want[None] = [_generate(peft_model, p) for p in PROMPTS]
    return want


@torch.no_grad()
def _generate(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def _engine(root: Path, backend: str, max_loras: int = 4) -> LLMEngine:
    loaded = load(root / "base", torch.float32, torch.device("cpu"))
    modules = tuple(f"{n}={root / n}" for n in ADAPTERS)
    settings = Settings(
        num_kv_blocks=128, block_size=16 if backend == "triton" else 4,  # Triton's smallest
        attention_backend=backend, lora_modules=modules,
        max_loras=max_loras, max_lora_rank=8, max_num_batched_tokens=64,
    )  # fmt: skip
    return LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])  # triton: the interpreter
def test_requests_of_several_adapters_batched_give_peft_models_greedy_tokens(
    checkpoint, backend: str
) -> None:
    root, want = checkpoint
    engine = _engine(root, backend)
    names = [None, *ADAPTERS]
    prompts = PROMPTS[:2] if backend == "triton" else PROMPTS  # the interpreter is slow
    requests = {
        f"{i}-{name}": (prompt, greedy(NEW, lora=name))
        for i, prompt in enumerate(prompts)
        for name in names
    }
    got = {rid: tokens_of(outs) for rid, outs in run_all(engine, requests).items()}
    for i in range(len(prompts)):
        for name in names:
            assert got[f"{i}-{name}"] == want[name][i], (i, name)
    assert all(want[name] != want[None] for name in ADAPTERS)  # each adapter matters
    assert engine.blocks.num_used == 0 and engine.adapters.running() == {}


def test_more_adapters_than_slots_take_turns(checkpoint) -> None:
    root, want = checkpoint
    engine = _engine(root, "torch", max_loras=1)
    requests = {
        f"{i}-{name}": (PROMPTS[i], greedy(NEW, lora=name)) for i in range(2) for name in ADAPTERS
    }
    got = {rid: tokens_of(outs) for rid, outs in run_all(engine, requests).items()}
    for rid, (_, params) in requests.items():
        assert got[rid] == want[params.lora][int(rid[0])], rid
    assert engine.adapters.loads >= 2 and engine.adapters.evictions >= 1


def test_a_prefix_is_reused_under_its_own_adapter_alone(checkpoint) -> None:
    root, _ = checkpoint
    engine = _engine(root, "torch")
    prompt = PROMPTS[1]  # 26 tokens: 6 full blocks of 4

    def cached(name: str | None) -> int:
        outs = run_all(engine, {f"r{cached.n}": (prompt, greedy(2, lora=name))})
        cached.n += 1
        return next(iter(outs.values()))[0].num_cached_tokens

    cached.n = 0
    assert cached("every") == 0
    assert cached(None) == 0 and cached("qv") == 0  # not under another adapter, nor the base
    assert cached("every") == 24 and cached(None) == 24


def test_a_request_naming_no_served_adapter_is_refused(checkpoint) -> None:
    root, _ = checkpoint
    engine = _engine(root, "torch")
    with pytest.raises(ParamError, match="no LoRA adapter 'other'"):
        engine.add_request("x", PROMPTS[0], greedy(2, lora="other"))


@torch.no_grad()
def test_the_cpu_kernels_gated_ffn_takes_the_delta_before_its_gate(tmp_path: Path) -> None:
    """bf16 on the cpu backend: the (gate | up) kernel that applies the gate itself
    (GatedSwiGLU) gives an adapted row's logits as float32's adapted model does, within
    bf16's error and far closer than the base model's."""
    write_llama(tmp_path / "base", tied=False, intermediate_size=128)
    write_tokenizer(tmp_path / "base")
    hf = tf.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    write_adapter(hf, tmp_path / "every", 1, **ADAPTERS["every"][1])
    loaded = load(tmp_path / "base", torch.bfloat16, torch.device("cpu"))
    settings = Settings(
        num_kv_blocks=64, attention_backend="cpu", lora_modules=(f"every={tmp_path / 'every'}",),
        max_lora_rank=8,
    )  # fmt: skip
    engine = LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)
    model = engine.model
    assert isinstance(model.layers[0].ffn, GatedSwiGLU)
    engine.adapters.adapters.fill("every", 0)
    ids = torch.tensor(PROMPTS[1])
    model.adapters.rows = torch.zeros(len(ids), dtype=torch.long)
    got = model(ids).float()
    model.adapters.rows = None
    base = model(ids).float()
    ref = load(tmp_path / "base", torch.float32, torch.device("cpu")).model
    bank = LoraBank(ref.cfg, 1, 8, "cpu", torch.float32)
    bank.load(engine.adapters.known["every"], 0)
    attach(ref, Adapters(bank))
    ref.adapters.rows = torch.zeros(len(ids), dtype=torch.long)
    want = ref(ids)
    error, moved = (got - want).abs().max().item(), (base - want).abs().max().item()
    assert error < 0.05 * moved


@pytest.mark.parametrize("threads", [None, 5])  # the machine's, and uneven splits of the work
def test_the_cpu_decoder_stack_adds_the_deltas_the_modules_do(
    threads: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on the cpu backend: the one-call decoder stack (stack.c) runs adapted rows,
    batched with other adapters' and the base model's, to the tokens the layers' modules
    give them, however many threads share its work items."""
    if threads is not None:
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    write_llama(tmp_path / "base", tied=False, **STACKED)
    write_tokenizer(tmp_path / "base")
    for name, (seed, config) in ADAPTERS.items():
        hf = tf.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
        write_adapter(hf, tmp_path / name, seed, **config)
    tokens = {}
    for stacked in (True, False):
        loaded = load(tmp_path / "base", torch.bfloat16, torch.device("cpu"))
        modules = tuple(f"{n}={tmp_path / n}" for n in ADAPTERS)
        settings = Settings(
            num_kv_blocks=128, block_size=16, attention_backend="cpu", lora_modules=modules,
            max_lora_rank=8,
        )  # fmt: skip
        engine = LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)
        assert engine.model.fused_layers is not None
        if not stacked:
            engine.model.fused_layers = None
        requests = {
            f"{i}-{name}": (prompt, greedy(NEW, lora=name))
            for i, prompt in enumerate(PROMPTS)
            for name in (None, *ADAPTERS)
        }
        tokens[stacked] = {r: tokens_of(o) for r, o in run_all(engine, requests).items()}
        if stacked:  # it ran every step
            assert engine.model.fused_layers._kernels is not None
    assert tokens[True] == tokens[False]
    assert all(
        tokens[True][f"{i}-{n}"] != tokens[True][f"{i}-None"] for i in range(4) for n in ADAPTERS
    )


def test_an_adapter_unloaded_with_requests_in_flight_finishes_them_first(checkpoint) -> None:
    """Unloaded while a request runs under it: the request ends with peft's tokens, a new
    request naming it is refused, and once its last request is gone the adapter is out
    of host memory and of its slot; loaded again, it serves again."""
    root, want = checkpoint
    engine = _engine(root, "torch")
    slots = engine.adapters
    engine.add_request("r", PROMPTS[0], greedy(NEW, lora="qv"))
    outputs = engine.step()  # its prompt, and its slot taken
    slots.remove("qv")
    assert "qv" not in slots.served and "qv" in slots.known
    with pytest.raises(ParamError, match="no LoRA adapter 'qv'"):
        engine.add_request("late", PROMPTS[1], greedy(NEW, lora="qv"))
    while engine.has_unfinished():
        outputs += engine.step()
    assert [t for o in outputs for t in o.token_ids] == want["qv"][0]
    assert "qv" not in slots.known and "qv" not in slots.names
    with pytest.raises(KeyError, match="no LoRA adapter 'qv' is loaded"):
        slots.remove("qv")
    slots.add(slots.read("qv", str(root / "qv")))
    got = run_all(engine, {"again": (PROMPTS[0], greedy(NEW, lora="qv"))})
    assert tokens_of(got["again"]) == want["qv"][0]
    with pytest.raises(ValueError, match="'qv' is loaded already"):
        slots.add(slots.read("qv", str(root / "qv")))


def test_a_load_at_run_time_reads_on_one_core_of_its_own(checkpoint) -> None:
    """read_later: the adapter read in a thread whose torch ops run on one core, while
    the engine's thread, and threads started afterwards, keep the engine's count."""
    root, _ = checkpoint
    slots = _engine(root, "torch").adapters
    threads = torch.get_num_threads()
    adapter = slots.read_later("late", str(root / "qv")).result()
    assert adapter.name == "late" and adapter.linears.keys() == slots.known["qv"].linears.keys()
    assert slots._reader.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == threads
    later: list[int] = []
    started = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    started.start()
    started.join()
    assert later == [threads]


def test_decode_graphs_carry_each_rows_adapter(checkpoint) -> None:
    """On the Triton backend (the interpreter) decode steps of adapters and of the base
    model go through the CUDA graphs' static buffers (replayed eagerly here), each row's
    slot with them: peft's tokens still."""
    root, want = checkpoint
    engine = _engine(root, "triton")
    graphs = DecodeGraphs(engine.model, engine.kv_cache, 16, 256, capture=False)
    sizes: list[int] = []
    run = graphs.run
    graphs.run = lambda tokens, meta, *lora: (
        sizes.append(tokens.shape[0]) or run(tokens, meta, *lora)
    )
    engine.runner.graphs = graphs
    requests = {f"{i}-{name}": (PROMPTS[i], greedy(NEW, lora=name)) for i in range(1)
                for name in (None, *ADAPTERS)}  # fmt: skip
    got = {rid: tokens_of(o) for rid, o in run_all(engine, requests).items()}
    assert got == {rid: want[p.lora][int(rid[0])] for rid, (_, p) in requests.items()}
    assert sum(sizes) >= len(requests) * NEW // 2  # most decodes went through the graphs
