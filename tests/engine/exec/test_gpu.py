"""The GPU path on CUDA: the Triton kernels against the torch reference, one host sync
per decode step, decode steps replayed as CUDA graphs, and a compute-sanitizer pass.
Marked `gpu`: skipped, with that reason, where there is no CUDA (tests/conftest.py)."""

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from model.backends import select_backend
from model.backends.reference import TorchBackend
from model.config import ModelConfig
from model.kv_cache import PagedKVCache
from model.metadata import AttentionMetadata
from model.weights import load_model
from service.config import Settings
from service.engine.core.engine import LLMEngine
from tests.engine.core.test_engine import mixed_requests
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import (
    small_model,
    tokenizer,
    write_gemma2,
    write_gemma3,
    write_gpt_oss,
    write_mistral,
    write_qwen3_moe,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]


def cuda_engine(model, **settings) -> LLMEngine:
    defaults = dict(num_kv_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
    defaults.update(settings)
    return LLMEngine.build(model, tokenizer(), Settings(**defaults).engine)


def cuda_kernels(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """module(x), and the names of the CUDA kernels it launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = module(x)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return out, [e.name for e in prof.events() if e.device_type == cuda]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(8, 2, 64, 16), (12, 4, 80, 32), (32, 8, 128, 16)], ids=str)
def test_triton_attention_matches_reference_on_cuda(shape, dtype) -> None:
    h, kv, d, bs = shape
    cfg = ModelConfig(vocab_size=8, d_model=h * d, n_layers=1, n_heads=h, n_kv_heads=kv, d_ff=8)
    dev = torch.device("cuda")
    triton = select_backend("triton", dev, dtype, cfg, bs)
    cache = PagedKVCache(cfg, 64, bs, dtype, dev, triton)
    for t in cache.layer(0):
        t.copy_(torch.randn(t.shape, device=dev).to(dtype))
    batch = [(40, 1), (0, 9), (70, 41), (17, 1), (0, 1)]
    tables, nxt = [], 0
    for c, n in batch:
        need = -(-(c + n) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    cached, new = [c for c, _ in batch], [n for _, n in batch]
    q = torch.randn(sum(new), h, d, device=dev).to(dtype)
    ref_meta = AttentionMetadata.paged(tables, cached, new, bs, dev)
    ref = TorchBackend(dev).attend(q, q, q, cache.layer(0), ref_meta, d**-0.5, None).float()
    meta = triton.metadata(tables, cached, new, bs, dev, cache.null_block)
    out = triton.attend(q, q, q, cache.layer(0), meta, d**-0.5, None).float()
    torch.testing.assert_close(out, ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)


@pytest.mark.parametrize("d", [576, 2048, 4096])
def test_fused_add_rms_norm_matches_reference_on_cuda(d: int) -> None:
    """The residual add in place and the RMSNorm in one kernel: the reference's sum bit
    for bit, its norm rarely apart: the sum of squares in another order can move x * rstd
    by an ulp, and the weight's product, rounded again, up to two (2**-6 relative)."""
    from model.layers import RMSNorm

    cfg = ModelConfig(vocab_size=8, d_model=d, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=8)
    dev = torch.device("cuda")
    triton = select_backend("triton", dev, torch.bfloat16, cfg, 16)
    norm = RMSNorm(d, 1e-5).to(dev, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, device=dev) + 0.5)
    x = (torch.randn(300, d, device=dev) * 3).to(torch.bfloat16)
    delta = torch.randn(300, d, device=dev).to(torch.bfloat16)
    x_ref, h_ref = TorchBackend(dev).add_norm(norm, x.clone(), delta)
    x_out, h = triton.add_norm(norm, x.clone(), delta)
    assert torch.equal(x_out, x_ref)
    torch.testing.assert_close(h.float(), h_ref.float(), atol=0, rtol=2**-6)
    assert (h != h_ref).float().mean() < 0.01


def test_cuda_default_is_triton_with_graphs_and_matches_eager() -> None:
    model = small_model().to("cuda", torch.bfloat16)
    engine = cuda_engine(model)
    assert engine.backend.name == "triton" and engine.runner.graphs is not None
    eager = cuda_engine(model, enforce_eager=True)
    assert eager.runner.graphs is None
    requests = mixed_requests(8)
    for e in (engine, eager):
        for rid, (prompt, params) in requests.items():
            e.add_request(rid, prompt, params)
    outs: list[dict[str, list[int]]] = [{}, {}]
    for i, e in enumerate((engine, eager)):
        while e.has_unfinished():
            for o in e.step():
                outs[i].setdefault(o.request_id, []).extend(o.token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "qwen3_moe", "gpt_oss"])
