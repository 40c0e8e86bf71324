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

from model.gguf import CONTROL, NORMAL, UNKNOWN, USER_DEFINED

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


def from_gguf_vocabulary(
    tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool
) -> dict[str, Any]:
    """The tokenizer.json of a SentencePiece BPE vocabulary as a GGUF file holds it
    (tokenizer.ggml.model 'llama': each piece with its score and type; llama.cpp's
    converter writes them from the tokenizer.model of Llama 2, Mistral, Gemma, ...): BPE
    with byte fallback whose merges are rebuilt from the scores (gguf_merges), `▁` for a
    space, and one put before the text where the file asks (add_space_prefix: Llama's
    default; Gemma's files say false)."""
    vocab: dict[str, int] = {}
    for tid, piece in enumerate(tokens):
        vocab.setdefault(piece, tid)
    unknown = next((t for t, k in zip(tokens, types, strict=True) if k == UNKNOWN), None)
    spaces = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    pieces = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
              {"type": "ByteFallback"}, {"type": "Fuse"}]  # fmt: skip
    if add_space_prefix:
        prepend = {"type": "Prepend", "prepend": SPACE}
        normalizer = {"type": "Sequence", "normalizers": [prepend, spaces]}
        pieces.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    added = [{"id": tid, "content": piece, "special": kind != USER_DEFINED, "single_word": False,
              "lstrip": False, "rstrip": False, "normalized": False}
             for tid, (piece, kind) in enumerate(zip(tokens, types, strict=True))
             if kind in (UNKNOWN, CONTROL, USER_DEFINED)]  # fmt: skip
    merges = gguf_merges(tokens, scores, types)
    model = {"type": "BPE", "vocab": vocab, "merges": merges, "unk_token": unknown,
             "fuse_unk": True, "byte_fallback": True}  # fmt: skip
    return {
        "version": "1.0",
        "normalizer": normalizer if add_space_prefix else spaces,
        "pre_tokenizer": None,
        "model": model,
        "decoder": {"type": "Sequence", "decoders": pieces},
        "added_tokens": added,
    }


def gguf_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """BPE merges that join pieces as SentencePiece's BPE does: it joins the adjacent pair
    whose join is the piece of highest score. Every split of a normal piece into two
    normal pieces is a merge, ranked by the piece's score (highest first, then by id),
    the splits of one piece by their parts' ids."""
    normal = {piece: tid for tid, (piece, kind) in enumerate(zip(tokens, types, strict=True))
              if kind == NORMAL}  # fmt: skip
    found = []
    for piece, tid in normal.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in normal and piece[i:] in normal]  # fmt: skip
        splits.sort(key=lambda lr: (normal[lr[0]], normal[lr[1]]))
        found += [(-scores[tid], tid, j, left, right) for j, (left, right) in enumerate(splits)]
    found.sort()
    return [[left, right] for *_, left, right in found]
