"""The prefix cache's third tier: blocks the host tier drops, written behind to files on
local disk (`--kv-disk-path`, `--kv-disk-gib`) and read back on a later hit, also after
a restart of the same model.

A folder per model, dtype, quantization and block size (the prefix cache's namespace),
a file per block named by its key (whose chain starts from the namespace and the
request's cache_salt, so tenants stay apart). A file is its header (the key, its
parent's key, the block's tokens, dtype and shape), the block's K and V in every layer,
and a SHA-256 over both; it is written to a temporary name and renamed, so a reader sees
a whole file or none, and a write that fails leaves no temporary file behind. The files
hold prompts' tokens: each is created 0600 in folders of 0700 (never through a link), and
a `--kv-disk-path` other users can write to is refused. A read checks the checksum, the header and the size before the
bytes are used: a corrupt or truncated file is deleted and its block recomputed.

Entry ids do not survive a restart, so a file's hit is checked by its key, its tokens
and its parent's key (the pool's hits also by the entries they sit on). The oldest files
go first past the size limit. One writer thread does the writing and one reader thread
the reading: the scheduler never touches a file. A prompt whose next blocks are on disk
has them read ahead (`prefetch`) and waits, a step or more, until they are in memory
(`ready`), as vLLM's requests wait for remote KV; what was read stays until a hit claims
it, within a budget of host memory (READ_AHEAD_BYTES), oldest first out."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import mmap
import os
import queue
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("kvserve.engine")
MAGIC = b"KVSBLK1\0"
READ_AHEAD_BYTES = 256 * 2**20  # blocks read ahead and not yet claimed, at most

Link = tuple[bytes, bytes, tuple[int, ...]]  # a block of a chain: key, parent's key, tokens


@dataclass(slots=True)
class DiskStats:
    written: int = 0  # blocks written to disk
    read: int = 0  # blocks read back into the pool for a hit (HostTier.claim)
    corrupt: int = 0  # files that failed their checks: deleted, recomputed
    dropped: int = 0  # files deleted past the size limit


def private_folder(path: Path, flag: str) -> Path:
    """`path` as a folder of this user's alone (made 0700 if missing); a ValueError
    naming the flag if it cannot be one: not a folder, not this user's, or writable by
    other users (who could plant or replace the files kvserve reads back)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{flag} {path}: not a folder (a link or a file)")
    if info.st_uid != os.geteuid():
        raise ValueError(f"{flag} {path}: belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise ValueError(f"{flag} {path}: other users can write to it (mode "
                         f"{stat.S_IMODE(info.st_mode):o}); give kvserve a folder of its own, "
                         "chmod 700")  # fmt: skip
    return path


class DiskTier:
    def __init__(
        self, path: str, budget: int, namespace: str, dtype: torch.dtype, block_bytes: int
    ) -> None:
        """block_bytes: a block's K and V in every layer (what a read holds in memory)."""
        tag = hashlib.sha256(f"kvserve-disk\0{namespace}".encode()).hexdigest()[:24]
        private_folder(Path(path), "--kv-disk-path")
        self.dir = private_folder(Path(path) / tag, "--kv-disk-path")
        os.chmod(self.dir, 0o700)
        self.budget, self.dtype = budget, dtype
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index: the writer adds, the scheduler reads
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._bytes = 0  # the files' sizes together
        for f in sorted(self.dir.glob("*.kvb"), key=lambda f: f.lstat().st_mtime):
            info = f.lstat()  # what an earlier run of the same model left: its files alone
            if (
                not stat.S_ISREG(info.st_mode)
                or len(f.stem) != 64
                or any(c not in "0123456789abcdef" for c in f.stem)
            ):
                continue  # not a block's file
            self._index[bytes.fromhex(f.stem)] = info.st_size
            self._bytes += info.st_size
            f.chmod(0o600)  # an earlier version's files were readable by all
        for f in self.dir.glob("*.tmp"):  # a write cut short
            f.unlink(missing_ok=True)
        self._trim()
        self._queue: queue.Queue[tuple[bytes, bytes, tuple[int, ...], Tensor] | None] = (
            queue.Queue()
        )
        self._writer = threading.Thread(
            target=self._write_loop, name="kvserve-kv-disk", daemon=True
        )
        self._writer.start()
        self.read_ahead = max(16, READ_AHEAD_BYTES // max(1, block_bytes))
        self._pending: set[bytes] = set()  # queued for the reader, or being read
        # read: (parent's key, tokens, the bytes or None where the file failed its checks)
        self._done: OrderedDict[bytes, tuple[bytes, tuple[int, ...], Tensor | None]] = OrderedDict()
        self._reads: queue.Queue[Link | None] = queue.Queue()
        self._read_one = threading.Event()
        self._reader = threading.Thread(
            target=self._read_loop, name="kvserve-kv-disk-read", daemon=True
        )
        self._reader.start()

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def write(self, key: bytes, parent_key: bytes, tokens: tuple[int, ...], data: Tensor) -> None:
        """Queue a block's bytes (a CPU tensor of its own) to be written behind."""
        self._queue.put((key, parent_key, tokens, data))

    def read(self, key: bytes, parent_key: bytes, tokens: tuple[int, ...]) -> Tensor | None:
        """The block under `key`, if its file holds exactly these tokens on top of
        exactly `parent_key` and passes its checks; None otherwise (a file that fails
        them is deleted). The reader thread's work (prefetch)."""
        with self._lock:
            if key not in self._index:
                return None
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(fd, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                header, data = self._check(m, key)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("KV disk block dropped", extra={"file": str(path), "why": str(exc)})
            self._forget(key, corrupt=True)
            return None
        if header["parent"] != parent_key.hex() or tuple(header["tokens"]) != tokens:
            return None  # a collision: not this request's block
        return data

    # ---- reading ahead ------------------------------------------------------------------

    def prefetch(self, chain: Iterator[Link]) -> bool:
        """Queue for the reader the blocks of `chain` (a prompt's next blocks, in order)
        that the disk holds, up to the first it does not; True while the first of them
        is still to be read (the prompt waits for it)."""
        with self._lock:
            first = next(chain, None)
            if first is None or first[0] in self._done or first[0] not in self._index:
                return False
            for key, parent_key, tokens in itertools.chain([first], chain):
                if key not in self._index or len(self._pending) >= self.read_ahead:
                    break
                if key not in self._pending and key not in self._done:
                    self._pending.add(key)
                    self._reads.put((key, parent_key, tokens))
            return first[0] in self._pending

    def ready(self, key: bytes, parent_key: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether the block's bytes were read, passed their checks and are these."""
        with self._lock:
            done = self._done.get(key)
        return done is not None and done[2] is not None and done[:2] == (parent_key, tokens)

    def claim(self, key: bytes) -> Tensor:
        """A ready block's bytes, taken (a hit copies them into a device block)."""
        with self._lock:
            data = self._done.pop(key)[2]
        assert data is not None
        self.stats.read += 1
        return data

    def wait_for_reads(self, timeout: float) -> None:
        """Until a read ends (or `timeout`): an engine with nothing else to run waits so."""
        self._read_one.wait(timeout)
        self._read_one.clear()

    def _read_loop(self) -> None:
        while (link := self._reads.get()) is not None:
            key, parent_key, tokens = link
            data = self.read(key, parent_key, tokens)
            with self._lock:
                self._pending.discard(key)
                self._done[key] = (parent_key, tokens, data)
                while len(self._done) > 2 * self.read_ahead:  # unclaimed: the oldest go
                    self._done.popitem(last=False)
            self._read_one.set()

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        self._reads.put(None)
        self._queue.put(None)
        self._writer.join()
        self._reader.join()

    # ---- the files ---------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kvb"

    def _check(self, m: mmap.mmap, key: bytes) -> tuple[dict, Tensor]:
        if len(m) < len(MAGIC) + 4 + 32 or m[: len(MAGIC)] != MAGIC:
            raise ValueError("not a KV block file, or cut short")
        body = memoryview(m)[:-32]
        try:
            if hashlib.sha256(body).digest() != m[-32:]:
                raise ValueError("checksum mismatch")
        finally:
            body.release()
        start = len(MAGIC) + 4
        length = int.from_bytes(m[len(MAGIC) : start], "little")
        header = json.loads(m[start : start + length])
        shape, dtype = tuple(header["shape"]), getattr(torch, header["dtype"])
        payload = bytearray(m[start + length : len(m) - 32])
        if header["key"] != key.hex() or dtype != self.dtype:
            raise ValueError("another block's file")
        if len(payload) != torch.Size(shape).numel() * dtype.itemsize:
            raise ValueError("the payload's size is not its shape's")
        return header, torch.frombuffer(payload, dtype=dtype).view(shape)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except OSError as exc:  # a full or failing disk: the block is not kept
                log.warning("KV disk block not written", extra={"why": str(exc)})
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: bytes, parent_key: bytes, tokens: tuple[int, ...], data: Tensor) -> None:
        header = json.dumps({
            "key": key.hex(), "parent": parent_key.hex(), "tokens": list(tokens),
            "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
        }).encode()  # fmt: skip
        body = MAGIC + len(header).to_bytes(4, "little") + header
        body += data.contiguous().view(torch.uint8).numpy().tobytes()
        path, tmp = self._path(key), self._path(key).with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)  # fmt: skip
        try:
            with open(fd, "wb") as f:
                f.write(body + hashlib.sha256(body).digest())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._bytes += len(body) + 32 - self._index.get(key, 0)
            self._index[key] = len(body) + 32
            self._index.move_to_end(key)
            self._done.pop(key, None)  # a read of what the file held before
        self.stats.written += 1
        self._trim()

    def _trim(self) -> None:
        """Delete the oldest files past the size limit."""
        while True:
            with self._lock:
                if self._bytes <= self.budget or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            _remove(self._path(key))
            self.stats.dropped += 1

    def _forget(self, key: bytes, corrupt: bool) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)
        _remove(self._path(key))
        self.stats.corrupt += corrupt


def _remove(path: Path) -> None:
    """Delete a block's file; what cannot be deleted (a folder planted in its place) is
    left, never a failure of the step."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("KV disk file not deleted", extra={"file": str(path), "why": str(exc)})
