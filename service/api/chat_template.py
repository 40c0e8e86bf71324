"""Chat templates: the model's Jinja template from tokenizer_config.json, rendered in a
sandbox, or a ChatML default for models without one (the demo model)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.gguf import is_gguf, open_gguf

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template could not render these messages (the API answers 400)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(
            v, ensure_ascii=False, indent=indent
        )
        self.template = env.from_string(source)
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def for_model(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The template in the directory's tokenizer_config.json (a GGUF file's
        tokenizer.chat_template), else the ChatML default."""
        if model_dir is None:
            return cls(DEFAULT_TEMPLATE)
        path = Path(model_dir) / "tokenizer_config.json"
        if is_gguf(model_dir):
            config = open_gguf(model_dir).tokenizer_config()
        elif path.exists():
            config = json.loads(path.read_text(encoding="utf-8"))
        else:
            return cls(DEFAULT_TEMPLATE)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        chat_jinja = Path(model_dir) / "chat_template.jinja"
        if not source and chat_jinja.exists():
            source = chat_jinja.read_text(encoding="utf-8")
        return cls(
            source or DEFAULT_TEMPLATE,
            _token(config.get("bos_token")),
            _token(config.get("eos_token")),
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """extra: more variables for the template (a request's chat_template_kwargs, e.g.
        enable_thinking); they cannot replace the ones set here."""
        try:
            return self.template.render(
                **(extra or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None


# the variables render() sets, which a request's extra ones cannot replace
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def _token(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""
