"""The Qwen3 chat template as we render it: hand-derived expected prompts, HF parity, message validation."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from llm_anatomy.errors import ConfigError, RequestError
from llm_anatomy.tokenizer import Tokenizer, validate_messages

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo <city> & 'temp'",  # non-ASCII and HTML characters must come out verbatim
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def call(city, arguments_as_string=False):
    args = {"city": city}
    return {"id": f"call_{city}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(args) if arguments_as_string else args}}


# Each expected string was written by walking the template in llm_anatomy/data/chat_template.jinja by hand.
CASES = {
    "system_user": (
        dict(messages=[{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello!"}]),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    # last_query_index = 2: the first assistant turn loses its <think> block, the last one keeps it
    "multi_turn_thinking": (
        dict(messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"},
        ], add_generation_prompt=False),
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nagain\n</think>\n\n6<|im_end|>\n",
    ),
    "no_thinking": (
        dict(messages=[{"role": "user", "content": "Hi"}], enable_thinking=False),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    "tools": (
        dict(messages=[{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Weather in Paris?"}],
             tools=[WEATHER_TOOL]),
        "<|im_start|>system\nYou are a bot.\n\n"
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Météo <city> & \'temp\'", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    # content None -> '', no newline before the first call; consecutive tool messages share one user turn
    "tool_call_and_response": (
        dict(messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call("Paris")]},
            {"role": "tool", "tool_call_id": "call_Paris", "content": '{"temp": 21}'},
        ]),
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n",
    ),
    "two_tool_calls_with_text": (
        dict(messages=[
            {"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": "Let me check.",
             "tool_calls": [call("Paris", arguments_as_string=True), call("Lyon")]},
            {"role": "tool", "content": "21 C"},
            {"role": "tool", "content": "18 C"},
        ]),
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
    ),
    # turns after the last real user query keep their reasoning, given as reasoning_content or inline
    "reasoning_after_tool": (
        dict(messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [call("Paris")]},
            {"role": "tool", "content": "21 C"},
            {"role": "assistant", "content": "<think>\nIt is mild.\n</think>\n\nIt is 21 C."},
        ], add_generation_prompt=False),
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nIt is mild.\n</think>\n\nIt is 21 C.<|im_end|>\n",
    ),
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.embedded()


@pytest.mark.parametrize("case", CASES)
def test_expected_prompt(tok, case):
    kwargs, expected = CASES[case]
    assert tok.apply_chat_template(**kwargs) == expected


@pytest.mark.parametrize("case", CASES)
def test_same_as_transformers(tok, case):
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(CASES[case][0])
    messages = kwargs.pop("messages")
    kwargs.setdefault("add_generation_prompt", True)
    kwargs.setdefault("enable_thinking", True)
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=tok.chat_template,
                                        eos_token=tok.eos_token, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == rendered[0]


def test_tokenize_and_text_parts(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert text == "<|im_start|>user\nHello\nworld<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=True) == tok.encode(text)


def test_messages_are_not_modified(tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


# --- validate_messages -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("messages, needle", [
    ("hi", "non-empty list"),
    ({"role": "user", "content": "hi"}, "non-empty list"),
    ([], "non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"content": "hi"}], "it has none"),
    ([{"role": "robot", "content": "hi"}], "'robot'"),
    ([{"role": 1, "content": "hi"}], "must be one of"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 42}], "messages[1].content must be a string"),
    ([{"role": "user", "content": None}], "content is missing"),
    ([{"role": "user"}], "content is missing"),
    ([{"role": "assistant", "content": None}], "content is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url': only text"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "only text parts"),
    ([{"role": "user", "content": ["hi"]}], "only text parts"),
])
def test_validate_messages_errors(messages, needle):
    with pytest.raises(RequestError) as info:
        validate_messages(messages)
    assert needle in str(info.value)
    assert info.value.param == "messages"


def test_validate_messages_keeps_other_keys():
    calls = [call("Paris")]
    out = validate_messages([
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "r"},
        {"role": "tool", "content": "x", "tool_call_id": "call_Paris"},
    ])
    assert out[1] == {"role": "user", "content": "a", "name": "bob"}
    assert out[2] == {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "r"}
    assert out[3]["tool_call_id"] == "call_Paris"


def test_bad_tools(tok):
    with pytest.raises(RequestError) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tools={"name": "f"})
    assert info.value.param == "tools"


# --- templates that come with a model directory -------------------------------------------------------------------
def model_dir(tmp_path, template_config=None, jinja_file=None):
    """A directory with config.json and a tiny byte-level tokenizer.json (256 byte tokens + <|im_end|>)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    hf = HFTokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|im_end|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<s>"}
    if template_config is not None:
        config["chat_template"] = template_config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return Tokenizer.from_pretrained(tmp_path)


USER = [{"role": "user", "content": "hi"}]


def test_template_from_config_string(tmp_path):
    tok = model_dir(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}")
    assert tok.apply_chat_template(USER) == "<s>hi<|im_end|>"


def test_template_from_named_list(tmp_path):
    tok = model_dir(tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ x }}"}])
    assert tok.apply_chat_template(USER, x=7) == "D7"  # extra kwargs reach the template


def test_jinja_file_wins_over_config(tmp_path):
    tok = model_dir(tmp_path, "from config", jinja_file="from file")
    assert tok.apply_chat_template(USER) == "from file"


def test_no_template_falls_back_to_qwen3(tmp_path):
    tok = model_dir(tmp_path)
    assert tok.chat_template == Tokenizer.embedded().chat_template
    assert tok.apply_chat_template(USER) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_helpers(tmp_path):
    tok = model_dir(tmp_path, "{{ {'a': 'é<'} | tojson }}|{{ [1, 2] | tojson(indent=1) }}|{{ strftime_now('%Y') }}"
                              "|{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    assert tok.apply_chat_template(USER) == f'{{"a": "é<"}}|[\n 1,\n 2\n]|{datetime.now().year}|01'


def test_raise_exception_becomes_request_error(tmp_path):
    tok = model_dir(tmp_path, "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}")
    with pytest.raises(RequestError, match="^System first!$"):
        tok.apply_chat_template(USER)


def test_template_runtime_error(tmp_path):
    tok = model_dir(tmp_path, "{{ messages[0].content + 1 }}")
    with pytest.raises(RequestError, match="chat template .* failed on these messages: TypeError"):
        tok.apply_chat_template(USER)


def test_sandbox(tmp_path):
    tok = model_dir(tmp_path, "{{ messages.append(1) }}")
    with pytest.raises(RequestError, match="SecurityError"):
        tok.apply_chat_template(USER)


def test_template_syntax_error(tmp_path):
    tok = model_dir(tmp_path, "{% if %}")
    with pytest.raises(ConfigError, match="does not compile"):
        tok.apply_chat_template(USER)
