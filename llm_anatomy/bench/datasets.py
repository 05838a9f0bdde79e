"""The prompts a benchmark sends: random token ids, random text, or a JSONL file (ShareGPT or plain prompts).

Random prompts differ from each other from their first token, so a server's prefix cache finds nothing to
share between them (as vLLM's random dataset intends). A dataset file is read and checked whole before any
request is sent; every error names the line to fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import AnatomyError

# Common English words that are each exactly one token, with or without a leading space, in Qwen3's tokenizer
# (tests/test_bench_datasets.py checks it against the shipped one); most are single tokens in GPT-2's, Llama's
# and Mistral's vocabularies too. Text prompts are built from them, so that N words are about N tokens.
WORDS = tuple("""
time people year way day man thing woman life child world school state family student group country problem
hand part place case week company system program question work government number night point home water room
mother area money story fact month lot right study book eye job word business issue side kind head house service
friend father power hour game line end member law car city community name team minute idea kid body information
back parent face others level office door health person art war history party result change reason research girl
moment air teacher force education foot boy age policy process music market sense nation plan college interest
death experience effect use class control care field development role rate heart drug show leader light voice wife
mind price report decision son view relationship town road arm difference value building action model season tax
director position player record paper space ground form event official matter center site project activity star
table need court oil cost industry figure street image phase stage river sound window summer winter spring forest
bridge station train plane ship letter picture song dance dream color paint stone metal glass wood fire earth wind
rain snow cloud sun moon sky farm horse bird fish tree flower grass bread coffee tea salt apple orange green blue
red black white yellow brown small large long short high low early late young old new good great little open
clear simple strong quiet bright warm cold fast slow soft hard happy ready
""".split())


class DatasetError(AnatomyError):
    """A dataset file that cannot be used as it is."""


@dataclass(frozen=True)
class Prompt:
    """One request's input: token ids (sent to /v1/completions as a list of ints) or text; and its output length."""

    output_tokens: int
    token_ids: tuple[int, ...] | None = None
    text: str | None = None

    @property
    def input_tokens(self) -> int | None:
        """Known exactly for token ids; for text only the server's usage tells."""
        return len(self.token_ids) if self.token_ids is not None else None


def random_token_prompts(n: int, input_tokens: int, output_tokens: int, id_range: tuple[int, int],
                         seed: int | str) -> list[Prompt]:
    """n prompts of input_tokens ids drawn uniformly from [lo, hi)."""
    rng = random.Random(seed)
    lo, hi = id_range
    return [Prompt(output_tokens, token_ids=tuple(rng.randrange(lo, hi) for _ in range(input_tokens)))
            for _ in range(n)]


def random_text_prompts(n: int, input_tokens: int, output_tokens: int, seed: int | str) -> list[Prompt]:
    """n texts of input_tokens words from WORDS (about input_tokens tokens; the chat template adds its own)."""
    rng = random.Random(seed)
    return [Prompt(output_tokens, text=" ".join(rng.choices(WORDS, k=input_tokens))) for _ in range(n)]


@dataclass(frozen=True)
class DatasetEntry:
    line: int
    prompt: str
    output_tokens: int | None  # from the entry's own `output_tokens`, else None
    reply: str | None  # a ShareGPT conversation's first answer: its length is the output length


def _entry(obj, line: int, where: str) -> DatasetEntry | None:
    """One record; None for a ShareGPT conversation with no human turn followed by an answer (vLLM skips those)."""
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                  for t in turns):
            raise DatasetError(f"{where}: `conversations` must be a list of {{\"from\", \"value\"}} objects")
        for i, turn in enumerate(turns[:-1]):
            if turn.get("from") in ("human", "user") and turns[i + 1].get("from") in ("gpt", "assistant", "chatgpt"):
                if turn["value"].strip():
                    return DatasetEntry(line, turn["value"], None, turns[i + 1]["value"])
        return None
    if "prompt" in obj:
        prompt, out = obj["prompt"], obj.get("output_tokens")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(f"{where}: `prompt` must be a non-empty string")
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
            raise DatasetError(f"{where}: `output_tokens` must be an integer >= 1, got {out!r}")
        return DatasetEntry(line, prompt, out, None)
    raise DatasetError(f"{where}: no `prompt` or `conversations` field (keys: {', '.join(sorted(obj)) or 'none'})")


def load_dataset(path: Path) -> list[DatasetEntry]:
    """A JSONL file (one object a line), or a JSON array of objects (as ShareGPT exports are published). Each
    object is {"prompt": str, "output_tokens": int (optional)} or ShareGPT's {"conversations": [{"from",
    "value"}, ...]}, whose first human turn is the prompt and the answer to it gives the output length."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"cannot read --dataset {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"--dataset {path} is not UTF-8 text: {e}") from None
    if text.lstrip().startswith("["):
        try:
            records = [(i + 1, obj) for i, obj in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise DatasetError(f"--dataset {path} is not a valid JSON array: {e}") from None
        label = "record"
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"--dataset {path} line {n} is not JSON: {e.msg}") from None
        label = "line"
    entries = [e for n, obj in records if (e := _entry(obj, n, f"--dataset {path} {label} {n}")) is not None]
    if not entries:
        raise DatasetError(f"--dataset {path} has no usable prompt ({len(records)} records; a ShareGPT "
                           "conversation needs a human turn followed by an answer)")
    return entries


def dataset_prompts(entries: list[DatasetEntry], n: int, output_tokens: int | None, seed: int | str) -> list[Prompt]:
    """n prompts from the entries in an order shuffled by seed (each used once), with output lengths from
    --output-tokens, else each entry's own, else the ShareGPT answer's length in Qwen3's tokenizer (vLLM counts
    it with the served model's tokenizer; another model's would give a somewhat different length)."""
    if n > len(entries):
        raise DatasetError(f"the dataset has {len(entries)} usable prompts: ask for --num-prompts <= {len(entries)} "
                           f"per level")
    chosen = random.Random(seed).sample(entries, n)
    counter = None
    prompts = []
    for e in chosen:
        out = output_tokens or e.output_tokens
        if out is None and e.reply is not None:
            if counter is None:
                from ..tokenizer import Tokenizer

                counter = Tokenizer.embedded()
            out = len(counter.encode(e.reply))
        if not out:
            raise DatasetError(f"dataset line {e.line} gives no output length (no `output_tokens`, or an empty "
                               "answer): give --output-tokens")
        prompts.append(Prompt(out, text=e.prompt))
    return prompts