def test_windowed_and_soft_capped_models_replay_graphs_with_eagers_tokens(
    family: str, tmp_path
) -> None:
    """Gemma 2 (soft-caps, windows beside global layers), Gemma 3 (its window pool), a
    Mistral windowed in every layer, and the mixtures of experts Qwen3-MoE and gpt-oss
    (Triton's expert kernels, sinks), captured as CUDA graphs: the greedy tokens of the
    eager engine, float32, with prompts and decodes past the window of 8."""
    writers = {"gemma2": write_gemma2, "gemma3": lambda p: write_gemma3(p, sliding_window=8),
               "mistral": lambda p: write_mistral(p, sliding_window=8),
               "qwen3_moe": write_qwen3_moe, "gpt_oss": write_gpt_oss}  # fmt: skip
    writers[family](tmp_path)
    model = load_model(tmp_path, torch.float32, device="cuda")
    requests = {f"r{i}": ([(5 * i + j) % 300 + 1 for j in range(11 + 9 * i)], greedy(40))
                for i in range(6)}  # fmt: skip
    engine = cuda_engine(model)
    assert engine.runner.graphs is not None
    eager = cuda_engine(model, enforce_eager=True)
    got = {rid: tokens_of(o) for rid, o in run_all(engine, requests).items()}
    want = {rid: tokens_of(o) for rid, o in run_all(eager, requests).items()}
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_on_cuda_gives_the_graphs_tokens(method: str) -> None:
    """Speculative steps run eagerly beside the graphs' plain decode steps: the same greedy
    tokens as the engine without speculation (CUDA graphs on), with drafts accepted."""
    from tests.engine.exec.test_speculative import copy_requests

    model = small_model().to("cuda", torch.bfloat16)
    requests = copy_requests(4, 40)
    want = run_all(cuda_engine(model), requests)
    draft = dict(speculative_model="in-memory") if method == "draft" else {}
    engine = LLMEngine.build(
        model,
        tokenizer(),
        Settings(
            num_kv_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
            speculative_method=method, speculative_min_speedup=0, **draft,
        ).engine,
        draft=model if method == "draft" else None,
    )  # fmt: skip
    assert engine.runner.graphs is not None
    got = run_all(engine, requests)
    assert {r: tokens_of(o) for r, o in got.items()} == {r: tokens_of(o) for r, o in want.items()}
    assert engine.stats.spec_accepted_tokens > 0 and engine.blocks.num_used == 0


