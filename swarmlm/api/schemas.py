"""OpenAI's request and response bodies (the fields swarmlm serves). Unknown request fields are ignored, as
OpenAI's own API does; a known field of the wrong type is a 400 (strict: "5" is not an integer)."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16  # choices per request: each is a session on every server of its route
MAX_PROMPTS = 16  # prompts per completion request (choices = prompts x n, bounded again by the gateway's config)
MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string: each is searched in the text after every token
MIN_TEMPERATURE = 0.01  # below it (and above 0) logits / temperature overflow: 0 is greedy
SEED_RANGE = 2 ** 64  # torch generators take seeds in [0, 2**64): any integer is taken modulo this


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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, v: str) -> str:
        return _unicode(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _unicode(v) if isinstance(v, str) else v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error schema."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
