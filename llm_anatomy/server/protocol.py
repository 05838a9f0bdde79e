"""The OpenAI API as this server reads it: request bodies, parsed, type- and range-checked before any work.

- A field the API defines is honoured, or refused with a 400 that says so (`param` names it).
- Every number is range-checked here (and again by SamplingParams): a value no engine should see never
  reaches it.
- vLLM's extensions are honoured where this engine can (top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
  skip_special_tokens, chat_template_kwargs, stream_options.continuous_usage_stats); those it cannot honour
  are accepted at their no-op values (repetition_penalty 1, use_beam_search false, ...) and refused otherwise.
- Any other field is accepted and ignored, as vLLM does: the server logs its name (once) and the call's
  anatomy lists it (`request.ignored_fields`).
- `anatomy: true` puts the call's anatomy summary in the response.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling import INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from ..errors import RequestError
from .errors import APIError

MAX_N = 16  # choices per request
MAX_STOP = 4  # the OpenAI API's limit on stop sequences
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_DEPTH = 64  # JSON nesting a body may have (tool schemas are the deepest real bodies, about ten levels)
TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key (ASCII digits only: int() also takes '²' and '١')

Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) in every chunk; needs include_usage


class ResponseFormat(_Body):
    type: str


class ChatTemplateKwargs(_Body):
    enable_thinking: bool = True


class _Sampling(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: Annotated[str, Field(max_length=1024)]
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    max_tokens: TokenCount | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    # ours
    anatomy: bool = False  # put the anatomy summary in the response (in the last chunk of a stream)


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: str | None = None


# vLLM's extensions this engine does not implement: accepted at the value that changes nothing, else refused.
NO_OP_EXTENSIONS = {
    "repetition_penalty": 1, "length_penalty": 1, "use_beam_search": False, "include_stop_str_in_output": False,
    "spaces_between_special_tokens": True, "return_tokens_as_token_ids": False, "prompt_logprobs": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "structured_outputs": None, "logits_processors": None, "bad_words": None,
    "allowed_token_ids": None, "truncate_prompt_tokens": None, "chat_template": None, "documents": None,
    "add_generation_prompt": True, "continue_final_message": False,
}


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


def _too_deep(value: Any, limit: int) -> bool:
    """Whether lists and objects (as json.loads makes them) nest more than `limit` deep. Only containers go on the
    stack: a prompt of token ids is thousands of numbers."""
    if not isinstance(value, (dict, list)):
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        kinds = set(map(type, children))  # in C: most lists hold numbers or strings alone
        if dict in kinds or list in kinds:
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes, kind: type[_Sampling]) -> _Sampling:
    """Bytes -> a validated request, or an APIError (400) naming what to fix."""
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_DEPTH} levels)",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    if _too_deep(data, MAX_DEPTH):
        raise APIError(400, f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", code="invalid_json")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "missing":
            message, code = f"{where} is required", "missing_required_parameter"
        else:
            got = json.dumps(err.get("input"), default=str)
            message = f"{where}: {err['msg'].lower()} (got {got[:80]}{'...' if len(got) > 80 else ''})"
            code = "invalid_value" if err["type"] in _RANGE_ERRORS else "invalid_type"
        raise APIError(400, message, param=param, code=code) from None


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                 "too_long", "too_short", "string_too_long"}


@dataclass
class Request:
    """What the engine loop is given for one call, after the protocol's checks."""

    kind: Literal["chat", "completion"]
    model: str
    messages: list[dict] | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: dict  # SamplingParams fields (None: the model's default)
    max_tokens_given: bool
    enable_thinking: bool
    tools: list[dict] | None
    parse_tool_calls: bool
    stream: bool
    include_usage: bool
    want_anatomy: bool
    echo: bool = False
    n: int = 1  # choices: each its own sequence (and its own anatomy); with a seed, choice i uses seed + i
    parallel_tool_calls: bool = True  # false: at most one tool call per answer (the first the model wrote)
    user: str | None = None
    continuous_usage: bool = False  # usage so far in every chunk of a stream (vLLM's continuous_usage_stats)
    shown: dict = field(default_factory=dict)  # the request as recorded in its anatomy
    fingerprint: str | None = None  # the response's system_fingerprint: this server and its weights' kind

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


def _is_no_op(value: Any, no_op: Any) -> bool:
    if no_op is None:
        return value is None or (isinstance(value, (list, dict, str)) and not value)
    if isinstance(no_op, bool):
        return value is no_op
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == no_op


