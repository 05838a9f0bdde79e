"""The front half of every call: a request's prompt (chat messages, raw text or token ids) -> token ids.

`llm-anatomy call`, the server and `Engine.generate` all go through `render_prompt`, so a prompt is templated,
tokenized and refused the same way whichever door it came in by, and each caller gets the instants it needs
to time the template and tokenize phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import RequestError
from .tokenizer import Tokenizer, validate_messages


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str | None  # the prompt after the chat template (None when token ids were given)
    template_ns: int  # perf_counter_ns when templating began (equal to tokenize_ns when there was no template)
    tokenize_ns: int  # when tokenizing began
    done_ns: int  # when the token ids were ready


def render_prompt(tokenizer: Tokenizer, *, messages=None, prompt: str | None = None,
                  prompt_token_ids=None, enable_thinking: bool = True, tools=None) -> RenderedPrompt:
    """Exactly one of chat `messages`, a raw `prompt` or `prompt_token_ids` -> token ids. Messages go through the
    model's chat template with a generation prompt; token ids are only checked to be a list of ints (the engine
    checks them against its vocabulary)."""
    given = [name for name, value in (("messages", messages), ("prompt", prompt),
                                      ("prompt_token_ids", prompt_token_ids)) if value is not None]
    if len(given) != 1:
        raise RequestError("give exactly one of messages, prompt or prompt_token_ids"
                           + (f" (got {', '.join(given)})" if given else ""), param="prompt")
    t_template = time.perf_counter_ns()
    if messages is not None:
        prompt = tokenizer.apply_chat_template(validate_messages(messages), add_generation_prompt=True,
                                               enable_thinking=enable_thinking, tools=tools)
    t_tokenize = time.perf_counter_ns()
    if prompt is not None:
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        ids = tokenizer.encode(prompt)
    else:
        if not isinstance(prompt_token_ids, (list, tuple)) or not (
                set(map(type, prompt_token_ids)) == {int}  # what JSON gives, checked in C; else each one
                or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids)):
            raise RequestError("prompt_token_ids must be a list of integers", param="prompt")
        ids = list(prompt_token_ids)
    return RenderedPrompt(ids, prompt, t_template, t_tokenize, time.perf_counter_ns())
