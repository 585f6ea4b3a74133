"""`swarmlm chat` as a user meets it, in a pseudo-terminal against a real swarm: a system prompt, two turns, Ctrl-C
in the middle of an answer (the program goes on), /reset, Ctrl-D; every answer the tokens the client's generate()
gives for the same conversation through the model's chat template. And `generate` on a model with a template."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time

import pytest
import torch

from swarmlm.api.prompts import encode_chat
from swarmlm.types import BlockRange
from tests.swarm_helpers import client_of, in_process_swarm

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
SYSTEM = "You answer in one word."
MAX_NEW = 400  # tokens: an answer of some seconds, that Ctrl-C stops in the middle
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory) -> str:
    """tiny-llama with a chat template in its tokenizer_config.json, as instruct models have."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "tiny-llama-chat"
    shutil.copytree(tiny_llama, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def swarm_and_client(chat_model):
    with in_process_swarm(chat_model, [BlockRange(0, 3), BlockRange(3, 6)]) as swarm:
        client = client_of(swarm)
        try:
            yield swarm, client
        finally:
            client.close()


def reply(client, messages, max_new_tokens: int = MAX_NEW) -> tuple[list[int], str]:
    from swarmlm.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(client.model_dir)
    ids = torch.tensor([encode_chat(tokenizer, messages)])
    new = client.generate(ids, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


class Terminal:
    """A command in a pseudo-terminal of its own (its controlling terminal: Ctrl-C there is SIGINT)."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.execvpe(argv[0], argv, {**os.environ, "TERM": "dumb", "COLUMNS": "200"})
        self.seen = ""

    def read_until(self, marker: str, timeout_s: float = 300.0, min_chars: int = 0) -> str:
        """Everything printed up to `marker` (consumed), escape codes removed, lines ending in \\n; with
        `min_chars`, at least that much printed first."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.seen or len(self.seen) < min_chars:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.seen!r}"
            if select.select([self.fd], [], [], 1.0)[0]:
                try:
                    chunk = os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child is gone
                    raise AssertionError(f"exited before {marker!r}: {self.seen!r}") from None
                self.seen = ANSI.sub("", self.seen + chunk).replace("\r\n", "\n")
        if not marker:
            return ""
        head, _, self.seen = self.seen.partition(marker)
        return head

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            with_data = select.select([self.fd], [], [], 0.2)[0]
            if with_data:
                try:
                    os.read(self.fd, 4096)
                except OSError:
                    pass
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def answer_of(terminal: Terminal, question: str) -> str:
    terminal.send(question + "\r")
    shown = terminal.read_until(">>> ")
    return shown.partition(question + "\n")[2]  # after the echo of the question


def test_chat_in_a_terminal(chat_model, swarm_and_client):
    swarm, client = swarm_and_client
    first, second = "What is the capital of France?", "And of Spain?"
    after_first = [("system", SYSTEM), ("user", first)]
    _, answer1 = reply(client, after_first)
    after_first.append(("assistant", answer1.strip()))
    _, answer2 = reply(client, [*after_first, ("user", second)])
    long_answers = ((q, reply(client, [*after_first, ("user", q)]))
                    for q in ("Tell me a story.", "Write a poem.", "Explain the sky.", "Count to ten."))
    long_question, (_, answer3) = next((q, r) for q, r in long_answers if len(r[0]) == MAX_NEW)  # no early end

    terminal = Terminal([sys.executable, "-m", "swarmlm.cli.main", "chat", "--model", chat_model,
                         "--servers", *swarm.addresses, "--system", SYSTEM, "--max-new-tokens", str(MAX_NEW)])
    try:
        banner = terminal.read_until(">>> ")
        assert "through the model's chat template" in banner
        assert answer_of(terminal, first).strip() == answer1.strip()
        assert answer_of(terminal, second).strip() == answer2.strip()  # the first turn in its history

        terminal.send("/reset\r")
        assert "forgotten" in terminal.read_until(">>> ")
        assert answer_of(terminal, first).strip() == answer1.strip()  # as in a new conversation

        terminal.send(long_question + "\r")
        terminal.read_until(long_question + "\n")
        terminal.read_until("", min_chars=1)  # the answer has begun
        terminal.send("\x03")  # Ctrl-C
        shown = terminal.read_until("[stopped]").replace("^C", "")  # the terminal's echo of Ctrl-C
        shown = shown.strip().rstrip("\ufffd")  # a character cut in its bytes
        terminal.read_until(">>> ")  # and the chat goes on
        assert answer3.strip().startswith(shown) and len(shown) < len(answer3.strip())
        terminal.send("\x04")  # Ctrl-D
        assert terminal.wait() == 0
    finally:
        terminal.close()


def _swarmlm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_chat_reads_a_piped_prompt(chat_model, swarm_and_client):
    swarm, client = swarm_and_client
    _, expected = reply(client, [("system", SYSTEM), ("user", "What is the capital of France?")], 12)
    done = _swarmlm("chat", "--model", chat_model, "--servers", *swarm.addresses, "--system", SYSTEM,
                    "--max-new-tokens", "12", stdin="What is the capital of France?\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.strip()


def test_generate_applies_the_chat_template_and_says_so(chat_model, swarm_and_client):
    from swarmlm.model.checkpoint import load_tokenizer

    swarm, client = swarm_and_client
    templated, _ = reply(client, [("user", "Hello there")], 8)
    common = ("generate", "--model", chat_model, "--servers", *swarm.addresses, "--max-new-tokens", "8", "--json")
    done = _swarmlm(*common, "--prompt", "Hello there")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == templated
    assert "chat template" in done.stderr and "--raw" in done.stderr

    raw = _swarmlm(*common, "--raw", stdin="Hello there")  # and the prompt from a pipe
    ids = load_tokenizer(chat_model)("Hello there", return_tensors="pt").input_ids
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout)["token_ids"] == client.generate(ids, max_new_tokens=8)[0, ids.shape[1]:].tolist()
    assert "chat template" not in raw.stderr


def test_the_oldest_turns_make_room_when_the_conversation_outgrows_the_context(chat_model):
    from swarmlm.cli.chat_cmd import Conversation, fitted_ids
    from swarmlm.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(chat_model)
    conversation = Conversation(SYSTEM)
    for i in range(6):
        conversation.messages += [("user", f"Question {i} about the sea."), ("assistant", f"Answer {i} of the sea.")]
    conversation.messages.append(("user", "The last question."))
    last_two_turns = [conversation.messages[0], *conversation.messages[-5:]]
    limit = len(encode_chat(tokenizer, last_two_turns))
    ids = fitted_ids(tokenizer, conversation, limit)
    assert conversation.messages == last_two_turns and ids == encode_chat(tokenizer, last_two_turns)
    with pytest.raises(ValueError, match="more than the model's context"):
        fitted_ids(tokenizer, _with(Conversation(SYSTEM), "a long question " * 50), 40)


def _with(conversation, question: str):
    conversation.messages.append(("user", question))
    return conversation
