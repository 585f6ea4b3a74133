"""The chat page in a real browser: headless Chromium (Debian's package; `make chromium`), driven through the
DevTools protocol (tests/cdp.py), types into `/chat` of the real gateway against a live swarm (DHT + 2 servers):
the streamed answer equals the API's greedy answer, and Stop ends the generation on the servers.

(The screenshots in README.md and docs/API.md are of the real catalog model: benchmarks/chat_screenshot.py.)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from swarmlm.wire import swarm_pb2 as pb
from tests.cdp import Browser
from tests.swarm_helpers import gateway_stack, stub

pytestmark = pytest.mark.slow
KEY = "chat-key"
LAST_ANSWER = "document.querySelector('#messages .msg.assistant:last-child')"


@pytest.fixture(scope="module")
def stack(tiny_bloom, tmp_path_factory):
    with gateway_stack(tiny_bloom, tmp_path_factory.mktemp("chat"), extra=["--api-key", KEY]) as stack:
        yield stack


@pytest.fixture
def page(stack, tmp_path):
    """The chat page, opened with the API key in its URL, once it knows the model."""
    with Browser(tmp_path / "profile") as browser:
        browser.open(f"{stack[1].url}/chat#key={KEY}")
        browser.wait_for("document.getElementById('model')?.textContent", what="the model name")
        yield browser


def _active_sessions(swarm) -> list[int]:
    return [stub(s.address).Info(pb.InfoRequest(), timeout=10).active_sessions for s in swarm.servers]


def _gateway_metrics(gateway) -> dict:
    r = httpx.get(f"{gateway.url}/v1/swarm", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    return r.json()["gateway"]


def _ask(page: Browser, question: str, temperature: str, max_tokens: str, system: str = "") -> None:
    page.type_into("#system", system)
    page.type_into("#temperature", temperature)
    page.type_into("#max-tokens", max_tokens)
    page.type_into("#prompt", question)
    page.click("#send")


def test_streamed_answer_equals_the_greedy_api_answer(page, stack, tiny_bloom):
    swarm, gateway = stack
    system, question = "Answer in one word.", "What is the capital of France?"
    _ask(page, question, temperature="0", max_tokens="12", system=system)
    state = page.wait_for(f"{LAST_ANSWER}.dataset.state !== 'streaming' && {LAST_ANSWER}.dataset.state",
                          what="the answer")
    answer = page.eval(f"({{text: {LAST_ANSWER}.dataset.raw, "
                       f"route: {LAST_ANSWER}.querySelector('.route').textContent, "
                       f"meta: {LAST_ANSWER}.querySelector('.meta').textContent, ...{LAST_ANSWER}.dataset}})")
    assert state == "done", (answer, page.eval("document.getElementById('status').textContent"))

    body = {"model": tiny_bloom, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert answer["text"] == choice["message"]["content"] and answer["text"], (answer, choice)
    assert int(answer["tokens"]) == r.json()["usage"]["completion_tokens"]
    assert float(answer["ttftS"]) > 0 and "first token" in answer["meta"]
    # the route: every server, with its blocks, in the order of the chain (as the API reports it)
    route = choice["swarmlm"]["route"]
    assert [(s["address"], s["blocks"]) for s in route] == [(s.address, list(s.ready["blocks"])) for s in
                                                            sorted(swarm.servers, key=lambda s: s.ready["blocks"])]
    for s in route:
        assert f"{s['address']} [{s['blocks'][0]}, {s['blocks'][1]})" in answer["route"], answer["route"]

    # the next turn carries the conversation: the page sends the history, the API answers the same
    page.type_into("#prompt", "And of Italy?")
    page.click("#send")
    page.wait_for(f"document.querySelectorAll('#messages .msg.assistant').length === 2 && "
                  f"{LAST_ANSWER}.dataset.state === 'done'", what="the second answer")
    second = page.eval(f"{LAST_ANSWER}.dataset.raw")
    body["messages"] += [{"role": "assistant", "content": answer["text"]}, {"role": "user", "content": "And of Italy?"}]
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120)
    assert second == r.json()["choices"][0]["message"]["content"]


def test_stop_ends_the_generation_on_the_servers(page, stack):
    swarm, gateway = stack
    assert _active_sessions(swarm) == [0, 0]
    for attempt in range(6):
        _ask(page, "Tell me a very long story.", temperature="0.7", max_tokens="1500")
        page.wait_for(f"{LAST_ANSWER} && Number({LAST_ANSWER}.dataset.tokens) >= 3", what="a few streamed tokens")
        if min(_active_sessions(swarm)) == 1:  # the answer's session is open on both servers
            page.click("#stop")
        # random weights sample their end-of-text token now and then (1 in 512): an answer may end by itself before
        # the check or before the click lands (the stop button is then disabled), and is asked again
        state = page.wait_for(f"{LAST_ANSWER}.dataset.state !== 'streaming' && {LAST_ANSWER}.dataset.state")
        if state == "stopped":
            break
        assert state == "done" and int(page.eval(f"{LAST_ANSWER}.dataset.tokens")) < 1500, state
    else:
        pytest.fail("no answer was stopped while it streamed in 6 attempts")
    deadline = time.monotonic() + 60
    while _active_sessions(swarm) != [0, 0]:
        assert time.monotonic() < deadline, f"sessions left open on the servers: {_active_sessions(swarm)}"
        time.sleep(0.2)
    metrics = _gateway_metrics(gateway)
    assert metrics["active_requests"] == 0, metrics
    time.sleep(1.0)  # and no token is generated any more
    assert _gateway_metrics(gateway)["total_tokens"] == metrics["total_tokens"]
    shown = int(page.eval(f"{LAST_ANSWER}.dataset.tokens"))
    assert shown < 1500 and page.eval("document.getElementById('send').disabled") is False
    assert json.loads(page.eval("JSON.stringify(document.getElementById('stop').disabled)")) is True


def test_the_conversation_survives_a_reload_and_the_page_fits_400_px(page, stack):
    _ask(page, "What is the capital of France?", temperature="0", max_tokens="6", system="Be brief.")
    page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'", what="the answer")
    before = page.eval("[...document.querySelectorAll('#messages .msg')].map(e => e.dataset.raw)")
    assert len(before) == 2 and before[0] == "What is the capital of France?"

    page.call("Page.reload")
    page.wait_for("document.querySelectorAll('#messages .msg').length === 2", what="the restored conversation")
    assert page.eval("[...document.querySelectorAll('#messages .msg')].map(e => e.dataset.raw)") == before
    assert page.eval("[document.getElementById('system').value, document.getElementById('temperature').value]") \
        == ["Be brief.", "0"]

    page.call("Emulation.setDeviceMetricsOverride", width=400, height=800, deviceScaleFactor=1, mobile=False)
    page.wait_for("window.innerWidth === 400", what="the 400 px viewport")
    layout = page.eval("[document.documentElement.scrollWidth, "
                       "document.getElementById('prompt').getBoundingClientRect().width]")
    assert layout[0] <= 400 and layout[1] >= 300, layout  # no sideways scrolling; a prompt box of the width

    page.click("#clear")  # a new conversation forgets the old one, also after a reload
    page.call("Page.reload")
    page.wait_for("document.getElementById('model')?.textContent", what="the model name")
    assert page.eval("document.querySelectorAll('#messages .msg').length") == 0


def test_answers_render_markdown_code_blocks_and_never_raw_html(page, stack):
    """An answer (here one restored from the browser's storage, as after a reload) is Markdown: a fenced block is
    a code element with its text; HTML in the model's text is shown as text, and a javascript: link is none."""
    raw = "Run this:\n\n```python\nprint('<hi>')\n```\n<img src=x onerror=\"window.owned=1\"> [a](javascript:x)"
    saved = {"conversation": [{"role": "user", "content": "<b>code?</b>"}, {"role": "assistant", "content": raw}],
             "settings": {}}
    model = page.eval("document.getElementById('model').textContent")
    page.eval(f"localStorage.setItem({json.dumps('swarmlm-chat/' + model)}, {json.dumps(json.dumps(saved))})")
    page.call("Page.reload")
    page.wait_for("document.querySelectorAll('#messages .msg').length === 2", what="the restored conversation")
    shown = page.eval("(a => ({code: a.querySelector('pre code')?.textContent, raw: a.dataset.raw, "
                      "imgs: a.querySelectorAll('img').length, links: a.querySelectorAll('a').length, "
                      "text: a.querySelector('.text').textContent, user: document.querySelector('.msg.user .text')"
                      ".innerHTML}))(document.querySelector('.msg.assistant'))")
    assert shown["code"] == "print('<hi>')\n" and shown["raw"] == raw, shown
    assert shown["imgs"] == 0 and shown["links"] == 0 and "<img src=x" in shown["text"], shown
    assert shown["user"] == "&lt;b&gt;code?&lt;/b&gt;" and page.eval("window.owned === undefined")


def test_past_chats_copy_and_regenerate(page, stack):
    """The chats list keeps each conversation (across a reload too) and switches between them; Copy puts the
    answer's text on the clipboard; Regenerate asks for the last answer again in place (greedy: the same text)."""
    _ask(page, "What is the capital of France?", temperature="0", max_tokens="6")
    page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'", what="the first chat's answer")
    first = page.eval("[...document.querySelectorAll('#messages .msg')].map(e => e.dataset.raw)")
    page.click("#clear")
    assert page.eval("document.querySelectorAll('#messages .msg').length") == 0
    _ask(page, "And of Italy?", temperature="0", max_tokens="6")
    page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'", what="the second chat's answer")
    titles = "[...document.querySelectorAll('#chat-list .chat-item .open')].map(e => e.textContent)"
    assert page.eval(titles)[:2] == ["And of Italy?", "What is the capital of France?"]
    page.click("#chat-list .chat-item:nth-child(2) .open")
    shown = "[...document.querySelectorAll('#messages .msg')].map(e => e.dataset.raw)"
    assert page.eval(shown) == first
    page.call("Page.reload")
    page.wait_for("document.querySelectorAll('#messages .msg').length === 2", what="the restored chat")
    assert page.eval(shown) == first and page.eval(titles)[:2] == ["And of Italy?", "What is the capital of France?"]
    assert page.eval("document.querySelector('#chat-list [aria-current=true] .open').textContent") == \
        "What is the capital of France?"

    page.call("Browser.grantPermissions", permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
    page.click(f"#messages .msg.assistant:last-child .copy")
    page.wait_for(f"{LAST_ANSWER}.dataset.copied", what="the copy")
    assert page.eval("navigator.clipboard.readText()") == first[1]

    page.eval(f"{LAST_ANSWER}.dataset.marker = 'before'")
    page.click("#messages .msg.assistant:last-child .regenerate")
    page.wait_for(f"!{LAST_ANSWER}.dataset.marker && {LAST_ANSWER}.dataset.state === 'done'", what="the new answer")
    assert page.eval(shown) == first  # in place of the old answer, and greedy gives the same text
    model = page.eval("document.getElementById('model').textContent")
    saved = json.loads(page.eval(f"localStorage.getItem({json.dumps('swarmlm-chat/' + model)})"))
    current = next(c for c in saved["chats"] if c["id"] == saved["current"])
    assert [t["content"] for t in current["conversation"]] == first and len(saved["chats"]) >= 2
    page.click("#chat-list [aria-current=true] .delete")  # deleting the shown chat starts a new one
    assert page.eval("document.querySelectorAll('#messages .msg').length") == 0
    assert "What is the capital of France?" not in page.eval(titles)


def test_an_answer_waiting_for_missing_blocks_says_which(page, stack):
    """Last in this module: it takes a server away. The answer waits for blocks [3, 6) (the gateway's
    --wait-for-blocks) and says so, instead of a bare cursor."""
    swarm, _ = stack
    swarm.kill(swarm.servers[1])
    _ask(page, "Hello?", temperature="0", max_tokens="4")
    waiting = page.wait_for(f"{LAST_ANSWER}.dataset.waiting", what="the waiting state")
    assert waiting == "[3, 6)"
    assert page.eval(f"{LAST_ANSWER}.querySelector('.meta').textContent") == \
        "waiting for blocks [3, 6): no server serves them yet"
    page.click("#stop")
    assert page.wait_for(f"{LAST_ANSWER}.dataset.state !== 'streaming' && {LAST_ANSWER}.dataset.state") == "stopped"


def test_a_gateway_serving_a_tuned_model_lets_the_page_choose_it(tiny_llama, tmp_path):
    """Issue 37: with `api --adapter`, the page lists the base model and the tuned one in a menu; the chosen one
    answers (the API's tokens for that id), keeps its own chats, and is still chosen after a reload."""
    import torch

    from swarmlm.client.model import DistributedModelForCausalLM

    tuned = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=["127.0.0.1:1"], dtype="float32",
                                                        tuning_mode="ptune", pre_seq_len=3)  # (never connects)
    with torch.no_grad():
        tuned.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(7))
    tuned.save_adapter(tmp_path / "my-prompt")
    tuned.close()
    with gateway_stack(tiny_llama, tmp_path / "logs", ["--adapter", str(tmp_path / "my-prompt")]) as (_, gateway), \
            Browser(tmp_path / "profile") as page:
        page.open(f"{gateway.url}/chat")
        page.wait_for("document.getElementById('model')?.textContent", what="the model name")
        menu = "document.getElementById('model-choice')"
        assert page.eval(f"[...{menu}.options].map(o => o.value)") == [Path(tiny_llama).name, "my-prompt"]
        assert page.eval(f"!{menu}.hidden && {menu}.value") == Path(tiny_llama).name
        page.eval(f"{menu}.value = 'my-prompt'; {menu}.dispatchEvent(new Event('change'))")
        _ask(page, "Hello there", temperature="0", max_tokens="6")
        page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'", what="the answer")
        shown = page.eval(f"{LAST_ANSWER}.dataset.raw")
        answers = {name: httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120, json={
            "model": name, "temperature": 0, "max_tokens": 6, "messages": [{"role": "user", "content": "Hello there"}],
        }).json()["choices"][0]["message"]["content"] for name in (Path(tiny_llama).name, "my-prompt")}
        assert shown == answers["my-prompt"] and answers["my-prompt"] != answers[Path(tiny_llama).name], answers
        page.call("Page.reload")
        page.wait_for("document.querySelectorAll('#messages .msg').length === 2", what="the restored chat")
        assert page.eval(f"{menu}.value") == "my-prompt"
        page.eval(f"{menu}.value = {json.dumps(Path(tiny_llama).name)}; {menu}.dispatchEvent(new Event('change'))")
        assert page.eval("document.querySelectorAll('#messages .msg').length") == 0  # the base's own chats
