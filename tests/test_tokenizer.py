"""Tokenizer: llama.cpp's Qwen2 vocabulary test vectors, added tokens, both backends, streaming detokenization."""

from __future__ import annotations

import base64
import json
import random
import unicodedata
from importlib import resources
from pathlib import Path

import pytest

from llm_anatomy import hub
from llm_anatomy.errors import ConfigError, ModelNotFoundError
from llm_anatomy.tokenizer import IncrementalDetokenizer, Tokenizer

DATA = Path(__file__).parent / "data"
SEPARATOR = "\n__ggml_vocab_test__\n"


def read_vectors() -> list[tuple[str, list[int]]]:
    # llama.cpp writes every input followed by the separator and every output followed by "\n", so both files
    # end with one: splitting leaves one empty piece at the end that is not a case (case 3 is a real empty input).
    inputs = (DATA / "qwen2-vocab-test.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    outputs = (DATA / "qwen2-vocab-test.out").read_bytes().decode("utf-8").split("\n")
    assert inputs[-1] == "" and outputs[-1] == ""
    inputs, outputs = inputs[:-1], outputs[:-1]
    assert len(inputs) == len(outputs) == 46
    return [(text, [int(i) for i in line.split()]) for text, line in zip(inputs, outputs)]


VECTORS = read_vectors()
TEXTS = [text for text, _ in VECTORS]
STREAM_TEXT = "Hi 🦙 世界! e\u0301 👩‍👩‍👧 😶‍🌫️ Ελληνικά ကြောင်း <|im_end|> done"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.embedded()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A real Qwen3 tokenizer.json built from the same ranks with transformers' tiktoken converter."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    files = resources.files("llm_anatomy").joinpath("data")
    spec = json.loads(files.joinpath("special_tokens.json").read_text())
    lines = files.joinpath("qwen.tiktoken").read_text().splitlines()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines)}

    class FromRanks(TikTokenConverter):
        def load_tiktoken_bpe(self, _):
            return ranks

    pattern = next(p["Regex"] for p in spec["tokenizer_json_pipeline"]["pre_tokenizer"] if p["type"] == "Split")
    # Split(regex, isolated) + ByteLevel(add_prefix_space=False, use_regex=False) pre-tokenizer, ByteLevel decoder
    hf = FromRanks(pattern=pattern).converted()
    hf.normalizer = normalizers.NFC()
    hf.model.ignore_merges = False  # as in Qwen's own tokenizer.json: ids come from the merges alone
    hf.add_tokens([AddedToken(t["content"], special=t["special"], normalized=False) for t in spec["added_tokens"]])
    assert hf.token_to_id("</think>") == 151668
    directory = tmp_path_factory.mktemp("qwen3-tokenizer")
    hf.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    template = files.joinpath("chat_template.jinja").read_text()
    config = {"chat_template": template, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def hf_tok(hf_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(hf_dir)


@pytest.fixture(params=["embedded", "tokenizers"])
def any_tok(request) -> Tokenizer:
    return request.getfixturevalue("tok" if request.param == "embedded" else "hf_tok")


# --- the embedded tokenizer --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", VECTORS, ids=[f"case{i + 1}" for i in range(len(VECTORS))])
def test_vectors(tok, text, expected):
    assert tok.encode(text) == expected


def test_roundtrip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_added_tokens(tok):
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert tok.encode("a<think>b</think>") == [64, 151667, 65, 151668]
    assert tok.token_to_id("</think>") == 151668
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert tok.token_to_id("<|im_end|>") == 151645
    assert tok.token_to_id("<|extra_0|>") is None  # Qwen-1 names are not used
    assert tok.vocab_size == 151669
    assert tok.special_token_ids == frozenset(range(151643, 151657))
    assert tok.added_tokens[151657] == "<tool_call>"


def test_token_to_id_uses_byte_level_strings(tok):
    assert tok.token_to_id("Hello") == 9707 and tok.token_to_id("ĠHello") == 21927  # from the test vectors
    assert tok.token_to_id(" Hello") is None  # a space is spelled Ġ in the vocabulary
    assert tok.token_to_id("no-such-token-xyz") is None


def test_skip_special_tokens(tok):
    ids = [151644, *tok.encode("user\nhi"), 151645, 151667, *tok.encode("hmm"), 151668, 151643]
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|><think>hmm</think><|endoftext|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>hmm</think>"  # <think> is not "special"


def test_decode_drops_unknown_ids(tok):
    assert tok.decode([9707, 151669, 151935, -1]) == "Hello"


def test_token_bytes(tok):
    assert tok.token_bytes(151668) == b"</think>"
    assert tok.token_bytes(198) == b"\n" and tok.token_bytes(21927) == b" Hello"
    assert {tok.token_bytes(i) for i in range(256)} == {bytes([b]) for b in range(256)}
    for text in TEXTS:
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == unicodedata.normalize("NFC", text).encode()
    with pytest.raises(ValueError, match="151669"):
        tok.token_bytes(151669)


def test_embedded_is_cached(tok):
    assert Tokenizer.embedded() is tok and Tokenizer.from_pretrained() is tok
    assert tok.name == "embedded Qwen3 BPE (tiktoken)"


def test_encode_is_fast(tok):
    import time

    text = " ".join(TEXTS) * 200  # ~300 KB
    start = time.perf_counter()
    tok.encode(text)
    assert time.perf_counter() - start < 2.0


# --- the tokenizers backend agrees with the embedded one ---------------------------------------------------------
def test_hf_backend_same_ids(tok, hf_tok, hf_dir):
    assert hf_tok.name == str(hf_dir / "tokenizer.json")
    assert hf_tok.vocab_size == tok.vocab_size
    assert hf_tok.special_token_ids == tok.special_token_ids and hf_tok.added_tokens == tok.added_tokens
    for text, expected in VECTORS:
        assert hf_tok.encode(text) == expected
        assert hf_tok.decode(expected) == tok.decode(expected)
    for text in ["<|im_start|>user\nhi<|im_end|>", "a<think>b</think>", STREAM_TEXT]:
        assert hf_tok.encode(text) == tok.encode(text)


def test_hf_backend_same_lookups(tok, hf_tok):
    ids = [*range(300), *range(0, 151669, 997), *range(151640, 151669)]
    assert [hf_tok.token_bytes(i) for i in ids] == [tok.token_bytes(i) for i in ids]
    for token in ["Hello", "ĠHello", "</think>", "<|endoftext|>", " Hello", "nope-nope-nope"]:
        assert hf_tok.token_to_id(token) == tok.token_to_id(token)
    mixed = [151644, 9707, 151645, 151667, 151668, 151669]
    for skip in (False, True):
        assert hf_tok.decode(mixed, skip_special_tokens=skip) == tok.decode(mixed, skip_special_tokens=skip)


def test_hf_backend_same_template(tok, hf_tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert hf_tok.eos_token == tok.eos_token == "<|im_end|>"
    assert hf_tok.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert hf_tok.apply_chat_template(messages, tokenize=True) == tok.apply_chat_template(messages, tokenize=True)


def test_hf_dir_without_template_uses_qwen3(tmp_path, hf_dir, tok):
    (tmp_path / "tokenizer.json").symlink_to(hf_dir / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.chat_template == tok.chat_template and bare.eos_token is None


# --- from_pretrained -----------------------------------------------------------------------------------------------
def test_unknown_name():
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_pretrained("no-such-org/no-such-model-xyz")


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ConfigError, match=r"tokenizer\.json is not a tokenizer\.json") as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_not_byte_level_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    hf = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    hf.decoder = decoders.WordPiece()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="not a byte-level BPE tokenizer"):
        Tokenizer.from_pretrained(tmp_path)


def test_dir_without_tokenizer_json(tmp_path, tok):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert Tokenizer.from_pretrained(tmp_path) is tok
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="no tokenizer.json.*'llama'"):
        Tokenizer.from_pretrained(tmp_path)


def test_preset_without_local_files(monkeypatch, tok):
    monkeypatch.setattr(hub, "cached_snapshot", lambda _: None)  # as if the HF cache were empty
    assert Tokenizer.from_pretrained("Qwen/Qwen3-8B") is tok


# --- streaming detokenization ------------------------------------------------------------------------------------
def stream(tok, ids, skip=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.add(i) for i in ids]
    final = detok.flush()
    assert detok.text == "".join(pieces) + final
    return pieces, final


def test_stream_never_breaks_characters(any_tok):
    ids = any_tok.encode(STREAM_TEXT)
    assert any(not _is_utf8(any_tok.token_bytes(i)) for i in ids)  # the text really does split characters
    for skip in (True, False):
        pieces, final = stream(any_tok, ids, skip)
        assert not any("\ufffd" in p for p in pieces) and final == ""
        assert "".join(pieces) == any_tok.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(any_tok, ids)[0]) == unicodedata.normalize("NFC", STREAM_TEXT).replace("<|im_end|>", "")


