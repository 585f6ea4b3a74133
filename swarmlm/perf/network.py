"""Links between named nodes (RTT and bandwidth): from a topology file, or measured by the live client."""
from __future__ import annotations

import math
from typing import Mapping

from swarmlm.perf.nonnegative import check_nonneg


class Network:
    """Symmetric links between named nodes: RTT (s) and bandwidth (bits/s).

    Lookup order: explicit link, then cluster rule (intra/inter), then defaults. Unknown pair without
    a default: KeyError naming the pair. Mutable so the live client can record measured RTTs.
    """

    def __init__(self, default_rtt_s: float | None = None, default_bandwidth_bps: float = math.inf) -> None:
        # explicit links, stored under both (a, b) and (b, a): one dict probe per lookup, no key sorting
        self._rtt: dict[tuple[str, str], float] = {}
        self._bw: dict[tuple[str, str], float] = {}
        self._cluster: dict[str, str] = {}
        self._intra = (0.0, math.inf)  # (rtt_s, bandwidth_bps) inside a cluster
        self._inter: tuple[float, float] | None = None
        self._pair_rtt: dict[tuple[str, str], float] = {}  # cluster pair (both orders) -> RTT overriding _inter
        self._default_rtt_s = default_rtt_s
        self._default_bw = default_bandwidth_bps
        self.version = 0  # bumped on every change, so caches of derived times know when to drop

    @property
    def default_rtt_s(self) -> float | None:
        return self._default_rtt_s

    @default_rtt_s.setter
    def default_rtt_s(self, value: float | None) -> None:
        self._default_rtt_s = value
        self.version += 1

    def set_link(self, a: str, b: str, rtt_s: float, bandwidth_bps: float | None = None) -> None:
        check_nonneg(f"link {a}-{b}", rtt_s=rtt_s)
        self._rtt[a, b] = self._rtt[b, a] = float(rtt_s)
        if bandwidth_bps is not None:
            if not bandwidth_bps > 0:
                raise ValueError(f"link {a}-{b}: bandwidth_bps must be > 0, got {bandwidth_bps}")
            self._bw[a, b] = self._bw[b, a] = float(bandwidth_bps)
        self.version += 1

    def set_bandwidth(self, a: str, b: str, bandwidth_bps: float) -> None:
        if not bandwidth_bps > 0:
            raise ValueError(f"link {a}-{b}: bandwidth_bps must be > 0, got {bandwidth_bps}")
        self._bw[a, b] = self._bw[b, a] = float(bandwidth_bps)
        self.version += 1

    @classmethod
    def from_matrix(cls, rtt_s: Mapping[str, Mapping[str, float]],
                    bandwidth_bps: Mapping[str, Mapping[str, float]] | None = None,
                    default_rtt_s: float | None = None, default_bandwidth_bps: float = math.inf) -> "Network":
        """Nested dict {a: {b: rtt}}; one direction is enough (symmetric)."""
        net = cls(default_rtt_s, default_bandwidth_bps)
        for a, row in rtt_s.items():
            for b, value in row.items():
                net.set_link(a, b, value)
        for a, row in (bandwidth_bps or {}).items():
            for b, value in row.items():
                net.set_bandwidth(a, b, value)
        return net

    @classmethod
    def from_clusters(cls, cluster_of: Mapping[str, str], intra_rtt_s: float, inter_rtt_s: float,
                      intra_bandwidth_bps: float = math.inf, inter_bandwidth_bps: float = math.inf,
                      pair_rtt_s: Mapping[tuple[str, str], float] | None = None) -> "Network":
        """Every node in a cluster; RTT and bandwidth depend only on same/different cluster.

        `pair_rtt_s` overrides the inter-cluster RTT for specific cluster pairs.
        """
        check_nonneg("clusters", intra_rtt_s=intra_rtt_s, inter_rtt_s=inter_rtt_s)
        net = cls()
        net._cluster = dict(cluster_of)
        net._intra = (float(intra_rtt_s), float(intra_bandwidth_bps))
        net._inter = (float(inter_rtt_s), float(inter_bandwidth_bps))
        for (ca, cb), v in (pair_rtt_s or {}).items():
            net._pair_rtt[ca, cb] = net._pair_rtt[cb, ca] = float(v)
        return net

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(rtt_s, bandwidth_bps) of the link a-b: explicit link, then cluster rule, then defaults."""
        if a == b:
            return 0.0, math.inf
        rtt = self._rtt.get((a, b))
        bw = self._bw.get((a, b))
        if rtt is not None and bw is not None:
            return rtt, bw
        cluster = self._cluster_link(a, b)
        if rtt is None:
            rtt = cluster[0] if cluster is not None else self._default_rtt_s
            if rtt is None:
                raise KeyError(f"no RTT known between {a!r} and {b!r}")
        if bw is None:
            bw = cluster[1] if cluster is not None else self._default_bw
        return rtt, bw

    def _cluster_link(self, a: str, b: str) -> tuple[float, float] | None:
        if self._inter is None:
            return None
        ca, cb = self._cluster.get(a), self._cluster.get(b)
        if ca is None or cb is None:
            return None
        if ca == cb:
            return self._intra
        return self._pair_rtt.get((ca, cb), self._inter[0]), self._inter[1]

    def rtt_s(self, a: str, b: str) -> float:
        return self.link(a, b)[0]

    def bandwidth_bps(self, a: str, b: str) -> float:
        if a == b:
            return math.inf
        bw = self._bw.get((a, b))
        if bw is not None:
            return bw
        cluster = self._cluster_link(a, b)
        return cluster[1] if cluster is not None else self._default_bw

    def known_rtt_s(self, a: str, b: str) -> float | None:
        """The RTT of a-b if a link or the cluster rule gives it (measured or from a topology), else None: the
        default stands in for links nobody measured, which a decision may rather estimate its own way."""
        if a == b:
            return 0.0
        rtt = self._rtt.get((a, b))
        if rtt is None and (cluster := self._cluster_link(a, b)) is not None:
            rtt = cluster[0]
        return rtt

    def has_rtt(self, a: str, b: str) -> bool:
        try:
            self.link(a, b)
        except KeyError:
            return False
        return True
