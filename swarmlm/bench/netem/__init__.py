"""Emulated network for the benchmark: link profiles, a delaying TCP relay, a namespace testbed, probes."""
from swarmlm.bench.netem.link_probe import (BandwidthStats, RttStats, measure_bandwidth, measure_rtt, probe_server_argv,
                                       start_probe_server)
from swarmlm.bench.netem.profile import (CLIENT, PRESETS, LinkMatrix, LinkProfile, NamedLinks, load_named_links,
                                         network_for, preset)
from swarmlm.bench.netem.delay_relay import DirectionSpec, ListenSpec, RelayProcess, RelayRoute
from swarmlm.bench.netem.netns import NetemUnavailable, cleanup_leftovers, leftovers, namespaces_unsupported_reason
from swarmlm.bench.netem.testbed import Mode, Testbed

__all__ = [
    "BandwidthStats", "CLIENT", "DirectionSpec", "LinkMatrix", "LinkProfile", "ListenSpec", "Mode", "NamedLinks",
    "NetemUnavailable", "PRESETS", "RelayProcess", "RelayRoute", "RttStats", "Testbed", "cleanup_leftovers", "leftovers",
    "load_named_links", "measure_bandwidth", "measure_rtt", "namespaces_unsupported_reason", "network_for", "preset",
    "probe_server_argv", "start_probe_server",
]
