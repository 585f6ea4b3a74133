"""How closely the emulated network follows its profile, and what the relay costs by itself.

`python -m swarmlm.bench.netem.accuracy` prints both (the numbers in docs/NETWORK_EMULATION.md come from it);
`check_link` is what the tests and the benchmark report use to show a profile really applies.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from swarmlm.bench.netem.link_probe import BandwidthStats, RttStats, measure_bandwidth, measure_rtt, start_probe_server
from swarmlm.bench.netem.profile import CLIENT, PRESETS, LinkProfile
from swarmlm.bench.netem.delay_relay import DirectionSpec, ListenSpec, RelayProcess, RelayRoute
from swarmlm.bench.netem.testbed import Testbed


@dataclass(frozen=True)
class LinkCheck:
    profile: LinkProfile
    rtt: RttStats
    up: BandwidthStats | None  # None when the profile has no rate
    down: BandwidthStats | None

    @property
    def rtt_error(self) -> float:
        """Relative error of the median RTT against the profile."""
        return abs(self.rtt.median_s - self.profile.rtt_s) / self.profile.rtt_s

    @property
    def rate_error(self) -> float:
        """Worst relative error of the two directions' goodput against the profile's (rate minus headers)."""
        expected = self.profile.goodput_bps
        if self.up is None or self.down is None or expected is None:
            return 0.0
        return max(abs(b.bits_per_s - expected) / expected for b in (self.up, self.down))


def check_link(address: str, profile: LinkProfile, transfer_s: float = 0.4) -> LinkCheck:
    """Measure RTT (about 1 s worth of echoes, 10-100 of them) and both directions' goodput at `address`."""
    samples = int(min(100, max(10, 1.0 / max(profile.rtt_s, 1e-4))))
    rtt = measure_rtt(address, samples=samples)
    if profile.rate_bps is None:
        return LinkCheck(profile, rtt, None, None)
    nbytes = max(4 << 20, int(profile.rate_bps / 8 * transfer_s))
    return LinkCheck(profile, rtt, measure_bandwidth(address, nbytes, "up"), measure_bandwidth(address, nbytes, "down"))


def check_testbed(tb: Testbed, host: int = 0) -> LinkCheck:
    """Start a probe server on `host`, measure the client's link to it, stop the probe."""
    proc, port = start_probe_server(tb.host_ip(host), 0, tb.exec_prefix(host))
    try:
        return check_link(tb.expose(host, port), tb.network.link(CLIENT, host))
    finally:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class RelayOverhead:
    direct_rtt_s: float  # loopback echo without the relay
    relay_rtt_s: float  # the same through a relay that adds no delay and no rate
    direct_bps: float  # bulk goodput without the relay (the slower direction)
    relay_bps: float  # bulk goodput through the relay (the slower direction)


def relay_overhead(nbytes: int = 200 << 20) -> RelayOverhead:
    """The relay's own cost on loopback: zero delay, no rate limit."""
    proc, port = start_probe_server("127.0.0.1", 0)
    try:
        with RelayProcess() as relay:
            zero = DirectionSpec(delay_s=0.0)
            host, relay_port = relay.listen(ListenSpec("127.0.0.1", 0, "127.0.0.1", port, {"*": RelayRoute(zero, zero)}))
            direct, relayed = f"127.0.0.1:{port}", f"{host}:{relay_port}"
            rtts = [measure_rtt(a, samples=500).median_s for a in (direct, relayed)]
            rates = [min(measure_bandwidth(a, nbytes, d).bits_per_s for d in ("up", "down")) for a in (direct, relayed)]
    finally:
        proc.kill()
        proc.wait()
    return RelayOverhead(rtts[0], rtts[1], rates[0], rates[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="measure the emulated network against its profiles")
    parser.add_argument("--modes", nargs="+", default=["namespaces", "relay-only"])
    args = parser.parse_args(argv)
    o = relay_overhead()
    print(f"relay overhead on loopback (zero delay): RTT {o.direct_rtt_s * 1e6:.0f} us direct -> "
          f"{o.relay_rtt_s * 1e6:.0f} us relayed (+{(o.relay_rtt_s - o.direct_rtt_s) * 1e6:.0f} us); "
          f"goodput {o.direct_bps / 1e9:.1f} -> {o.relay_bps / 1e9:.1f} Gbit/s")
    profiles = dict(PRESETS, custom=LinkProfile(rtt_s=0.020, rate_bps=100e6))
    print(f"{'mode':<11} {'profile':<7} {'rtt_ms':>8} {'meas_ms':>8} {'err':>6} {'rate_Mb':>8} {'up_Mb':>7} "
          f"{'down_Mb':>7} {'err':>6} {'floor_us':>8}")
    for mode in args.modes:
        for name, profile in profiles.items():
            start = time.monotonic()
            with Testbed(1, profile, mode=mode) as tb:
                c = check_testbed(tb)
                print(f"{tb.mode:<11} {name:<7} {profile.rtt_s * 1e3:8.3f} {c.rtt.median_s * 1e3:8.3f} "
                      f"{c.rtt_error:6.1%} {profile.rate_bps / 1e6:8.0f} {c.up.bits_per_s / 1e6:7.1f} "
                      f"{c.down.bits_per_s / 1e6:7.1f} {c.rate_error:6.1%} {tb.path_overhead_s * 1e6:8.0f}"
                      f"  ({time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
