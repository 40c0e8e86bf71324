import pytest

from service.config import (
    CPU_MIXED_PREFILL_TOKENS,
    Settings,
    add_arguments,
    load_settings,
    settings_from_argv,
)


def test_flags_override_env_override_defaults() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    env = {
        "KVSERVE_PORT": "9001",
        "KVSERVE_MAX_QUEUE": "7",
        "KVSERVE_API_KEYS": "a, b",
        "KVSERVE_KV_CACHE_GIB": "0.5",
    }
    s = load_settings(parser.parse_args(["--port", "9002"]), env)
    assert s.port == 9002 and s.max_queue == 7 and s.api_keys == ("a", "b")
    assert s.kv_cache_bytes == 1 << 29
    assert load_settings(parser.parse_args([]), {}) == Settings()


def test_invalid_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="port"):
        settings_from_argv(["--port", "0"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        settings_from_argv(["--max-num-seqs", "abc"])
    with pytest.raises(ValueError, match="log_level"):
        Settings(log_level="loud")
    with pytest.raises(ValueError, match="mixed_prefill_tokens"):
        settings_from_argv(["--mixed-prefill-tokens", "-1"])


def test_mixed_prefill_cap_by_device_and_flag() -> None:
    assert Settings().mixed_prefill_cap("cpu") == CPU_MIXED_PREFILL_TOKENS
    assert Settings().mixed_prefill_cap("cuda") is None
    none = settings_from_argv(["--mixed-prefill-tokens", "0"])
    assert none.mixed_prefill_cap("cpu") is None and none.mixed_prefill_cap("cuda") is None
    cap = settings_from_argv(["--mixed-prefill-tokens", "256"])
    assert cap.mixed_prefill_cap("cpu") == cap.mixed_prefill_cap("cuda") == 256
    with pytest.raises(dataclass_frozen_error()):
        Settings().port = 1  # type: ignore[misc]


def dataclass_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_backend_graphs_and_seqs_per_step() -> None:
    assert Settings().attention_backend == "auto" and not Settings().enforce_eager
    s = settings_from_argv(["--attention-backend", "triton", "--enforce-eager"])
    assert s.attention_backend == "triton" and s.enforce_eager
    env = {"KVSERVE_ATTENTION_BACKEND": "torch", "KVSERVE_ENFORCE_EAGER": "1"}
    s = load_settings(None, env)
    assert s.attention_backend == "torch" and s.enforce_eager
    assert not load_settings(None, {"KVSERVE_ENFORCE_EAGER": "false"}).enforce_eager
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        settings_from_argv(["--attention-backend", "cuda"])
    with pytest.raises(ValueError, match="enforce_eager"):
        load_settings(None, {"KVSERVE_ENFORCE_EAGER": "maybe"})
    assert Settings().seqs_per_step("cpu") == 64 and Settings().seqs_per_step("cuda") == 256
    assert settings_from_argv(["--max-num-seqs", "8"]).seqs_per_step("cuda") == 8
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        settings_from_argv(["--gpu-memory-utilization", "1.5"])


def test_int8_weights_with_settings_that_cannot_run_them_stop_at_the_settings() -> None:
    """int8 runs on the cpu backend's C kernels with bf16 activations: a backend, dtype
    or device that rules that out is a settings error, found before any weight is read."""
    for flags, needle in [
        (["--attention-backend", "torch"], "not on the torch backend"),
        (["--attention-backend", "triton"], "not on the triton backend"),
        (["--dtype", "float32"], "bfloat16 activations and KV cache, not float32"),
        (["--dtype", "float16"], "not float16"),
        (["--device", "cuda"], "not on cuda"),
        (["--device", "cuda:1"], "not on cuda:1"),
    ]:
        with pytest.raises(ValueError, match=needle):
            settings_from_argv(["--quantization", "int8", *flags])
        settings_from_argv(flags)  # fine without int8
    for flags in ([], ["--attention-backend", "cpu"], ["--dtype", "bfloat16"], ["--device", "cpu"]):
        assert settings_from_argv(["--quantization", "int8", *flags]).quantization == "int8"


def test_a_setting_that_does_not_parse_stops_the_cli_before_torch_loads() -> None:
    """`kvserve serve` with a bad flag or KVSERVE_* variable, and `--help`, answer without
    importing torch (seconds of start-up) first."""
    import subprocess
    import sys

    check = (
        "import sys\n"
        "from service.cli import main\n"
        "assert main(['serve', '--max-num-seqs', '-1']) == 2\n"
        "assert main(['serve', '--quantization', 'int8', '--dtype', 'float32']) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "try:\n"
        "    main(['serve', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "kvserve: error: max_num_seqs must be > 0, got -1" in out.stderr
