"""OpenAI API request bodies and error responses (pydantic: the HTTP trust boundary).

Request models validate shapes; ``parse`` then checks every range through ``runtime.validation`` (the one
validation path, shared with the engine) by building the request's ``SamplingParams``. Checks that need the model
(unknown model name, token ids, prompt plus ``max_tokens`` beyond ``max_model_len``) are done by the server. Unknown fields are ignored, as OpenAI clients send
extras (``user``, ``metadata``...). ``ApiError`` carries an HTTP status and renders OpenAI's error JSON:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.runtime import validation
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.validation import InvalidParam

RETRY_AFTER_S = "1"   # the Retry-After of every 503 (overloaded, draining, engine down)


class ApiError(Exception):
    """An error answered to the client as OpenAI-shaped JSON with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.TYPES.get(self.status, "server_error"), self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras). Shapes only here: ranges are
    checked by ``validation`` when ``parse`` builds the request's ``SamplingParams``."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # pdserve / vLLM extensions
    request_id: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None

    API_NAMES: ClassVar[dict[str, str]] = {}   # SamplingParams / check_request field -> this request's field

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        return [] if v is None else [v] if isinstance(v, str) else v

    def wants_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def token_limit(self) -> int | None:
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """This request's ``SamplingParams`` with ``max_tokens``; out-of-range values are a 400 naming the field."""
        fields = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                                "frequency_penalty", "repetition_penalty", "min_tokens",
                                                "stop_token_ids")}
        try:
            return SamplingParams(n=self.n, max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
                                  logprobs=self.num_logprobs(), skip_special_tokens=self.skip_special_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  **{k: v for k, v in fields.items() if v is not None})
        except InvalidParam as e:
            raise self.api_error(e) from None

    def api_error(self, e: InvalidParam) -> ApiError:
        """A 400 for ``e``, naming the field as this request spells it (``top_logprobs``, ``messages``...)."""
        param, msg = self.API_NAMES.get(e.param, e.param), str(e)
        if param == "max_tokens" and getattr(self, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
        if param != e.param and msg.startswith(e.param):
            msg = param + msg[len(e.param):]
        return ApiError(400, msg, param=param)

    def validate_ranges(self) -> None:
        """Every numeric range of the request (``validation``), so that nothing out of range reaches the engine."""
        try:
            validation.check_priority(self.priority)
            if self.request_id is not None:
                validation.check_request_id(self.request_id)
            validation.check_truncate_prompt_tokens(self.truncate_prompt_tokens)
            if self.logit_bias:
                validation.check_logit_bias(self.logit_bias)
                raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        except InvalidParam as e:
            raise self.api_error(e) from None
        self.sampling_params(self.token_limit())


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (batched prompts are refused: use one request per prompt)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "only a single prompt per request is supported", param="prompt")
            p = p[0]
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return p


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _checks(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format type 'text' is supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    API_NAMES: ClassVar[dict[str, str]] = {"prompt": "messages", "logprobs": "top_logprobs"}

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body, turning pydantic's errors into one 400 ``ApiError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        if err.get("type") == "missing":
            msg = f"missing required field {param!r}"
        raise ApiError(400, msg if param is None else f"{param}: {msg}", param=param) from None
    if isinstance(req, SamplingRequest):
        req.validate_ranges()
    return req
