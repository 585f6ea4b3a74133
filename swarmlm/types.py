"""Plain data exchanged between components: block ranges, spans, routes.

Block ranges are half-open `[start, end)` and count from 0 everywhere.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from swarmlm.errors import InvalidRequest


class StepKind(enum.Enum):
    """What a step is, for everything that orders steps (the client's and a pushing server's link schedulers, the
    server's compute rounds): decode steps go first."""

    DECODE = "decode"  # one new token per sequence: small, latency-critical
    PREFILL = "prefill"  # several tokens: a prompt, a chunk of one, or a failover replay
    # a member is its one object (Enum compares by identity): the C identity hash, not Enum's Python `__hash__`
    # (hash of its name: two Python-level calls per dict lookup, e.g. the link's written counts on every step)
    __hash__ = object.__hash__

    @classmethod
    def of(cls, n_tokens: int) -> "StepKind":
        """The kind of a step carrying `tokens` new tokens per sequence."""
        return cls.DECODE if n_tokens == 1 else cls.PREFILL


@dataclass(frozen=True, order=True)
class BlockRange:
    start: int  # first block served
    end: int  # one past the last block served

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"block range [{self.start}, {self.end}) is empty or negative")

    @property
    def length(self) -> int:
        return self.end - self.start

    def contains(self, other: "BlockRange") -> bool:
        return self.start <= other.start and other.end <= self.end

    @classmethod
    def parse(cls, text: str) -> "BlockRange":
        """'3:7' -> [3, 7)."""
        try:
            start, end = (int(part) for part in text.split(":"))
        except ValueError as exc:
            raise ValueError(f"block range must look like START:END, got {text!r}") from exc
        return cls(start, end)

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


@dataclass(frozen=True)
class Span:
    """One hop of a route: `server_id` runs blocks `[start, end)`; `address` is where to reach it (host:port)."""

    server_id: str
    start: int
    end: int
    address: str = ""

    @property
    def blocks(self) -> BlockRange:
        return BlockRange(self.start, self.end)

    @property
    def length(self) -> int:
        return self.end - self.start

    def describe(self, id_chars: int | None = None) -> str:
        """For people (logs, tables, CSV): "id[start:end)" (the id's last `id_chars` characters, if given). Code reads
        the fields, never this string."""
        return f"{self.server_id[-id_chars:] if id_chars else self.server_id}[{self.start}:{self.end})"


def describe_spans(spans, id_chars: int | None = None) -> str:
    return " -> ".join(s.describe(id_chars) for s in spans)


@dataclass(frozen=True)
class Route:
    """An ordered chain of spans that together cover blocks [0, num_blocks) without gaps or overlaps."""

    spans: tuple[Span, ...]

    def __post_init__(self) -> None:
        for prev, nxt in zip(self.spans, self.spans[1:]):
            if prev.end != nxt.start:
                raise ValueError(f"route has a gap or overlap between {prev} and {nxt}")

    @property
    def start(self) -> int:
        return self.spans[0].start if self.spans else 0

    @property
    def end(self) -> int:
        return self.spans[-1].end if self.spans else 0

    def describe(self) -> str:
        return describe_spans(self.spans)


@dataclass(frozen=True)
class CacheOp:
    """An edit of a session's attention caches, applied before a step's tokens are written: keep the first
    `truncate_to` tokens (None: all), and take rows `rows` (new row i = old row rows[i]; None: unchanged). The two
    commute (one cuts positions, the other picks sequences), so an op is one of each at most."""

    truncate_to: int | None = None  # tokens kept
    rows: tuple[int, ...] | None = None  # old row of each new row; a row may appear several times (copies)

    def __post_init__(self) -> None:
        if self.truncate_to is not None and self.truncate_to < 0:
            raise ValueError(f"truncate_to must be >= 0, got {self.truncate_to}")
        if self.rows is not None and (not self.rows or min(self.rows) < 0):
            raise ValueError(f"rows must be a non-empty list of row indices, got {self.rows}")

    def then(self, later: "CacheOp") -> "CacheOp":
        """This op followed by `later`, as one op."""
        cuts = [t for t in (self.truncate_to, later.truncate_to) if t is not None]
        rows = self.rows if later.rows is None else (
            later.rows if self.rows is None else tuple(self.rows[i] for i in later.rows))
        return CacheOp(min(cuts) if cuts else None, rows)

    def kept(self, position: int) -> int:
        """Tokens a session holding `position` keeps."""
        return position if self.truncate_to is None else min(self.truncate_to, position)

    def rows_after(self, rows: int) -> int:
        return rows if self.rows is None else len(self.rows)

    def check(self, position: int, rows: int, reserved_rows: int) -> tuple[int, int | None]:
        """For a session holding `position` tokens in `rows` rows, with `reserved_rows` reserved at open: the tokens
        kept, and the rows the step must then have (None: any up to `reserved_rows`, as the session holds nothing).
        InvalidRequest when the op does not fit the session (the one rule of client and server)."""
        if self.truncate_to is not None and self.truncate_to > position:
            raise InvalidRequest(f"cache_op: truncate_to {self.truncate_to} is past the {position} tokens the "
                                 "session holds")
        kept = self.kept(position)
        if self.rows is not None:
            if kept == 0:
                raise InvalidRequest("cache_op: rows of a session that holds no tokens (send the rows instead)")
            if len(self.rows) > reserved_rows:
                raise InvalidRequest(f"cache_op: {len(self.rows)} rows exceed the batch of {reserved_rows} reserved "
                                     "at open")
            if max(self.rows) >= rows:
                raise InvalidRequest(f"cache_op: row {max(self.rows)} is out of range: the session has {rows} rows")
        return kept, (self.rows_after(rows) if kept else None)
