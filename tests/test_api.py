"""The OpenAI-compatible gateway against a real swarm (DHT + 2 server processes) and the real `swarmlm api`
process, driven by the official `openai` client; texts checked against plain transformers on the same checkpoint."""
from __future__ import annotations

import json
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # what openai 3.x is built on
import openai
import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.api.process import GatewayProcess
from swarmlm.swarm.local import LocalSwarm
from tests.swarm_helpers import (active_sessions, assert_n_choices_share_a_session, gateway_stack, reference_generate,
                                 reference_model)

pytestmark = pytest.mark.slow
KEY = "test-key"
STREAM_LIMIT = 9  # per client: 8 concurrent streams pass, the 10th of 10 held open is refused
PROMPTS = ["The quick brown fox", "What is the capital of France?", "Water boils at", "A spider has",
           "The library opens at", "Machine learning models", "In 1969, astronauts", "Python is a"]


@pytest.fixture(scope="module")
def stack(tiny_bloom, tmp_path_factory):
    """A DHT, 2 servers and the gateway, the gateway starting while the servers load (both take seconds)."""
    with gateway_stack(tiny_bloom, tmp_path_factory.mktemp("api"),
                       extra=["--api-key", KEY, "--max-streams-per-client", str(STREAM_LIMIT),
                              "--wait-for-blocks", "3"]) as stack:
        yield stack


@pytest.fixture(scope="module")
def swarm(stack) -> LocalSwarm:
    return stack[0]


