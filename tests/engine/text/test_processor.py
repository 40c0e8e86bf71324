"""The front's output processor (service/engine/text/processor.py): token ids to text, a
stop string cut where it completes (across tokens, held back until it can no longer be
one), a sequence's end told once, and nothing of a sequence handed on after it."""

from model.tokenizer import Tokenizer
from service.engine.output import RequestOutput, TokenLogprobs
from service.engine.request import FinishReason, SamplingParams
from service.engine.text.processor import RequestText, Stop, Texts

TOKENIZER = Tokenizer.default()
WORDS = TOKENIZER.encode(" one two three four five six")


def out(tokens: list[int], count: int, index: int | None = None, **kw: object) -> RequestOutput:
    """An output of request "r"; with an index, of its sequence r.{index} (n > 1)."""
    return RequestOutput(
        request_id="r" if index is None else f"r.{index}",
        index=index or 0,
        parent=None if index is None else "r",
        token_ids=tokens,
        logprobs=[TokenLogprobs(t, -0.5, ()) for t in tokens],
        num_output_tokens=count,
        **kw,
    )


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot() -> None:
    """ " tw" could begin " two!": held back; " three" shows it does not, and it goes out."""
    text = RequestText(TOKENIZER, SamplingParams(stop=(" two!",)))
    (first,), stops = text.process([out(WORDS[:2], 2)])
    assert first.text == " one" and stops == []  # " two" waits
    (second,), _ = text.process([out(WORDS[2:3], 3)])
    assert second.text == " two t"  # the last 4 characters could still begin " two!"
    (last,), _ = text.process([out(WORDS[3:4], 4, finished=True)])
    assert first.text + second.text + last.text == TOKENIZER.decode(WORDS[:4])
    assert text.ended == {0}


def test_a_stop_string_cut_where_it_completes_and_told_once() -> None:
    text = RequestText(TOKENIZER, SamplingParams(stop=("ree fo",)))
    shown, stops = text.process([out(WORDS[:2], 2), out(WORDS[2:5], 5)])
    cut = shown[-1]
    assert cut.token_ids == WORDS[2:4] and len(cut.logprobs) == 2  # " three", " four"
    assert cut.finished and cut.finish_reason == FinishReason.STOP and cut.num_output_tokens == 4
    assert "".join(o.text for o in shown) == " one two th"
    assert stops == [Stop("r", 4)]
    assert text.process([out(WORDS[5:], 6)]) == ([], [])  # what the core ran past it


def test_one_sequence_stops_while_its_sibling_runs_on() -> None:
    """n = 2: the first sequence's stop string ends it alone; the second runs to its end."""
    stop = TOKENIZER.decode([WORDS[1]])
    text = RequestText(TOKENIZER, SamplingParams(n=2, stop=(stop,)))
    steps = [[out([WORDS[0]], 1, 0), out([WORDS[0]], 1, 1)],
             [out([WORDS[1]], 2, 0), out([WORDS[2]], 2, 1)],
             [out([WORDS[2]], 3, 0), out([WORDS[3]], 3, 1, finished=True)]]  # fmt: skip
    got, told = [], []
    for step in steps:
        shown, stops = text.process(step)
        got += shown
        told += stops
    firsts = [o for o in got if o.index == 0]
    assert [o.token_ids for o in firsts] == [[WORDS[0]], [WORDS[1]]] and firsts[-1].finished
    assert "".join(o.text for o in firsts) == TOKENIZER.decode([WORDS[0]])
    assert [t for o in got if o.index == 1 for t in o.token_ids] == WORDS[0:1] + WORDS[2:4]
    assert told == [Stop("r.0", 2)] and text.ended == {0, 1}


def test_a_failed_sequence_drops_what_was_held_back() -> None:
    text = RequestText(TOKENIZER, SamplingParams(stop=(" two!",)))
    text.process([out(WORDS[:2], 2)])  # " two" held back
    (failed,), _ = text.process([out([], 2, finished=True, error="generation failed")])
    assert failed.text == "" and failed.error == "generation failed"


def test_an_engine_driven_in_process_is_told_its_stops() -> None:
    """Texts: every request of an offline engine, a stop told through its callback, a
    request forgotten once each of its sequences ended."""
    told = []
    texts = Texts(TOKENIZER, lambda seq, kept: told.append((seq, kept)))
    texts.add("r", SamplingParams(stop=(" two",)))
    shown = texts.process([out(WORDS[:3], 3)])
    assert shown[0].text == " one" and told == [("r", 2)] and texts.requests == {}