def test_stream_invalid_bytes(any_tok):
    byte_id = {any_tok.token_bytes(i): i for i in range(256)}
    a, lead, bad = byte_id[b"a"], byte_id[b"\xe4"], byte_id[b"\xff"]
    assert stream(any_tok, [lead]) == ([""], "\ufffd")  # might still complete: only flush can tell
    assert stream(any_tok, [lead, a]) == (["", "\ufffda"], "")  # 'a' cannot continue it
    assert stream(any_tok, [bad, a]) == (["\ufffd", "a"], "")  # 0xFF is never valid: replaced at once
    llama = [byte_id[bytes([b])] for b in "🦙".encode()]
    assert stream(any_tok, llama[:2]) == (["", ""], "\ufffd")  # a truncated emoji at the end of generation
    for ids in ([lead], [lead, a], [bad, a], llama[:2]):
        assert "".join(stream(any_tok, ids)[0]) + stream(any_tok, ids)[1] == any_tok.decode(ids)


def test_stream_matches_decode_on_random_ids(any_tok):
    rng = random.Random(0)
    pool = [*range(256), *range(151643, 151669), 151700]  # raw bytes mostly: the hardest case for UTF-8
    for _ in range(200):
        ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(151643) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            pieces, final = stream(any_tok, ids, skip)
            assert "".join(pieces) + final == any_tok.decode(ids, skip_special_tokens=skip)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_tokenizer_that_rendered_its_template_still_pickles():
    """The server's engine core sends its tokenizer to the HTTP process: once the chat template was compiled (a
    jinja2 environment with local functions) it must still pickle, and render alike on the other side."""
    import pickle

    from llm_anatomy.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(None)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert pickle.loads(pickle.dumps(tok)).apply_chat_template(messages) == text
