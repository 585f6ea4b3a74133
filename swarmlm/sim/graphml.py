"""Load a Topology-Zoo-style GraphML file as a graph with per-link delay and bandwidth.

Link delay, in order of preference: an edge attribute `delay_s`, `delay_ms` or `delay_us`; else the great-circle
distance between the endpoints' `Latitude`/`Longitude` over the speed of light in fibre; else `default_delay_s`.
Bandwidth: `bandwidth_bps` or Topology Zoo's `LinkSpeedRaw` (bits/s), else `default_bandwidth_bps`.
Only the largest connected component is kept (Topology Zoo files sometimes have stray nodes).
"""
from __future__ import annotations

import math
from pathlib import Path

import networkx as nx

from swarmlm.sim.generators import FIBRE_S_PER_KM, graph_topology

EARTH_RADIUS_KM = 6371.0


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(min(1.0, a)))


def _coords(attrs: dict) -> tuple[float, float] | None:
    try:
        return float(attrs["Latitude"]), float(attrs["Longitude"])
    except (KeyError, TypeError, ValueError):
        return None


def _edge_delay_s(attrs: dict, a: dict, b: dict, default_delay_s: float) -> tuple[float, bool]:
    """(delay, measured_or_geographic); False means the default was used."""
    for key, scale in (("delay_s", 1.0), ("delay_ms", 1e-3), ("delay_us", 1e-6)):
        if key in attrs:
            value = float(attrs[key]) * scale
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"edge attribute {key}={attrs[key]!r} is not a delay")
            return value, True
    ca, cb = _coords(a), _coords(b)
    if ca and cb:
        return haversine_km(*ca, *cb) * FIBRE_S_PER_KM, True
    return default_delay_s, False


def load_graphml(path: str | Path, default_delay_s: float = 1e-3, default_bandwidth_bps: float = 1e9) -> nx.Graph:
    """An undirected graph with edge attributes delay_s and bandwidth_bps; node ids are strings."""
    raw = nx.read_graphml(str(path))
    g = nx.Graph()
    defaulted = 0
    for u, v, attrs in raw.edges(data=True):
        u, v = str(u), str(v)
        if u == v:
            continue
        delay, known = _edge_delay_s(attrs, raw.nodes[u], raw.nodes[v], default_delay_s)
        defaulted += not known
        bw = float(attrs.get("bandwidth_bps") or attrs.get("LinkSpeedRaw") or default_bandwidth_bps)
        if g.has_edge(u, v):  # parallel links (MultiGraph files): keep the faster one
            delay = min(delay, g.edges[u, v]["delay_s"])
            bw = max(bw, g.edges[u, v]["bandwidth_bps"])
        g.add_edge(u, v, delay_s=delay, bandwidth_bps=bw if bw > 0 else default_bandwidth_bps)
    if g.number_of_nodes() == 0:
        raise ValueError(f"{path}: no links")
    giant = max(nx.connected_components(g), key=len)
    g = g.subgraph(giant).copy()
    g.graph["defaulted_delays"] = defaulted
    g.graph["name"] = Path(path).stem
    return g


def graphml_topology(path: str | Path, seed: int, **kwargs) -> dict:
    """A topology in the planner's format from a GraphML file; kwargs go to `generators.graph_topology`."""
    g = load_graphml(path)
    kwargs.setdefault("name", g.graph["name"])
    return graph_topology(g, seed, **kwargs)
