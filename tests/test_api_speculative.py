"""The gateway with `--speculative`: prompt-lookup drafts verified by the swarm, several tokens per pass. Greedy
answers, penalties, logprobs, stop strings and streams equal plain transformers (what the gateway gives without
speculation, tests/test_api.py); seeded sampling repeats; the drafts are both accepted and rolled back; n choices
share one session whose rows speculate."""
from __future__ import annotations


import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarmlm.client.decoding.sampling import Sampling
from swarmlm.client.decoding.decoder import Decoder
from swarmlm.client.model import DistributedModelForCausalLM
from tests.swarm_helpers import assert_greedy_up_to_ties, assert_n_choices_share_a_session, gateway_stack

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
# one prompt that quotes itself (prompt lookup drafts at once), two that do not
PROMPTS = ["one two three four one two three four one two", "The quick brown fox", "Water boils at"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(tiny_bloom, tmp_path_factory):
    # (--publish-counters: the prefix test reads the servers' hit counters, private by default)
    with gateway_stack(tiny_bloom, tmp_path_factory.mktemp("api-spec"), extra=["--speculative", "4"],
                       server_extra=lambda i: ["--publish-counters"]) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(tiny_bloom):
    return AutoTokenizer.from_pretrained(tiny_bloom), AutoModelForCausalLM.from_pretrained(tiny_bloom).eval()


def greedy_ids(model, ids: torch.Tensor, steps: int, freq: float = 0.0, pres: float = 0.0) -> list[int]:
    """Greedy decoding on logits - freq * count - pres * (count > 0) of the generated tokens, eos not special."""
    prompt = ids.shape[1]
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(ids).logits[0, -1]
            counts = torch.bincount(ids[0, prompt:], minlength=logits.shape[0]).float()
            logits = logits - freq * counts - pres * (counts > 0).float()
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, prompt:].tolist()


def expected_text(ref, prompt: str, freq: float = 0.0, pres: float = 0.0) -> tuple[str, str]:
    """The gateway's greedy answer: up to the first eos (finish "stop") or MAX_TOKENS tokens ("length")."""
    tokenizer, model = ref
    new = greedy_ids(model, tokenizer(prompt, return_tensors="pt").input_ids, MAX_TOKENS, freq, pres)
    eos = tokenizer.eos_token_id
    if eos in new:
        return tokenizer.decode(new[:new.index(eos)], skip_special_tokens=True), "stop"
    return tokenizer.decode(new, skip_special_tokens=True), "length"


def test_speculative_greedy_completions_and_streams_equal_transformers(client, ref, tiny_bloom):
    for prompt in PROMPTS:
        want, reason = expected_text(ref, prompt)
        got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want, reason)
        if reason == "length":
            assert got.usage.completion_tokens == MAX_TOKENS  # a pass's extra tokens are not counted nor sent
        chunks = list(client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_speculative_n_choices_share_one_session(stack, client, tiny_bloom):
    swarm, gateway = stack
    got = client.completions.create(model=tiny_bloom, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in got.choices)
    # their tokens are checked in test_choice_group_speculates (a batch's numerics need a tolerance)

    assert_n_choices_share_a_session(gateway.url, swarm, {"model": tiny_bloom, "prompt": PROMPTS[0], "max_tokens": 1000,
                                                          "temperature": 0.8, "n": 3})


def test_speculative_seeded_n_choices_repeat_and_differ(client, tiny_bloom):
    kwargs = dict(model=tiny_bloom, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.5, top_p=0.95, seed=7,
                  n=3)
    a, b = (client.completions.create(**kwargs) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i, in its own row
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_decoder_rows_speculate(stack, ref, tiny_bloom):
    """The gateway's n when speculating: greedy rows of one prompt's copied cache, each its own drafts; rows leave at
    their own max_new_tokens; every row is greedy decoding up to ties."""
    swarm, _ = stack
    tokenizer, _ = ref
    ids = tokenizer(PROMPTS[0]).input_ids
    lengths = [4, 16, 9]
    client = DistributedModelForCausalLM.from_pretrained(tiny_bloom, initial_peers=swarm.initial_peers)
    decoder = Decoder(client, [Sampling.from_request(m, temperature=0) for m in lengths], 4)
    got: dict[int, list[int]] = {i: [] for i in range(len(lengths))}
    try:
        passed = decoder.start_rows(torch.tensor([ids]), copies=len(lengths))
        while True:
            for row, (tokens, _) in passed.items():
                got[row] += tokens
                assert len(got[row]) <= lengths[row]  # a pass drafts no further than the row's room
                if len(got[row]) == lengths[row]:
                    decoder.drop(row)
            if not decoder.live:
                break
            passed = decoder.step()
        stats = decoder.stats
    finally:
        decoder.close()
        client.close()
    for row, m in enumerate(lengths):
        assert len(got[row]) == m
        assert_greedy_up_to_ties(tiny_bloom, ids, got[row])
    assert stats.passes < max(lengths) - 1 and 0 < stats.accepted <= stats.drafted


def test_gateway_config_refuses_a_bad_speculative_mode():
    from swarmlm.api.config import GatewayConfig

    assert GatewayConfig(model_name="m", speculative="auto").speculative == "auto"
    for bad in ("sometimes", 17, -1):
        with pytest.raises(ValueError, match="speculative"):
            GatewayConfig(model_name="m", speculative=bad)


def test_speculative_penalties_logprobs_and_stop_equal_transformers(client, ref, tiny_bloom):
    tokenizer, model = ref
    prompt = PROMPTS[0]
    want, _ = expected_text(ref, prompt, freq=1.5, pres=0.5)  # the processors see each draft's own context
    got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    frequency_penalty=1.5, presence_penalty=0.5)
    assert got.choices[0].text == want

    # every token's logprob, also those a pass verified at a draft's position
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    new = greedy_ids(model, ids, 8)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.cat([ids, torch.tensor([new])], dim=1)).logits[0].float(), dim=-1)
    expected = [float(logprobs[ids.shape[1] - 1 + i, t]) for i, t in enumerate(new)]
    got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected[:len(lp.token_logprobs)], abs=1e-4)

    text, _ = expected_text(ref, prompt)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stop=[stop])
        assert (got.choices[0].text, got.choices[0].finish_reason) == (text[:text.index(stop)], "stop")


