"""Small random models and an engine driver for the engine tests."""

from model.tokenizer import Tokenizer
from service.config import Settings
from service.engine.engine import LLMEngine
from service.engine.output import RequestOutput
from service.engine.request import SamplingParams
from tests.model.helpers import tiny_model

_TOKENIZER = None


def tokenizer() -> Tokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer.default()
    return _TOKENIZER


def small_model(vocab: int = 300, **overrides: object):
    fields = dict(vocab_size=vocab, n_kv_heads=2, max_position=512)
    fields.update(overrides)
    return tiny_model(**fields)


def make_engine(model=None, draft=None, **settings: object) -> LLMEngine:
    """An engine on Settings (no cap on prompt tokens in a step with decodes unless
    given); draft: a speculative draft model (with speculative_method draft)."""
    defaults = dict(
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        mixed_prefill_tokens=0,
    )
    defaults.update(settings)
    return LLMEngine(model or small_model(), tokenizer(), Settings(**defaults), draft=draft)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]
