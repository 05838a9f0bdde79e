"""Text <-> token ids for Qwen3, and the chat template that turns messages into prompt text.

Two backends give the same ids. The embedded one (tiktoken over the Qwen BPE ranks shipped in data/) needs no
download; a model directory's own tokenizer.json (the `tokenizers` library) is used when there is one, so a
checkpoint with a changed vocabulary or template is tokenized the way its authors meant.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import unicodedata
from collections.abc import Iterable
from datetime import datetime
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox

from . import hub
from .errors import ConfigError, RequestError

EMBEDDED_MODEL_TYPES = ("qwen3", "qwen2")  # model types whose vocabulary the embedded tokenizer is
ROLES = ("system", "user", "assistant", "tool")


def _data(name: str) -> bytes:
    return resources.files("llm_anatomy").joinpath(f"data/{name}").read_bytes()


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2 ByteLevel alphabet, char -> byte: printable latin-1 bytes stand for themselves, the other 68 bytes
    are shifted to U+0100.. in byte order, so every token string is printable."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


class Tokenizer:
    """Common behaviour; `_Tiktoken` and `_HFTokenizers` below supply encode/decode/lookup."""

    name: str
    vocab_size: int  # ids 0..vocab_size-1 are known (151669 for Qwen3); the model's embedding may have more rows
    added_tokens: dict[int, str]  # id -> content of each added (control) token
    special_token_ids: frozenset[int]  # added tokens flagged "special": what skip_special_tokens drops

    def __init__(self, name: str, added: dict[int, tuple[str, bool]], chat_template: str, eos: str | None,
                 bos: str | None = None):
        self.name = name
        self.added_tokens = {i: content for i, (content, _) in added.items()}
        self.special_token_ids = frozenset(i for i, (_, special) in added.items() if special)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos, eos

    @classmethod
    def embedded(cls) -> Tokenizer:
        return _embedded()

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None) -> Tokenizer:
        """None -> embedded; a directory (or cached hub snapshot) with tokenizer.json -> that file; otherwise the
        embedded Qwen3 tokenizer, but only for Qwen configs, since ids from another vocabulary would be garbage."""
        if name_or_path is None:
            return cls.embedded()
        source = hub.resolve(name_or_path)
        if source.directory is not None and (source.directory / "tokenizer.json").is_file():
            return _HFTokenizers(source.directory)
        model_type = source.config.get("model_type")
        if model_type not in EMBEDDED_MODEL_TYPES:
            where = f"{source.directory} has" if source.directory else f"{source.name} has no local files and"
            raise ConfigError(f"{where} no tokenizer.json, and the embedded Qwen3 tokenizer only fits model_type "
                              f"{' or '.join(EMBEDDED_MODEL_TYPES)}, not {model_type!r}")
        return cls.embedded()

    # --- backend hooks -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of `text`; added tokens in it become their single ids (like HF's add_special_tokens=False). No BOS."""
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (may be part of a UTF-8 character)."""
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """One token's text as it shows alone: a partial UTF-8 character becomes U+FFFD; "" for an id with no
        bytes."""
        try:
            return self.token_bytes(token_id).decode("utf-8", errors="replace")
        except ValueError:
            return ""

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given as its vocabulary string (ByteLevel form, e.g. 'Ġthe') or an added token's content."""
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # Unknown ids (e.g. the embedding's padding rows past vocab_size) are dropped, as HF's decode does.
        kept = [i for i in map(int, ids) if 0 <= i < self.vocab_size
                and not (skip_special_tokens and i in self.special_token_ids)]
        return self._decode(kept)

    def __getstate__(self) -> dict:
        # The server's engine core sends its tokenizer to the HTTP process: a compiled template holds its
        # environment's functions, which do not pickle; it is compiled again on first use there.
        state = self.__dict__.copy()
        state.pop("_template", None)
        return state

    @cached_property
    def _template(self) -> jinja2.Template:
        try:
            return _jinja_env().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:  # the model's files are broken, not the request
            raise ConfigError(f"the chat template of {self.name} does not compile: {e} (line {e.lineno})") from e

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, enable_thinking: bool = True,
                            tools: list[dict] | None = None, tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render messages to prompt text the way HF's apply_chat_template does (ids if tokenize=True)."""
        messages = validate_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError("tools must be a list of JSON objects", param="tools")
        known = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v is not None}
        try:
            text = self._template.render(**{**known, **kwargs}, messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
        except _TemplateRaised as e:  # the template's own raise_exception(...) message is meant for the user
            raise RequestError(str(e), param="messages") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"the chat template of {self.name} failed on these messages: "
                               f"{type(e).__name__}: {e}", param="messages") from e
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"<Tokenizer {self.name}, {self.vocab_size} ids>"


