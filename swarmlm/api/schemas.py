"""OpenAI's request and response bodies (the fields swarmlm serves). Unknown request fields are ignored, as
OpenAI's own API does; a known field of the wrong type is a 400 (strict: "5" is not an integer), and so is an
OpenAI field this gateway does not implement (`UNSUPPORTED`: tools, response_format, image parts...), never a
silent 200. Beyond OpenAI's sampling fields: `top_k`, `min_p`, `repetition_penalty` (llama.cpp's
`repeat_penalty` too), as vLLM and llama.cpp's servers take them."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmlm.client.decoding.sampling import SEED_RANGE

MAX_N = 16  # choices per request: each is a session on every server of its route
MAX_PROMPTS = 16  # prompts per completion request (choices = prompts x n, bounded again by the gateway's config)
MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string: each is searched in the text after every token
MIN_TEMPERATURE = 0.01  # below it (and above 0) logits / temperature overflow: 0 is greedy
# OpenAI fields not implemented here -> the value that means "not used" (anything else is a 400 naming the field)
UNSUPPORTED: dict[str, tuple] = {"tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
                                 "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
                                 "logit_bias": ({},), "audio": (), "modalities": (["text"],), "prediction": (),
                                 "web_search_options": (), "echo": (False,), "best_of": (1,), "suffix": ("",)}


def _unicode(text: str) -> str:
    """Text a tokenizer can read: JSON's \\ud800 escapes can carry lone surrogates, which are no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (a lone surrogate)") from None
    return text


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # 0 = greedy; else >= MIN_TEMPERATURE
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stop: str | list[str] | None = Field(default=None, validate_default=True)  # -> list[str]
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream_options: dict | None = None
    top_k: int = Field(default=0, ge=-1)  # 0 or -1 (vLLM's): off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # transformers' (over prompt + output)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # llama.cpp's name for the same
    unsupported: dict[str, Any] = Field(default_factory=dict, exclude=True)  # UNSUPPORTED fields given

    @model_validator(mode="before")
    @classmethod
    def _collect_unsupported(cls, data):
        if isinstance(data, dict):
            given = {k: data[k] for k in UNSUPPORTED
                     if k in data and data[k] is not None and data[k] not in UNSUPPORTED[k]}
            data = {**{k: v for k, v in data.items() if k not in UNSUPPORTED and k != "unsupported"},
                    "unsupported": given}
        return data

    @model_validator(mode="after")
    def _one_penalty(self):
        if None not in (self.repetition_penalty, self.repeat_penalty) and \
                self.repetition_penalty != self.repeat_penalty:
            raise ValueError(f"repetition_penalty ({self.repetition_penalty}) and repeat_penalty "
                             f"({self.repeat_penalty}) disagree: give one")
        return self

    @property
    def penalty(self) -> float:
        """The repetition penalty under either name (1: off)."""
        return self.repetition_penalty or self.repeat_penalty or 1.0

    def unsupported_field(self) -> str | None:
        """The first OpenAI field given that this gateway does not implement, as a path (`messages[0].content[1]`)."""
        return next(iter(self.unsupported), None)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(s == "" or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must have 1 to {MAX_STOP_CHARS} characters")
        return [_unicode(s) for s in stops]

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

    @property
    def generator_seed(self) -> int | None:
        """Any integer seed as a torch generator's seed."""
        return None if self.seed is None else self.seed % SEED_RANGE

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)  # alternatives per token; 0 = the chosen token only

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not 1 <= len(v) <= MAX_PROMPTS:
            raise ValueError(f"prompt must be a string or a list of 1 to {MAX_PROMPTS} strings")
        return _unicode(v) if isinstance(v, str) else [_unicode(p) for p in v]

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class ContentPart(BaseModel):
    """A part of a message's content: text (image, audio and file parts are named by unsupported_field())."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        return None if v is None else _unicode(v)

    @model_validator(mode="after")
    def _text_has_text(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _unicode(v) if isinstance(v, str) else v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported_field(self) -> str | None:
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type != "text":
                    return f"messages[{i}].content[{j}] ({part.type})"
        return super().unsupported_field()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error schema."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