def test_structured_outputs_on_cuda() -> None:
    """Constrained rows on the GPU (masks computed on the host and applied on the
    device; forced text appended beside the graphs' decode steps): every schema of the
    corpus gives a valid document, greedy and sampled."""
    import json

    import jsonschema

    from model.demo import build_demo_model
    from model.tokenizer import Tokenizer
    from service.engine.request import Constraint, SamplingParams
    from tests.api.json_schemas import SCHEMAS

    model = build_demo_model(torch.bfloat16, torch.device("cuda"))
    engine = LLMEngine.build(
        model, Tokenizer.default(), Settings(num_kv_blocks=1024, max_num_seqs=16).engine
    )
    prompt = engine.tokenizer.encode("Answer in JSON:")
    requests = {
        f"{name}/{t}": (prompt, SamplingParams(max_tokens=300, temperature=t, seed=1, constraint=Constraint("json", json.dumps(schema), "response_format")))
        for name, (schema, _) in SCHEMAS.items()
        for t in (0.0, 1.0)
    }  # fmt: skip
    for rid, outs in run_all(engine, requests).items():
        text = "".join(o.text for o in outs)
        assert outs[-1].finish_reason.value == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMAS[rid.split("/")[0]][0])
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("pool", [256, 24])  # 24 blocks of 16: preempts (on the CPU)
def test_async_scheduling_on_cuda_gives_the_read_each_step_outputs(pool: int) -> None:
    """On CUDA the engine queues a step before it reads the last one's tokens (the
    default): greedy, sampled, stopped, biased and n > 1 requests get the tokens of the
    engine that reads every step (graphs on in both; in float32, where a batch one row
    larger, as async scheduling runs a request that just stopped for one more step, is
    far less likely than in bf16 to move an argmax); penalties and logprobs too, the
    logprobs to float32's last bits."""
    from tests.engine.core.test_async_scheduling import run, same_outputs, workload

    model = small_model().to("cuda", torch.float32)
    outputs = {}
    for mode in ("auto", "off"):
        engine = cuda_engine(model, num_kv_blocks=pool, async_scheduling=mode)
        assert engine.runner.graphs is not None
        assert engine.async_scheduling == (mode == "auto")
        outputs[mode], chained = run(engine, workload(3))
        assert (chained > 0) == (mode == "auto")
    assert same_outputs(outputs["auto"], outputs["off"])


