"""SentencePiece-style `tokenizer.json` files (Llama 2, Mistral v0.1-v0.3, Phi-3, Gemma):
pieces of characters with `▁` for a space, and `<0xNN>` pieces for the bytes of a
character no piece covers (byte fallback).

The `tokenizers` library encodes them: these files are written for it, and their merges
join characters, which tiktoken's merges of bytes cannot express. Decoding is kvserve's
own, by each id's bytes as for every tokenizer (model/tokenizer.py), so streamed text
holds back a character split across byte pieces; a whole decode also drops the one
leading space that the file's decoder strips (the `▁` the encoder put before the text).
A file this module cannot read raises ValueError naming the file and what it met.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SPACE = "▁"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class LibraryEncoding:
    """What Tokenizer asks of its engine (tiktoken.Encoding's `encode`, `name`), from a
    `tokenizers` Tokenizer; its ids are the model's ids."""

    def __init__(self, text: str, name: str) -> None:
        from tokenizers import Tokenizer as Library

        self.name = name
        try:
            self._special = Library.from_str(text)  # special tokens in the text recognised
            self._plain = Library.from_str(text)
        except Exception as exc:  # the library's own error type
            raise ValueError(f"{name}: the tokenizers library cannot read it ({exc})") from None
        self._plain.encode_special_tokens = True  # ... or plain text

    def encode(self, text: str, allowed_special: Any, disallowed_special: Any) -> list[int]:
        library = self._special if allowed_special == "all" else self._plain
        return library.encode(text, add_special_tokens=False).ids


def piece_bytes(piece: str, byte_fallback: bool) -> bytes:
    """A vocabulary piece's bytes: `▁` is a space, `<0xNN>` the byte NN."""
    byte = _BYTE_PIECE.match(piece) if byte_fallback else None
    if byte is not None:
        return bytes([int(byte[1], 16)])
    return piece.replace(SPACE, " ").encode("utf-8")


def leading_strip(decoder: dict[str, Any] | None, path: Path) -> str:
    """The text a whole decode drops from its start, as the file's decoder does: a
    Strip after the pieces are fused, or a Metaspace decoder that prepends. A decoder
    step kvserve does not know is an error naming it, not a guess."""
    if decoder is None:
        return ""
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    strip = ""
    for step in steps:
        kind = step.get("type")
        if kind == "Replace":
            pattern = (step.get("pattern") or {}).get("String")
            if (pattern, step.get("content")) != (SPACE, " "):
                raise _unsupported(path, step)
        elif kind == "Strip":
            if step.get("stop", 0) or step.get("content") != " ":
                raise _unsupported(path, step)
            strip = " " * int(step.get("start", 0))
        elif kind == "Metaspace":
            if step.get("replacement", SPACE) != SPACE:
                raise _unsupported(path, step)
            scheme = step.get("prepend_scheme")
            if scheme is None:  # the older form of the same choice
                scheme = "always" if step.get("add_prefix_space", True) else "never"
            strip = "" if scheme == "never" else " "
        elif kind not in ("ByteFallback", "Fuse"):
            raise _unsupported(path, step)
    return strip


def _unsupported(path: Path, step: dict[str, Any]) -> ValueError:
    return ValueError(f"{path}: unsupported decoder step {step}")


def vocabulary(data: dict[str, Any], path: Path) -> tuple[dict[int, bytes], dict[str, int], int]:
    """(each regular id's bytes, the added tokens' ids, the vocabulary's size) of a
    SentencePiece-style file; an Unigram model's vocab is a list of [piece, score]."""
    model = data.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        pieces = dict(model.get("vocab") or {})
    elif kind == "Unigram":
        pieces = {entry[0]: i for i, entry in enumerate(model.get("vocab") or [])}
    else:
        raise ValueError(f"{path}: model type {kind!r} is not BPE or Unigram")
    if not pieces:
        raise ValueError(f"{path}: the model has no vocabulary")
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    fallback = bool(model.get("byte_fallback", False))
    id_bytes = {
        tid: piece_bytes(piece, fallback) for piece, tid in pieces.items() if piece not in added
    }
    for text, tid in added.items():
        id_bytes[tid] = text.encode("utf-8")
    return id_bytes, added, max(id_bytes) + 1
