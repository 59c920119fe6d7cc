"""OpenAI request bodies, parsed strictly and turned into the engine's inputs.

Both endpoints take the OpenAI fields ``model``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``,
``stop`` (a string or a list), ``stream``, ``stream_options.include_usage``, ``n`` (1 only) and
``user`` (ignored), plus the extensions ``top_k`` (``-1`` or 0 = off, as in vLLM), ``min_p`` and
``repetition_penalty``. ``/v1/completions`` takes ``prompt``: a string, a list of token ids, or a
list holding exactly one of those. ``/v1/chat/completions`` takes ``messages`` (text content: a
string or a list of ``{"type": "text"}`` parts; role ``developer`` is passed to the template as
``system``).

Values are checked by type without coercion (``"0.5"`` is not a number, ``true`` is not 1), then
by :class:`~verispec.config.SamplingParams`, which holds every numeric parameter to the range
its fp32 arithmetic can hold (the same ranges for the CLI and the Python API; an error names the
field). Text (prompts, message content, stop strings) must be valid Unicode: a lone surrogate
(``"\\ud800"``) is a 400. Unknown fields are refused (OpenAI does the same), and fields the server
does not implement (``logprobs``, ``echo``, ``suffix``, ``best_of`` > 1, tools, JSON response
formats) are refused unless they hold their default value, so that nobody gets a silently
different answer than the one asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from verispec.config import SamplingParams, check_text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)  # -1 = off, as in vLLM; the rest is SamplingParams' check
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Accepted only at their default (this server does not implement them).
    ignore_eos: bool = False
    best_of: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # the limits are SamplingParams' checks

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 12:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:40]!r}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> _Request:
        if self.n != 1:
            raise ValueError("n must be 1: this server returns one choice per request; send several requests")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        if self.ignore_eos:
            raise ValueError("ignore_eos=true is not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters (raises :class:`~verispec.errors.ConfigError` for bad values)."""
        top_k = self.top_k if self.top_k is not None else 0
        return SamplingParams(
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_k=0 if top_k == -1 else top_k,
            top_p=self.top_p if self.top_p is not None else 1.0,
            min_p=self.min_p if self.min_p is not None else 0.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            presence_penalty=self.presence_penalty if self.presence_penalty is not None else 0.0,
            frequency_penalty=self.frequency_penalty if self.frequency_penalty is not None else 0.0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=tuple(self.stop or ()),
        )


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            return value[0]  # a batch of one prompt
        if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
            raise ValueError(
                f"one prompt per request: got a batch of {len(value)} prompts; send one request per prompt"
            )
        ints = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not isinstance(value, str) and not ints:
            raise ValueError("must be a string, a list of token ids, or a list holding one of those")
        if isinstance(value, str):
            check_text("prompt", value)
        return value

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported by this server; leave logprobs out")
        if self.echo:
            raise ValueError("echo=true is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys are ignored: clients echo whole assistant messages back (refusal, annotations, ...).
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
                if isinstance(part.get("text"), str):
                    check_text("text", part["text"])
        elif isinstance(value, str):
            check_text("content", value)
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None:
            check_text("name", value)
        return value

    @model_validator(mode="after")
    def _no_tools(self) -> ChatMessage:
        if self.tool_calls:
            raise ValueError("tool calls are not supported by this server")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: role and string content."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _unsupported_chat(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported by this server; leave logprobs out")
        if self.tools or self.functions or self.tool_choice not in (None, "none") or self.function_call:
            raise ValueError("tools and function calling are not supported by this server")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported by this server")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError("only the text modality is supported by this server")
        return self
