"""The one sampling-parameters type (client/decoding/sampling.py): its processors are transformers' own for every
parameter generate() takes, in generate()'s order; an API request maps onto it (temperature 0 is greedy)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from swarmlm.client.decoding.sampling import Sampling

CASES = [dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.3),
         dict(do_sample=True, temperature=0.7), dict(do_sample=True, top_k=5), dict(do_sample=True, top_p=0.8),
         dict(do_sample=True, min_p=0.2), dict(do_sample=True, temperature=1.4, top_k=20, top_p=0.9, min_p=0.05,
                                               repetition_penalty=1.2)]


@pytest.fixture(scope="module")
def reference(tiny_bloom):
    return AutoModelForCausalLM.from_pretrained(tiny_bloom).eval()


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_processors_equal_transformers_for_every_parameter(reference, options):
    config = GenerationConfig(**{"top_k": 0, **options})  # transformers' default top_k of 50 off unless asked
    want = reference._get_logits_processor(config, input_ids_seq_length=6)
    got = Sampling.from_generation_config(config, max_new_tokens=8).processors()
    assert [type(p) for p in got] == [type(p) for p in want]
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    scores = torch.randn(2, 100, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(got(ids, scores.clone()), want(ids, scores.clone()))


def test_an_api_request_maps_onto_it():
    assert Sampling.from_request(4, temperature=0).greedy and Sampling.from_request(4, top_p=0).greedy
    sampled = Sampling.from_request(4, temperature=0.5, top_k=3, min_p=0.1, presence_penalty=0.5)
    assert not sampled.greedy
    assert [type(p).__name__ for p in sampled.processors(2)] == ["OpenAIPenalties", "TemperatureLogitsWarper",
                                                                 "TopKLogitsWarper", "MinPLogitsWarper"]
    # top_k=1 keeps the argmax only: a draw is the greedy token
    scores = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    top1 = Sampling.from_request(4, temperature=1.0, top_k=1, seed=9)
    assert top1.choose(top1.processors()(torch.zeros(1, 1, dtype=torch.long), scores), top1.generator()) \
        == int(scores.argmax())
    a, b = (Sampling.from_request(4, seed=5).generator().initial_seed() for _ in range(2))
    assert a == b != Sampling.from_request(4, seed=5).generator(offset=1).initial_seed()


def test_bad_parameters_are_refused():
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=1, top_p=1.5), dict(max_new_tokens=1, top_k=-2),
                dict(max_new_tokens=1, repetition_penalty=0.0), dict(max_new_tokens=1, temperature=0.0)):
        with pytest.raises(ValueError):
            Sampling(**bad)