class _Tiktoken(Tokenizer):
    def __init__(self) -> None:
        spec = json.loads(_data("special_tokens.json"))
        self._ranks = {base64.b64decode(tok): int(rank)
                       for tok, rank in (line.split() for line in _data("qwen.tiktoken").splitlines() if line)}
        self._added_ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
        pipeline = spec["tokenizer_json_pipeline"]
        assert pipeline["normalizer"]["type"] == "NFC", "encode() hard-codes the NFC normalizer"
        pattern = next(p["Regex"] for p in pipeline["pre_tokenizer"] if p["type"] == "Split")
        import tiktoken  # deferred: only this backend needs it

        self._enc = tiktoken.Encoding("qwen3", pat_str=pattern, mergeable_ranks=self._ranks,
                                      special_tokens=self._added_ids)
        self.vocab_size = self._enc.n_vocab
        added = {t["id"]: (t["content"], t["special"]) for t in spec["added_tokens"]}
        eos = spec["tokenizer_config_fields_original_Qwen3"]["eos_token"]
        super().__init__("embedded Qwen3 BPE (tiktoken)", added, _data("chat_template.jinja").decode(), eos)

    def encode(self, text: str) -> list[int]:
        # NFC over the whole text equals HF's NFC between added tokens: they are ASCII, nothing composes across them.
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def _decode(self, ids: list[int]) -> str:
        return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError):
            raise ValueError(f"token id {token_id} is not in {self.name} (0..{self.vocab_size - 1})") from None

    def token_to_id(self, token: str) -> int | None:
        if token in self._added_ids:
            return self._added_ids[token]
        table = _byte_decoder()
        if not all(c in table for c in token):
            return None
        return self._ranks.get(bytes(table[c] for c in token))


@cache
def _embedded() -> Tokenizer:
    return _Tiktoken()  # immutable, ~0.2 s to build: share one


class _HFTokenizers(Tokenizer):
    def __init__(self, directory: Path) -> None:
        import tokenizers

        path = directory / "tokenizer.json"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception with serde's message
            raise ConfigError(f"{path} is not a tokenizer.json the `tokenizers` library can read: {e}") from e
        if not isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel):
            # token_bytes() and the incremental detokenizer rely on the GPT-2 byte alphabet
            decoder = type(self._tok.decoder).__name__
            raise ConfigError(f"{path} is not a byte-level BPE tokenizer (its decoder is {decoder})")
        config_path = directory / "tokenizer_config.json"
        config = hub.read_json(config_path) if config_path.is_file() else {}
        template = _dir_chat_template(directory, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = {i: (t.content, t.special) for i, t in self._tok.get_added_tokens_decoder().items()}
        super().__init__(str(path), added, template if template is not None else _embedded().chat_template,
                         _token_text(config.get("eos_token")), _token_text(config.get("bos_token")))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self.added_tokens:
            return self.added_tokens[token_id].encode()
        token = self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if token is None:
            raise ValueError(f"token id {token_id} is not in {self.name}")
        table = _byte_decoder()
        return bytes(table[c] for c in token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _dir_chat_template(directory: Path, config: dict) -> str | None:
    # Newer transformers save the template as chat_template.jinja, which wins over tokenizer_config.json (as in HF).
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                          f"{{name, template}} objects")
    return template


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


# --- chat template -------------------------------------------------------------------------------------------------
class _TemplateRaised(jinja2.TemplateError):
    """raise_exception(...) called by the template itself."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
            sort_keys: bool = False) -> str:
    # HF's version: jinja's own tojson HTML-escapes <>&' which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Templates come with model files, i.e. are untrusted code: sandboxed, and configured as HF does.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def validate_messages(messages: Any) -> list[dict]:
    """Check OpenAI-style chat messages and return copies whose content is a str (or None for tool-call turns)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content, not {type(message).__name__}",
                               param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            got = "it has none" if "role" not in message else f"got {role!r}"
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}; {got}", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, where)
        elif content is None:
            if not (role == "assistant" and message.get("tool_calls")):
                raise RequestError(f"{where}.content is missing; only an assistant message with tool_calls may "
                                   f"have no content", param="messages")
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts, not "
                               f"{type(content).__name__}", param="messages")
        checked.append({**message, "content": content})
    return checked


def _join_text_parts(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}.content[{j}] is {kind!r}: only text parts ({{\"type\": \"text\", "
                               f"\"text\": ...}}) are supported, this is a text-only model", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)  # one part per line, as vLLM joins text parts


# --- streaming -----------------------------------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive. A token can end mid UTF-8 character (emoji, CJK are often
    split over several byte tokens), so incomplete trailing bytes are held until the character completes."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still incomplete)."""
        tok, token_id = self.tokenizer, int(token_id)
        if not 0 <= token_id < tok.vocab_size or (self.skip_special_tokens and token_id in tok.special_token_ids):
            return ""  # same ids decode() drops
        piece = self._utf8.decode(tok.token_bytes(token_id))
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end: bytes still held can no longer complete a character, so they become U+FFFD."""
        piece = self._utf8.decode(b"", final=True)
        self.text += piece
        return piece
