"""gpt-oss's harmony output read into a chat message (service/api/harmony.py): the
analysis channel as reasoning, the final channel as content, commentary addressed to a
function as a tool call; a stream fed in any pieces gives what the whole text gives."""

import json

import pytest

from service.api.harmony import HarmonyReader
from service.api.tool_formats import ToolFormat
from service.api.tools import Tools

TOOLS = Tools({"get_weather": {"name": "get_weather"}}, "auto", True, ToolFormat("harmony"))
THOUGHT_AND_ANSWER = (
    "<|channel|>analysis<|message|>The user greets; answer in kind.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! a <| b<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)
ROLE_ADDRESSED = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}'


def test_channels_are_reasoning_content_and_calls() -> None:
    m = HarmonyReader(TOOLS, include_reasoning=True).message(THOUGHT_AND_ANSWER)
    assert m["reasoning_content"] == "The user greets; answer in kind."
    assert m["content"] == "Hello! a <| b"  # "<|" that opens no marker is text
    reader = HarmonyReader(TOOLS, include_reasoning=True)
    m = reader.message(CALL)
    assert m["reasoning_content"] == "Need the weather." and m["content"] is None
    (call,) = m["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert call["id"].startswith("call_") and reader.finish_reason("stop") == "tool_calls"
    # the recipient in the role's header, the output cut before its end marker
    (call,) = HarmonyReader(TOOLS, True).message(ROLE_ADDRESSED)["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}


def test_without_tools_or_reasoning() -> None:
    m = HarmonyReader(None, include_reasoning=False).message(THOUGHT_AND_ANSWER)
    assert "reasoning_content" not in m and m["content"] == "Hello! a <| b"
    commentary = "<|channel|>commentary<|message|>Looking it up.<|end|>"
    assert HarmonyReader(None, True).message(commentary)["content"] == "Looking it up."
    # text outside the format is content; a header cut before its message is dropped
    assert HarmonyReader(None, True).message("plain words")["content"] == "plain words"
    assert HarmonyReader(None, True).message("<|channel|>analy")["content"] == ""


@pytest.mark.parametrize("text", [THOUGHT_AND_ANSWER, CALL, ROLE_ADDRESSED])
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_a_stream_in_any_pieces_adds_up_to_the_whole(text: str, size: int) -> None:
    whole = HarmonyReader(TOOLS, True).message(text)
    reader = HarmonyReader(TOOLS, True)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = reader.feed(piece, final=i == len(pieces) - 1)
        assert "<|" not in delta.get("reasoning_content", "").replace("a <| b", "")
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c["function"].get("name", "")
            entry["arguments"] += c["function"]["arguments"]
    assert reasoning == whole.get("reasoning_content", "")
    assert content == (whole["content"] or "")
    want = [c["function"] for c in whole.get("tool_calls", [])]
    assert [calls[i] for i in sorted(calls)] == want
