"""Driving an engine in the engine tests: greedy requests, run to the end with their text
made as a front makes it, their tokens (engines themselves come from tests/factories.py)."""

from service.engine.core.engine import LLMEngine
from service.engine.output import RequestOutput
from service.engine.request import SamplingParams
from service.engine.text.processor import Texts


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    texts = Texts(engine.tokenizer, engine.stop)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        texts.add(rid, params)
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in texts.process(engine.step()):
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]
