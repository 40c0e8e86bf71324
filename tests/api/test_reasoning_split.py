"""The reasoning split (service/api/reasoning.py): whole outputs, and the same outputs fed
in every chunking hypothesis draws give the same parts."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.reasoning import ReasoningSplitter, split

CASES = [
    # (output, the prompt left a block open, reasoning, content)
    ("<think>\nadd them\n</think>\n\nFour.", False, "\nadd them\n", "Four."),
    ("Four.", False, None, "Four."),
    ("add them</think>\n\nFour.", True, "add them", "Four."),
    ("still thinking when cut", True, "still thinking when cut", ""),
    ("<think>cut short </thi", False, "cut short </thi", ""),
    ("<thin", False, None, "<thin"),
    ("a <think> later is text", False, None, "a <think> later is text"),
    ("<think></think>", False, "", ""),
    ("x</think>\n\n\n", True, "x", ""),
]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), CASES)
def test_whole_outputs(text: str, thinking: bool, reasoning: str | None, content: str) -> None:
    assert split(text, thinking) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(CASES),
    st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_any_chunking_gives_the_whole(case, cuts: list[int]) -> None:
    text, thinking, reasoning, content = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = ReasoningSplitter(thinking)
    got_r, got_c = "", ""
    for a, b in itertools.pairwise(points):
        r, c = splitter.feed(text[a:b])
        got_r, got_c = got_r + r, got_c + c
    r, c = splitter.finish()
    assert (got_r + r, got_c + c) == (reasoning or "", content)
