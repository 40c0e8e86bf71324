import json
import time
from pathlib import Path

import pytest
import torch

from model.backends.device import pick_dtype
from model.demo import DEMO_MODEL_ID, build_demo_model
from model.loader import load
from model.tokenizer import TokenizerError
from tests.factories import write_llama
from tests.model.backends import generate_auto
from tests.model.test_config import LLAMA_HF


def test_demo_model_is_deterministic_and_fast() -> None:
    t0 = time.perf_counter()
    loaded = load(None, torch.float32, torch.device("cpu"))
    assert time.perf_counter() - t0 < 30  # "starts in a few seconds" with a wide margin
    assert loaded.model_id == DEMO_MODEL_ID and "random" in loaded.model_id
    other = build_demo_model()
    for (n, a), (_, b) in zip(loaded.model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n
    prompt = loaded.tokenizer.encode("The quick brown fox")
    a = generate_auto(loaded.model, prompt, 8)
    assert a == generate_auto(other, prompt, 8) and len(a) == 8
    s1 = generate_auto(other, prompt, 8, temperature=1.0, seed=3)
    assert s1 == generate_auto(other, prompt, 8, temperature=1.0, seed=3)


def test_tokenizer_larger_than_vocab_is_refused(tmp_path: Path) -> None:
    write_llama(tmp_path, tied=True)  # vocab 384, no tokenizer files: default cl100k
    with pytest.raises(TokenizerError, match="100277 tokens but config.json vocab_size is 384"):
        load(tmp_path, torch.float32, torch.device("cpu"))


def test_generate_rejects_overlong_requests() -> None:
    model = build_demo_model()
    with pytest.raises(ValueError, match="context length"):
        generate_auto(model, [1] * 4000, 200)
    with pytest.raises(ValueError, match="at least one token"):
        generate_auto(model, [], 2)


def test_cli_generate_and_audit(capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli import main

    assert main(["generate", "--prompt", "Hello", "--max-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Hello") and "4 generated" in out.err
    assert main(["audit"]) == 0
    report = json.loads(capsys.readouterr().out)
    itemsize = pick_dtype("auto", torch.device("cpu")).itemsize  # bf16 from AVX2 up
    assert report["model"] == DEMO_MODEL_ID
    assert report["kv_bytes_per_token"] == 2 * 2 * 64 * 4 * itemsize
    assert main(["audit", "--model", "/nonexistent"]) == 2
    assert "model directory not found" in capsys.readouterr().err


def test_cli_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from model.audit import kv_bytes_per_token, weight_bytes
    from model.demo import demo_config
    from service.cli import main

    assert (
        main(
            [
                "plan",
                "--no-measure",
                "--json",
                "--memory-gib",
                "1",
                "--dtype",
                "float32",
                "--seq-len",
                "1000",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    cfg = demo_config()
    room = (1 << 30) - weight_bytes(cfg, "float32")
    assert report["kv_tokens"] == room // kv_bytes_per_token(cfg, "float32")
    assert report["sequences_of_seq_len"] == report["kv_tokens"] // 1000
    # a Llama-3-70B-class config.json: 327,680 KV bytes per token in fp16, and it does not fit 24 GiB
    hf = {**LLAMA_HF, "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert (
        main(
            [
                "plan",
                "--config",
                str(tmp_path / "config.json"),
                "--no-measure",
                "--json",
                "--memory-gib",
                "24",
                "--dtype",
                "float16",
            ]
        )
        == 0
    )
    big = json.loads(capsys.readouterr().out)
    assert big["kv_bytes_per_token"] == 327_680 and big["fits"] is False and big["kv_tokens"] == 0
    assert main(["plan", "--dtype", "float32", "--memory-gib", "2"]) == 0
    assert "decode floor" in capsys.readouterr().out
    # the same 70B-class config split over 4 devices of 80 GB (74.5 GiB)
    split = ["--config", str(tmp_path / "config.json"), "--no-measure", "--dtype", "bfloat16"]
    assert main(["plan", *split, "--memory-gib", "74.5", "--tensor-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "weights per device (of 4): 32.86 GiB" in out
    assert "81,920 per device (of 4)" in out and "collectives per token" in out
    # its linears in FP8 (one byte and a scale a row): one such device holds it, with room
    assert main(["plan", *split, "--memory-gib", "74.5", "--quantization", "fp8", "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["quantization"] == "fp8" and fp8["fits"] is True
    assert 65 * (1 << 30) < fp8["weight_bytes"] < 70 * (1 << 30)


@pytest.mark.parametrize(
    ("level", "want"),
    [("baseline", torch.float32), ("avx2", torch.bfloat16), ("avx512f", torch.bfloat16),
     ("avx512-bf16", torch.bfloat16), ("amx", torch.bfloat16)],
)  # fmt: skip
def test_auto_dtype_is_bf16_on_cuda_and_where_the_bf16_kernels_run(
    monkeypatch: pytest.MonkeyPatch, level: str, want: torch.dtype
) -> None:
    import model.backends.device as device

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(device, "cpu_isa", lambda: level)
    assert pick_dtype("auto", cpu) == want and pick_dtype("auto", cuda) == torch.bfloat16
    assert pick_dtype("auto", cpu, "int8") == torch.bfloat16  # int8 weights, bf16 activations
    assert pick_dtype("float32", cpu) == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        pick_dtype("float8", cpu)


def test_isa_levels_follow_the_cpu_flags_and_kvserve_cpu_isa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import model.backends.cpu.isa as device

    zen4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(zen4))
    device._resolve_isa.cache_clear()
    try:
        assert device.native_isa() == "avx512-bf16" and not device.cpu_has_amx()
        assert device.isa_missing("amx") == ("amx_tile", "amx_bf16")
        monkeypatch.setenv(device.ISA_ENV, "avx2")
        assert device.cpu_isa() == "avx2"
        assert "-mno-avx512f" in device.isa_flags("avx2")
        monkeypatch.setenv(device.ISA_ENV, "amx")
        with pytest.raises(
            ValueError, match="needs CPU flags amx_tile, amx_bf16.*up to avx512-bf16"
        ):
            device.cpu_isa()
        monkeypatch.setenv(device.ISA_ENV, "sse2")
        with pytest.raises(ValueError, match="must be one of"):
            device.cpu_isa()
        monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"sse2"}))
        monkeypatch.delenv(device.ISA_ENV)
        assert device.native_isa() == "baseline" and device.isa_flags("baseline") == ()
    finally:
        device._resolve_isa.cache_clear()
