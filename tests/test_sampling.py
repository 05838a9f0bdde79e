"""The sampler on hand-made distributions, and SamplingParams validation."""

import math

import pytest
import torch

from llm_anatomy.engine.sampling import Sampler, SamplingParams
from llm_anatomy.errors import RequestError

CPU = torch.device("cpu")


def draw(logits_row, params, n=4000, seed=0):
    """n samples from one row of logits (as n identical rows)."""
    sampler = Sampler(CPU, seed=seed)
    logits = torch.tensor(logits_row, dtype=torch.float32).repeat(n, 1)
    tokens = sampler(logits, [params] * n, [None] * n, [None] * n)
    return torch.bincount(tokens, minlength=len(logits_row)).float() / n


def test_temperature_one_follows_softmax():
    logits = [2.0, 1.0, 0.0, -1.0]
    freq = draw(logits, SamplingParams(temperature=1.0), n=20000)
    expect = torch.tensor(logits).softmax(-1)
    assert torch.allclose(freq, expect, atol=0.015)


def test_low_temperature_sharpens():
    freq = draw([1.0, 0.5, 0.0], SamplingParams(temperature=0.1))
    assert freq[0] > 0.98


def test_top_k_keeps_only_k_best():
    freq = draw([3.0, 2.9, 2.8, 2.7, 2.6], SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0 and freq[0] > 0.4 and freq[1] > 0.4


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = draw(probs.log().tolist(), SamplingParams(temperature=1.0, top_p=0.75))
    assert freq[2:].sum() == 0  # 0.5 < 0.75 so the second token stays; 0.8 >= 0.75 so the third goes
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = draw(probs.log().tolist(), SamplingParams(temperature=1.0, min_p=0.5))
    assert freq[2:].sum() == 0 and freq[1] > 0.3


def test_bf16_logits_as_the_model_gives_them():
    """The model hands the sampler its logits in bf16: greedy takes their argmax as they are; penalties, bans and
    temperatures work in float32, so a penalty smaller than a bf16 step still counts."""
    sampler = Sampler(CPU, seed=0)
    logits = torch.tensor([[1.0, 1.0078125, 0.0], [2.0, 0.0, 1.0]], dtype=torch.bfloat16)  # 1.0078125: 1 + a step
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [greedy] * 2, [None] * 2, [None] * 2).tolist() == [1, 0]
    assert sampler(logits, [greedy] * 2, [None] * 2, [None] * 2, banned=[(1,), (0,)]).tolist() == [0, 2]
    counts = torch.tensor([0, 1, 0], dtype=torch.int32)
    small = SamplingParams(temperature=0, frequency_penalty=0.005)  # 1.0078 - 0.005 > 1.0 in float32, not in bf16
    assert sampler(logits[:1], [small], [None], [counts]).item() == 1
    penalised = SamplingParams(temperature=0, frequency_penalty=0.01)
    assert sampler(logits[:1], [penalised], [None], [counts]).item() == 0
    hot = SamplingParams(temperature=0.5, top_k=2, seed=1)
    assert sampler(logits, [hot] * 2, [None] * 2, [None] * 2).tolist()[1] in (0, 2)


def test_greedy_and_penalties():
    sampler = Sampler(CPU, seed=0)
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    counts = torch.tensor([3, 0, 0], dtype=torch.int32)
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [greedy], [None], [None]).item() == 0
    penalised = SamplingParams(temperature=0, frequency_penalty=0.1)  # 1.0 - 0.3 < 0.9
    assert sampler(logits, [penalised], [None], [counts]).item() == 1
    presence = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sampler(logits, [presence], [None], [counts]).item() == 1


def test_logit_bias_moves_the_choice_row_by_row():
    sampler = Sampler(CPU, seed=0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    rows = [SamplingParams(temperature=0, logit_bias=((3, 5.0),)),  # -1 + 5 beats 2
            SamplingParams(temperature=0, logit_bias=((0, -100.0),)),  # the best is banned: the next one
            SamplingParams(temperature=0)]
    assert sampler(logits, rows, [None] * 3, [None] * 3).tolist() == [3, 1, 0]
    banned = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0)))
    assert draw([2.0, 1.0, 0.0, -1.0], banned)[:2].sum() == 0


def test_mixed_rows_and_seeded_generators():
    sampler = Sampler(CPU, seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7), SamplingParams(top_k=5)]

    def run():
        gens = [None, torch.Generator().manual_seed(7), None]
        return sampler(logits, params, gens, [None] * 3)

    first, second = run(), run()
    assert first[0] == logits[0].argmax()
    assert first[1] == second[1]  # the seeded row repeats


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature must be >= 0"),
    ("temperature", math.nan, "temperature must be a finite number"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, "top_k must be an integer"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", "a", "frequency_penalty must be a finite number"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("max_tokens", True, "max_tokens must be an integer >= 1"),
    ("seed", 1.5, "seed must be an integer"),
    ("stop", ("",), "stop must be a list of non-empty strings"),
    ("stop_token_ids", (-1,), "stop_token_ids must be a list of non-negative integers"),
    ("logit_bias", ((3, 101.0),), r"logit_bias must map token ids \(>= 0\) to biases in \[-100, 100\]"),
    ("logit_bias", ((-1, 1.0),), "logit_bias must map token ids"),
    ("logprobs", 21, r"logprobs must be an integer in 0..20"),
])
def test_invalid_values_are_rejected_with_the_field_named(field, value, message):
    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_top_k_then_top_p_on_the_k_best():
    """top-k first, then top-p over the renormalised k best (the order HF and vLLM use)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = draw(probs.log().tolist(), SamplingParams(temperature=1.0, top_k=3, top_p=0.75), n=8000)
    assert freq[2:].sum() == 0  # within the top 3: 0.5/0.95 < 0.75 <= 0.8/0.95, so two tokens stay
    assert abs(freq[0] - 0.625) < 0.03
    mixed = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.6)]
    tokens = Sampler(CPU, seed=1)(torch.tensor([probs.log().tolist()] * 2), mixed, [None, None], [None, None])
    assert tokens[0] in (0, 1) and tokens[1] in (0, 1)


def test_a_requests_record_is_its_fields_and_gives_it_back():
    """What an anatomy records of the sampling asked (SamplingParams.record) is its fields but `extra`, whatever was
    computed of it since (plain_greedy, cached on first use), and passing it back gives the same parameters."""
    from dataclasses import fields

    params = SamplingParams(temperature=0, max_tokens=7, stop=("x",), logit_bias=((3, 1.5),), extra={"user": "u"})
    assert params.plain_greedy is False  # the bias: not a bare argmax
    record = params.record()
    assert set(record) == {f.name for f in fields(SamplingParams)} - {"extra"}
    assert SamplingParams(**record) == params and SamplingParams(**record).plain_greedy is False
