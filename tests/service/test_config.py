import hashlib
import os
from pathlib import Path

import pytest
import torch

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
    assert s.engine.cache.kv_cache_bytes == 1 << 29
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
    assert Settings().engine.scheduler.mixed_prefill_cap("cpu") == CPU_MIXED_PREFILL_TOKENS
    assert Settings().engine.scheduler.mixed_prefill_cap("cuda") is None
    none = settings_from_argv(["--mixed-prefill-tokens", "0"])
    assert (
        none.engine.scheduler.mixed_prefill_cap("cpu") is None
        and none.engine.scheduler.mixed_prefill_cap("cuda") is None
    )
    cap = settings_from_argv(["--mixed-prefill-tokens", "256"])
    assert (
        cap.engine.scheduler.mixed_prefill_cap("cpu")
        == cap.engine.scheduler.mixed_prefill_cap("cuda")
        == 256
    )
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
    assert (
        Settings().engine.scheduler.seqs_per_step("cpu") == 64
        and Settings().engine.scheduler.seqs_per_step("cuda") == 256
    )
    assert settings_from_argv(["--max-num-seqs", "8"]).engine.scheduler.seqs_per_step("cuda") == 8
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        settings_from_argv(["--gpu-memory-utilization", "1.5"])


def test_engine_process_mode() -> None:
    assert Settings().engine_process == "auto"
    assert settings_from_argv(["--engine-process", "on"]).engine_process == "on"
    assert load_settings(None, {"KVSERVE_ENGINE_PROCESS": "off"}).engine_process == "off"
    with pytest.raises(ValueError, match="engine_process must be one of"):
        settings_from_argv(["--engine-process", "yes"])
    # the engine process is rank 0 of tensor parallelism
    tp = settings_from_argv(["--engine-process", "on", "--tensor-parallel-size", "2"])
    assert tp.engine_process == "on"


def test_auto_runs_the_engine_apart_with_cuda_and_in_a_thread_on_the_cpu() -> None:
    """`auto`'s choice, made on the settings before any device is touched: its own
    process for a CUDA device (named, or `auto` where CUDA is available), a thread on the
    CPU; on and off as said."""
    from service.build import engine_apart

    assert engine_apart(settings_from_argv(["--device", "cuda:1"]))
    assert not engine_apart(settings_from_argv(["--device", "cpu"]))
    assert engine_apart(Settings()) == torch.cuda.is_available()
    assert not engine_apart(settings_from_argv(["--device", "cuda", "--engine-process", "off"]))
    assert engine_apart(settings_from_argv(["--device", "cpu", "--engine-process", "on"]))


def test_api_server_count() -> None:
    assert Settings().api_server_count == 1
    assert settings_from_argv(["--api-server-count", "3"]).api_server_count == 3
    assert load_settings(None, {"KVSERVE_API_SERVER_COUNT": "2"}).api_server_count == 2
    with pytest.raises(ValueError, match="api_server_count must be > 0"):
        settings_from_argv(["--api-server-count", "0"])
    with pytest.raises(ValueError, match="api_server_count: several front processes"):
        settings_from_argv(["--api-server-count", "2", "--engine-process", "off"])
    with pytest.raises(ValueError, match="api_server_count: several fronts run one rank"):
        settings_from_argv(["--api-server-count", "2", "--tensor-parallel-size", "2"])


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


def test_int4_runs_on_the_cpu_backend_in_bf16_and_on_the_torch_and_triton_backends() -> None:
    """int4 on the cpu backend computes in bf16 (a float32 or float16 dtype there is a
    settings error); the torch and Triton backends (a GPU's W4A16 kernel) take it in any
    dtype and on CUDA."""
    for flags in (
        ["--attention-backend", "triton", "--dtype", "float32"],
        ["--attention-backend", "torch", "--dtype", "float16"],
        ["--device", "cuda"],
        ["--device", "cpu"],
        [],
    ):
        assert settings_from_argv(["--quantization", "int4", *flags]).quantization == "int4"
    for flags in (["--device", "cpu", "--dtype", "float32"], ["--attention-backend", "cpu",
                  "--dtype", "float16"]):  # fmt: skip
        with pytest.raises(ValueError, match="computes with bfloat16 activations"):
            settings_from_argv(["--quantization", "int4", *flags])


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


def every_variable() -> list[str]:
    """Every KVSERVE_* variable kvserve reads: one per setting, and the kernels' four."""
    from dataclasses import fields

    from model.backends.cpu.isa import ISA_ENV
    from model.backends.cpu.kernels.build import CACHE_ENV, DISABLE_ENV
    from model.backends.cpu.pages import HUGE_PAGES_ENV

    names = ["KVSERVE_" + f.name.upper() for f in fields(Settings)]
    return [*names, ISA_ENV, CACHE_ENV, DISABLE_ENV, HUGE_PAGES_ENV]