@pytest.fixture(scope="module")
def gateway(stack) -> GatewayProcess:
    return stack[1]


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_bloom):
    """Greedy text of plain transformers: the prompt tokenized as tokenizer(prompt) does, decoded without
    special tokens; and the finish reason it implies."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_bloom)

    def greedy(prompt: str, max_tokens: int) -> tuple[str, str]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = reference_generate(tiny_bloom, ids, max_new_tokens=max_tokens)
        new = out[0, ids.shape[1]:]
        reason = "stop" if len(new) < max_tokens or int(new[-1]) == tokenizer.eos_token_id else "length"
        return tokenizer.decode(new, skip_special_tokens=True), reason

    greedy.model, greedy.tokenizer = reference_model(tiny_bloom), tokenizer
    return greedy


def _post(gateway, path: str, body, key: str | None = KEY, raw: bool = False) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw:
        return httpx.post(f"{gateway.url}{path}", content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=60)
    return httpx.post(f"{gateway.url}{path}", json=body, headers=headers, timeout=60)


def _assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# ---- completions and chat equal transformers -----------------------------------------------------------------
def test_models_and_responses_carry_the_name_not_the_path(gateway, client, tiny_bloom):
    """A checkpoint directory is served by its own name: the path (the user's home) never leaves the machine; the
    path as given is accepted as "model" too."""
    name = Path(tiny_bloom).name
    assert [m.id for m in client.models.list().data] == [name] and gateway.model == name
    for model in (name, tiny_bloom):
        raw = _post(gateway, "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert raw.status_code == 200 and raw.json()["model"] == name and tiny_bloom not in raw.text
    view = httpx.get(f"{gateway.url}/v1/swarm", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert view.json()["model"] == name and tiny_bloom not in view.text


def test_greedy_completions_equal_transformers(client, reference, tiny_bloom):
    for prompt in PROMPTS[:3]:
        want, reason = reference(prompt, 12)
        got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason == reason
        prompt_tokens = len(reference.tokenizer(prompt).input_ids)
        assert got.usage.prompt_tokens == prompt_tokens and got.usage.completion_tokens == 12
        assert got.usage.total_tokens == prompt_tokens + 12


def test_greedy_chat_equals_transformers_on_the_fallback_template(client, reference, tiny_bloom):
    # the tiny tokenizer has no chat template: "Role: content\n" per message, then "Assistant:" (docs/API.md)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    want, reason = reference("System: You are brief.\nUser: Why is the sky blue?\nAssistant:", 10)
    got = client.chat.completions.create(model=tiny_bloom, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.choices[0].finish_reason == reason


def test_a_tokenizer_chat_template_is_used_when_there_is_one(tiny_bloom):
    from swarmlm.api.prompts import encode_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_bloom)
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    messages = [("system", "Be brief."), ("user", "Hello")]
    want = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert encode_chat(tokenizer, messages) == list(want)
    assert encode_chat(tokenizer, messages)[0] == tokenizer.bos_token_id  # the template's own special tokens


def test_stream_chunks_join_to_the_whole_text(client, tiny_bloom):
    prompt = PROMPTS[1]
    whole = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == 10  # the include_usage chunk

    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=tiny_bloom, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=tiny_bloom, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_eight_concurrent_streams_each_equal_their_solo_result(client, tiny_bloom):
    def solo(prompt: str) -> str:
        return client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    def streamed(prompt: str) -> str:
        stream = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    alone = [solo(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(streamed, PROMPTS))
    assert together == alone


# ---- sampling options ----------------------------------------------------------------------------------------
def test_stop_strings_truncate_and_finish_with_stop(client, tiny_bloom):
    full = client.completions.create(model=tiny_bloom, prompt=PROMPTS[2], max_tokens=16, temperature=0).choices[0].text
    assert len(full) >= 4
    stop = full[2:4]
    cut = full[:full.find(stop)]
    got = client.completions.create(model=tiny_bloom, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                    stop=[stop, "never-appears"])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model=tiny_bloom, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_seeded_sampling_repeats_and_n_gives_distinct_seeded_choices(client, tiny_bloom):
    kwargs = dict(model=tiny_bloom, prompt=PROMPTS[0], max_tokens=12, temperature=1.5, top_p=0.95, seed=7, n=3)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    assert a.usage.completion_tokens == 36


def test_frequency_and_presence_penalties_follow_openai_formula(client, reference, tiny_bloom):
    model, tokenizer = reference.model, reference.tokenizer
    prompt = PROMPTS[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    n_prompt, freq, pres = ids.shape[1], 1.5, 0.5
    with torch.inference_mode():
        for _ in range(10):  # greedy on logits - freq * count - pres * (count > 0), counting generated tokens
            logits = model(ids).logits[0, -1]
            counts = torch.bincount(ids[0, n_prompt:], minlength=logits.shape[0]).float()
            logits = logits - freq * counts - pres * (counts > 0).float()
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    want = tokenizer.decode(ids[0, n_prompt:], skip_special_tokens=True)
    got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=10, temperature=0,
                                    frequency_penalty=freq, presence_penalty=pres)
    assert got.choices[0].text == want
    assert want != reference(prompt, 10)[0]  # the penalties changed something


def _sampled_text(reference, prompt: str, steps: int, seed: int, temperature: float, **warpers) -> str:
    """What a seeded request samples, computed here: the reference model's logits through transformers' own
    warpers (temperature, then top-k / min-p as generate() orders them), one draw per token from a generator
    seeded as the gateway seeds a choice; up to the first eos."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper)

    model, tokenizer = reference.model, reference.tokenizer
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if warpers.get("top_k"):
        processors.append(TopKLogitsWarper(warpers["top_k"]))
    if warpers.get("min_p"):
        processors.append(MinPLogitsWarper(warpers["min_p"]))
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    new: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            scores = processors(ids, model(ids).logits[:, -1].float())
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_top_k_one_is_greedy_and_top_k_min_p_sample_as_transformers_warpers(client, reference, tiny_bloom):
    prompt = PROMPTS[4]
    want, _ = reference(prompt, 10)
    top1 = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=10, temperature=1.0,
                                     seed=3, extra_body={"top_k": 1})
    assert top1.choices[0].text == want
    # (the tiny model's logits are nearly flat: min-p needs a low temperature to leave only a few tokens)
    for warpers, temperature in (({"top_k": 4}, 1.5), ({"min_p": 0.6}, 0.5)):
        # a seed whose draw the warper changes (computed here, so the test cannot pass by ignoring the warper)
        seed = next(s for s in range(10) if _sampled_text(reference, prompt, 10, s, temperature, **warpers)
                    != _sampled_text(reference, prompt, 10, s, temperature))
        got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=10, temperature=temperature,
                                        seed=seed, extra_body=warpers)
        assert got.choices[0].text == _sampled_text(reference, prompt, 10, seed, temperature, **warpers), warpers


def test_repetition_penalty_under_both_names_and_unimplemented_fields_are_400(gateway, client, reference, tiny_bloom):
    model, tokenizer = reference.model, reference.tokenizer
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.5)
    new = want[0, ids.shape[1]:].tolist()
    new = new[:new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
    for name in ("repetition_penalty", "repeat_penalty"):
        got = client.completions.create(model=tiny_bloom, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                        extra_body={name: 1.5})
        assert got.choices[0].text == tokenizer.decode(new, skip_special_tokens=True), name
    chat = {"model": tiny_bloom, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10})):
        error = _assert_error(_post(gateway, "/v1/chat/completions", {**chat, field: value}), 400,
                              "unsupported_parameter")
        assert error["param"] == field and field in error["message"]
    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    error = _assert_error(_post(gateway, "/v1/chat/completions", {**chat, "messages": [image]}), 400,
                          "unsupported_parameter")
    assert "messages[0].content[1]" in error["message"] and "image_url" in error["message"]
    # their neutral values ask for nothing unsupported
    ok = _post(gateway, "/v1/chat/completions", {**chat, "tools": [], "response_format": {"type": "text"}})
    assert ok.status_code == 200, ok.text


