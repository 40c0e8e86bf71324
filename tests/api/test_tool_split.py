"""The tool-call split (service/api/tools.py): whole outputs, and the same outputs fed in
every chunking hypothesis draws give the same content and calls."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.tools import Tools, ToolSplitter, split_calls

TOOLS = Tools({"add": {"name": "add"}, "echo": {"name": "echo"}}, "auto", True)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CASES = [
    # (output, content, the calls' (name, arguments))
    (CALL, "", [("add", {"a": 1, "b": 2})]),
    ("Let me add. " + CALL + "\n" + CALL.replace("add", "echo"), "Let me add. ",
     [("add", {"a": 1, "b": 2}), ("echo", {"a": 1, "b": 2})]),
    ("no call here", "no call here", []),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    ("cut <tool_call>\n{\"name\": \"add\"", "cut <tool_call>\n{\"name\": \"add\"", []),
    ("<tool_ca", "<tool_ca", []),
]  # fmt: skip


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    assert [c["index"] for c in calls] == list(range(len(calls)))
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_outputs(text: str, content: str, calls: list) -> None:
    got_content, got_calls = split_calls(text, TOOLS)
    assert (got_content, calls_of(got_calls)) == (content, calls)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_any_chunking_gives_the_whole(case, cuts: list[int]) -> None:
    text, content, calls = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter, got_content, got_calls = ToolSplitter(TOOLS), "", []
    for a, b in itertools.pairwise(points):
        c, found = splitter.feed(text[a:b])
        got_content, got_calls = got_content + c, got_calls + found
    got_content += splitter.finish()
    assert (got_content, calls_of(got_calls)) == (content, calls)