def test_speculative_seeded_sampling_repeats(client, tiny_bloom):
    kwargs = dict(model=tiny_bloom, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.8, seed=7)
    a, b = (client.completions.create(**kwargs) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_one_row_accepts_and_rolls_back_drafts(stack, ref, tiny_bloom):
    swarm, _ = stack
    tokenizer, model = ref
    client = DistributedModelForCausalLM.from_pretrained(tiny_bloom, initial_peers=swarm.initial_peers)
    try:
        drafted = accepted = 0
        for prompt in PROMPTS[:2]:
            ids = tokenizer(prompt).input_ids
            decoder = Decoder(client, Sampling.from_request(24, temperature=0), 4)
            try:
                tokens = decoder.start(ids)[0]
                while len(tokens) < 24:
                    tokens += decoder.step()[0][0]
            finally:
                decoder.close()
            assert tokens == greedy_ids(model, torch.tensor([ids]), 24)
            stats = decoder.stats
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        assert 0 < accepted < drafted  # drafts kept and drafts rolled back
    finally:
        client.close()


def test_speculating_choices_start_from_a_held_prefix(stack, client, ref, tiny_bloom):
    """A speculating choice opens its session from the prefix the servers hold (the decoder's one prefix rule): the
    second chat sharing a system prompt has its leading runs found in the servers' prefix caches, not computed
    again, and still answers plain greedy's text."""
    from swarmlm.wire import swarm_pb2 as pb
    from swarmlm.wire.prefix_keys import RUN_TOKENS
    from tests.swarm_helpers import stub

    swarm, _ = stack
    tokenizer, _ = ref
    system = ("You are a careful assistant for a library. Answer in one short sentence, cite the shelf number when "
              "you know it, never invent a book, and say when the library is closed. Opening hours are nine to five.")

    def hits() -> list[int]:
        return [stub(s.address).Info(pb.InfoRequest()).prefix_cache.hit_tokens for s in swarm.servers]

    def chat(question: str) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return client.chat.completions.create(model=tiny_bloom, messages=messages, max_tokens=6,
                                              temperature=0).choices[0].message.content

    start = hits()
    chat("Where are the atlases?")
    first = hits()
    answer = chat("Is it open on Sunday?")
    second = hits()
    shared = len(tokenizer(f"System: {system}\nUser:").input_ids) // RUN_TOKENS * RUN_TOKENS
    assert shared > 0 and first == start  # the first chat found nothing held
    assert all(b - a >= shared for a, b in zip(first, second)), (first, second)  # the second, the system prompt
    want, _ = expected_text(ref, f"System: {system}\nUser: Is it open on Sunday?\nAssistant:")
    assert answer and want.startswith(answer)
