"""Engine events (Piece, Finish) -> OpenAI's response bodies and stream chunks, for completions and chat.

One extension field: each finished choice (in the whole response, and in its finish chunk when streamed) carries
`"swarmlm": {"route": [{"server_id", "address", "blocks": [start, end)}, ...]}`, the servers it went through.
"""
from __future__ import annotations

from typing import Sequence

from swarmlm.api.engine import Finish, Piece, Token
from swarmlm.api.schemas import now_s


def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "swarmlm"}


def swarm_extension(finish: Finish) -> dict:
    """The non-OpenAI field of a finished choice: its route (clients that do not know it ignore it)."""
    return {"route": [{"server_id": s.server_id, "address": s.address, "blocks": [s.start, s.end]}
                      for s in finish.route]}


class Renderer:
    object_whole = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str, tokenizer, req, prompts: Sequence[Sequence[int]]) -> None:
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.req = req
        self.created = now_s()
        self.choices = len(prompts) * req.n
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0

    # ---- the whole response --------------------------------------------------------------------------------
    def whole(self, events: Sequence[Piece | Finish]) -> dict:
        pieces: dict[int, list[Piece]] = {i: [] for i in range(self.choices)}
        finishes: dict[int, Finish] = {}
        for e in events:
            if isinstance(e, Piece):
                pieces[e.index].append(e)
            else:
                finishes[e.index] = e
                self.completion_tokens += e.completion_tokens
        choices = []
        for i in range(self.choices):
            finish = finishes.get(i)
            choices.append(self._finished(self.whole_choice(i, pieces[i], finish.reason if finish else "length"),
                                          finish))
        return {"id": self.id, "object": self.object_whole, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    # ---- streaming ------------------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        return []

    def chunk(self, event: Piece | Finish) -> list[dict]:
        if isinstance(event, Finish):
            self.completion_tokens += event.completion_tokens
            return [self._chunk(self._finished(self.finish_choice(event), event))]
        return [self._chunk(self.piece_choice(event))]

    @staticmethod
    def _finished(choice: dict, finish: Finish | None) -> dict:
        return {**choice, "swarmlm": swarm_extension(finish)} if finish is not None else choice

    def end(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [{**self._chunk(None), "choices": [], "usage": self.usage()}]

    def _chunk(self, choice: dict | None) -> dict:
        return {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
                "choices": [choice] if choice else []}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # per endpoint
    def whole_choice(self, index: int, pieces: list[Piece], reason: str) -> dict:
        raise NotImplementedError

    def piece_choice(self, piece: Piece) -> dict:
        raise NotImplementedError

    def finish_choice(self, finish: Finish) -> dict:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object_whole = object_chunk = "text_completion"

    def _logprobs(self, tokens: list[Token], offset: int = 0) -> dict | None:
        if self.req.logprobs is None:
            return None
        texts = [self.token_text(t.id) for t in tokens]
        offsets, at = [], offset
        for t in texts:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self.token_text(i): lp for i, lp in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def whole_choice(self, index: int, pieces: list[Piece], reason: str) -> dict:
        tokens = [p.token for p in pieces if p.token is not None]
        return {"index": index, "text": "".join(p.text for p in pieces), "logprobs": self._logprobs(tokens),
                "finish_reason": reason}

    def piece_choice(self, piece: Piece) -> dict:
        tokens = [piece.token] if piece.token is not None else []
        return {"index": piece.index, "text": piece.text, "logprobs": self._logprobs(tokens) if tokens else None,
                "finish_reason": None}

    def finish_choice(self, finish: Finish) -> dict:
        return {"index": finish.index, "text": "", "logprobs": None, "finish_reason": finish.reason}


class ChatRenderer(Renderer):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, tokens: list[Token]) -> dict | None:
        if not self.req.logprobs:
            return None
        return {"content": [{**self._entry(t.id, t.logprob), "top_logprobs": [self._entry(i, lp) for i, lp in t.top]}
                            for t in tokens]}

    def whole_choice(self, index: int, pieces: list[Piece], reason: str) -> dict:
        tokens = [p.token for p in pieces if p.token is not None]
        return {"index": index, "message": {"role": "assistant", "content": "".join(p.text for p in pieces)},
                "logprobs": self._logprobs(tokens), "finish_reason": reason}

    def start(self) -> list[dict]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.choices)]

    def piece_choice(self, piece: Piece) -> dict:
        tokens = [piece.token] if piece.token is not None else []
        return {"index": piece.index, "delta": {"content": piece.text},
                "logprobs": self._logprobs(tokens) if tokens else None, "finish_reason": None}

    def finish_choice(self, finish: Finish) -> dict:
        return {"index": finish.index, "delta": {}, "logprobs": None, "finish_reason": finish.reason}
