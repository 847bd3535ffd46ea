"""OpenAI wire format: pydantic models of the request and response bodies the server speaks, and the error body.

Requests: :class:`CompletionRequest` (``POST /v1/completions``) and :class:`ChatCompletionRequest`
(``POST /v1/chat/completions``). Every top-level field is honoured or refused by name: an unknown field, or a known
one at a value the server cannot honour (penalties, ``min_p``, ``logit_bias``, ``response_format`` json_object /
json_schema, ``best_of``, ``suffix``, ``logprobs`` with ``stream``, ...), is a 400 naming it, with an OpenAI-style
body (:func:`error_body`), as is any invalid value. Nested objects (messages, tools) ignore unknown keys. Every
body, and each tool call's ``arguments``, is within :mod:`phaseserve.server.jsonbounds`' limits (nesting depth,
finite numbers, unique keys, UTF-8) before anything recurses into it.

Sampling fields map onto :class:`phaseserve.Request` (:meth:`SamplingFields.sampling`): ``temperature``,
``top_p``, ``top_k`` (vLLM's extension; ``-1`` or ``0`` disable it), ``seed``, ``max_tokens``
(``max_completion_tokens`` for chat), ``ignore_eos``, ``stop_token_ids`` and ``min_tokens`` (vLLM's extensions) and
``stop`` (strings, matched on the decoded text by the server, see :mod:`phaseserve.server.chat`).

Responses are plain dicts built by :mod:`phaseserve.server.app` in the same shapes (``object`` names
``text_completion``, ``chat.completion``, ``chat.completion.chunk``), so nothing here is on the hot path of
streaming.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from phaseserve.engine.request import MAX_LOGPROBS
from phaseserve.server.jsonbounds import JsonBoundsError, check_value, loads

U32 = 2**32
MAX_CHOICES = 16  # n: choices per prompt
MAX_STOPS = 16  # stop strings per request
REFUSED_UNLESS_DEFAULT = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                          "min_p": 0.0, "logit_bias": None, "skip_special_tokens": True,
                          "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
I32_MAX = 2**31 - 1


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI's server does


class _Body(BaseModel):
    """A request body: checked whole, before any field, by :func:`~phaseserve.server.jsonbounds.check_value`
    (nesting depth, lone surrogates, non-finite floats), so nothing below recurses deeper than its bound; the
    HTTP body was bounded as text already (:func:`~phaseserve.server.jsonbounds.loads`), this covers values
    handed over from Python too."""

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        check_value(data, "")  # messages: "messages.0.content: ...", the body itself "body: ..."
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions. A field this server does not know is refused by name
    (a 400), and so is a known one set to a value it cannot honour (:data:`REFUSED_UNLESS_DEFAULT`,
    ``response_format`` other than text): nothing a client sends is silently ignored."""

    model_config = ConfigDict(extra="allow")  # kept to be named in the refusal

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None  # None: 1.0 (OpenAI)
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=I32_MAX)] | None = None  # vLLM extension; -1 / 0: off
    seed: Annotated[int, Field(ge=0, lt=U32)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # one engine request per choice (seed + j when seeded)
    ignore_eos: bool = False  # vLLM extension
    user: str | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None  # vLLM
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM: stops (tokens and strings) only count after this many
    # accepted at their defaults only (refused by name otherwise, see _refused):
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("a stop string must not be empty")
        return v

    @model_validator(mode="after")
    def _supported(self):
        unknown = sorted(self.model_extra or {})
        if unknown:
            raise ValueError(f"unsupported field{'s' * (len(unknown) > 1)}: {', '.join(unknown)} (this server "
                             f"refuses what it would otherwise ignore; see docs/server.md)")
        for name, default in REFUSED_UNLESS_DEFAULT.items():
            value = getattr(self, name)
            if value != default and not (name == "logit_bias" and not value):
                raise ValueError(f"{name}={value!r:.80} is not supported (only {default!r})")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise ValueError(f"response_format type {fmt!r} is not supported: no constrained decoding (only 'text')")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, max_tokens: int, choice: int = 0) -> dict[str, Any]:
        """Keyword arguments of :class:`phaseserve.Request` (besides id and prompt) for choice ``choice`` of ``n``:
        seeded, choice j runs with ``seed + j`` (mod 2**32); unseeded, the engine draws a fresh seed per choice."""
        return {"max_tokens": max_tokens, "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": max(self.top_k or 0, 0),
                "seed": None if self.seed is None else (self.seed + choice) % U32, "ignore_eos": self.ignore_eos,
                "stop_token_ids": tuple(self.stop_token_ids or ()), "min_tokens": self.min_tokens}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either (one choice per
    prompt and ``n``, ``index = prompt * n + j``). ``echo`` prepends the prompt to each choice's text (and, with
    ``logprobs``, its tokens' logprobs: the first token's is null); ``max_tokens=0`` with ``echo`` scores the prompt
    without generating (lm-eval's loglikelihood requests). ``return_token_ids`` (vLLM's extension) adds each choice's
``prompt_token_ids`` and generated ``token_ids`` (up to a stop string, as its text)."""

    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds],
                                                                                   Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: a string prompt's <bos> (as the model was trained); false: text only
    return_token_ids: bool = False  # vLLM: each choice also carries prompt_token_ids and token_ids (not streamed)

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.stream and self.logprobs is not None:
            raise ValueError("logprobs with stream is not supported: send stream=false")
        if self.stream and self.return_token_ids:
            raise ValueError("return_token_ids with stream is not supported: send stream=false")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt, a string or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class FunctionDef(_Lenient):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict) -> dict:
        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as e:
            raise ValueError(f"parameters is not a valid JSON schema: {e.message}") from None
        return v


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Lenient):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        try:
            check_value(loads(v or "{}", "function.arguments"), "function.arguments")
        except JsonBoundsError:
            raise
        except ValueError:
            raise ValueError("function.arguments must be a JSON string") from None
        return v


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    parallel_tool_calls: bool | None = None  # one call per reply here, which either value allows
    functions: list | None = None  # deprecated by OpenAI: refused (send tools)
    function_call: Any = None

    @model_validator(mode="after")
    def _tools(self):
        if self.functions is not None or self.function_call is not None:
            raise ValueError("functions / function_call are not supported: send tools / tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream and self.logprobs:
            raise ValueError("logprobs with stream is not supported: send stream=false")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    @property
    def tools_on(self) -> bool:
        """Whether the reply may be a tool call (tools given and ``tool_choice`` is not ``"none"``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def offered_tools(self) -> dict[str, dict] | None:
        """name -> parameters schema of the tools a reply may call (None: no tool call is read)."""
        return {t.function.name: t.function.parameters for t in self.tools} if self.tools_on else None


class TokenizeRequest(_Body, _Lenient):
    """``POST /tokenize`` (vLLM's): a ``prompt`` (``add_special_tokens``: as a completion prompt is encoded, with
    ``<bos>``) or chat ``messages`` (rendered as a chat completion's prompt)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.add_generation_prompt:
            raise ValueError("add_generation_prompt=false is not supported: a chat prompt ends where the reply starts")
        return self


class DetokenizeRequest(_Body, _Lenient):
    """``POST /detokenize`` (vLLM's): token ids -> ``{"prompt": text}``."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class ApiError(Exception):
    """An HTTP error in OpenAI's body: ``status`` and ``body`` (:func:`error_body`)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message (and the offending field's dotted path) from pydantic's ``errors()``."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return msg or "invalid request", param
