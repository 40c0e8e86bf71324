"""The forms chat templates teach models to write tool calls in: for each, the grammar
that holds an output to calls of given tools (service/api/tools.py builds the calls'
JSON Schemas) and how an output's text is read back into calls.

- hermes (Qwen2.5, Qwen3, Hermes and their fine-tunes): one block per call,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, blocks on lines of
  their own, text around them.
- llama3_json (Llama 3.1-3.3's JSON tool calling): the whole answer is the call,
  `{"name": ..., "parameters": {...}}`, calls separated by "; " (the template's
  `<|python_tag|>` is a special token the text drops).
- mistral (Mistral 7B v0.3, Nemo, Small): the `[TOOL_CALLS]` control token, then a JSON
  array of `{"name": ..., "arguments": {...}}`; text may come before it, nothing after.
  Its call ids are 9 letters and digits, what Mistral's templates accept back.
- harmony (gpt-oss): a message on the commentary channel addressed to the function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
  its body the arguments (service/api/harmony.py reads the output's channels).

Chosen from the template's text (its markers), or by `--tool-call-format`."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

MISTRAL_OPENING = "[TOOL_CALLS]"
# harmony's markers (service/api/harmony.py reads them)
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
_ID_CHARS = string.ascii_letters + string.digits
_ANY_TEXT = "TEXT: /(.|\\n)*/\n"


@dataclass(frozen=True)
class ToolFormat:
    """name: a TOOL_CALL_FORMATS entry but auto (service/config.py); opening_id: the
    id of the opening control token (mistral)."""

    name: str
    opening_id: int | None = None
    markers: tuple[tuple[str, int], ...] = ()  # harmony's special tokens and their ids

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.name == "llama3_json" else "arguments"

    @property
    def keeps_special_tokens(self) -> bool:
        """The output's text must keep special tokens: the opening is one (mistral)."""
        return self.name == "mistral"

    def grammar(self, call: str, choice: str, parallel: bool) -> str:
        """The Lark grammar of an output under `choice` ("auto", "required" or a name),
        `call` the grammar of one call's JSON (`%json {...}`); parallel: one call or more."""
        auto = choice == "auto"
        if self.name == "hermes":
            block = f'"\\n" {call} "\\n</tool_call>"'
            if auto:  # any text; each call from its marker on (a lazy lexeme)
                return (
                    f"%llguidance {{}}\nstart: {'call* TEXT' if parallel else 'call | TEXT'}\n"
                    f'call: opening {block}\nopening[lazy]: TEXT "<tool_call>"\n{_ANY_TEXT}'
                )
            more = ' ("\\n" call)*' if parallel else ""
            return f'start: call{more}\ncall: "<tool_call>" {block}\n'
        sep = '"; "' if self.name == "llama3_json" else '", "'
        calls = f"calls: call ({sep} call)*\n" if parallel else "calls: call\n"
        if self.name == "llama3_json":  # auto: the calls, or text not opening with "{"
            start = "(calls | TEXT)?\nTEXT: /[^{](.|\\n)*/" if auto else "calls"
            return f"%llguidance {{}}\nstart: {start}\n{calls}call: {call}\n"
        array = f'array: <[{self.opening_id}]> "[" calls "]"\n'
        start = "TEXT array?" if auto else "array"
        text = _ANY_TEXT if auto else ""
        return f"%llguidance {{}}\nstart: {start}\n{array}{calls}call: {call}\n{text}"

    def harmony_grammar(self, arguments: dict[str, str]) -> str:
        """The Lark grammar of a harmony output that calls one of the tools (tool_choice
        required or a name: the call at once, no thinking first), `arguments` each
        tool's arguments grammar by its name."""
        ids = dict(self.markers)
        calls = " | ".join(f"call{i}" for i in range(len(arguments)))
        rules = "".join(
            f'call{i}: "{name}" " " <[{ids[CONSTRAIN]}]> "json" <[{ids[MESSAGE]}]> '
            f"args{i}\nargs{i}: {grammar}\n"
            for i, (name, grammar) in enumerate(arguments.items())
        )
        head = f'<[{ids[CHANNEL]}]> "commentary to=functions."'
        return f"%llguidance {{}}\nstart: {head} ({calls}) <[{ids[CALL]}]>\n{rules}"

    def call_id(self) -> str:
        if self.name == "mistral":
            return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


def harmony_tokens(special_ids: dict[str, int]) -> dict[str, int] | None:
    """The harmony markers' ids where the tokenizer has each as a special token (a
    gpt-oss tokenizer), else None."""
    if not all(m in special_ids for m in HARMONY_MARKERS):
        return None
    return {m: special_ids[m] for m in HARMONY_MARKERS}


def format_for(setting: str, template: str, special_ids: dict[str, int]) -> ToolFormat:
    """The tool-call format: the setting's, or ("auto") the one the template's text
    writes (its markers; Hermes-style where it names none)."""
    name = setting
    harmony = harmony_tokens(special_ids)
    if name == "auto":
        if harmony is not None and CHANNEL in template:
            name = "harmony"
        elif MISTRAL_OPENING in template:
            name = "mistral"
        elif "<tool_call>" in template:
            name = "hermes"
        elif "<|python_tag|>" in template or "ipython" in template:
            name = "llama3_json"
        else:
            name = "hermes"
    if name == "mistral":
        if MISTRAL_OPENING not in special_ids:
            raise ValueError(
                f"tool-call format mistral needs the tokenizer's {MISTRAL_OPENING} token"
            )
        return ToolFormat(name, special_ids[MISTRAL_OPENING])
    if name == "harmony":
        if harmony is None:
            raise ValueError("tool-call format harmony needs the tokenizer's harmony tokens")
        return ToolFormat(name, markers=tuple(harmony.items()))
    return ToolFormat(name)


def read_calls(fmt: ToolFormat, body: str, names: set[str]) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) of each call in the text that follows a llama3_json
    or mistral opening; None when the text is not calls of given tools."""
    decoder = json.JSONDecoder()
    try:
        if fmt.name == "mistral":
            values, end = decoder.raw_decode(body.lstrip())
            rest = body.lstrip()[end:]
            if not isinstance(values, list):
                return None
        else:
            values, pos, text = [], 0, body.strip()
            while pos < len(text):
                value, pos = decoder.raw_decode(text, pos)
                values.append(value)
                while pos < len(text) and text[pos] in "; \n":
                    pos += 1
            rest = ""
    except ValueError:
        return None
    if rest.strip():
        return None
    out = []
    for value in values:
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        arguments = value.get(fmt.arguments_key, value.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        out.append((value["name"], json.dumps(arguments, ensure_ascii=False)))
    return out or None
