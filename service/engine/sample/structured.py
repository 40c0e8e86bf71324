"""Structured outputs: a request's output held to a JSON Schema, any JSON object, a regex,
one of a list of choices, or a grammar (Lark, or GBNF converted to it), by llguidance
(chosen by measurement against xgrammar and outlines-core: docs/decisions.md).

Each constrained sequence has a `Guide` (its matcher). service/engine/sample/structured_sampling.py decides
which rows need their `Masks` and when (after the step's first choices; on a GPU also
while the forward runs). A guide advances with every token the sequence accepts, says
which tokens the grammar forces next (jump-forward) and when the grammar is complete
(the request then finishes with `stop`). Requests without a constraint build nothing
and pay nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import string
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from model.tokenizer import Tokenizer
from service.engine.request import Constraint, ParamError


class ConstraintError(ParamError):
    """A constraint that does not compile (a 400 naming the API parameter)."""


SETUP_NICE = 10  # the grammar workers' scheduling priority, below the engine's 0


def lower_priority() -> None:
    """The calling thread below the engine's priority (SETUP_NICE)."""
    with contextlib.suppress(AttributeError, OSError):  # Linux: per thread
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SETUP_NICE)


# Where grammars are compiled and their start matchers built (Grammars.check): off the
# engine's step, in threads below the engine's priority. llguidance releases the GIL, but
# on a machine with few cores a compile at the engine's priority takes a core from the
# step's OpenMP threads, and the step waits for it (docs/decisions.md).
SETUP_POOL = ThreadPoolExecutor(2, "kvserve-grammar", initializer=lower_priority)


# A reasoning model's think block, as its output's text writes it
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Before the constraint's own grammar ("answer"): the thinking up to its first closing
# marker (a lazy lexeme: it ends there), the newlines the models write after it
_THOUGHT = f'\nthought[lazy]: THOUGHT "{THINK_CLOSE}"\nTHOUGHT: /(.|\\n)*/\nNL: /\\n{{0,2}}/\n'
_AFTER_THINKING = {
    "open": "%llguidance {}\nstart: thought NL @answer" + _THOUGHT,
    "maybe": f'%llguidance {{}}\nstart: think? @answer\nthink: "{THINK_OPEN}" thought NL'
    + _THOUGHT,
}


def _grammar(c: Constraint) -> str:
    """The llguidance grammar (its JSON form) of a constraint, held from where its think
    state says."""
    answer = _answer(c)
    if not c.think:
        return answer
    if c.kind in ("json", "json_object", "regex", "choice"):
        entry = json.loads(answer)["grammars"][0]  # llguidance's JSON form: one grammar
    else:
        entry = {"lark_grammar": answer}
    wrap = {"name": "thinking", "lark_grammar": _AFTER_THINKING[c.think]}
    return json.dumps({"grammars": [wrap, {**entry, "name": "answer"}]})


