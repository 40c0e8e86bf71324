"""OpenAI request models (pydantic, the HTTP edge only) and the error shape."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.limits import (
    ADAPTER_NAME,
    MAX_ADAPTER_NAME_CHARS,
    MAX_ADAPTER_PATH_CHARS,
    MAX_CACHE_SALT_CHARS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS,
    MAX_TOOLS,
    PRIORITY_RANGE,
)

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by completions and chat completions (OpenAI + vLLM extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(default=None, max_length=MAX_STOP)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    # extras users of vLLM expect
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    # vLLM's: the prompt tokens' logprobs with this many alternatives each
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: requests share cached prompt blocks only when their salts are equal
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: where the request queues under --scheduling-policy priority (lower first);
    # the route sets it to what runs (ServingState.priority_of)
    priority: int | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    # structured outputs (service/api/structured.py): OpenAI's, and vLLM's extras
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt scored alone
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=MAX_TEMPLATE_KWARGS
    )
    # reasoning models (service/api/reasoning.py): the thinking in reasoning_content (off:
    # dropped), and a budget of thinking tokens (vLLM's name, and another in use)
    include_reasoning: bool = True
    # OpenAI's effort, to the templates that read it (gpt-oss's)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=1)
    max_thinking_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool = True


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


# a LoRA adapter's name: what a request's model gives, a metric label, a path-free word
AdapterName = Annotated[
    str, Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS, pattern=ADAPTER_NAME)
]


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName
    lora_path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName
    lora_int_id: int | None = None  # vLLM's; names are what kvserve goes by


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
