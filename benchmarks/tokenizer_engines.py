"""Which engine encodes a tokenizer.json faster: tiktoken (kvserve's conversion of a
byte-level BPE file) or the `tokenizers` library the files are written for, one thread,
on Python's own sources; and the library on a SentencePiece-style file (the one engine
that can run those: model/sentencepiece.py).

Files: a byte-level BPE of 49,152 tokens trained here (SmolLM2's size,
benchmarks.common.write_tokenizer) and a Llama-2-style SentencePiece BPE of 32,000
(tests/sentencepiece_files.py). Each engine encodes the whole corpus three times; the
best time counts. Prints a table, writes JSON (--out) and records the rows in
docs/results.md.

    PYTHONPATH=. .venv/bin/python benchmarks/tokenizer_engines.py
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT, write_json, write_tokenizer
from benchmarks.results import record
from model.tokenizer import Tokenizer


def corpus(limit: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def best_of(runs: int, encode, texts: list[str]) -> tuple[float, int]:
    """(seconds of the fastest pass, tokens in a pass)"""
    best, count = float("inf"), 0
    for _ in range(runs):
        t0 = time.perf_counter()
        count = sum(len(encode(t)) for t in texts)
        best = min(best, time.perf_counter() - t0)
    return best, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=120, help="stdlib modules encoded")
    parser.add_argument("--out", type=Path, default=OUT / "tokenizer_engines.json")
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the library's own threads: one
    from tokenizers import Tokenizer as Library

    from tests.sentencepiece_files import write

    texts = corpus(args.files)
    size = sum(len(t.encode()) for t in texts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        byte_level, spm = Path(tmp, "byte_level"), Path(tmp, "spm")
        byte_level.mkdir()
        spm.mkdir()
        write_tokenizer(byte_level)
        write(spm, "llama2", 32000)
        ours = Tokenizer.from_dir(byte_level)
        lib = Library.from_file(str(byte_level / "tokenizer.json"))
        cases = [
            ("byte-level BPE 49k", "tiktoken (kvserve)", lambda t: ours.encode(t, add_bos=False)),
            (
                "byte-level BPE 49k",
                "tokenizers",
                lambda t: lib.encode(t, add_special_tokens=False).ids,
            ),
        ]
        sp = Tokenizer.from_dir(spm)
        cases.append(
            ("SentencePiece BPE 32k", "tokenizers (kvserve)", lambda t: sp.encode(t, add_bos=False))
        )
        for file, engine, encode in cases:
            seconds, tokens = best_of(3, encode, texts)
            rows.append(
                {
                    "file": file,
                    "engine": engine,
                    "tokens": tokens,
                    "seconds": round(seconds, 4),
                    "mb_per_s": round(size / seconds / 1e6, 2),
                    "tokens_per_s": round(tokens / seconds),
                }
            )
    print(f"{len(texts)} stdlib modules, {size / 1e6:.2f} MB, one thread, best of 3")
    print(f"{'file':24} {'engine':22} {'tokens':>9} {'MB/s':>7} {'tokens/s':>11}")
    for r in rows:
        print(
            f"{r['file']:24} {r['engine']:22} {r['tokens']:9d} {r['mb_per_s']:7.2f} "
            f"{r['tokens_per_s']:11,d}"
        )
    write_json(args.out, {"corpus_bytes": size, "files": len(texts), "rows": rows})
    record(
        "tokenizer_engines",
        {
            f"{r['file']}, {r['engine']}, {size / 1e6:.2f} MB of Python, one thread": (
                f"{r['mb_per_s']:.2f} MB/s ({r['tokens_per_s']:,} tokens/s)"
            )
            for r in rows
        },
    )


if __name__ == "__main__":
    main()