def _answer(c: Constraint) -> str:
    """The constraint's own grammar."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    M = llguidance.LLMatcher
    if c.kind in ("json", "json_object"):
        schema = json.loads(c.spec) if c.kind == "json" else {"type": "object"}
        if not isinstance(schema, dict):
            raise ValueError("a JSON Schema must be a JSON object")
        # compact JSON: no whitespace between tokens (a random model would pad with it)
        return M.grammar_from_json_schema(schema | {"x-guidance": {"whitespace_flexible": False}})
    if c.kind == "regex":
        return M.grammar_from_regex(c.spec)
    if c.kind == "choice":
        choices = json.loads(c.spec)
        return M.grammar_from_regex("|".join(_regex_literal(s) for s in choices))
    return M.grammar_from_lark(any_to_lark(c.spec))  # Lark, or GBNF converted


def _regex_literal(s: str) -> str:
    """s matched literally: ASCII punctuation escaped (the regex syntax escapes nothing
    else), every other character as itself."""
    return "".join("\\" + ch if ch in string.punctuation else ch for ch in s)


class Guide:
    """One sequence's place in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: object) -> None:
        self.matcher = matcher

    def allows(self, token: int) -> bool:
        """Whether the grammar takes this token next (without taking it). A negative id
        (the sampler's non-finite flag) is left to the engine, which fails the request."""
        return token < 0 or self.matcher.validate_tokens([token]) == 1  # type: ignore[attr-defined]

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the
        forced text's own tokenization, short of any token the text after it could
        merge into); empty when the next token is a choice."""
        return list(self.matcher.compute_ff_tokens())  # type: ignore[attr-defined]

    def accept(self, token: int) -> bool:
        """Advance with a sampled token; False: the grammar rejects it."""
        return bool(self.matcher.consume_token(token))  # type: ignore[attr-defined]

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return bool(self.matcher.is_stopped())  # type: ignore[attr-defined]

    @property
    def error(self) -> str | None:
        m = self.matcher
        return m.get_error() if m.is_error() else None  # type: ignore[attr-defined]


GRAMMARS_CACHED = 256  # compiled grammars and start matchers kept, the newest


class Grammars:
    """llguidance for one tokenizer: the token table is built once (about half a second
    for a 100k vocabulary, much of it holding the GIL), by prepare() or else on the first
    constrained request; compiled grammars and their start matchers are cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab_size, list(eos_ids)
        self._lock = threading.Lock()
        self._ll: object | None = None
        self._cache_lock = threading.Lock()
        self._grammars: OrderedDict[Constraint, str] = OrderedDict()  # compiled, newest last

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def words(self) -> int:
        """int32 words of a bitmask row."""
        return (self._vocab + 31) // 32

    def _lltokenizer(self) -> object:
        with self._lock:
            if self._ll is None:
                import llguidance

                vocab = _Vocab(self._tokenizer, self._vocab, self._eos)
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
            return self._ll

    def prepare(self) -> None:
        """Build the token table now: a server does it before it takes requests, so that
        the first constrained request does not hold the GIL from the engine's steps."""
        self._lltokenizer()

    def check(self, c: Constraint) -> None:
        """Raise ConstraintError if the constraint does not compile. Also builds its
        start matcher (tens of ms for a large grammar; llguidance releases the GIL), so
        the caller pays for it, off the engine's step: the front calls this in a worker
        thread, and guide() on the engine thread then copies the cached matcher."""
        self._start(c)

    def compiled(self, c: Constraint) -> str:
        """The constraint as a checked llguidance grammar (ConstraintError if it is not
        one): converted and validated once, then cached."""
        with self._cache_lock:
            found = self._grammars.get(c)
        if found is None:
            found = self._compile(c)
            self.adopt(c, found)
        return found

    def adopt(self, c: Constraint, grammar: str) -> None:
        """Take `grammar` as `c`'s, checked already (by the front that sent the request,
        check_request): the engine's process builds its matcher without validating it
        again."""
        with self._cache_lock:
            self._grammars[c] = grammar
            self._grammars.move_to_end(c)
            while len(self._grammars) > GRAMMARS_CACHED:
                self._grammars.popitem(last=False)

    def _compile(self, c: Constraint) -> str:
        import llguidance

        try:
            grammar = _grammar(c)
        except Exception as exc:  # each compiler raises its own types (GbnfToLarkError, ...)
            raise ConstraintError(c.param, str(exc) or type(exc).__name__) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._lltokenizer()
        )
        if is_error:
            raise ConstraintError(c.param, "; ".join(messages) or "not a valid grammar")
        return grammar

    @functools.lru_cache(maxsize=GRAMMARS_CACHED)  # noqa: B019 - one Grammars per engine
    def _start(self, c: Constraint) -> object:
        """A matcher at the grammar's start, never advanced: each guide is a copy of it
        (a copy takes about a microsecond, a new matcher about a millisecond)."""
        import llguidance

        matcher = llguidance.LLMatcher(self._lltokenizer(), self.compiled(c))
        if matcher.is_error():
            raise ConstraintError(c.param, matcher.get_error())
        return matcher

    def guide(self, c: Constraint) -> Guide:
        return Guide(self._start(c).deep_copy())  # type: ignore[attr-defined]


class _Vocab:
    """What llguidance's LLTokenizer reads of a tokenizer: every id's bytes (special
    tokens marked: those an output's text drops, so that added tokens it keeps, Qwen3's
    `<think>` and `<tool_call>`, are the text a grammar spells), the end-of-sequence id and
    a tokenize function."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        special = tokenizer.skipped_ids
        self.tokens = [
            tokenizer.token_bytes(i) if tokenizer.valid_id(i) else b"" for i in range(vocab_size)
        ]
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self.eos_token_id = eos_ids[0] if eos_ids else vocab_size - 1
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False, special=False)


class Masks:
    """The allowed tokens of constrained rows, as llguidance writes them: one bit per
    token, packed into int32 words (R, (V + 31) // 32). When they are computed is
    service/engine/sample/structured_sampling.py's decision."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars

    def compute(self, guides: Sequence[Guide]) -> np.ndarray:
        """The packed masks of the guides, one after another (llguidance's parallel
        executor measured slower on 2 cores)."""
        import llguidance.numpy as lln

        words = np.zeros((len(guides), self.grammars.words), dtype=np.int32)
        for i, g in enumerate(guides):
            lln.fill_next_token_bitmask(g.matcher, words, i)
        return words

    @staticmethod
    def counts(words: np.ndarray) -> list[int]:
        """Tokens each row allows."""
        return np.bitwise_count(words.view(np.uint32)).sum(axis=1).tolist()

    @staticmethod
    def pairs(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, token id) of every token the rows allow, in row then id order, read
        from the non-zero words alone (a few when the grammar allows a few tokens)."""
        width = words.shape[1]
        flat = words.reshape(-1)
        word = np.flatnonzero(flat != 0)  # (numpy's nonzero is 10x slower on int32 than bool)
        bits = np.unpackbits(flat[word].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
        k = np.flatnonzero(bits.view(np.bool_).reshape(-1))  # bit b of a word: token 32 w + b
        word = word[k // 32]
        return word // width, (word % width) * 32 + k % 32

    def dense(self, words: np.ndarray, device: torch.device) -> Tensor:
        """(R, vocab_size) bool on the device: the tokens each row allows. A GPU gets the
        packed words (1/8 of the bytes) and unpacks them itself."""
        v = self.grammars.vocab_size
        if device.type == "cpu":
            bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # (R, 32 W)
            return torch.from_numpy(bits[:, :v].view(np.bool_))
        return unpack(torch.from_numpy(words).to(device, non_blocking=True), v)


def unpack(words: Tensor, vocab_size: int) -> Tensor:
    """Packed masks (R, W) int32, on any device -> (R, vocab_size) bool there."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (R, W, 32): bit b of word w, token 32 w + b
    return bits.view(len(words), -1)[:, :vocab_size].bool()
