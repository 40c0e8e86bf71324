"""The tool-call split (service/api/tool_split.py) in each format
(service/api/tool_formats.py): whole outputs, and the same outputs fed in every chunking
hypothesis draws, give the same content and calls (streamed Hermes calls: a header, then
argument fragments that add up to the model's own arguments text); each format's grammar
takes the outputs that are calls and, under "auto", text, and refuses malformed calls;
the format follows the template's markers."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.tokenizer import Tokenizer
from service.api.tool_formats import ToolFormat, format_for
from service.api.tool_split import merge, split_calls, splitter
from service.api.tools import Tools
from service.engine.request import Constraint
from service.engine.sample.structured import Grammars

FUNCTIONS = {
    "add": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}},
    "echo": {"name": "echo"},
}  # fmt: skip
MISTRAL_ID = 100276  # a cl100k special token standing in for [TOOL_CALLS]
HERMES, LLAMA3, MISTRAL = (
    ToolFormat("hermes"), ToolFormat("llama3_json"), ToolFormat("mistral", MISTRAL_ID)
)  # fmt: skip
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ADD, ECHO = ("add", {"a": 1, "b": 2}), ("echo", {"a": 1, "b": 2})
CASES = [
    # (format, output, content, the calls' (name, arguments))
    (HERMES, CALL, "", [ADD]),
    (HERMES, "Let me add. " + CALL + "\n" + CALL.replace("add", "echo"), "Let me add. ",
     [ADD, ECHO]),
    (HERMES, "no call here", "no call here", []),
    (HERMES, "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (HERMES, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    (HERMES, "cut <tool_call>\n{\"name\": \"add\"", "cut <tool_call>\n{\"name\": \"add\"", []),
    (HERMES, 'cut <tool_call>\n{"name": "add", "arguments": {"a": 1, "b"', "cut ",
     [("add", '{"a": 1, "b"')]),  # cut by max_tokens: what was written, as OpenAI's
    (HERMES, "<tool_ca", "<tool_ca", []),
    (LLAMA3, '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD]),
    (LLAMA3, '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "echo", "parameters": {"a": 1, "b": 2}}', "", [ADD, ECHO]),
    (LLAMA3, "It is sunny {really}", "It is sunny {really}", []),
    (LLAMA3, '{"name": "rm", "parameters": {}}', '{"name": "rm", "parameters": {}}', []),
    (LLAMA3, '{"name": "add", "param', '{"name": "add", "param', []),
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "echo", "arguments": {"a": 1, "b": 2}}]', "", [ADD, ECHO]),
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Sure. ",
     [ADD]),
    (MISTRAL, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    (MISTRAL, "[TOOL_CAL", "[TOOL_CAL", []),
]  # fmt: skip


def calls_of(calls: list[dict]) -> list[tuple[str, dict | str]]:
    """Whole calls -> (name, arguments parsed, or as text where they do not parse)."""
    assert [c["index"] for c in calls] == list(range(len(calls)))
    out = []
    for c in calls:
        assert set(c) == {"index", "id", "type", "function"}
        try:
            out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
        except ValueError:
            out.append((c["function"]["name"], c["function"]["arguments"]))
    return out


def tools(fmt: ToolFormat, choice: str = "auto", parallel: bool = True) -> Tools:
    return Tools(FUNCTIONS, choice, parallel, fmt)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_outputs(fmt: ToolFormat, text: str, content: str, calls: list) -> None:
    got_content, got_calls = split_calls(text, tools(fmt))
    assert (got_content, calls_of(got_calls)) == (content, calls)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_any_chunking_gives_the_whole(case, cuts: list[int]) -> None:
    fmt, text, content, calls = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    split, got_content, entries = splitter(tools(fmt)), "", []
    for a, b in itertools.pairwise(points):
        c, found = split.feed(text[a:b])
        got_content, entries = got_content + c, entries + found
    rest, more = split.finish()
    entries += more
    headers = [e for e in entries if "id" in e]  # each call's first entry, in index order
    assert [e["index"] for e in headers] == list(range(len(headers)))
    assert all(e["index"] < len(headers) for e in entries)
    assert (got_content + rest, calls_of(merge(entries))) == (content, calls)
    assert merge(entries) == [{**c, "id": h["id"]} for c, h in
                              zip(split_calls(text, tools(fmt))[1], headers, strict=True)]  # fmt: skip


def test_call_ids() -> None:
    """Mistral's templates take back ids of 9 letters and digits; the others OpenAI's."""
    assert all(len(MISTRAL.call_id()) == 9 and MISTRAL.call_id().isalnum() for _ in range(20))
    assert HERMES.call_id().startswith("call_") and LLAMA3.call_id().startswith("call_")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = Tokenizer.default()
    return Grammars(tok, tok.vocab_size, tok.eos_ids)


@pytest.mark.parametrize(
    ("fmt", "choice", "parallel", "output", "takes"),
    [
        (HERMES, "required", True, CALL + "\n" + CALL, True),
        (HERMES, "required", True, "hello", False),
        (HERMES, "auto", False, "hi " + CALL, True),
        (HERMES, "auto", True, "hi <tool_call>\nhello", False),
        (LLAMA3, "required", True, '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
         '{"name": "echo", "parameters": {}}', True),
        (LLAMA3, "required", False, '{"name": "add", "arguments": {"a": 1, "b": 2}}', False),
        (LLAMA3, "auto", True, "It is sunny", True),
        (LLAMA3, "auto", True, '{"name": "add", "parameters": {"a": 1}}', False),
        (MISTRAL, "required", True, '\x00[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
         '{"name": "echo", "arguments": {}}]', True),
        (MISTRAL, "required", True, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', False),
        (MISTRAL, "auto", True, 'Sure. \x00[{"name": "echo", "arguments": {}}]', True),
        (MISTRAL, "auto", True, "Just text.", True),
        (MISTRAL, "auto", True, 'x \x00[{"name": "rm", "arguments": {}}]', False),
        (MISTRAL, "named", False, '\x00[{"name": "echo", "arguments": {}}]', False),
        (MISTRAL, "named", False, '\x00[{"name": "add", "arguments": {"a": 1, "b": 2}}]', True),
    ],
)  # fmt: skip
def test_each_formats_grammar(
    grammars: Grammars, fmt: ToolFormat, choice: str, parallel: bool, output: str, takes: bool
) -> None:
    """Outputs as token ids (\\x00 stands for Mistral's [TOOL_CALLS] control token): a
    call the grammar takes ends it (or, with text, leaves it complete)."""
    choice = "add" if choice == "named" else choice
    spec = tools(fmt, choice, parallel).constraint().spec
    guide = grammars.guide(Constraint("grammar", spec, "tools"))
    tok = Tokenizer.default()
    ids: list[int] = []
    for i, part in enumerate(output.split("\x00")):
        ids += ([MISTRAL_ID] if i else []) + tok.encode(part, add_bos=False)
    ok = all(guide.accept(t) for t in ids)
    complete = ok and (guide.done or guide.allows(tok.eos_ids[0]))
    assert complete == takes


@pytest.mark.parametrize(
    ("template", "setting", "want"),
    [
        ("{{ '<tool_call>' }}", "auto", "hermes"),
        ("{{ '[TOOL_CALLS]' }}", "auto", "mistral"),
        ("{{ '<|python_tag|>' }}", "auto", "llama3_json"),
        ("{% if message.role == 'ipython' %}", "auto", "llama3_json"),
        ("plain ChatML", "auto", "hermes"),
        ("{{ '<tool_call>' }}", "llama3_json", "llama3_json"),
    ],
)
def test_the_format_follows_the_template(template: str, setting: str, want: str) -> None:
    assert format_for(setting, template, {"[TOOL_CALLS]": 9}).name == want


def test_mistral_needs_its_token() -> None:
    with pytest.raises(ValueError, match=r"\[TOOL_CALLS\]"):
        format_for("mistral", "", {})


@pytest.mark.parametrize("fmt", [LLAMA3, MISTRAL], ids=["llama3_json", "mistral"])
def test_parsed_calls_keep_non_ascii_arguments_as_written(fmt: ToolFormat) -> None:
    """Llama 3's and Mistral's calls are parsed and their arguments written back as JSON:
    the characters as the model wrote them (no \\u escapes), the same values."""
    from service.api.tool_formats import read_calls

    call = {"name": "echo", fmt.arguments_key: {"city": "Zürich", "emoji": "🌤"}}
    body = json.dumps([call] if fmt is MISTRAL else call, ensure_ascii=False)
    [(name, arguments)] = read_calls(fmt, body, {"echo"})
    assert name == "echo" and "Zürich" in arguments and "🌤" in arguments
    assert json.loads(arguments) == call[fmt.arguments_key]