def test_logprobs_are_the_models_log_softmax(client, reference, tiny_bloom):
    model, tokenizer = reference.model, reference.tokenizer
    prompt = PROMPTS[3]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
    top = logprobs.topk(3)
    got = client.completions.create(model=tiny_bloom, prompt=prompt, max_tokens=3, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.token_logprobs[0] == pytest.approx(float(top.values[0]), abs=1e-4)
    assert list(lp.top_logprobs[0].values()) == pytest.approx(top.values.tolist(), abs=1e-4)

    chat = client.chat.completions.create(model=tiny_bloom, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top token


# ---- n choices of a prompt in one session (one decoder) --------------------------------------------------------
def test_n_choices_share_one_session_and_equal_transformers(gateway, client, swarm, reference, tiny_bloom):
    want, reason = reference(PROMPTS[1], 12)
    got = client.completions.create(model=tiny_bloom, prompt=PROMPTS[1], max_tokens=12, temperature=0, n=3)
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [(i, want, reason) for i in range(3)]

    assert_n_choices_share_a_session(gateway.url, swarm, {"model": tiny_bloom, "prompt": PROMPTS[0], "max_tokens": 1000,
                                                          "temperature": 0.8, "n": 3},
                                     {"Authorization": f"Bearer {KEY}"})


def test_one_decoder_copies_the_prompt_and_drops_ended_rows(swarm, reference, tiny_bloom):
    """The gateway's n: rows of one Decoder (client/decoding/decoder.py), k = 0 (plain decoding): one prompt step,
    its cache copied to every row; each row leaves the session at its own max_new_tokens."""
    from swarmlm.client.decoding.decoder import Decoder
    from swarmlm.client.decoding.sampling import Sampling
    from swarmlm.client.model import DistributedModelForCausalLM

    ids = reference.tokenizer(PROMPTS[2]).input_ids
    with torch.inference_mode():
        want = reference.model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                                        do_sample=False)[0, len(ids):].tolist()
    model = DistributedModelForCausalLM.from_pretrained(tiny_bloom, initial_peers=swarm.initial_peers)
    lengths = [4, 12, 1, 8]  # each choice leaves the session after its own count (one after the prompt's step)
    decoder = Decoder(model, [Sampling.from_request(m, temperature=0) for m in lengths], "off")
    got: dict[int, list[int]] = {i: [] for i in range(len(lengths))}
    try:
        passed = decoder.start_rows(torch.tensor([ids]), copies=len(lengths))
        while True:
            for row, (tokens, _) in passed.items():
                assert len(tokens) == 1  # one token per step (no speculation)
                got[row] += tokens
                if len(got[row]) == lengths[row]:
                    decoder.drop(row)
            if not decoder.live:
                break
            passed = decoder.step()
        prefills = [r for r in decoder.cache.session.steps if r.n_tokens == len(ids)]
    finally:
        decoder.close()
        model.close()
    assert [got[i] for i in range(len(lengths))] == [want[:m] for m in lengths]
    assert len(prefills) == 1  # the prompt went through the swarm once


# ---- errors ------------------------------------------------------------------------------------------------
def test_invalid_requests_are_400_in_openai_schema(gateway, tiny_bloom):
    base = {"model": tiny_bloom, "prompt": "Hi"}
    _assert_error(_post(gateway, "/v1/completions", b'{"model": "x", "prompt": ', raw=True), 400)
    _assert_error(_post(gateway, "/v1/completions", {**base, "max_tokens": "5"}), 400)
    _assert_error(_post(gateway, "/v1/completions", {**base, "temperature": [1]}), 400)
    _assert_error(_post(gateway, "/v1/completions", {**base, "max_tokens": 0}), 400)
    _assert_error(_post(gateway, "/v1/completions", {**base, "max_tokens": 10**6}), 400, "context_length_exceeded")
    _assert_error(_post(gateway, "/v1/completions", {**base, "prompt": ""}), 400)
    _assert_error(_post(gateway, "/v1/completions", {**base, "prompt": ["Hi", ""]}), 400)
    _assert_error(_post(gateway, "/v1/completions", {"model": tiny_bloom}), 400)
    _assert_error(_post(gateway, "/v1/chat/completions", {"model": tiny_bloom, "messages": []}), 400)
    _assert_error(_post(gateway, "/v1/chat/completions", {"model": tiny_bloom, "messages": [{"role": "wizard",
                                                                                            "content": "x"}]}), 400)
    # unknown fields are ignored, as OpenAI does
    ok = _post(gateway, "/v1/completions", {**base, "max_tokens": 2, "temperature": 0, "best_of_everything": True})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_api_key_and_model_errors(gateway, tiny_bloom):
    body = {"model": tiny_bloom, "prompt": "Hi", "max_tokens": 2}
    _assert_error(_post(gateway, "/v1/completions", body, key=None), 401, "invalid_api_key")
    _assert_error(_post(gateway, "/v1/completions", body, key="wrong"), 401, "invalid_api_key")
    _assert_error(_post(gateway, "/v1/completions", {**body, "model": "gpt-4"}), 404, "model_not_found")
    _assert_error(_post(gateway, "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user",
                                                                                           "content": "x"}]}),
                  404, "model_not_found")
    _assert_error(httpx.get(f"{gateway.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404)
    assert httpx.get(f"{gateway.url}/v1/models").status_code == 401


def test_disconnected_streams_close_their_sessions_and_the_stream_limit_holds(gateway, swarm, tiny_bloom):
    assert active_sessions(swarm) == [0, 0]
    body = {"model": tiny_bloom, "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    http = httpx.Client(timeout=60)
    streams, readers = [], []
    solo = _post(gateway, "/v1/completions", {**body, "stream": False, "max_tokens": 4}).json()["choices"][0]["text"]
    try:
        for i in range(STREAM_LIMIT):  # hold the client's limit of streams open, each past its first token, unread
            if i == STREAM_LIMIT - 1:  # 8 streams nobody reads do not stall another request
                ok = _post(gateway, "/v1/completions", {**body, "stream": False, "max_tokens": 4})
                assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == solo, ok.text
            cm = http.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=headers)
            response = cm.__enter__()
            streams.append(cm)
            assert response.status_code == 200
            lines = response.iter_lines()
            readers.append(lines)  # kept: a collected line iterator closes its response (a disconnect)
            first = next(lines)
            while not first.startswith("data: "):
                first = next(lines)
            assert first.startswith("data: {")
        assert min(active_sessions(swarm)) >= 1
        _assert_error(_post(gateway, "/v1/completions", {**body, "stream": False, "max_tokens": 2}), 429,
                      "too_many_streams")
    finally:
        for cm in streams:  # the client goes away mid-stream
            cm.__exit__(None, None, None)
        http.close()
    deadline = time.monotonic() + 60
    while active_sessions(swarm) != [0, 0]:
        assert time.monotonic() < deadline, f"sessions left open on the servers: {active_sessions(swarm)}"
        time.sleep(0.2)
    # the limit was released with the streams
    ok = _post(gateway, "/v1/completions", {**body, "stream": False, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# ---- the swarm view ------------------------------------------------------------------------------------------
def test_swarm_view_lists_servers_coverage_and_gateway_metrics(gateway, swarm):
    view = httpx.get(f"{gateway.url}/v1/swarm", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    by_address = {s["address"]: s for s in view["servers"]}
    assert set(by_address) == {s.address for s in swarm.servers}
    assert sorted(s["blocks"] for s in view["servers"]) == [[0, 3], [3, 6]]
    assert all(s["state"] == "online" and s["last_seen_s_ago"] is not None for s in view["servers"])
    # what their values are (read from their DHT records): float32 blocks and caches, unquantized
    assert {(s["quant"], s["dtype"], s["kv_dtype"]) for s in view["servers"]} == {("none", "float32", "float32")}
    assert view["coverage"] == [1] * 6 and view["complete"] and view["missing_blocks"] == []
    g = view["gateway"]
    assert g["total_tokens"] > 0 and g["total_requests"] > 0 and g["ttft_s"]["p50"] > 0 and g["tpot_s"]["p90"] > 0
    json.dumps(view, allow_nan=False)  # plain JSON for any client


def test_status_command_prints_the_same_view(swarm, tiny_bloom, capsys):
    from swarmlm.cli.main import main

    assert main(["status", "--initial-peers", *swarm.initial_peers, "--model", tiny_bloom]) == 0
    out = capsys.readouterr().out
    for s in swarm.servers:
        assert s.address in out
    assert "[0, 3)" in out and "[3, 6)" in out and "every block is served" in out


def test_uncovered_model_is_503_with_a_reason(gateway, swarm, tiny_bloom):
    """Last in this module: it takes a server away."""
    swarm.kill(swarm.servers[1])
    body = {"model": tiny_bloom, "prompt": "Hi", "max_tokens": 2}
    error = _assert_error(_post(gateway, "/v1/completions", body), 503)
    assert error["code"] in ("missing_blocks", "swarm_unavailable") and "swarm" in error["message"]
    stream = _post(gateway, "/v1/chat/completions", {"model": tiny_bloom, "stream": True, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    _assert_error(stream, 503)