def _extensions(body: _Sampling) -> list[str]:
    """Check the fields the API does not define: vLLM's unimplemented ones must be no-ops; the names of the
    others (ignored) are returned."""
    ignored = []
    for name, value in (body.model_extra or {}).items():
        if name in NO_OP_EXTENSIONS:
            if not _is_no_op(value, NO_OP_EXTENSIONS[name]):
                _refuse(name, f"is not supported by this server (a vLLM extension); only "
                              f"{json.dumps(NO_OP_EXTENSIONS[name])} (no effect) is accepted")
        else:
            ignored.append(name)
    for part in (body.stream_options, getattr(body, "chat_template_kwargs", None)):
        if part is not None and part.model_extra:
            ignored += [f"{'stream_options' if part is body.stream_options else 'chat_template_kwargs'}.{k}"
                        for k in part.model_extra]
    return [name if len(name) <= 64 else name[:61] + "..." for name in ignored]


def _common(body: _Sampling) -> dict:
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not TOKEN_ID.fullmatch(key):
            raise APIError(400, f"logit_bias keys are token ids (digits), got {key[:40]!r}", param="logit_bias",
                           code="invalid_value")
        bias.append((int(key), float(value)))
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if stop is not None and len(stop) > MAX_STOP:  # the API's limit
        raise APIError(400, f"stop takes at most {MAX_STOP} sequences, got {len(stop)}", param="stop")
    return dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                seed=body.seed, stop=tuple(stop or ()), stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, min_tokens=body.min_tokens,
                logit_bias=tuple(sorted(bias)))


def _streaming(body: _Sampling) -> dict:
    options = body.stream_options
    usage = bool(options and options.include_usage)
    return dict(stream=bool(body.stream), include_usage=usage,
                continuous_usage=usage and bool(options and options.continuous_usage_stats))


def _shown(body: _Sampling, exclude: set[str], ignored: list[str]) -> dict:
    shown = body.model_dump(exclude_none=True, exclude=exclude | set(body.model_extra or ()))
    if ignored:
        shown["ignored_fields"] = ignored
    return shown


def _check_chat_fields(body: ChatCompletionRequest) -> None:
    for name in ("audio", "prediction", "web_search_options", "functions", "function_call", "reasoning_effort",
                 "metadata"):
        if getattr(body, name) is not None:
            _refuse(name, "is not supported by this server")
    if body.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", "may be \"auto\" or \"default\": this server has one tier")
    if body.store:
        _refuse("store", "is not supported: this server keeps anatomies, not completions")
    if body.modalities not in (None, ["text"]):
        _refuse("modalities", "must be [\"text\"]: this is a text-only model")
    if body.response_format is not None and body.response_format.type != "text":
        _refuse("response_format", f"type {body.response_format.type!r} is not supported (no guided decoding); "
                                   f"only \"text\"")
    if body.tool_choice not in (None, "auto", "none"):
        _refuse("tool_choice", "may be \"auto\" or \"none\": forcing a tool call needs guided decoding")
    for i, tool in enumerate(body.tools or ()):
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
                and isinstance(tool["function"].get("name"), str)):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param="tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                       param="max_completion_tokens")


def chat_request(body: ChatCompletionRequest) -> Request:
    ignored = _extensions(body)
    sampling = _common(body)
    _check_chat_fields(body)
    sampling["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    from ..tokenizer import validate_messages

    try:
        messages = validate_messages(body.messages)
    except RequestError as e:
        raise APIError(400, str(e), param="messages") from None
    thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else True
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    return Request("chat", body.model, messages, None, None, {**sampling, "max_tokens": max_tokens},
                   max_tokens is not None, thinking, tools, tools is not None, want_anatomy=body.anatomy,
                   n=body.n or 1, parallel_tool_calls=body.parallel_tool_calls is not False, user=body.user,
                   shown={"messages": messages, **_shown(body, {"messages", "model"}, ignored)}, **_streaming(body))


def completion_request(body: CompletionRequest) -> Request:
    ignored = _extensions(body)
    sampling = _common(body)
    if body.best_of not in (None, body.n or 1):
        _refuse("best_of", "must equal n: choices are not ranked")
    if body.logprobs is not None and body.echo:
        _refuse("logprobs", "with echo is not supported (the prompt's own logprobs are not computed)")
    sampling["logprobs"] = body.logprobs
    if body.suffix is not None:
        _refuse("suffix", "is not supported (Qwen3 has no fill-in-the-middle mode)")
    prompt, ids = body.prompt, None
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        elif prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, f"prompt holds {len(prompt)} prompts: send one per request", param="prompt")
    if isinstance(prompt, list):
        ids, prompt = prompt, None
    if (prompt is not None and not prompt) or (ids is not None and not ids):
        raise APIError(400, "prompt is empty", param="prompt")
    return Request("completion", body.model, None, prompt, ids,
                   {**sampling, "max_tokens": body.max_tokens if body.max_tokens is not None else 16},
                   True, True, None, False, want_anatomy=body.anatomy, echo=body.echo, n=body.n or 1,
                   user=body.user, shown=_shown(body, {"model"}, ignored), **_streaming(body))
