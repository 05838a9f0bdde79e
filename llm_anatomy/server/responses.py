"""What this server answers: completion bodies, SSE chunks, logprobs and tool calls, as the OpenAI API shapes them."""

from __future__ import annotations

import json
import re
import time
from json.encoder import encode_basestring  # json.dumps(str, ensure_ascii=False) without building an encoder

from .protocol import Request

TOOL_CALL_START = "<tool_call>"

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


def logprobs_body(req: Request, tokenizer, tokens: list[int], entries: list, offset: int = 0) -> dict:
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


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> str:
    """usage() as json.dumps writes it, without building the dict (it rides on every chunk of some streams)."""
    return (f'{{"prompt_tokens": {prompt_tokens}, "completion_tokens": {completion_tokens}, '
            f'"total_tokens": {prompt_tokens + completion_tokens}}}')


class TextChunks:
    """SSE lines of a stream's plain text chunks. The chunk's JSON is cut once around markers, so that each chunk
    encodes only its text (and, with continuous usage, its token count): at hundreds of streams, building and
    dumping a dict per chunk costs the event loop real time."""

    TEXT, USAGE = "\x00text\x00", "\x00usage\x00"

    def __init__(self, req: Request, request_id: str, created: int, index: int, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.continuous = req.continuous_usage
        line = sse(chunk(req, request_id, created, text=self.TEXT, index=index,
                         usage_=self.USAGE if self.continuous else None))
        self.head, rest = line.split(json.dumps(self.TEXT))
        self.middle, self.tail = rest.split(json.dumps(self.USAGE)) if self.continuous else (rest, "")

    def line(self, text: str, completion_tokens: int) -> str:
        encoded = encode_basestring(text)
        if not self.continuous:
            return self.head + encoded + self.middle
        return self.head + encoded + self.middle + usage_so_far(self.prompt_tokens, completion_tokens) + self.tail


def before_tool_call(text: str) -> int:
    """Where streamed content must stop: at a tool-call block, or at a partial '<tool_call>' at the end."""
    i = text.find(TOOL_CALL_START)
    if i >= 0:
        return i
    for k in range(len(TOOL_CALL_START) - 1, 0, -1):
        if text.endswith(TOOL_CALL_START[:k]):
            return len(text) - k
    return len(text)
