"""`kvserve serve --tensor-parallel-size 2` on the CPU (gloo): the server starts its
second rank itself, serves one rank's greedy tokens and logprobs, says how it was built,
and fails fast and non-zero when a rank dies or hangs (never a hang of its own)."""

import contextlib
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from model.tokenizer import Tokenizer
from tests.engine.exec.tp_ranks import WRITERS
from tests.factories import Server, start_server, write_adapter, write_tokenizer

pytestmark = pytest.mark.slow
BODY = {"prompt": [(7 * i + 3) % 290 for i in range(40)], "max_tokens": 20, "temperature": 0,
        "ignore_eos": True, "logprobs": 1}  # fmt: skip


def checkpoint(family: str, root: Path) -> Path:
    WRITERS[family](root)
    write_tokenizer(root)
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint("llama_kv_split", tmp_path_factory.mktemp("llama"))


def serve(ckpt: Path, tmp: Path, *args: str, wait: bool = True) -> Server:
    return start_server(str(tmp), "--model", str(ckpt), "--dtype", "float32", *args, wait=wait)


def rank_pids(server: Server) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def listening(pids: list[int]) -> set[str]:
    """The addresses the processes' listening TCP sockets are bound to (from /proc)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                raw = bytes.fromhex(cols[1].split(":")[0][:width])
                if width == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def complete(server: Server, model: str) -> tuple[str, list[float]]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/completions", json=BODY | {"model": model})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]


# the server's part (starting rank 1, serving, draining, stopping it) is the same for every
# family; tests/engine/exec/test_tensor_parallel.py splits each family (GPT-2's fused Conv1D
# with biases included). Here: K/V heads split over the ranks (~15 s a case on 2 cores)
@pytest.mark.parametrize(
    "family, engine_process", [("llama_kv_split", "off"), ("llama_kv_split", "on")]
)
def test_two_ranks_serve_one_ranks_tokens(family: str, engine_process: str, tmp_path: Path) -> None:
    """With --engine-process on, the engine process is rank 0."""
    ckpt = checkpoint(family, tmp_path / family)
    one = serve(ckpt, tmp_path, wait=False)  # both start side by side
    two = serve(
        ckpt,
        tmp_path,
        "--tensor-parallel-size",
        "2",
        "--engine-process",
        engine_process,
        wait=False,
    )
    try:
        ref_text, ref_lps = complete(one.wait_healthy(), ckpt.name)
    except BaseException:
        two.stop()
        raise
    finally:
        one.stop()
    try:
        two.wait_healthy()
        # rank 1, started by the server (with the engine process on, that process and
        # multiprocessing's resource tracker too)
        assert len(rank_pids(two)) == (3 if engine_process == "on" else 1)
        names = {
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in rank_pids(two)
        }
        assert b"kvserve: rank 1" in names  # as ps shows it
        assert (b"kvserve: engine core" in names) == (engine_process == "on")
        text, lps = complete(two, ckpt.name)
        card = httpx.get(f"{two.url}/v1/models/{ckpt.name}", timeout=30).json()
        assert card["memory"]["tensor_parallel_size"] == 2
        metrics = httpx.get(f"{two.url}/metrics", timeout=30).text
        assert 'tensor_parallel_size="2"' in metrics
    finally:
        assert two.stop() == 0  # SIGTERM: drained, rank 1 told to stop
    assert text == ref_text
    assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= 1e-5
    log = Path(two.log_path).read_text()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log


def wait_exit(server: Server, within: float) -> tuple[int, list[int]]:
    """The server's exit status, and the /health codes seen until it exited."""
    codes = []
    deadline = time.monotonic() + within
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, "the server did not exit"
        with contextlib.suppress(httpx.HTTPError):
            codes.append(httpx.get(server.url + "/health", timeout=2).status_code)
        time.sleep(0.05)
    return server.proc.returncode, codes


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_rank_fails_the_server_fast(fault: str, ckpt: Path, tmp_path: Path) -> None:
    """A killed rank is heard at once (its process exits, its socket closes); a hung one
    (SIGSTOP) by the next collective that waits --rank-timeout for it."""
    server = serve(ckpt, tmp_path, "--tensor-parallel-size", "2", "--rank-timeout", "3")
    (rank1,) = rank_pids(server)
    try:
        complete(server, ckpt.name)
        os.kill(rank1, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        status, codes = wait_exit(server, within=30)
        took = time.monotonic() - t0
    finally:
        server.stop()
        with contextlib.suppress(ProcessLookupError):  # the server ends its ranks itself
            os.kill(rank1, signal.SIGKILL)
    assert status != 0
    if 503 in codes:  # once it has noticed, it never says healthy again
        assert 200 not in codes[codes.index(503) :]
    log = Path(server.log_path).read_text()
    expected = "rank 1 exited with status -9" if fault == "killed" else "ranks stopped answering"
    assert expected in log
    assert took < (5 if fault == "killed" else 12)  # --rank-timeout 3, then the exit
    with pytest.raises(ProcessLookupError):  # no rank outlives its server
        os.kill(rank1, 0)


def test_two_ranks_serve_lora_adapters_as_peft_does(tmp_path: Path) -> None:
    """LoRA adapters split over two ranks (each its share of B's rows of q|k|v and
    gate|up, of A's columns of o and down): requests of two adapters and the base model
    together get the peft library's greedy text (float32)."""
    import transformers as tf

    from tests.api.test_lora_served import ADAPTERS, _greedy

    ckpt = checkpoint("llama_kv_split", tmp_path / "llama")
    tokenizer = Tokenizer.from_dir(ckpt)
    prompt = BODY["prompt"][:20]
    want = {}
    for name, (seed, config) in ADAPTERS.items():
        hf = tf.LlamaForCausalLM.from_pretrained(ckpt).eval()
        peft_model = write_adapter(hf, tmp_path / name, seed, **config)
        want[name] = tokenizer.decode(_greedy(peft_model, prompt))
        with peft_model.disable_adapter():
            want["llama"] = tokenizer.decode(_greedy(peft_model, prompt))
    modules = ",".join(f"{n}={tmp_path / n}" for n in ADAPTERS)
    server = serve(ckpt, tmp_path, "--tensor-parallel-size", "2", "--lora-modules", modules,
                   "--max-lora-rank", "8")  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:

            def text(model: str) -> str:
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                r = c.post("/v1/completions", json=body | {"model": model})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ThreadPoolExecutor(3) as pool:
                got = dict(zip(want, pool.map(text, want), strict=True))
    finally:
        assert server.stop() == 0
    assert got == want and len(set(want.values())) == 3
