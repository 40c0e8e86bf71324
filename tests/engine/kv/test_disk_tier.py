"""The prefix cache's disk tier (service/engine/kv/disk_tier.py) behind the host tier: a
conversation's blocks written to files come back after a restart (bit for bit: the
logprobs of blocks that never left the pool); a corrupt or truncated file is detected,
deleted and its block recomputed; another tenant's salt or another model finds nothing."""

import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from service.engine.kv.disk_tier import DiskTier
from service.engine.kv.prefix_keys import chain_hashes, root_digest
from service.engine.text.processor import Texts
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import make_engine, small_model

MODEL = small_model()
PER_BLOCK = MODEL.cfg.n_layers * 2 * MODEL.cfg.kv_heads * MODEL.cfg.head_dim * 4 * 4  # bytes
TURN = list(range(1, 42))  # ten full blocks of 4 and a token
OTHERS = {f"o{i}": ([100 + 7 * i + j for j in range(30)], greedy(4)) for i in range(3)}


def disk_engine(path: Path, model=MODEL, **kw):
    """A pool of 24 blocks, a host tier of 4, the disk tier at `path`."""
    return make_engine(model, num_kv_blocks=24, kv_host_gib=4 * PER_BLOCK / 2**30,
                       kv_disk_path=str(path), **kw)  # fmt: skip


def first_run(path: Path, salt: str | None = None) -> None:
    """The first turn, others that evict it, and a clean shutdown."""
    engine = disk_engine(path)
    run_all(engine, {"first": (TURN, greedy(4, cache_salt=salt))})
    run_all(engine, OTHERS)
    engine.close()
    assert engine.blocks.tier.disk.stats.written >= 10


def next_turn(engine, salt: str | None = None):
    prompt = [*TURN, 200, 201, 202]
    return run_all(engine, {"next": (prompt, greedy(8, logprobs=3, cache_salt=salt))})["next"]


