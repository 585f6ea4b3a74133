"""What a link looks like: delay, jitter, rate and loss, per pair of endpoints.

Units are in the names: seconds (`_s`), bits per second (`_bps`), loss as a probability per packet.
Endpoints are host indices 0..n-1; the client (the root namespace) is `CLIENT` (-1).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

CLIENT = -1  # endpoint index of the benchmark client (root namespace / plain loopback)


@dataclass(frozen=True)
class LinkProfile:
    rtt_s: float  # round-trip propagation delay; each direction gets rtt_s / 2
    rate_bps: float | None = None  # bits per second in each direction; None = unlimited
    jitter_s: float = 0.0  # one-way delay is uniform in [rtt_s/2 - jitter_s, rtt_s/2 + jitter_s], order kept
    loss: float = 0.0  # packet loss probability; TCP hides it, so it becomes retransmit delay + a rate cap

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ValueError(f"rtt_s must be finite and >= 0, got {self.rtt_s}")
        if self.rate_bps is not None and not (math.isfinite(self.rate_bps) and self.rate_bps > 0):
            raise ValueError(f"rate_bps must be > 0 or None, got {self.rate_bps}")
        if not (math.isfinite(self.jitter_s) and 0 <= self.jitter_s):
            raise ValueError(f"jitter_s must be >= 0, got {self.jitter_s}")
        if self.jitter_s > self.rtt_s / 2:
            raise ValueError(f"jitter_s={self.jitter_s} exceeds the one-way delay rtt_s/2={self.rtt_s / 2}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2

    @property
    def goodput_bps(self) -> float | None:
        """TCP payload rate of a bulk transfer: rates are line rates (as tc and NICs count), headers included."""
        return None if self.rate_bps is None else self.rate_bps * GOODPUT_PER_LINE_RATE

    @property
    def effective_rate_bps(self) -> float | None:
        """The rate a TCP flow can reach: `rate_bps`, capped by the Mathis et al. bound when loss > 0.

        throughput <= MSS / RTT * sqrt(3 / (2 p)); with no loss (or no RTT) the link rate alone applies.
        """
        if self.loss == 0 or self.rtt_s == 0:
            return self.rate_bps
        mathis_bps = 8 * _MSS_BYTES / self.rtt_s * math.sqrt(1.5 / self.loss)
        return mathis_bps if self.rate_bps is None else min(self.rate_bps, mathis_bps)


_MSS_BYTES = 1448  # TCP payload of a 1500-byte Ethernet frame with timestamps
GOODPUT_PER_LINE_RATE = _MSS_BYTES / 1514  # payload per frame as tbf counts it (Ethernet + IP + TCP headers)

PRESETS: dict[str, LinkProfile] = {
    "lan": LinkProfile(rtt_s=0.001, rate_bps=1e9),  # same-rack / same-site Ethernet
    "wan": LinkProfile(rtt_s=0.050, rate_bps=100e6),  # cross-region internet link
}


def preset(name: str) -> LinkProfile:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown network profile {name!r}; known: {sorted(PRESETS)} or a topology file") from None


@dataclass(frozen=True)
class LinkMatrix:
    """The link between every pair of endpoints (CLIENT and hosts 0..n_hosts-1); symmetric."""

    n_hosts: int
    links: tuple[tuple[LinkProfile, ...], ...]  # [n_hosts + 1][n_hosts + 1]; row/column 0 is the client

    def __post_init__(self) -> None:
        size = self.n_hosts + 1
        if self.n_hosts < 1 or len(self.links) != size or any(len(row) != size for row in self.links):
            raise ValueError(f"links must be a {size}x{size} matrix for n_hosts={self.n_hosts}")

    def link(self, a: int, b: int) -> LinkProfile:
        for x in (a, b):
            if not CLIENT <= x < self.n_hosts:
                raise ValueError(f"endpoint {x} is neither CLIENT nor a host in [0, {self.n_hosts})")
        return self.links[a + 1][b + 1]

    @classmethod
    def uniform(cls, n_hosts: int, profile: LinkProfile) -> "LinkMatrix":
        """A full mesh where every pair (client-server and server-server) has the same link."""
        size = n_hosts + 1
        return cls(n_hosts, tuple(tuple(profile for _ in range(size)) for _ in range(size)))

    @classmethod
    def star(cls, profiles: Sequence[LinkProfile]) -> "LinkMatrix":
        """Host i sits behind access link profiles[i]; the client is at the hub.

        Between two hosts both access links are crossed: delays and jitters add, the slower rate wins.
        """
        ends = [LinkProfile(rtt_s=0.0)] + list(profiles)  # the hub itself adds nothing
        rows = tuple(tuple(_in_series(ends[a], ends[b]) if a != b else ends[a] for b in range(len(ends)))
                     for a in range(len(ends)))
        return cls(len(profiles), rows)

    @classmethod
    def from_named(cls, links: "NamedLinks", host_names: Sequence[str], client_name: str) -> "LinkMatrix":
        """Hosts and the client are nodes (servers, clients) of a topology file.

        Planner files need no server-server RTTs (its model relays hidden states through the client); a
        missing one becomes the path through the client: both client links in series.
        """
        where = [client_name] + list(host_names)

        def link(a: str, b: str) -> LinkProfile:
            try:
                return links.link(a, b)
            except ValueError:
                if client_name in (a, b):
                    raise
                return _in_series(links.link(client_name, a), links.link(client_name, b))

        return cls(len(host_names), tuple(tuple(link(a, b) for b in where) for a in where))


def _in_series(a: LinkProfile, b: LinkProfile) -> LinkProfile:
    rates = [r for r in (a.rate_bps, b.rate_bps) if r is not None]
    return LinkProfile(
        rtt_s=a.rtt_s + b.rtt_s,
        rate_bps=min(rates) if rates else None,
        jitter_s=a.jitter_s + b.jitter_s,
        loss=1 - (1 - a.loss) * (1 - b.loss),
    )


@dataclass(frozen=True)
class NamedLinks:
    """Link profiles between named nodes, read from the network part of a planner topology file.

    Resolved per pair like the planner does: an explicit `rtt_s[a][b]` first, then the `clusters` rule
    (a per-cluster-pair RTT, else intra/inter), then `default_rtt_s`. Bandwidth likewise, else unlimited.
    """

    servers: tuple[str, ...]  # node names in file order (after `count` expansion)
    clients: tuple[str, ...]
    cluster_of: Mapping[str, str]  # node -> cluster, for nodes that name one
    rtt_s: Mapping[frozenset[str], float]  # explicit node pairs (symmetric)
    bandwidth_bps: Mapping[frozenset[str], float]
    cluster_rtt_s: Mapping[frozenset[str], float]  # explicit cluster pairs
    intra_rtt_s: float | None = None
    inter_rtt_s: float | None = None
    intra_bandwidth_bps: float | None = None
    inter_bandwidth_bps: float | None = None
    default_rtt_s: float | None = None

    def link(self, a: str, b: str) -> LinkProfile:
        if a == b:
            return LinkProfile(rtt_s=0.0)  # a node talking to itself
        pair = frozenset((a, b))
        ca, cb = self.cluster_of.get(a), self.cluster_of.get(b)
        same = None if ca is None or cb is None else ca == cb
        rtt = self.rtt_s.get(pair)
        if rtt is None and same is not None:
            rtt = self.intra_rtt_s if same else self.cluster_rtt_s.get(frozenset((ca, cb)), self.inter_rtt_s)
        if rtt is None:
            rtt = self.default_rtt_s
        if rtt is None:
            raise ValueError(f"no RTT between {a!r} and {b!r}: add rtt_s.{a}.{b}, give both a cluster, "
                             f"or set default_rtt_s")
        rate = self.bandwidth_bps.get(pair)
        if rate is None and same is not None:
            rate = self.intra_bandwidth_bps if same else self.inter_bandwidth_bps
        return LinkProfile(rtt_s=rtt, rate_bps=rate)


def load_named_links(path: str | Path) -> NamedLinks:
    """Read only the network of a planner topology file (docs/TOPOLOGY_FORMAT.md), JSON or YAML.

    Uses servers[]/clients[] (name, cluster, count), rtt_s, bandwidth_bps, clusters and default_rtt_s;
    every other section is ignored, so a network-only file works too. The planner's loader validates the rest.
    """
    path = Path(path)
    text = path.read_text()
    data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping at the top level")
    cluster_of: dict[str, str] = {}
    nodes: dict[str, list[str]] = {"servers": [], "clients": []}
    for section, entries in nodes.items():
        for entry in data.get(section, []):
            count = entry.get("count")
            names = [f"{entry['name']}-{i}" for i in range(int(count))] if count is not None else [str(entry["name"])]
            entries.extend(names)
            cluster_of.update({n: str(entry["cluster"]) for n in names if entry.get("cluster") is not None})
    clusters = data.get("clusters") or {}

    def number(mapping: Mapping[str, Any], key: str) -> float | None:
        return None if mapping.get(key) is None else float(mapping[key])

    return NamedLinks(
        servers=tuple(nodes["servers"]), clients=tuple(nodes["clients"]), cluster_of=cluster_of,
        rtt_s=_pairs(data.get("rtt_s", {}), f"{path}: rtt_s"),
        bandwidth_bps=_pairs(data.get("bandwidth_bps", {}), f"{path}: bandwidth_bps"),
        cluster_rtt_s=_pairs(clusters.get("rtt_s", {}), f"{path}: clusters.rtt_s"),
        intra_rtt_s=number(clusters, "intra_rtt_s"), inter_rtt_s=number(clusters, "inter_rtt_s"),
        intra_bandwidth_bps=number(clusters, "intra_bandwidth_bps"),
        inter_bandwidth_bps=number(clusters, "inter_bandwidth_bps"),
        default_rtt_s=number(data, "default_rtt_s"))


def _pairs(nested: Any, where: str) -> dict[frozenset[str], float]:
    """{a: {b: x}} -> {frozenset({a, b}): x}; one direction is enough, as in the planner's files."""
    if not isinstance(nested, Mapping) or not all(isinstance(row, Mapping) for row in nested.values()):
        raise ValueError(f"{where} must be a mapping {{a: {{b: value}}}}")
    return {frozenset((str(a), str(b))): float(v) for a, row in nested.items() for b, v in row.items()}