def test_an_empty_variable_is_an_unset_one_for_every_setting() -> None:
    """compose and Kubernetes pass `${VAR:-}` as "": numbers, switches, lists, paths and
    names alike take their default, one at a time and all at once."""
    for name in every_variable():
        assert load_settings(None, {name: ""}) == Settings(), name
    assert load_settings(None, dict.fromkeys(every_variable(), "")) == Settings()
    # an empty flag is no flag either: the variable (or the default) stands
    s = settings_from_argv(["--max-num-seqs", "", "--model", ""])
    assert s.max_num_seqs is None and s.model is None


def test_empty_kernel_variables_take_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from model.backends.cpu import isa as device
    from model.backends.cpu import pages
    from model.backends.cpu.kernels import build

    monkeypatch.setenv(build.CACHE_ENV, "")
    assert build._cache_dir() == Path.home() / ".cache" / "kvserve" / "kernels"
    monkeypatch.setenv(device.ISA_ENV, "")
    assert device.cpu_isa() == device.native_isa()
    monkeypatch.setenv(pages.HUGE_PAGES_ENV, "")
    with_empty = pages.huge_pages()
    monkeypatch.delenv(pages.HUGE_PAGES_ENV)
    assert with_empty == pages.huge_pages()
    monkeypatch.setenv(build.DISABLE_ENV, "")
    assert not os.environ.get(build.DISABLE_ENV)  # how build() reads it: "" builds


def test_a_server_started_with_every_variable_empty_serves_the_defaults(tmp_path) -> None:
    """The compose file's `${KVSERVE_MAX_NUM_SEQS:-}` and friends, all at once, on a real
    server: it starts, serves the default model, and logs the default block size and
    scheduling."""
    import httpx

    from tests.factories import start_server

    srv = start_server(str(tmp_path), env=dict.fromkeys(every_variable(), ""))
    try:
        with srv.client() as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["kvserve-demo-random"]
            r = c.post(
                "/v1/completions", json={"prompt": "empty", "max_tokens": 4, "ignore_eos": True}
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        assert srv.stop() == 0
    log = Path(srv.log_path).read_text()
    assert "cannot parse" not in log
    assert f"KV blocks of {Settings().block_size} tokens" in log and "async scheduling off" in log


def test_every_setting_is_in_one_section() -> None:
    """The flags map onto the engine's sections and the server's settings: each setting
    in exactly one, under its own name, so the engine reads no setting it is not given."""
    from dataclasses import fields

    from service.config import SECTIONS, SERVER_SETTINGS

    names = [f.name for section in SECTIONS for f in fields(section)] + list(SERVER_SETTINGS)
    assert sorted(names) == sorted(f.name for f in fields(Settings))
    config = settings_from_argv(["--block-size", "32", "--num-speculative-tokens", "3"]).engine
    assert config.cache.block_size == 32 and config.speculative.num_speculative_tokens == 3


def test_key_priorities_are_checked_at_start() -> None:
    s = Settings(api_keys=("k1", "k2"), scheduling_policy="priority",
                 api_key_priority=("k1=10:5", "k2=-1"))  # fmt: skip
    assert s.engine.scheduler.scheduling_policy == "priority"
    assert s.key_priority == {
        hashlib.sha256(b"k1").hexdigest(): (10, 5),
        hashlib.sha256(b"k2").hexdigest(): (-1, None),
    }
    for kwargs, why in (
        (dict(api_key_priority=("k1=1",)), "set --scheduling-policy priority"),
        (dict(scheduling_policy="priority", api_key_priority=("k3=1",)), "not one of --api-keys"),
        (dict(scheduling_policy="priority", api_key_priority=("k1=soon",)), "not KEY=DEFAULT"),
        (dict(scheduling_policy="priority", api_key_priority=("k1=0:3",)), "below its ceiling"),
        (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
    ):
        with pytest.raises(ValueError, match=why):
            Settings(api_keys=("k1",), **kwargs)


def test_lora_settings_and_key_limits_are_checked_at_start() -> None:
    s = Settings(lora_modules=("sql=/a", "chat=org/chat-lora"), api_keys=("k1", "k2"),
                 api_key_models=("k2=sql|chat",))  # fmt: skip
    assert s.engine.lora.modules == {"sql": "/a", "chat": "org/chat-lora"}
    assert s.engine.lora.enabled and not Settings().engine.lora.enabled
    assert s.key_models == {hashlib.sha256(b"k2").hexdigest(): frozenset({"sql", "chat"})}
    for modules, why in (
        (("sql",), "is not name=path"),
        (("sql=/a", "sql=/b"), "two adapters have one name"),
        (("a b=/a",), "a name is letters, digits"),
    ):
        with pytest.raises(ValueError, match=why):
            Settings(lora_modules=modules)
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters load at run time on one"):
        Settings(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="a key limited is not one of --api-keys"):
        Settings(api_keys=("k1",), api_key_models=("k3=sql",))
    with pytest.raises(ValueError, match="is not KEY=NAME"):
        Settings(api_keys=("k1",), api_key_models=("k1",))