@torch.no_grad()
def test_a_restart_reads_the_conversation_back(tmp_path: Path) -> None:
    first_run(tmp_path)
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) >= 10 and not list(tmp_path.rglob("*.tmp"))
    engine = disk_engine(tmp_path)  # a restart: nothing in the pool or the host tier
    got = next_turn(engine)
    assert engine.blocks.tier.disk.stats.read == 10 and got[0].num_cached_tokens == 40
    kept = make_engine(MODEL, num_kv_blocks=256)
    run_all(kept, {"first": (TURN, greedy(4))})
    want = next_turn(kept)
    assert tokens_of(got) == tokens_of(want)
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@torch.no_grad()
def test_a_corrupt_or_truncated_file_is_recomputed(damage: str, tmp_path: Path) -> None:
    first_run(tmp_path)
    engine = disk_engine(tmp_path)
    disk, blocks = engine.blocks.tier.disk, engine.blocks
    keys = chain_hashes(TURN, 4, [], root_digest(blocks.namespace, None))
    fourth = disk.dir / f"{keys[3].hex()}.kvb"  # the turn's 4th block's file
    data = fourth.read_bytes()
    if damage == "flip":  # a bit of its K/V
        data = (
            data[: len(data) // 2]
            + bytes([data[len(data) // 2] ^ 0x40])
            + data[len(data) // 2 + 1 :]
        )
    fourth.write_bytes(data if damage == "flip" else data[:-100])
    got = next_turn(engine)
    # the reader thread checks the blocks it reads ahead, and may still be at the 4th's
    # when the request is done (the warning logged, the file not yet deleted)
    deadline = time.monotonic() + 10
    while disk.stats.corrupt == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk.stats.corrupt == 1 and not fourth.exists()  # dropped, and the chain stops
    assert got[0].num_cached_tokens == 12  # the three blocks before it
    plain = make_engine(MODEL, num_kv_blocks=24, disable_prefix_caching=True)
    run_all(plain, {"first": (TURN, greedy(4))})
    assert tokens_of(got) == tokens_of(next_turn(plain))


@torch.no_grad()
def test_a_slow_disk_never_holds_up_a_step(tmp_path: Path, monkeypatch) -> None:
    """Reads run on the disk tier's reader thread, never the engine's: while they are
    held up, a request whose blocks are on disk waits and another runs to its end; once
    they are done, the first is admitted with every block the disk held."""
    first_run(tmp_path)
    engine = disk_engine(tmp_path)
    gate, readers = threading.Event(), set()
    read = DiskTier.read

    def slow(self, *args):  # type: ignore[no-untyped-def]
        readers.add(threading.current_thread().name)
        assert gate.wait(30)
        return read(self, *args)

    monkeypatch.setattr(DiskTier, "read", slow)
    texts = Texts(engine.tokenizer, engine.stop)
    for rid, prompt in (("next", [*TURN, 200, 201, 202]), ("other", [250 + i for i in range(9)])):
        engine.add_request(rid, prompt, greedy(8))
        texts.add(rid, greedy(8))
    done: dict[str, object] = {}
    while "other" not in done:  # the reads are held: the other request runs alone
        for out in texts.process(engine.step()):
            if out.finished:
                done[out.request_id] = out
    assert "next" not in done and engine.requests["next"].num_computed == 0  # it waits
    gate.set()
    while engine.has_unfinished():
        for out in texts.process(engine.step()):
            done[out.request_id] = out if out.finished else done.get(out.request_id)
    assert done["next"].num_cached_tokens == 40 and engine.blocks.tier.disk.stats.read == 10
    assert readers == {"kvserve-kv-disk-read"}


def test_another_salt_or_model_reads_nothing(tmp_path: Path) -> None:
    first_run(tmp_path, salt="tenant-1")
    other = disk_engine(tmp_path)
    assert next_turn(other, salt="tenant-2")[0].num_cached_tokens == 0
    assert other.blocks.tier.disk.stats.read == 0
    same = disk_engine(tmp_path)
    assert next_turn(same, salt="tenant-1")[0].num_cached_tokens == 40
    another = disk_engine(tmp_path, model=small_model(max_position=256))  # another config
    assert next_turn(another, salt="tenant-1")[0].num_cached_tokens == 0
    assert another.blocks.tier.disk.dir != same.blocks.tier.disk.dir


def test_files_are_private_and_never_written_through_a_link(tmp_path: Path) -> None:
    """Files 0600 in a 0700 folder; a link planted where a temporary file goes fails
    that write (the block is not kept) without touching the link's target."""
    root = tmp_path / "kv"
    first_run(root)
    (folder,) = root.iterdir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 == stat.S_IMODE(folder.stat().st_mode)
    files = list(folder.iterdir())
    assert files and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    tier = DiskTier(str(root), 1 << 30, "ns", torch.float32, 4096)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    key = bytes(32)
    tier._path(key).with_suffix(".tmp").symlink_to(victim)
    tier.write(key, bytes(32), (1, 2), torch.zeros(4))
    tier.flush()
    assert victim.read_text() == "untouched" and tier.read(key, bytes(32), (1, 2)) is None
    tier.close()


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    """The rename fails (a folder sits where the file goes): the block is not kept, its
    temporary file is removed, and the next write works."""
    tier = DiskTier(str(tmp_path / "kv"), 1 << 30, "ns", torch.float32, 4096)
    stuck, fine = bytes([1]) * 32, bytes([2]) * 32
    (tier._path(stuck) / "in-the-way").mkdir(parents=True)
    tier.write(stuck, bytes(32), (1,), torch.ones(4))
    tier.write(fine, bytes(32), (2,), torch.ones(4))
    tier.flush()
    assert not list(tier.dir.glob("*.tmp"))
    assert tier.read(fine, bytes(32), (2,)) is not None and tier.stats.written == 1
    tier.close()


@pytest.mark.parametrize("case", ["others-write", "a-file", "a-planted-link"])
def test_an_unsafe_folder_is_refused_naming_the_flag(tmp_path: Path, case: str) -> None:
    """A folder others can write to, a file, or the model's folder planted as a link."""
    path = tmp_path / "kv"
    if case == "others-write":
        path.mkdir()
        path.chmod(0o777)
    elif case == "a-file":
        path.write_text("")
    else:
        tier = DiskTier(str(path), 1 << 30, "ns", torch.float32, 4096)  # to learn its folder
        tier.close()
        tier.dir.rmdir()
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        tier.dir.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="--kv-disk-path"):
        DiskTier(str(path), 1 << 30, "ns", torch.float32, 4096)