_INLINE = re.compile(r"^(?P<rtt>\d+(\.\d+)?)ms(/(?P<rate>\d+(\.\d+)?)(?P<unit>[kmg])bit)?$")


def inline_profile(spec: str) -> LinkProfile | None:
    """'20ms' or '20ms/100mbit': every link with that RTT (and rate); None if `spec` is not of that form."""
    m = _INLINE.match(spec.strip().lower())
    if m is None:
        return None
    rate = float(m["rate"]) * {"k": 1e3, "m": 1e6, "g": 1e9}[m["unit"]] if m["rate"] else None
    return LinkProfile(rtt_s=float(m["rtt"]) / 1e3, rate_bps=rate)


def network_for(spec: str, n_hosts: int) -> LinkMatrix:
    """The benchmark's `--network` value: a preset name, an inline profile ('20ms', '20ms/100mbit'), or a topology
    file whose first `n_hosts` servers are the hosts and whose first client is the client."""
    if spec in PRESETS:
        return LinkMatrix.uniform(n_hosts, PRESETS[spec])
    if (inline := inline_profile(spec)) is not None:
        return LinkMatrix.uniform(n_hosts, inline)
    if not Path(spec).is_file():
        raise ValueError(f"--network {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}), an inline profile "
                         f"('20ms', '20ms/100mbit') nor a file")
    links = load_named_links(spec)
    if len(links.servers) < n_hosts or not links.clients:
        raise ValueError(f"{spec}: need {n_hosts} servers and a client, found {len(links.servers)} servers and "
                         f"{len(links.clients)} clients")
    return LinkMatrix.from_named(links, links.servers[:n_hosts], links.clients[0])
