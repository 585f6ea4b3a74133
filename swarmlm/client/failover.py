"""Failover: a broken span's blocks routed again from a fresh view of the swarm, the replacement chain opened and
replayed the span's history so its caches match; bounded attempts, each failed server banned (docs/FAILURES.md).
`session` is the client/session.py InferenceSession whose step broke; this module uses its public surface only
(open_spans, close_spans, hang_timeout_s, remote, prompt, prefix_context, the routing hints)."""
from __future__ import annotations

import logging

import torch

from swarmlm.client.pipeline import Chunk, Hop, OpenSpan
from swarmlm.client.remote import report_failure
from swarmlm.errors import ServerFailed, ServerTampered
from swarmlm.types import Route, Span

log = logging.getLogger(__name__)


async def replace_hop(session, hop: Hop, exc: ServerFailed | None, record) -> list[Hop]:
    """A new chain over the hop's blocks, its caches rebuilt from the span's history; bounded attempts, each
    failed server banned. The new hops carry on from the chunks the old one answered."""
    broken = hop.open_span
    await session.close_spans([broken])
    loop = session.remote.loop.loop
    while True:
        if exc is None:
            record.reopened += 1
            log.info("reopening blocks [%d, %d) left mid-step", broken.span.start, broken.span.end)
        else:
            record.failovers += 1
            if record.failovers > session.remote.config.max_retries:
                raise exc
            session.remote.view.ban(exc.server_id, tampered=isinstance(exc, ServerTampered))
            report_failure(session.remote.reported, exc.server_id, f"failover: {exc}; re-routing blocks "
                           f"[{broken.span.start}, {broken.span.end})", exc)
        # route the broken part again from a fresh view of the swarm (blocking DHT reads go to a thread)
        route = await loop.run_in_executor(None, _reroute, session, broken.span)
        try:
            replacement = await session.open_spans(route.spans)
        except ServerFailed as again:
            exc = again
            continue
        try:
            await _replay(session, await _history_of(session, broken), replacement)
        except ServerFailed as again:
            await session.close_spans(replacement)
            exc = again
            continue
        done = hop.answered
        hops = [Hop(s, [None] * done, written=done) for s in replacement]
        hops[-1].outputs = list(hop.outputs)  # the chain's answers so far are the broken span's
        return hops


def _reroute(session, span: Span) -> Route:
    return session.remote.route(span.start, span.end, session.l_in_hint, session.l_out_hint, session.batch,
                                session.max_length, refresh=True)


async def _history_of(session, broken: OpenSpan) -> list[Chunk]:
    """A span's inputs to replay: its history, after the inputs of the cached prefix it started from (never
    sent: the embeddings of those tokens, run through fresh sessions over the blocks before the span)."""
    if not broken.prefix_tokens:
        return broken.history
    ids = torch.tensor([session.prompt[:broken.prefix_tokens]])
    hidden = session.prefix_context.embed(ids)
    if broken.span.start > 0:
        loop = session.remote.loop.loop
        route = await loop.run_in_executor(None, lambda: session.remote.route(
            0, broken.span.start, broken.prefix_tokens, 1, 1, session.max_length, refresh=True))
        upstream = await session.open_spans(route.spans)
        try:
            for s in upstream:
                bound = session.hang_timeout_s(s.span, 1, broken.prefix_tokens, cached=False)
                hidden, _ = await s.stream.step(hidden, None, bound)
        finally:
            await session.close_spans(upstream)
    rows = torch.tensor(broken.prefix_rows)
    return [(hidden[rows], torch.ones(len(rows), broken.prefix_tokens, dtype=torch.long)), *broken.history]


async def _replay(session, history: list[Chunk], spans: list[OpenSpan]) -> None:
    """Send the broken span's past inputs through its replacement chain so their caches match."""
    if not history:
        return
    hidden = torch.cat([h for h, _ in history], dim=1)
    mask = torch.cat([m for _, m in history], dim=1)
    for opened in spans:
        bound = session.hang_timeout_s(opened.span, *hidden.shape[:2], cached=bool(opened.history))
        out, _ = await opened.stream.step(hidden, mask, bound)
        opened.answered(hidden, mask)
        hidden = out
