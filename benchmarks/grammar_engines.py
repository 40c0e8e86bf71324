"""Which grammar engine constrains kvserve's structured outputs: llguidance, xgrammar and
outlines-core, measured on the same vocabularies and JSON Schemas.

Vocabularies (byte-level BPE, built from tiktoken's cl100k_base, which is on this machine;
no other tokenizer is): 49k (cl100k's first 49,152 ranks, a valid BPE of its own: a
SmolLM2-sized vocabulary), 100k (cl100k itself) and 128k (cl100k plus 27,744 ranks that
merge two earlier tokens: a Llama-3-sized vocabulary). Schemas: tests/api/json_schemas.py
(nested objects, bounded arrays, enums, anyOf, patterns and formats, bounded numbers,
optional fields, additionalProperties false), each driven through its valid instance
(compact JSON) token by token:

  compile      ms to turn the schema into the engine's matcher for that vocabulary
  mask         us per token to compute the allowed-token mask (median and p99 over
               every token of every schema), the cost a constrained request adds to a step
  coverage     schemas the engine compiled and whose instance it accepted, token by token

Prints a table and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
import torch

from model.tokenizer import DEFAULT_ENCODING
from service.bench_report import cpu_model, write_report
from tests.api.json_schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]


def vocabularies() -> dict[str, tiktoken.Encoding]:
    base = tiktoken.get_encoding(DEFAULT_ENCODING)  # cl100k_base, shipped offline
    ranks = base._mergeable_ranks
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    small = dict(by_rank[:49152])
    big = dict(ranks)
    rng = np.random.default_rng(0)
    words = [b for b, r in by_rank[256:20000]]
    while len(big) < 128000:
        a, b = words[rng.integers(len(words))], words[rng.integers(len(words))]
        big.setdefault(a + b, len(big))

    def enc(name: str, table: dict[bytes, int]) -> tiktoken.Encoding:
        return tiktoken.Encoding(
            name, pat_str=base._pat_str, mergeable_ranks=table,
            special_tokens={"<|eos|>": len(table)},
        )  # fmt: skip

    return {"49k": enc("v49k", small), "100k": enc("v100k", dict(ranks)), "128k": enc("v128k", big)}


def token_bytes(enc: tiktoken.Encoding) -> list[bytes]:
    out = [b""] * enc.n_vocab
    for b, r in enc._mergeable_ranks.items():
        out[r] = b
    return out


class LLGuidance:  # each engine: compile(schema) -> matcher; fill(m); step(m, token) -> allowed
    name = "llguidance"

    def __init__(self, enc: tiktoken.Encoding, eos: int) -> None:
        import llguidance
        import llguidance.numpy
        import llguidance.tiktoken

        self.ll, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.tiktoken.lltokenizer_from_encoding(enc, eos_token=eos)
        self.mask = llguidance.numpy.allocate_token_bitmask(1, enc.n_vocab)

    def compile(self, schema: dict) -> Any:
        options = {"x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                  "key_separator": ":"}}  # fmt: skip
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema | options))
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def step(self, m: Any, token: int) -> bool:
        self.np.fill_next_token_bitmask(m, self.mask, 0)
        allowed = bool(self.mask[0, token // 32] >> (token % 32) & 1)
        return allowed and m.consume_token(token)

    def fill(self, m: Any) -> None:
        self.np.fill_next_token_bitmask(m, self.mask, 0)


class XGrammar:
    name = "xgrammar"

    def __init__(self, enc: tiktoken.Encoding, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(token_bytes(enc), xgr.VocabType.RAW, vocab_size=enc.n_vocab,
                                 stop_token_ids=[eos])  # fmt: skip
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.mask = xgr.allocate_token_bitmask(1, enc.n_vocab)

    def compile(self, schema: dict) -> Any:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.mask)

    def step(self, m: Any, token: int) -> bool:
        m.fill_next_token_bitmask(self.mask)
        allowed = bool(int(self.mask[0, token // 32]) >> (token % 32) & 1)
        return allowed and m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, enc: tiktoken.Encoding, eos: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.regex, self.eos = outlines_core, build_regex_from_schema, eos
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes(enc)):
            if b:
                table.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, table)
        self.mask = torch.zeros((enc.n_vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        index = self.oc.Index(self.regex(json.dumps(schema), whitespace_pattern=""), self.vocab)
        return self.oc.Guide(index)

    def fill(self, g: Any) -> None:
        g.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)

    def step(self, g: Any, token: int) -> bool:
        self.fill(g)
        if not int(self.mask[token // 32]) >> (token % 32) & 1:
            return False
        if token == self.eos:  # a complete document: the guide takes nothing more
            return g.is_finished()
        g.advance(token)
        return True


ENGINES = (LLGuidance, XGrammar, OutlinesCore)

# JSON Schema features: a schema, an instance it allows and one it forbids. An engine
# enforces the feature if it compiles the schema, accepts the first token by token and
# rejects (or never completes) the second.
FEATURES: dict[str, tuple[dict, object, object]] = {
    "multipleOf (number)": ({"type": "number", "multipleOf": 0.5}, 1.5, 1.25),
    "multipleOf (integer)": ({"type": "integer", "multipleOf": 3}, 9, 10),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, 6, 5),
    "minLength / maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "abcd"),
    "pattern": ({"type": "string", "pattern": "^a+b$"}, "aab", "aba"),
    "format: date-time": ({"type": "string", "format": "date-time"}, "2026-11-23T10:00:00Z", "soon"),
    "format: email": ({"type": "string", "format": "email"}, "a@b.io", "a@"),
    "enum of objects": ({"enum": [{"a": 1}, {"b": 2}]}, {"b": 2}, {"a": 2}),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
    "$ref to $defs": ({"$defs": {"n": {"type": "integer"}}, "type": "array",
                       "items": {"$ref": "#/$defs/n"}}, [1, 2], ["x"]),
    "recursive $ref": ({"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array",
                        "items": {"$ref": "#/$defs/t"}}}, "additionalProperties": False}},
                        "$ref": "#/$defs/t"}, {"c": [{"c": []}]}, {"c": [{"d": 1}]}),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, {"x1": 1}, {"y": 1}),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], ["a", 1]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                    [1, 2], [1, 1]),
    "not": ({"not": {"type": "string"}}, 1, "s"),
}  # fmt: skip


def enforces(engine: Any, enc: tiktoken.Encoding, schema: dict, good: object, bad: object) -> bool:
    def runs(instance: object) -> bool:
        m = engine.compile(schema)
        tokens = enc.encode(json.dumps(instance, separators=(",", ":")))
        if not all(engine.step(m, t) for t in tokens):
            return False
        return engine.step(m, enc.n_vocab - 1)  # then end-of-sequence: is it complete?

    try:
        return runs(good) and not runs(bad)
    except Exception:  # the engine cannot take the schema
        return False


def measure(engine_cls: type, enc: tiktoken.Encoding) -> dict[str, Any]:
    eos = enc.n_vocab - 1
    engine = engine_cls(enc, eos)
    compile_ms, mask_us, covered, failures = [], [], 0, {}
    for name, (schema, instance) in SCHEMAS.items():
        try:
            t0 = time.perf_counter()
            m = engine.compile(schema)
            compile_ms.append(1000 * (time.perf_counter() - t0))
            tokens = enc.encode(json.dumps(instance, separators=(",", ":")))
            ok = True
            for t in tokens:
                t0 = time.perf_counter()
                engine.fill(m)
                mask_us.append(1e6 * (time.perf_counter() - t0))
                if not engine.step(m, t):
                    ok = False
                    failures[name] = f"rejected token {t} ({enc.decode([t])!r})"
                    break
            covered += ok
        except Exception as exc:  # a schema the engine cannot take
            failures[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    mask_us.sort()
    return {
        "compile_ms_median": statistics.median(compile_ms) if compile_ms else None,
        "mask_us_median": statistics.median(mask_us) if mask_us else None,
        "mask_us_p99": mask_us[int(0.99 * (len(mask_us) - 1))] if mask_us else None,
        "tokens": len(mask_us),
        "covered": covered,
        "schemas": len(SCHEMAS),
        "failures": failures,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/grammar_engines.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    print(f"{cpu_model()}: one thread")
    print(
        f"{'vocab':>6} {'engine':<14} {'compile ms':>11} {'mask us p50':>12} {'p99':>8} {'coverage':>9}"
    )
    for vname, enc in vocabularies().items():
        for cls in ENGINES:
            r = measure(cls, enc)
            results[f"{vname}/{cls.name}"] = r
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            print(f"{vname:>6} {cls.name:<14} {fmt(r['compile_ms_median'], '11.1f')} "
                  f"{fmt(r['mask_us_median'], '12.1f')} {fmt(r['mask_us_p99'], '8.1f')} "
                  f"{r['covered']:>4}/{r['schemas']}")  # fmt: skip
            for schema, why in r["failures"].items():
                print(f"{'':>22}{schema}: {why}")
    enc = vocabularies()["49k"]
    engines = [cls(enc, enc.n_vocab - 1) for cls in ENGINES]
    support = {f: [enforces(e, enc, *FEATURES[f]) for e in engines] for f in FEATURES}
    print(f"\n{'JSON Schema feature (49k)':<26}" + "".join(f"{c.name:>15}" for c in ENGINES))
    for f, row in support.items():
        print(f"{f:<26}" + "".join(f"{'enforced' if ok else '-':>15}" for ok in row))
    totals = [sum(row[i] for row in support.values()) for i in range(len(ENGINES))]
    print(f"{'enforced':<26}" + "".join(f"{t:>12}/{len(FEATURES)}" for t in totals))
    results["features"] = {f: dict(zip([c.name for c in ENGINES], row, strict=True))
                           for f, row in support.items()}  # fmt: skip
    write_report(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
