"""Tensor parallelism on the CPU (gloo): two ranks give one rank's logits and greedy tokens
for the Llama (K/V heads split, and fewer K/V heads than ranks), Qwen2 and GPT-2
checkpoints, through kvserve's own build and engine; the ranks' KV pools add up; and the
two ranks also run as two hosts (network namespaces joined by a veth pair)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from service.build import build
from tests.engine.exec.tp_rank import PROMPTS, dense_tokens, serve, settings
from tests.engine.exec.tp_ranks import WRITERS, run_ranks
from tests.factories import write_tokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for family, write in WRITERS.items():
        path = tmp_path_factory.mktemp(family)
        write(path)
        write_tokenizer(path)
        paths[family] = path
    return paths


@torch.inference_mode()
def one_rank(ckpt: Path) -> dict[str, object]:
    engine = build(settings(str(ckpt), 1)).engine
    logits = engine.model(dense_tokens(engine.model.cfg.vocab_size))
    report = serve(engine)
    return report | {
        "logits": logits,
        "kv_blocks": engine.blocks.num_blocks,
        "kv_window_blocks": engine.kv_cache.window_blocks,
        "window_only": engine.kv_cache.window_only,
        "kv_pool_bytes": engine.kv_cache.nbytes,
    }


def two_ranks(ckpt: Path, out: Path, **kw: object) -> dict[str, object]:
    results = run_ranks(2, ["-m", "tests.engine.exec.tp_rank", str(ckpt), str(out)], **kw)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stdout[-3000:]}"
    report = json.loads(out.read_text())
    return report | {"logits": torch.tensor(report["logits"])}


@pytest.mark.parametrize("family", list(WRITERS))
def test_two_ranks_give_one_ranks_logits_and_tokens(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = checkpoints[family]
    ref = one_rank(ckpt)
    got = two_ranks(ckpt, tmp_path / "rank0.json")
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-5
    assert got["tokens"] == ref["tokens"]
    assert len(got["tokens"]["a"]) == 16
    for rid, lps in ref["logprobs"].items():
        assert max(abs(a - b) for a, b in zip(lps, got["logprobs"][rid], strict=True)) <= 1e-5
    # each rank holds its share of the K/V heads in the same byte budget: with the heads
    # split the pool holds twice the tokens (to a block); with one K/V head each rank
    # holds a replica. Gemma 3's windowed layers' pool is as many blocks (sized by the
    # sequences a step holds) at half the bytes: the global pool gets the rest. With every
    # layer windowed (Mistral's), the window pool is the one that holds K/V
    split = not family.endswith("kv_replicated")
    pool = got["kv_blocks"]
    assert got["window_only"] == ref["window_only"]
    if ref["window_only"]:
        pool = got["kv_window_blocks"]
        assert pool // 2 == ref["kv_window_blocks"]
    elif ref["kv_window_blocks"]:
        assert got["kv_window_blocks"] == ref["kv_window_blocks"]
        assert got["kv_blocks"] > 2 * ref["kv_blocks"]
    else:
        assert got["kv_blocks"] // (2 if split else 1) == ref["kv_blocks"]
    budget = settings(str(ckpt), 2).engine.cache.kv_cache_bytes  # per rank
    assert budget - got["kv_pool_bytes"] < 2 * got["kv_pool_bytes"] / pool


def test_two_ranks_restore_from_the_host_tier(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The host tier's copies reach every rank: a prompt evicted from both ranks' pools
    comes back from their host tiers (each its share of the heads) with one rank's tokens."""
    ckpt = checkpoints["llama_kv_split"]
    with torch.inference_mode():
        ref = serve(build(settings(str(ckpt), 1, kv_host_gib=0.01)).engine)
    args = [
        "-m",
        "tests.engine.exec.tp_rank",
        str(ckpt),
        str(tmp_path / "rank0.json"),
        "0.001",
        "0.01",
    ]
    for rank, r in enumerate(run_ranks(2, args)):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stdout[-3000:]}"
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert ref["restored"] > 0 and got["restored"] > 0
    assert got["tokens"]["a again"] == got["tokens"]["a"] == ref["tokens"]["a again"]
    for rid in [*PROMPTS, "a again"]:  # the evicting prompts differ: the pools do
        assert got["tokens"][rid] == ref["tokens"][rid], rid


def _netns(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():  # type: ignore[no-untyped-def]
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2."""
    if shutil.which("ip") is None:
        pytest.skip("two hosts need iproute2's `ip` (not installed)")
    names = ("kvserve-tp0", "kvserve-tp1")
    try:
        for ns in names:
            _netns("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode().strip()}")
    try:
        _netns("link", "add", "kvtp0", "type", "veth", "peer", "name", "kvtp1")
        for i, ns in enumerate(names):
            _netns("link", "set", f"kvtp{i}", "netns", ns)
            _netns("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", f"kvtp{i}")
            _netns("-n", ns, "link", "set", f"kvtp{i}", "up")
            _netns("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_ranks_as_two_hosts(checkpoints: dict[str, Path], two_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 on 10.77.0.1, rank 1 on 10.77.0.2: gloo over the veth pair, nothing shared
    but the checkpoint on disk."""
    ckpt = checkpoints["llama_kv_split"]
    ref = one_rank(ckpt)
    got = two_ranks(
        ckpt,
        tmp_path / "rank0.json",
        master="10.77.0.1",
        wrap=[["ip", "netns", "exec", ns] for ns in two_hosts],
        env=[{"GLOO_SOCKET_IFNAME": f"kvtp{i}"} for i in range(2)],
    )
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-5
    assert got["tokens"] == ref["tokens"]
