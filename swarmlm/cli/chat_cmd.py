"""`swarmlm chat --model NAME --initial-peers ADDR [--system TEXT]`: a conversation in the terminal through the
model's chat template (swarmlm/api/prompts.py: a plain "User: ... Assistant:" one for models without).

The answer streams as it is generated. Ctrl-C stops the answer (what was shown stays in the history) and not the
program; `/reset` forgets the conversation, `/exit` or Ctrl-D leaves. With a pipe on stdin, its text is one prompt
and the answer is printed once."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from swarmlm.cli.args import model_ref
from swarmlm.cli.generate_cmd import add_client, add_sampling, connect, sampling_options, stdin_prompt

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops an answer"
# --help lists these first ("common options"), the rest under "advanced options"
COMMON = ("--model", "--initial-peers", "--servers", "--adapter", "--system", "--max-new-tokens", "--do-sample",
          "--temperature")


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with the swarm's model in the terminal")
    add_client(p)
    p.add_argument("--system", metavar="TEXT", help="a system prompt, the first message of every conversation")
    add_sampling(p, max_new_tokens=512)


class Conversation:
    """The messages so far, as (role, content), the system prompt first; `reset` keeps only that."""

    def __init__(self, system: str | None) -> None:
        self.system = [("system", system)] if system else []
        self.messages = list(self.system)

    def reset(self) -> None:
        self.messages = list(self.system)


class _Printer:
    """A transformers streamer that prints each token's text as it comes (a character still missing bytes waits for
    the next token) and keeps the answer's text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.text, self.prompt_skipped = tokenizer, [], "", False

    def put(self, value) -> None:
        if not self.prompt_skipped:  # generate() hands the prompt first
            self.prompt_skipped = True
            return
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        self._show(self.tokenizer.decode(self.ids, skip_special_tokens=True).removesuffix("\ufffd"))

    def end(self) -> None:
        self._show(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        print(flush=True)

    def _show(self, text: str) -> None:
        print(text[len(self.text):] if text.startswith(self.text) else text, end="", flush=True)
        self.text = text


class CtrlC:
    """SIGINT while an answer is generated stops it (a stopping criterion checked after each token: the answer ends
    cleanly, its session closed as after any answer); anywhere else it is the usual KeyboardInterrupt."""

    def __init__(self) -> None:
        self.answering = False
        self.stop = threading.Event()

    def _handler(self, signum, frame) -> None:
        if not self.answering:
            raise KeyboardInterrupt
        self.stop.set()

    @contextlib.contextmanager
    def installed(self):
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def answer(self):
        self.stop.clear()
        self.answering = True
        try:
            yield
        finally:
            self.answering = False

    def criterion(self):
        from transformers import StoppingCriteria

        stop = self.stop

        class OnCtrlC(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                import torch

                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool)

        return OnCtrlC()


def fitted_ids(tokenizer, conversation: Conversation, context_tokens: int | None) -> list[int]:
    """The conversation's prompt, its oldest turns dropped (the system prompt kept) until the prompt and the answer
    fit the model's context."""
    from swarmlm.api.prompts import encode_chat

    ids = encode_chat(tokenizer, conversation.messages)
    while context_tokens is not None and len(ids) > context_tokens:
        turns = conversation.messages[len(conversation.system):]
        if len(turns) <= 1:
            raise ValueError(f"the message takes {len(ids)} tokens: more than the model's context allows")
        conversation.messages = conversation.system + turns[2:]  # one question and its answer
        print("(the oldest turn no longer fits the model's context: forgotten)", file=sys.stderr, flush=True)
        ids = encode_chat(tokenizer, conversation.messages)
    return ids


def answer(model, tokenizer, conversation: Conversation, args: argparse.Namespace, ctrl_c: CtrlC) -> str:
    """Generates the reply to the conversation, streaming it; returns its text (cut where Ctrl-C stopped it)."""
    import torch
    from transformers import StoppingCriteriaList

    positions = getattr(model.config, "max_position_embeddings", None)
    ids = torch.tensor([fitted_ids(tokenizer, conversation, positions and positions - args.max_new_tokens)])
    printer = _Printer(tokenizer)
    with ctrl_c.answer():
        model.generate(ids, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer, streamer=printer,
                       stopping_criteria=StoppingCriteriaList([ctrl_c.criterion()]),
                       generator=torch.Generator().manual_seed(args.seed), **sampling_options(args))
    if ctrl_c.stop.is_set():
        print("[stopped]", file=sys.stderr, flush=True)
    return printer.text


def _read_line() -> str | None:
    """The user's next line; None at the end (Ctrl-D); Ctrl-C at the prompt only clears the line."""
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:
            print(f"\n({HELP})")


def _interactive(model, tokenizer, conversation: Conversation, args: argparse.Namespace, ctrl_c: CtrlC) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    while (line := _read_line()) is not None:
        text = line.strip()
        if text in ("/exit", "/bye", "/quit"):
            return
        if text == "/reset":
            conversation.reset()
            print("(the conversation is forgotten)")
        elif text.startswith("/"):
            print(f"(unknown command {text.split()[0]}: {HELP})")
        elif text:
            conversation.messages.append(("user", text))
            try:
                reply = answer(model, tokenizer, conversation, args, ctrl_c)
            except KeyboardInterrupt:  # Ctrl-C before the answer began
                print("[stopped]", file=sys.stderr, flush=True)
                reply = ""
            except ValueError as exc:  # a message longer than the context: the conversation goes on without it
                print(f"({exc})", file=sys.stderr, flush=True)
                conversation.messages.pop()
                continue
            conversation.messages.append(("assistant", reply.strip()))


def run(args: argparse.Namespace) -> int:
    model_name = model_ref(args)  # a bad path fails before the slow imports
    piped = sys.stdin is not None and not sys.stdin.isatty()
    prompt = stdin_prompt("chat") if piped else None
    from swarmlm.collector import freeze_start_up
    from swarmlm.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    template = "the model's chat template" if getattr(tokenizer, "chat_template", None) else \
        "a plain User:/Assistant: template (the model has no chat template)"
    conversation = Conversation(args.system)
    model = connect(args, model_name)
    freeze_start_up()  # a conversation may last hours: start-up's heap out of every collection (swarmlm/collector.py)
    try:
        with CtrlC().installed() as ctrl_c:
            if prompt is not None:
                conversation.messages.append(("user", prompt))
                answer(model, tokenizer, conversation, args, ctrl_c)
            else:
                tuned = f" tuned by {args.adapter}" if args.adapter else ""
                print(f"chatting with {args.model}{tuned} through {template}; {HELP}", file=sys.stderr, flush=True)
                _interactive(model, tokenizer, conversation, args, ctrl_c)
    finally:
        model.close()
    return 0
