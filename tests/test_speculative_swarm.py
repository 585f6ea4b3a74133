"""Speculative generation through server processes: the tokens of plain transformers greedy decoding, drafts accepted
and rejected (the servers' caches truncated with the next step), and a server SIGKILLed mid-generation."""
from __future__ import annotations

import signal

import pytest
import torch

from tests.swarm_helpers import reference_model

torch.set_num_threads(1)

# a prompt that quotes itself (prompt lookup finds matches at once) and an open-ended one
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [101, 7, 230, 42, 17, 33]]  # no bos/eos/pad ids
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def swarm(twice_covered_swarm):
    return twice_covered_swarm


def greedy(path: str, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = reference_model(path).generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [4, "auto"])
def test_speculative_greedy_gives_plain_greedy_tokens(swarm, mode):
    _, client, path, _ = swarm
    drafted = accepted = 0
    for prompt in PROMPTS:
        out = client.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False, eos_token_id=None,
                              speculative=mode)
        assert out[0, len(prompt):].tolist() == greedy(path, prompt)
        spec = client.last_stats.speculation
        assert spec is not None and spec["tokens"] == NEW_TOKENS - 1  # the prefill chose the first token
        drafted += spec["drafted"]
        accepted += spec["accepted"]
    if mode == 4:
        assert drafted > 0 and 0 < accepted < drafted  # both branches: drafts kept and drafts rolled back


class KillAfter:
    """A streamer that SIGKILLs the server of `position` in the route once `tokens` new tokens have come out."""

    def __init__(self, local, session, position: int, n_tokens: int) -> None:
        self.local, self.session, self.position, self.n_tokens = local, session, position, n_tokens
        self.seen = -1  # the prompt comes first
        self.killed = None

    def put(self, value: torch.Tensor) -> None:
        self.seen += 1 if self.seen < 0 else value.numel()
        if self.killed is None and self.seen >= self.n_tokens:
            victim_id = self.session.spans[self.position].span.server_id
            self.killed = next(s for s in self.local.servers if s.server_id == victim_id)
            self.local.kill(self.killed, signal.SIGKILL)
            self.killed.proc.wait(60)

    def end(self) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("position", [0, 1])
def test_a_server_killed_during_speculative_generation_changes_nothing(swarm, position):
    local, client, path, ranges = swarm
    prompt = PROMPTS[0]
    with client.inference_session(max_length=len(prompt) + NEW_TOKENS + 8) as session:
        killer = KillAfter(local, session, position, n_tokens=6)
        out = client.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              speculative=4, streamer=killer, session=session)
    assert killer.killed is not None
    assert out[0, len(prompt):].tolist() == greedy(path, prompt)
    assert sum(r.failovers for r in client.last_stats.steps) >= 1
    local.servers.remove(killer.killed)  # restore: every block served twice again
    local.start_server(ranges[position])


@pytest.mark.slow
def test_speculative_sampling_runs_in_the_swarm(swarm):
    _, client, _, _ = swarm
    prompt = PROMPTS[0]
    gen = torch.Generator().manual_seed(3)
    out = client.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.7,
                          top_k=50, eos_token_id=None, speculative=4, generator=gen)
    spec = client.last_stats.speculation
    assert out.shape == (1, len(prompt) + NEW_TOKENS) and spec["drafted"] > 0
