"""What a cached prefix is worth on a hop (server/prefix_cache.py): the prefill a server does not run and the
hidden states the client does not send for the `held` tokens it already holds. The router subtracts it from the
hop's BPRR cost (PerfModel.hop_cost_terms), so a route whose servers hold the prompt's prefix wins unless their
load (the per-block part is multiplied by f(b + 1) after this) or their waits cost more; the simulator prices its
sessions' prefills with the same terms."""
from __future__ import annotations

import math

from swarmlm.perf.model import PerfModel


def prefix_saving_terms(perf: PerfModel, client: str, server: str, held: int) -> tuple[float, float]:
    """(fixed_s, per_block_s) a hop saves when its server holds the first `held` prompt tokens: their transfer both
    ways (fixed) and their marginal prefill compute per block (prefill_a_s x held, one session alone)."""
    if held <= 0:
        return 0.0, 0.0
    _, bw = perf.network.link(client, server)
    fixed = 2 * 8.0 * perf.hidden_bytes_per_token * held / bw if perf.hidden_bytes_per_token and math.isfinite(bw) \
        else 0.0
    return fixed, perf.profiles[server].prefill_a_s * held


def prefill_with_prefix_s(perf: PerfModel, server: str, blocks: int, l_in: int, held: int) -> float:
    """Compute seconds of a prompt of `l_in` tokens over `blocks` blocks of `server` that holds its first `held`
    tokens (at least one token is always computed)."""
    return blocks * perf.profiles[server].prefill_s(max(l_in - held, 1))
