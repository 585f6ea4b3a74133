"""Topology files (YAML or JSON): model, servers, clients, network, workload -> a validated `Topology`.

Every problem is reported as a PlanningError naming the offending field (`servers[2] (a100-1).memory_bytes`).
The format is documented in docs/TOPOLOGY_FORMAT.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from swarmlm.config import MESSAGE_OVERHEAD_S
from swarmlm.errors import PlanningError
from swarmlm.perf.model import ClientSpec, ComputeProfile, ModelSpec, Network, PerfModel, ServerSpec, Workload


@dataclass(frozen=True)
class Topology:
    model: ModelSpec
    servers: tuple[ServerSpec, ...]
    clients: tuple[ClientSpec, ...]
    network: Network
    workload: Workload
    max_concurrency: int | None = None  # cap on R when it is derived from the arrival rate
    warnings: tuple[str, ...] = field(default=())  # tolerated oddities (e.g. RTTs for names not declared)
    # what a hop's messages cost beyond the RTT and compute (PerfModel); 0 when the RTTs were measured end to end
    message_overhead_s: float = MESSAGE_OVERHEAD_S

    def __post_init__(self) -> None:
        if not self.servers:
            raise PlanningError("topology has no servers")
        if not self.clients:
            raise PlanningError("topology has no clients")

    @cached_property
    def perf(self) -> PerfModel:
        """One PerfModel per topology, so its memoised hop costs are shared by every planning step."""
        return PerfModel.from_specs(self.servers, self.network, self.model, self.message_overhead_s)

    @cached_property
    def worst_round_trip_s(self) -> dict[str, float]:
        """max over clients of the per-token round trip t_cj, per server (CG-BPRR's amortised block time)."""
        perf = self.perf
        return {s.name: max(perf.round_trip_s(c.name, s.name, 1) for c in self.clients) for s in self.servers}

    def server(self, name: str) -> ServerSpec:
        for s in self.servers:
            if s.name == name:
                return s
        raise PlanningError(f"unknown server {name!r}")


# ---------------------------------------------------------------------------------------------------------
# parsing helpers: every one names the field it complains about
# ---------------------------------------------------------------------------------------------------------

def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PlanningError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _keys(obj: Mapping[str, Any], where: str, required: set[str], optional: set[str]) -> None:
    missing = sorted(required - obj.keys())
    if missing:
        raise PlanningError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = sorted(obj.keys() - required - optional)
    if unknown:
        raise PlanningError(f"{where}: unknown field(s) {', '.join(unknown)} "
                            f"(allowed: {', '.join(sorted(required | optional))})")


def _num(value: Any, where: str, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1.32e9 (no sign in the exponent) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanningError(f"{where} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise PlanningError(f"{where} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise PlanningError(f"{where} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanningError(f"{where} must be >= {minimum}, got {value!r}")
    return int(value)


def _bandwidth(obj: Mapping[str, Any], key: str, where: str) -> float:
    """Optional bandwidth in bits/s; absent means unlimited (transfer time folded into the RTT)."""
    return _num(obj[key], f"{where}.{key}", 0, strict=True) if key in obj else math.inf


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise PlanningError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _names(entry: Mapping[str, Any], where: str) -> list[str]:
    """`count: n` expands one entry into n nodes named NAME-0 .. NAME-(n-1)."""
    name = _name(entry["name"], f"{where}.name")
    if "count" not in entry:
        return [name]
    count = _int(entry["count"], f"{where} ({name}).count", 1)
    return [f"{name}-{i}" for i in range(count)]


# ---------------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------------

def _parse_model(raw: Any) -> ModelSpec:
    m = _obj(raw, "model")
    _keys(m, "model", {"num_blocks", "block_bytes"},
          {"cache_bytes_per_session_block", "cache_bytes_per_token_block", "session_tokens", "hidden_bytes_per_token"})
    n_tokens = _int(m.get("session_tokens", 0), "model.session_tokens", 0)
    if "cache_bytes_per_session_block" in m:
        cache = _num(m["cache_bytes_per_session_block"], "model.cache_bytes_per_session_block", 0, strict=True)
    elif "cache_bytes_per_token_block" in m:
        if not n_tokens:
            raise PlanningError("model.cache_bytes_per_token_block needs model.session_tokens (l_in_max + l_max)")
        cache = _num(m["cache_bytes_per_token_block"], "model.cache_bytes_per_token_block", 0, strict=True) * n_tokens
    else:
        raise PlanningError("model: missing field cache_bytes_per_session_block "
                            "(or cache_bytes_per_token_block with session_tokens)")
    return ModelSpec(num_blocks=_int(m["num_blocks"], "model.num_blocks", 1),
                     block_bytes=_num(m["block_bytes"], "model.block_bytes", 0, strict=True),
                     cache_bytes_per_session_block=cache,
                     hidden_bytes_per_token=_num(m.get("hidden_bytes_per_token", 0.0), "model.hidden_bytes_per_token"),
                     session_tokens=n_tokens)


def _parse_servers(raw: Any, model: ModelSpec) -> list[ServerSpec]:
    if not isinstance(raw, list) or not raw:
        raise PlanningError("servers must be a non-empty list")
    out: list[ServerSpec] = []
    for i, entry in enumerate(raw):
        where = f"servers[{i}]"
        e = _obj(entry, where)
        _keys(e, where, {"name", "memory_bytes", "tau_prefill_s", "tau_decode_s"},
              {"cluster", "count", "tau_decode_rows_s"})
        label = f"{where} ({e['name']})"
        tp = e["tau_prefill_s"]
        if not isinstance(tp, (list, tuple)) or len(tp) != 2:
            raise PlanningError(f"{label}.tau_prefill_s must be [a, b] (a*l_in + b seconds per block), got {tp!r}")
        # optional compute contention (perf.model.CONTENTION_ROWS): one decode forward of 4 and of 16 rows
        rows = e.get("tau_decode_rows_s", [0.0, 0.0])
        if not isinstance(rows, (list, tuple)) or len(rows) != 2:
            raise PlanningError(f"{label}.tau_decode_rows_s must be [t4, t16] (seconds per block of one decode "
                                f"forward of 4 and of 16 sessions), got {rows!r}")
        times = (_num(tp[0], f"{label}.tau_prefill_s[0]"), _num(tp[1], f"{label}.tau_prefill_s[1]"),
                 _num(e["tau_decode_s"], f"{label}.tau_decode_s"), _num(rows[0], f"{label}.tau_decode_rows_s[0]"),
                 _num(rows[1], f"{label}.tau_decode_rows_s[1]"))
        try:
            profile = ComputeProfile(*times)
        except ValueError as exc:  # the numbers passed _num: only one of the two contention times is 0
            raise PlanningError(f"{label}.tau_decode_rows_s: {exc}") from None
        memory = _num(e["memory_bytes"], f"{label}.memory_bytes", 0, strict=True)
        need = model.block_bytes + model.cache_bytes_per_session_block
        if memory < need:
            raise PlanningError(f"{label}.memory_bytes={memory:.4g} cannot hold even one block with one session's "
                                f"cache ({model.block_bytes:.4g} + {model.cache_bytes_per_session_block:.4g} bytes)")
        cluster = _name(e["cluster"], f"{label}.cluster") if "cluster" in e else None
        out += [ServerSpec(n, memory, profile, cluster) for n in _names(e, where)]
    return out


def _parse_clients(raw: Any) -> list[ClientSpec]:
    if not isinstance(raw, list) or not raw:
        raise PlanningError("clients must be a non-empty list")
    out: list[ClientSpec] = []
    for i, entry in enumerate(raw):
        where = f"clients[{i}]"
        e = _obj(entry, where)
        _keys(e, where, {"name"}, {"cluster", "count"})
        cluster = _name(e["cluster"], f"{where}.cluster") if "cluster" in e else None
        out += [ClientSpec(n, cluster) for n in _names(e, where)]
    return out


def _parse_workload(raw: Any) -> tuple[Workload, int | None]:
    w = _obj(raw, "workload")
    _keys(w, "workload", {"input_tokens", "output_tokens"}, {"concurrency", "arrival_rate", "max_concurrency"})
    if ("concurrency" in w) == ("arrival_rate" in w):
        raise PlanningError("workload: give exactly one of concurrency (R) or arrival_rate (requests/s)")
    workload = Workload(
        input_tokens=_int(w["input_tokens"], "workload.input_tokens", 1),
        output_tokens=_int(w["output_tokens"], "workload.output_tokens", 1),
        concurrency=_int(w["concurrency"], "workload.concurrency", 1) if "concurrency" in w else None,
        arrival_rate=_num(w["arrival_rate"], "workload.arrival_rate", 0, strict=True) if "arrival_rate" in w else None)
    cap = _int(w["max_concurrency"], "workload.max_concurrency", 1) if "max_concurrency" in w else None
    return workload, cap


def _matrix(raw: Any, where: str, known: set[str], warnings: list[str], positive: bool) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for a, row in _obj(raw, where).items():
        for b, value in _obj(row, f"{where}.{a}").items():
            v = _num(value, f"{where}.{a}.{b}", 0, strict=positive)
            for node in (a, b):
                if node not in known:
                    warnings.append(f"{where}: {node!r} is not a declared server or client (entry ignored)")
            if a in known and b in known:
                out.setdefault(a, {})[b] = v
    return out


def _parse_network(doc: Mapping[str, Any], servers: list[ServerSpec], clients: list[ClientSpec],
                   warnings: list[str]) -> Network:
    known = {s.name for s in servers} | {c.name for c in clients}
    default_rtt = _num(doc["default_rtt_s"], "default_rtt_s") if "default_rtt_s" in doc else None
    if "clusters" in doc:
        c = _obj(doc["clusters"], "clusters")
        _keys(c, "clusters", {"intra_rtt_s", "inter_rtt_s"},
              {"intra_bandwidth_bps", "inter_bandwidth_bps", "rtt_s"})
        cluster_of = {}
        for node in [*servers, *clients]:
            if node.cluster is not None:
                cluster_of[node.name] = node.cluster
        names = set(cluster_of.values())
        pairs: dict[tuple[str, str], float] = {}
        for a, row in _obj(c.get("rtt_s", {}), "clusters.rtt_s").items():
            for b, value in _obj(row, f"clusters.rtt_s.{a}").items():
                for cl in (a, b):
                    if cl not in names:
                        raise PlanningError(f"clusters.rtt_s: unknown cluster {cl!r} (known: {', '.join(sorted(names))})")
                pairs[(a, b)] = _num(value, f"clusters.rtt_s.{a}.{b}")
        net = Network.from_clusters(
            cluster_of, _num(c["intra_rtt_s"], "clusters.intra_rtt_s"), _num(c["inter_rtt_s"], "clusters.inter_rtt_s"),
            _bandwidth(c, "intra_bandwidth_bps", "clusters"), _bandwidth(c, "inter_bandwidth_bps", "clusters"), pairs)
        net.default_rtt_s = default_rtt
    else:
        net = Network(default_rtt_s=default_rtt)
    for a, row in _matrix(doc.get("rtt_s", {}), "rtt_s", known, warnings, positive=False).items():
        for b, v in row.items():
            net.set_link(a, b, v)
    for a, row in _matrix(doc.get("bandwidth_bps", {}), "bandwidth_bps", known, warnings, positive=True).items():
        for b, v in row.items():
            net.set_bandwidth(a, b, v)
    # the BPRR model relays hidden states through the client: every client-server RTT must be known
    for cl in clients:
        for s in servers:
            if not net.has_rtt(cl.name, s.name):
                raise PlanningError(f"no RTT between client {cl.name!r} and server {s.name!r}: add rtt_s.{cl.name}."
                                    f"{s.name}, give both a cluster, or set default_rtt_s")
    return net


def parse_topology(doc: Any) -> Topology:
    d = _obj(doc, "topology")
    _keys(d, "topology", {"model", "servers", "clients", "workload"},
          {"rtt_s", "bandwidth_bps", "clusters", "default_rtt_s", "name", "description",
           "message_overhead_s"})
    model = _parse_model(d["model"])
    servers = _parse_servers(d["servers"], model)
    clients = _parse_clients(d["clients"])
    names = [s.name for s in servers] + [c.name for c in clients]
    dupes = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    if dupes:
        raise PlanningError(f"duplicate server/client name(s): {', '.join(dupes)}")
    if "clusters" in d:
        for node in [*servers, *clients]:
            if node.cluster is None and "default_rtt_s" not in d:
                raise PlanningError(f"{node.name!r} has no cluster but the network is given by clusters")
    workload, cap = _parse_workload(d["workload"])
    warnings: list[str] = []
    network = _parse_network(d, servers, clients, warnings)
    overhead_s = _num(d["message_overhead_s"], "message_overhead_s") if "message_overhead_s" in d \
        else MESSAGE_OVERHEAD_S
    return Topology(model, tuple(servers), tuple(clients), network, workload, cap, tuple(dict.fromkeys(warnings)),
                    overhead_s)


def load_topology(path: str | Path) -> Topology:
    """Read a .json, .yaml or .yml topology file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PlanningError(f"cannot read topology file {p}: {exc.strerror}") from exc
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml  # only needed for YAML files
            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError / yaml.YAMLError: report, do not crash
        raise PlanningError(f"{p}: not valid {'YAML' if p.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {exc}") from exc
    return parse_topology(doc)
