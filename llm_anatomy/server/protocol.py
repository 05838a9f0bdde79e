"""The OpenAI API as this server speaks it: request bodies (validated), responses and errors.

Every field the API defines is either honoured or refused with an error that says so; unknown fields are
refused too (OpenAI does the same), so nothing a client sends is silently ignored. Extensions use vLLM's
names (top_k, min_p, ignore_eos, stop_token_ids, skip_special_tokens, chat_template_kwargs) plus `anatomy`:
true puts the call's anatomy summary in the response. docs/server.md lists them.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import RequestError


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: str


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool = True


class _Sampling(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    anatomy: bool = False  # put the anatomy summary in the response (in the last chunk of a stream)


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
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
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


def parse_body(raw: bytes, kind: type[_Sampling]) -> _Sampling:
    """Bytes -> a validated request, or an APIError: 400 for JSON that does not parse, 422 for a body whose
    fields have the wrong types, are missing or are unknown."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden":
            message = f"unrecognized request argument supplied: {where}"
        elif err["type"] == "missing":
            message = f"{where} is required"
        else:
            message = f"{where}: {err['msg'].lower()} (got {json.dumps(err.get('input'))[:80]})"
        raise APIError(422, message, param=param, code="invalid_type" if err["type"] != "missing" else "missing")


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
    shown: dict = field(default_factory=dict)  # the request as recorded in its anatomy
    fingerprint: str | None = None  # the response's system_fingerprint: this server and its weights' kind

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


MAX_N = 16


def _common(body: _Sampling) -> dict:
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}, got {body.n}", param="n")
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
        bias.append((int(key), float(value)))
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if stop is not None and len(stop) > 4:  # the API's limit
        raise APIError(400, f"stop takes at most 4 sequences, got {len(stop)}", param="stop")
    return dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                seed=body.seed, stop=tuple(stop or ()), stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, logit_bias=tuple(sorted(bias)))


def chat_request(body: ChatCompletionRequest) -> Request:
    sampling = _common(body)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in 0..20, got {body.top_logprobs}", param="top_logprobs")
    sampling["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    for name in ("audio", "prediction", "web_search_options", "functions", "function_call", "reasoning_effort",
                 "service_tier", "metadata"):
        if getattr(body, name) is not None:
            _refuse(name, "is not supported by this server")
    if body.store:
        _refuse("store", "is not supported: this server keeps anatomies, not completions")
    if body.modalities not in (None, ["text"]):
        _refuse("modalities", "must be [\"text\"]: this is a text-only model")
    if body.response_format is not None and body.response_format.type != "text":
        _refuse("response_format", f"type {body.response_format.type!r} is not supported (no guided decoding); "
                                   f"only \"text\"")
    if body.tool_choice not in (None, "auto", "none"):
        _refuse("tool_choice", "may be \"auto\" or \"none\": forcing a tool call needs guided decoding")
    if body.tools is not None:
        for i, tool in enumerate(body.tools):
            if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
                    and isinstance(tool["function"].get("name"), str)):
                raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               param="tools")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                       param="max_completion_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    from ..tokenizer import validate_messages

    try:
        messages = validate_messages(body.messages)
    except RequestError as e:
        raise APIError(400, str(e), param="messages") from None
    thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else True
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    shown = body.model_dump(exclude_none=True, exclude={"messages", "model"})
    return Request("chat", body.model, messages, None, None, {**sampling, "max_tokens": max_tokens},
                   max_tokens is not None, thinking, tools, tools is not None, bool(body.stream),
                   bool(body.stream_options and body.stream_options.include_usage), body.anatomy,
                   n=body.n or 1, parallel_tool_calls=body.parallel_tool_calls is not False, user=body.user,
                   shown={"messages": messages, **shown})


def completion_request(body: CompletionRequest) -> Request:
    sampling = _common(body)
    if body.best_of not in (None, body.n or 1):
        _refuse("best_of", "must equal n: choices are not ranked")
    if body.logprobs is not None:
        if not 0 <= body.logprobs <= 5:
            raise APIError(400, f"logprobs must be in 0..5 for completions, got {body.logprobs}", param="logprobs")
        if body.echo:
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
    shown = body.model_dump(exclude_none=True, exclude={"model"})
    return Request("completion", body.model, None, prompt, ids,
                   {**sampling, "max_tokens": body.max_tokens if body.max_tokens is not None else 16},
                   True, True, None, False, bool(body.stream),
                   bool(body.stream_options and body.stream_options.include_usage), body.anatomy,
                   echo=body.echo, n=body.n or 1, user=body.user, shown=shown)


# ---- tool calls (Qwen3 writes them as Hermes-style <tool_call>{json}</tool_call> blocks) ----------------------------
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def split_tool_calls(text: str, request_id: str, most: int | None = None) -> tuple[str | None, list[dict]]:
    """(content without the tool-call blocks, the calls as OpenAI tool_calls, at most `most` of them). A block
    whose JSON does not parse, or lacks a name, stays in the content: the client sees what the model wrote."""
    calls, kept, last = [], [], 0
    for m in TOOL_CALL.finditer(text):
        if most is not None and len(calls) >= most:
            break
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"call_{request_id}_{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


# ---- logprobs ----------------------------------------------------------------------------------------------------
def _entry(tokenizer, token: int, logprob: float) -> dict:
    return {"token": tokenizer.token_text(token), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}


def chat_logprobs(tokenizer, tokens: list[int], entries: list) -> dict:
    """The chat API's logprobs object for these output tokens and their (logprob, top) entries."""
    return {"content": [{**_entry(tokenizer, t, lp), "top_logprobs": [_entry(tokenizer, i, v) for i, v in top]}
                        for t, (lp, top) in zip(tokens, entries)], "refusal": None}


def completion_logprobs(tokenizer, tokens: list[int], entries: list, offset: int = 0) -> dict:
    """The legacy completions API's logprobs object; `offset` is where these tokens' text starts."""
    texts = [tokenizer.token_text(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{tokenizer.token_text(i): v for i, v in top} for _, top in entries],
            "text_offset": offsets}


def logprobs_body(req: "Request", tokenizer, tokens: list[int], entries: list, offset: int = 0) -> dict:
    if req.chat:
        return chat_logprobs(tokenizer, tokens, entries)
    return completion_logprobs(tokenizer, tokens, entries, offset)


# ---- responses ----------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_id(req: Request, request_id: str) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{request_id}"


def completion_body(req: Request, request_id: str, created: int, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int, logprobs: dict | None = None) -> dict:
    if req.chat:
        content, calls = split_tool_calls(text, request_id, None if req.parallel_tool_calls else 1) \
            if req.parse_tool_calls else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            finish_reason = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": response_id(req, request_id), "object": "chat.completion" if req.chat else "text_completion",
            "created": created, "model": req.model, "choices": [choice], "system_fingerprint": req.fingerprint,
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: Request, request_id: str, created: int, *, text: str | None = None, role: bool = False,
          tool_calls: list[dict] | None = None, finish_reason: str | None = None, usage_: dict | None = None,
          no_choices: bool = False, logprobs: dict | None = None, index: int = 0) -> dict:
    """One SSE chunk as OpenAI sends it."""
    body = {"id": response_id(req, request_id), "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created, "model": req.model, "system_fingerprint": req.fingerprint}
    if no_choices:
        body["choices"] = []
    elif req.chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        body["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    if usage_ is not None or (req.include_usage and not no_choices):
        body["usage"] = usage_  # null on every chunk but the last when include_usage is on
    return body


def now_s() -> int:
    return int(time.time())
