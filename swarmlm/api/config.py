"""The gateway's settings: one frozen dataclass, every limit with its unit; `swarmlm api`'s flags take their
defaults from it (cli/api_cmd.py). Light on purpose: the CLI imports it to build its flags."""
from __future__ import annotations

from dataclasses import dataclass

from swarmlm.perf.speculation import parse_mode

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # Host header names answered unless more are allowed


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str  # the base model's id: clients send it as "model", responses and pages carry it (never a path)
    adapter_names: tuple[str, ...] = ()  # the ids of the tuned models served beside it (create_app's `adapters`)
    model_aliases: tuple[tuple[str, str], ...] = ()  # (alias, id): other names accepted as "model" (--model or
    # --adapter as given), answered as the id, never shown
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <key>"
    max_streams_per_client: int = 32  # concurrent choices (sessions) per API key, or per client IP without one
    max_choices_per_request: int = 16  # prompts x n of one request (each a session on every server of its route)
    max_prompt_chars: int = 262_144  # characters of a request's prompts or messages, checked before tokenizing
    max_body_bytes: int = 2 << 20  # a larger request body is refused (413) before it is read
    header_timeout_s: float = 10.0  # a connection's next request headers must arrive within this, or it is closed
    body_timeout_s: float = 30.0  # a body must arrive within this (408)
    request_timeout_s: float = 600.0  # a request still generating after this ends with 504 (the backstop)
    allowed_hosts: tuple[str, ...] = LOCAL_HOSTS  # Host header names answered ("*": any)
    default_context_tokens: int = 2048  # when neither the model config nor the servers state a limit
    view_refresh_s: float = 1.0  # a refused request re-reads the swarm at most this often
    speculative: str | int = "off"  # every choice: "off", "auto" or a fixed draft length (client/decoding/decoder.py)

    def __post_init__(self) -> None:
        ids = (self.model_name, *self.adapter_names)
        if not all(ids) or len(set(ids)) < len(ids):
            raise ValueError(f"served model ids must be distinct and not empty, got {list(ids)}")
        if any(target not in ids for _, target in self.model_aliases):
            raise ValueError(f"model_aliases {list(self.model_aliases)} must name served ids {list(ids)}")
        if self.max_streams_per_client < 1 or self.default_context_tokens < 2:
            raise ValueError(f"max_streams_per_client ({self.max_streams_per_client}) must be >= 1 and "
                             f"default_context_tokens ({self.default_context_tokens}) >= 2")
        if min(self.max_choices_per_request, self.max_prompt_chars, self.max_body_bytes) < 1:
            raise ValueError(f"max_choices_per_request ({self.max_choices_per_request}), max_prompt_chars "
                             f"({self.max_prompt_chars}) and max_body_bytes ({self.max_body_bytes}) must be >= 1")
        try:
            parse_mode(self.speculative)
        except ValueError as exc:
            raise ValueError(f"speculative: {exc}") from None
        if min(self.header_timeout_s, self.body_timeout_s, self.request_timeout_s) <= 0 or not self.allowed_hosts:
            raise ValueError(f"header_timeout_s ({self.header_timeout_s}), body_timeout_s ({self.body_timeout_s}) and "
                             f"request_timeout_s ({self.request_timeout_s}) must be > 0 and allowed_hosts not empty")

    @property
    def choices_limit(self) -> int:
        """Choices one request may ask for: it must fit the client's own limit too."""
        return min(self.max_choices_per_request, self.max_streams_per_client)
