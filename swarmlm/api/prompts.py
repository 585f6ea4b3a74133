"""Text in, token ids out: prompts as `tokenizer(prompt)` encodes them, chats through the tokenizer's template.

A tokenizer without a chat template (swarmlm's test checkpoints, many base models) gets a plain one:

    System: {system message}
    User: {user message}
    Assistant: {assistant message}
    Assistant:

one line per message ("Role: content\\n"), ending with "Assistant:" for the reply, encoded as a prompt is.
"""
from __future__ import annotations

from typing import Sequence

FALLBACK_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])


def fallback_chat_text(messages: Sequence[tuple[str, str]]) -> str:
    """[(role, content)] -> the plain template's text."""
    return "".join(f"{FALLBACK_ROLES[role]}: {content}\n" for role, content in messages) + "Assistant:"


def encode_chat(tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=True, tokenize=False,
        )
        # the template writes the special tokens itself (as apply_chat_template(tokenize=True) encodes it)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return encode_prompt(tokenizer, fallback_chat_text(messages))