def syncs_in_a_step(engine: LLMEngine) -> list[str]:
    """The host syncs torch's sync debug mode warns of in the engine's next step."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize(
    "graphs,mode,extras",
    [(True, "auto", False), (False, "auto", False), (True, "off", False), (True, "auto", True)],
)
def test_one_host_sync_per_decode_step(graphs: bool, mode: str, extras: bool) -> None:
    """With torch's sync debug mode on, a decode step (graphs or eager) that reads its
    own tokens warns exactly once: the sampled token ids coming back to the host. With
    async scheduling (the default) it warns never: the previous step's ids come in a
    copy queued after that step's sampling, and the host waits on an event recorded
    after the copy, not on the stream (which holds the step just queued). extras: every
    request with penalties and logprobs, which async scheduling keeps on the device."""
    model = small_model().to("cuda", torch.bfloat16)
    engine = cuda_engine(model, enforce_eager=not graphs, async_scheduling=mode)
    more = dict(frequency_penalty=0.5, repetition_penalty=1.2, logprobs=2) if extras else {}
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i] * (10 + i), greedy(12, **more))
    for _ in range(3):  # prefill and the first decodes, outside the count
        engine.step()
    syncs = syncs_in_a_step(engine)
    assert len(syncs) == (mode == "off"), syncs
    assert (engine.in_flight is not None) == (mode == "auto")


@pytest.mark.parametrize("writer", [write_qwen3_moe, write_gpt_oss])
def test_a_mixtures_eager_decode_step_reads_nothing_on_the_host(writer, tmp_path) -> None:
    """Triton's experts (their aligned layout built on the device) keep an eager decode
    step of a mixture free of host syncs under async scheduling, as a dense one is: what
    lets the graphs capture it."""
    writer(tmp_path)
    model = load_model(tmp_path, torch.bfloat16, device="cuda")
    engine = cuda_engine(model, enforce_eager=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i] * (10 + i), greedy(12))
    for _ in range(3):
        engine.step()
    syncs = syncs_in_a_step(engine)
    assert not syncs, syncs


def test_decode_step_is_one_graph_launch() -> None:
    model = small_model().to("cuda", torch.bfloat16)
    engine = cuda_engine(model)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i] * 10, greedy(12))
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 1
    assert names.count("cudaLaunchKernel") < 40  # sampling and copies, not the layers


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")
def test_compute_sanitizer_finds_no_errors_in_the_kernels() -> None:
    code = (
        "import torch\n"
        "from tests.engine.exec.test_gpu import test_triton_attention_matches_reference_on_cuda as t\n"
        "t((12, 4, 80, 32), torch.bfloat16)\n"
        "t((8, 2, 64, 16), torch.float32)\n"
    )
    proc = subprocess.run(
        [
            "compute-sanitizer",
            "--tool",
            "memcheck",
            "--error-exitcode",
            "9",
            sys.executable,
            "-c",
            code,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout


def test_fp8_linears_on_cuda_are_the_dequantized_reference() -> None:
    """An Fp8Linear's torch._scaled_mm (e4m3 activations per token, the weight's row
    scales) against F.linear of the dequantized weight and the per-token-quantized
    activations in float32: the same products, summed in another order."""
    import torch.nn.functional as F

    from model.backends.fp8 import Fp8Linear
    from model.fp8 import E4M3, E4M3_MAX, dequantize

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 (Ada, Hopper) or later")
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True)
    linear.weight.data = torch.randn(384, 256, generator=gen) * 0.05
    fp8 = Fp8Linear(linear.to(torch.bfloat16)).cuda()
    x = torch.randn(37, 256, generator=gen).to("cuda", torch.bfloat16)
    got = fp8(x).float()
    scale = x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX
    xq = (x.float() / scale).to(E4M3).float() * scale
    want = F.linear(xq, dequantize(fp8.weight, fp8.scale), fp8.bias.float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("k", [576, 1000, 2048, 14336], ids=lambda k: f"k{k}")
def test_fp8_activation_quantizer_kernel_is_torchs(k: int) -> None:
    """The triton backend's one-launch activation quantizer gives the torch reference's
    e4m3 values and per-token scales bit for bit (a row of zeros too), over one pass of
    its columns, several, and a ragged last one."""
    from model.backends.fp8 import quantize_rows
    from model.backends.triton.pointwise import quantize_rows_fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need compute capability 8.9 (Ada, Hopper) or later")
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(37, k, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    x[5] = 0
    q, s = quantize_rows_fp8(x)
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_on_cuda_matches_torch(dtype) -> None:
    from model.backends.triton.pointwise import silu_mul

    both = (torch.randn(33, 2 * 2900, device="cuda") * 4).to(dtype)
    gate, up = both.split(2900, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(both)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # the exponential's last bits may move a rounding: a rare bf16 ulp
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_a_decoder_layer_launches_these_kernels(quantization: str) -> None:
    """A Llama decoder layer's decode step on CUDA, replayed from a graph, counted with the
    profiler (a 4-layer model's step less a 2-layer one's, halved): two fused add+norms,
    the RoPE + KV store, the attention (split into shares and combined for one stream),
    the one-kernel SwiGLU gate and the four projections (with FP8, the weight-only
    kernel: no activation quantizer); no other kernel."""
    from benchmarks.launches import census
    from model.backends.triton.kernels import decode_splits

    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 (Ada, Hopper) or later")
    counts = []
    for layers in (2, 4):
        model = small_model(n_layers=layers, d_model=64, d_ff=96).to("cuda", torch.bfloat16)
        engine = cuda_engine(model, quantization=quantization)
        engine.add_request("r", [5] * 20, greedy(60))
        for _ in range(6):
            engine.step()
        counts.append(census(engine.step, 16)["launches"])
    two, four = counts
    layer = {k: (four.get(k, 0) - two.get(k, 0)) / 2 for k in four | two}
    layer = {k: n for k, n in layer.items() if n}
    want = {"norm": 2, "rope_store": 1, "attention": 1 + (decode_splits(1, 2) > 1),
            "silu_mul": 1, "gemm": 4}  # fmt: skip
    assert layer == want, (two, four)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fp8_decode_rows_take_the_weight_only_kernel(rows: int) -> None:
    """An Fp8Linear given the triton backend's kernels: up to 16 rows through fp8_gemv
    (bf16 activations times the dequantized weight, summed in fp32), as F.linear of the
    dequantized weight computes it; 17 rows through _scaled_mm again."""
    import torch.nn.functional as F

    from model.backends.fp8 import Fp8Linear
    from model.backends.triton import fp8_gemv
    from model.fp8 import dequantize

    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(4096, 6160, bias=True)  # a ragged last block of outputs
    linear.weight.data = torch.randn(6160, 4096, generator=gen) * 0.05
    fp8 = Fp8Linear(linear.to(torch.bfloat16)).cuda()
    fp8.gemv, fp8.gemv_rows = fp8_gemv.fp8_gemv, fp8_gemv.ROWS
    x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    want = F.linear(x.float(), dequantize(fp8.weight, fp8.scale), fp8.bias.float())
    got, kernels = cuda_kernels(fp8, x)
    assert len(kernels) == 1 and "fp8_gemv" in kernels[0], kernels
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)
    more = torch.randn(17, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert fp8(more).shape == (17, 6160)


@pytest.mark.parametrize("rows", [1, 5, 16, 300])
def test_int4_linears_on_cuda_are_the_dequantized_linear_in_one_launch(rows: int) -> None:
    """An Int4Linear given the triton backend's W4A16 kernel on the GPU: one launch at
    every row count (the one-row sums, a decode batch's and a prefill's tensor-core
    tiles, which take the weights rounded to bf16), F.linear of the dequantized weight
    up to bf16's rounding of the sums."""
    import torch.nn.functional as F

    from model.backends.int4 import Int4Linear
    from model.backends.triton import int4_linear

    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(6160, 4096, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    linear = Int4Linear(weight, torch.randn(6160, generator=gen).to("cuda", torch.bfloat16))
    linear.kernel = int4_linear.int4_linear
    x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    w = linear.dequantized() if rows == 1 else linear.dequantized().bfloat16().float()
    want = F.linear(x.float(), w, linear.bias.float())
    got, kernels = cuda_kernels(linear, x)
    assert len(kernels) == 1 and "int4" in kernels[0], kernels
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("writer", [None, write_qwen3_moe])
def test_int4_weights_on_cuda_replay_graphs_with_eagers_tokens(writer, tmp_path) -> None:
    """--quantization int4 on the GPU: the triton backend's int4 linears (and a mixture's
    int4 experts) captured in the decode graphs give the eager engine's greedy tokens."""

    def model():  # type: ignore[no-untyped-def]
        if writer is None:
            return small_model(d_model=128, n_heads=4, d_ff=256).to("cuda", torch.bfloat16)
        return load_model(tmp_path, torch.bfloat16, device="cuda")

    if writer is not None:
        writer(tmp_path)
    from model.backends.int4 import Int4Stack

    engine = cuda_engine(model(), quantization="int4")
    assert "int4" in engine.backend.describe()["linears"]
    stacks = [m for m in engine.model.modules() if isinstance(m, Int4Stack)]
    assert len(stacks) == (0 if writer is None else 2 * len(engine.model.cfg.sparse_layers))
    assert engine.runner.graphs is not None
    eager = cuda_engine(model(), quantization="int4", enforce_eager=True)
    requests = mixed_requests(8)
    got = {rid: tokens_of(o) for rid, o in run_all(engine, requests).items()}
    want = {rid: tokens_of(o) for rid, o in run_all(eager, requests).items()}
    assert got == want


def test_lora_adapters_on_cuda_give_peft_tokens_through_the_graphs(tmp_path: Path) -> None:
    """LoRA adapters on CUDA: the Triton shrink and expand kernels inside the decode
    graphs, requests of two adapters and of the base model together (float32), give the
    peft library's greedy tokens as the CPU computes them."""
    from tests.engine.core.test_lora_engine import ADAPTERS, NEW, PROMPTS, write_with_adapters

    want = write_with_adapters(tmp_path)
    model = load_model(tmp_path / "base", torch.float32).to("cuda")
    modules = tuple(f"{n}={tmp_path / n}" for n in ADAPTERS)
    engine = cuda_engine(model, lora_modules=modules, max_lora_rank=8, max_num_seqs=16)
    assert engine.runner.graphs is not None and engine.runner.graphs.lora_rows is not None
    requests = {f"{i}-{name}": (p, greedy(NEW, lora=name)) for i, p in enumerate(PROMPTS)
                for name in (None, *ADAPTERS)}  # fmt: skip
    got = {rid: tokens_of(o) for rid, o in run_all(engine, requests).items()}
    assert got == {rid: want[p.lora][int(rid[0])] for rid, (_, p) in requests.items()}
