"""Bad checkpoints and settings stop start-up: one clear line naming the file and the
field, and a non-zero exit status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.factories import ENGINE_MODES, free_port, write_llama
from tests.reliability.conftest import Row

pytestmark = pytest.mark.reliability  # make test-fast leaves these out


def _edit_config(root: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((root / "config.json").read_text())
    change(cfg)
    (root / "config.json").write_text(json.dumps(cfg))


def _truncate(root: Path) -> None:
    f = root / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _corrupt_header(root: Path) -> None:
    f = root / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\x00garbage, not a JSON header\xff\xfe\x00\x01"
    f.write_bytes(bytes(data))


def _write_tokenizer(root: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([Path(json.__file__).read_text()] * 4, trainer)
    tok.save(str(root / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab_size


def _del(key: str) -> Callable[[dict], None]:
    return lambda cfg: cfg.pop(key)


def _set(**values: object) -> Callable[[dict], None]:
    return lambda cfg: cfg.update(values)


# name, how to break a good checkpoint, extra flags, what the error line must contain
CASES: list[tuple[str, Callable[[Path], None] | None, list[str], list[str]]] = [
    ("truncated safetensors", _truncate, [], ["model.safetensors"]),
    ("corrupt safetensors header", _corrupt_header, [], ["model.safetensors", "header"]),
    (
        "missing weights file",
        lambda r: (r / "model.safetensors").unlink(),
        [],
        ["model.safetensors"],
    ),
    (
        "config.json not JSON",
        lambda r: (r / "config.json").write_text("{nope"),
        [],
        ["config.json"],
    ),
    (
        "config.json missing hidden_size",
        lambda r: _edit_config(r, _del("hidden_size")),
        [],
        ["config.json", "hidden_size"],
    ),
    (
        "num_attention_heads contradicts the weights",
        lambda r: _edit_config(r, _set(num_attention_heads=6)),
        [],
        ["config.json", "num_attention_heads"],
    ),
    (
        "KV heads do not divide heads",
        lambda r: _edit_config(r, _set(num_key_value_heads=3)),
        [],
        ["config.json", "num_key_value_heads"],
    ),
    (
        "config contradicts the weights",
        lambda r: _edit_config(r, _set(intermediate_size=96)),
        [],
        ["model.safetensors", "mlp"],
    ),
    (
        "unknown architecture",
        lambda r: _edit_config(r, _set(architectures=["MambaForCausalLM"])),
        [],
        ["config.json", "MambaForCausalLM"],
    ),
    (
        "tokenizer larger than vocab_size",
        lambda r: _write_tokenizer(r, 500),
        [],
        ["tokenizer.json", "vocab_size"],
    ),
    (
        "KV budget below one sequence",
        None,
        ["--kv-cache-gib", "0.00001"],
        ["kv_cache_gib", "max_model_len"],
    ),
    ("KV budget not a number", None, ["--kv-cache-gib", "lots"], ["kv_cache_gib", "lots"]),
    ("negative max_num_seqs", None, ["--max-num-seqs", "-1"], ["max_num_seqs"]),
    ("unknown quantization", None, ["--quantization", "fp4"], ["quantization", "fp4"]),
    (
        "int8 weights with fp32 activations",
        None,
        ["--quantization", "int8", "--dtype", "float32"],
        ["int8", "bfloat16"],
    ),
    (
        "heads that do not split over the ranks",
        None,
        ["--tensor-parallel-size", "3"],
        ["tensor_parallel_size", "8 attention heads do not split over 3 ranks"],
    ),
    ("zero ranks", None, ["--tensor-parallel-size", "0"], ["tensor_parallel_size"]),
    (
        "truncated safetensors on two ranks",
        _truncate,
        ["--tensor-parallel-size", "2"],
        ["model.safetensors"],
    ),
    (
        "draft model directory missing",
        None,
        ["--speculative-method", "draft", "--speculative-model", "/nonexistent/draft"],
        ["speculative_model", "/nonexistent/draft"],
    ),
    (
        "draft method without a draft model",
        None,
        ["--speculative-method", "draft"],
        ["speculative_model", "--speculative-method draft"],
    ),
    (
        "unknown speculative method",
        None,
        ["--speculative-method", "eagle"],
        ["speculative_method", "eagle"],
    ),
    (
        "int8 weights on the torch backend",
        None,
        ["--quantization", "int8", "--attention-backend", "torch"],
        ["int8", "torch"],
    ),
    ("fp8 weights on the CPU", None, ["--quantization", "fp8"], ["fp8", "CUDA", "int8"]),
    (
        "a quantized checkpoint kvserve cannot read",
        lambda r: _edit_config(
            r, _set(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
        ),
        [],
        ["config.json", "quant_method", "bitsandbytes"],
    ),
]


IN_THE_ENGINE = {
    "truncated safetensors",  # reading the weights
    "config.json not JSON",  # reading the config
    "unknown architecture",  # mapping it onto the model
    "tokenizer larger than vocab_size",  # the tokenizer against the model
    "KV budget below one sequence",  # sizing the KV pool
    "truncated safetensors on two ranks",  # a rank's load
    "a quantized checkpoint kvserve cannot read",
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good")
    write_llama(root, tied=True)  # vocab_size 384
    _write_tokenizer(root, 300)
    return root


def test_bad_checkpoints_and_settings_stop_startup(
    good: Path, tmp_path: Path, row: Row, mode: str
) -> None:
    """Bad checkpoints and settings at start-up"""
    # with the engine in a process, one case of each place a start fails after the
    # settings are read (those refused as they are read fail before any engine starts,
    # the same way in both modes): every one crosses back as the same Failed message
    cases = CASES if mode == "engine-thread" else [c for c in CASES if c[0] in IN_THE_ENGINE]
    procs = []
    for i, (_, breaker, flags, _) in enumerate(cases):
        root = tmp_path / f"case{i}"
        shutil.copytree(good, root)
        if breaker is not None:
            breaker(root)
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(free_port())]
        cmd += ["--model", str(root), "--engine-process", ENGINE_MODES[mode], *flags]
        procs.append(
            subprocess.Popen(
                cmd,
                stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "KVSERVE_LOG_LEVEL": "error"},
            )
        )
    failures = []
    for (name, _, _, needles), proc in zip(cases, procs, strict=True):
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err += "\n(still running after 120 s: it started)"
        # the last error line a kvserve process printed: with ranks or an engine process,
        # another process's log line may land after it on the shared stderr
        lines = err.strip().splitlines()
        last = next((ln for ln in reversed(lines) if ln.startswith("kvserve")), "")
        ok = proc.returncode != 0 and last.startswith("kvserve") and all(n in last for n in needles)
        shown = last.replace(f"{tmp_path}/", "").removeprefix("kvserve: error: ")
        row.add(f"{name}: exit {proc.returncode}, `{shown[:200]}`")
        if not ok:
            failures.append(f"{name}: exit {proc.returncode}: {err[-1500:]}")
    row.load = f"{len(cases)} broken checkpoints or settings, each a fresh `kvserve serve`"
    assert failures == [], "\n\n".join(failures)
