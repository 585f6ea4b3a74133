"""The one performance model shared by the planner, the client's router and the simulator.

BPRR model (arXiv 2512.21884, section "performance models"), all times in seconds, sizes in bytes:

    prefill hop  = tI_cj + k * (a_j * l_in + b_j)          # client -> server j -> client, k blocks, prompt
    decode hop   = t_cj  + k * tau_j                       # one generated token
    hop cost     = prefill hop + (l_out - 1) * decode hop  # BPRR edge weight
    request time = sum of hop costs over the route's spans

The client relays hidden states between consecutive servers (as Petals does), so only client<->server links
matter: tI_cj = RTT_cj + o + 2 * l_in * h / bw_cj and t_cj = RTT_cj + o + 2 * h / bw_cj, h = hidden bytes per token
(0 by default: the paper's RTTs already include the small per-token payload), o = what a message costs beyond the
network's round trip and the compute (serialising, parsing, the stack's wake-ups: `config.MESSAGE_OVERHEAD_S`,
measured on the default transport; 0 reproduces the paper, whose RTTs were measured end to end).

Compute contention (our addition; the paper measured GPU servers, whose step time does not grow with load): a server
running b sessions at once steps each of them in tau_j * f_j(b) per block, f_j(b) = the cost of one batched decode
forward of b rows over one of 1 row (`ComputeProfile.load_factor`), piecewise linear through the rows a server's
profile measured (1, 4 and 16: `CONTENTION_ROWS`). A profile without those measurements has f = 1 (the paper).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from swarmlm.config import MESSAGE_OVERHEAD_S
from swarmlm.perf.compute import CONTENTION_ROWS, ComputeProfile
from swarmlm.perf.network import Network
from swarmlm.perf.specs import ClientSpec, ModelSpec, ServerSpec, Workload
from swarmlm.types import Span

# the model's parts, importable from here as before: swarmlm.perf.model is the model's one door
__all__ = ["CONTENTION_ROWS", "PUSH_HOP_S", "ClientSpec", "ComputeProfile", "ModelSpec", "Network", "PerfModel",
           "ServerSpec", "Workload"]

# What one server-to-server push costs beyond the relayed message it replaces. Measured on loopback, where the links
# save nothing (docs/RESULTS-hop.md round 23): since kept routes (protocol 4) a pushed decode step is one compact frame
# per hop, taken by the servers' step lanes and the client's C chain: per push -0.05 to 0.0 ms beside the relayed
# path's (tiny-bloom, bloomz-560m: step minus compute), up to +0.15 ms on SmolLM2 at 2 vCPUs (each server wakes on
# the other vCPU, not warm behind the client), ~0.15 ms where no lane runs (a server with other sessions); 0.3 ms,
# rounded up, so that push is chosen where the links clearly pay for it (RTT > 0.6 ms; the client's probes measure
# 0.05-0.5 ms on loopback). It was 1 ms while pushes went through the event loop and named the route at every step
# (~0.6-1.6 ms).
PUSH_HOP_S = 0.0003


class PerfModel:
    """Predicts hop and request times from per-server profiles and a Network. No Topology needed.

    The live client builds one from announced profiles and measured RTTs (`set_profile`, `network.set_link`);
    the planner and the simulator build one from a topology file.
    """

    def __init__(self, profiles: Mapping[str, ComputeProfile], network: Network,
                 hidden_bytes_per_token: float = 0.0, message_overhead_s: float = MESSAGE_OVERHEAD_S) -> None:
        if message_overhead_s < 0:
            raise ValueError(f"message_overhead_s must be >= 0, got {message_overhead_s}")
        self.profiles: dict[str, ComputeProfile] = dict(profiles)
        self.network = network
        self.hidden_bytes_per_token = hidden_bytes_per_token
        self.message_overhead_s = message_overhead_s  # o: per hop (a request and its reply), beyond RTT and compute
        # (client, server, l_in, l_out) -> hop cost terms; dropped when profiles or the network change
        self._terms: dict[tuple[str, str, int, int], tuple[float, float]] = {}
        self._terms_version = network.version

    @classmethod
    def from_specs(cls, servers: Iterable[ServerSpec], network: Network, model: ModelSpec | None = None,
                   message_overhead_s: float = MESSAGE_OVERHEAD_S) -> "PerfModel":
        return cls({s.name: s.profile for s in servers}, network, model.hidden_bytes_per_token if model else 0.0,
                   message_overhead_s)

    def set_profile(self, server: str, profile: ComputeProfile) -> None:
        self.profiles[server] = profile
        self._terms.clear()

    # -- links --------------------------------------------------------------------------------------------
    def transfer_s(self, a: str, b: str, nbytes: float) -> float:
        """One-way delivery of `nbytes` from a to b: RTT/2 + serialisation."""
        bw = self.network.bandwidth_bps(a, b)
        return self.network.rtt_s(a, b) / 2 + (8.0 * nbytes / bw if nbytes and math.isfinite(bw) else 0.0)

    def round_trip_s(self, client: str, server: str, n_tokens: int) -> float:
        """tI_cj (tokens = l_in) or t_cj (tokens = 1): hidden states to the server and back, and the messages' own
        cost (o).

        Same as transfer_s(client, server, n) + transfer_s(server, client, n), with one lookup per link
        (the planner calls this ~10^5 times on 1,000-server topologies)."""
        rtt, bw = self.network.link(client, server)
        nbytes = n_tokens * self.hidden_bytes_per_token
        return rtt + self.message_overhead_s + (2 * 8.0 * nbytes / bw if nbytes and math.isfinite(bw) else 0.0)

    # -- hops ---------------------------------------------------------------------------------------------
    def prefill_hop_s(self, client: str, server: str, blocks: int, l_in: int, sessions: int = 1) -> float:
        """The prompt through k blocks of `server` while it runs `sessions` sessions (this one included)."""
        profile = self.profiles[server]
        return self.round_trip_s(client, server, l_in) + blocks * profile.prefill_s(l_in) * profile.load_factor(sessions)

    def decode_hop_s(self, client: str, server: str, blocks: int, sessions: int = 1) -> float:
        """One token through k blocks of `server` while it runs `sessions` sessions (this one included)."""
        profile = self.profiles[server]
        return self.round_trip_s(client, server, 1) + blocks * profile.decode_s * profile.load_factor(sessions)

    def load_factor(self, server: str, sessions: int) -> float:
        """f(b) of `server`: its compute with `sessions` running at once over one session's alone."""
        return self.profiles[server].load_factor(sessions)

    def hop_cost_s(self, client: str, server: str, blocks: int, l_in: int, l_out: int) -> float:
        """BPRR edge weight: (tI + (l_out-1) t) + (tauI + (l_out-1) tau) * k."""
        fixed_s, per_block_s = self.hop_cost_terms(client, server, l_in, l_out)
        return fixed_s + per_block_s * blocks

    def hop_cost_terms(self, client: str, server: str, l_in: int, l_out: int) -> tuple[float, float]:
        """The hop cost is affine in the block count k: (fixed_s, per_block_s) with cost = fixed + per_block * k.
        fixed = tI + (l_out-1) t (links and messages), per_block = tauI(l_in) + (l_out-1) tau (compute, one
        session alone: a router multiplies it by `load_factor(server, b)` for a server running b sessions).
        Memoised: the planner asks for every (client, server) pair, sometimes twice."""
        if self._terms_version != self.network.version:
            self._terms.clear()
            self._terms_version = self.network.version
        key = (client, server, l_in, l_out)
        terms = self._terms.get(key)
        if terms is None:
            profile = self.profiles[server]
            rtt, bw = self.network.link(client, server)
            fixed = l_out * (rtt + self.message_overhead_s)
            if self.hidden_bytes_per_token and math.isfinite(bw):
                # hidden states both ways: l_in tokens for the prompt, one per decode step
                fixed += 2 * 8.0 * self.hidden_bytes_per_token * (l_in + (l_out - 1)) / bw
            terms = self._terms[key] = (fixed, profile.prefill_s(l_in) + (l_out - 1) * profile.decode_s)
        return terms

    # -- whole requests -----------------------------------------------------------------------------------
    def ttft_s(self, client: str, spans: Sequence[Span], l_in: int) -> float:
        """Time to first token: the prompt through every hop."""
        return sum(self.prefill_hop_s(client, s.server_id, s.length, l_in) for s in spans)

    def decode_step_s(self, client: str, spans: Sequence[Span], push: bool = False) -> float:
        """One generated token through every hop (steady-state time per token); `push`: each server sends its
        output straight to the next one (server-to-server push, `push_saving_s`)."""
        step = sum(self.decode_hop_s(client, s.server_id, s.length) for s in spans)
        return step - self.push_saving_s(client, spans) if push else step

    def pass_s(self, client: str, spans: Sequence[Span], n_tokens: int, push: bool = False) -> float:
        """One step of `tokens` new tokens (a speculative pass verifying tokens - 1 drafts) through every hop:
        round trips with `tokens` hidden states plus compute past the cache (`ComputeProfile.extend_s`, as the
        client's hang timeout prices such a step); pass_s(..., 1) is the decode step."""
        step = sum(self.round_trip_s(client, s.server_id, n_tokens)
                   + s.length * self.profiles[s.server_id].extend_s(n_tokens) for s in spans)
        return step - self.push_saving_s(client, spans) if push else step

    # -- server-to-server push ------------------------------------------------------------------------------
    def push_saving_s(self, client: str, spans: Sequence[Span]) -> float:
        """Seconds one decode token saves on `spans` when every server pushes its output to the next one.

        Relayed, a token makes a round trip to every server: sum_j rt_cj(1). Pushed, it goes one way along the
        chain, client -> s_1 -> ... -> s_N -> client, and each of the N - 1 pushes costs PUSH_HOP_S more than the
        relayed message it replaces. A server-to-server RTT nobody measured is taken as the larger of the client's
        RTTs to the two servers (the servers are no closer to each other than to the client: the cautious guess).
        Every server handles one message per token either way (o each: relayed in its round trip, pushed here).
        <= 0: push does not pay (always so for one server)."""
        if len(spans) < 2:
            return 0.0
        ids = [s.server_id for s in spans]
        h = self.hidden_bytes_per_token
        relayed = sum(self.round_trip_s(client, sid, 1) for sid in ids)
        pushed = self.transfer_s(client, ids[0], h) + self.transfer_s(ids[-1], client, h) + \
            len(ids) * self.message_overhead_s
        for a, b in zip(ids, ids[1:]):
            rtt = self.network.known_rtt_s(a, b)
            if rtt is None:
                rtt = max(self.network.rtt_s(client, a), self.network.rtt_s(client, b))
            bw = self.network.bandwidth_bps(a, b)
            pushed += rtt / 2 + (8.0 * h / bw if h and math.isfinite(bw) else 0.0) + PUSH_HOP_S
        return relayed - pushed

    def push_pays(self, client: str, spans: Sequence[Span]) -> bool:
        """The `push="auto"` rule: push where the model predicts it saves time per token."""
        return self.push_saving_s(client, spans) > 0

    def request_time_s(self, client: str, spans: Sequence[Span], l_in: int, l_out: int) -> float:
        return self.ttft_s(client, spans, l_in) + (l_out - 1) * self.decode_step_s(client, spans)

    def per_token_s(self, client: str, spans: Sequence[Span], l_in: int, l_out: int) -> float:
        """The paper's metric: request time / l_out (TTFT amortised over the generated tokens)."""
        return self.request_time_s(client, spans, l_in, l_out) / l_out
