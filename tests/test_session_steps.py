"""Which thread carries a session's step (client/session.py): on framed streams, a decode step and a prompt short
enough to go whole (on a route not pushed) run from the caller's own thread; a prompt split into several chunks, or
pushed, goes through the client's loop thread. All give transformers' tokens. "Whole" is asked for (chunking off):
the automatic size follows measured links and forward times, and on a busy machine it may split even this prompt."""
from __future__ import annotations

import torch

from swarmlm.types import BlockRange
from tests.swarm_helpers import client_of, greedy_reference, server_processes


def test_a_whole_prompt_runs_from_the_callers_thread_and_a_chunked_one_through_the_loop(tiny_llama):
    ids, want = greedy_reference(tiny_llama, "a prompt of a few tokens, sent whole or in chunks", 4)
    assert ids.shape[1] > 4
    with server_processes(tiny_llama, [BlockRange(0, 3), BlockRange(3, 6)], dht=False) as swarm:
        for chunk, framed, push, blocking in ((0, True, False, True), (2, True, False, False),
                                              (0, True, True, False), (0, False, False, False)):
            client = client_of(swarm, frames=framed, push=push, prefill_chunk_tokens=chunk)
            try:
                with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
                    logits = client.step_logits(session, ids)
                    got = [int(logits[0, -1].argmax())]
                    for _ in range(3):
                        got.append(int(client.step_logits(session, torch.tensor([[got[-1]]]))[0, -1].argmax()))
                assert got == want, (chunk, framed, push)
                prompt = session.steps[0]
                assert prompt.n_tokens == ids.shape[1]
                assert prompt.chunks == (1 if chunk == 0 else -(-ids.shape[1] // 2))
                assert prompt.blocking is blocking and prompt.pushed is push, (chunk, framed, push)
                assert [s.blocking for s in session.steps[1:]] == [framed] * 3
            finally:
                client.close()


def test_decode_steps_keep_one_mask_and_their_hang_bounds_until_the_record_changes(tiny_llama, monkeypatch):
    """A decode step without a mask makes none: the session keeps one all-ones mask per shape, and every step's
    history entry holds that same tensor. A padded mask given by the caller is the step's own. Relayed, the second
    hop's request carries the first reply's float32 bytes as they came (one encode per step: the first hop's, a
    compact STEP's or a protobuf tensor's). A
    decode step's hang bound is the one pipeline.hang_timeout_s gives for the span's server record, worked out
    again when a new record (another announced profile) replaces it."""
    import dataclasses

    from swarmlm.client import streams
    from swarmlm.client.pipeline import hang_timeout_s
    from swarmlm.client.router import profile_of

    encoded = []
    encode_hidden = streams.compress.encode_hidden
    monkeypatch.setattr(streams.compress, "encode_hidden", lambda h, w: encoded.append(w) or encode_hidden(h, w))
    float32_values = streams.compact.float32_values  # (a compact STEP's encode: wire/compact.py)
    monkeypatch.setattr(streams.compact, "float32_values", lambda h: encoded.append("float32") or float32_values(h))
    with server_processes(tiny_llama, [BlockRange(0, 3), BlockRange(3, 6)], dht=False) as swarm:
        # (the hops in Python: the C chain, client/relay.py, builds its STEPs without a Python encode)
        client = client_of(swarm, frames=True, push=False, relay_in_c=False)
        try:
            with torch.no_grad(), client.inference_session(max_length=16) as session:
                client.step_logits(session, torch.tensor([[5, 6, 7]]))
                for token in (8, 9):
                    encoded.clear()
                    client.step_logits(session, torch.tensor([[token]]))
                    assert encoded == ["float32"]
                padded = torch.tensor([[0]])
                client.step_logits(session, torch.tensor([[10]]), attention_mask=padded)
                history = session.spans[0].history
                assert history[1][1] is history[2][1] and history[1][1].tolist() == [[1]]
                assert history[3][1] is not history[1][1] and history[3][1].tolist() == [[0]]
                assert [s.blocking for s in session.steps[1:]] == [True] * 3

                span, view = session.spans[0].span, client.remote.view
                config = client.remote.config

                def expected() -> float:
                    return hang_timeout_s(config, profile_of(view.records[span.server_id]), span, 1, 1, True)

                assert session.hang_timeout_s(span, 1, 1, True) == expected()
                record = view.records[span.server_id]
                view.records[span.server_id] = dataclasses.replace(record, decode_s=record.decode_s + 1.0)
                assert session.hang_timeout_s(span, 1, 1, True) == expected() > \
                    hang_timeout_s(config, profile_of(record), span, 1, 1, True)
        finally:
            client.close()
