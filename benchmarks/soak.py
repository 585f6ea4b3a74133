"""An hour of hostile weather (issue 39): a tiny-llama swarm of 4 servers (two replicas of [0, 3) and [3, 6)), a
gateway (`--speculative auto`) and 8 clients checking every answer against plain transformers, under one fault a
minute (SIGKILL of a server's main pid, SIGSTOP 8-30 s, an nftables partition of 30 s, a move to other blocks;
with --relays N --relayed SLOT..., servers behind NAT and a relay node killed).
Writes samples.jsonl, faults.jsonl, client*.jsonl, summary.json, report.md and rss.png to --out.

    nice -n 10 .venv/bin/python benchmarks/soak.py --duration-s 3600 --out /tmp/soak
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process (the children inherit it)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.bench.soak import CLIENTS, FAULTS, Soak, SoakConfig  # noqa: E402
from swarmlm.bench.soak_clients import KINDS  # noqa: E402
from swarmlm.bench.soak_report import markdown, plot, summary  # noqa: E402
from swarmlm.machine import machine_info  # noqa: E402
from swarmlm.model.random_checkpoint import init_checkpoint  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--fault-every-s", type=float, default=60.0)
    p.add_argument("--partition-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", nargs="*", choices=FAULTS, help="default: all (relay only with --relays)")
    p.add_argument("--relays", type=int, default=0, help="relay nodes besides the bootstrap node")
    p.add_argument("--relayed", nargs="*", type=int, default=[], metavar="SLOT",
                   help="servers (0-3) behind NAT, reached through the relays")
    p.add_argument("--clients", nargs="*", default=list(CLIENTS), choices=KINDS, help="one process per name")
    p.add_argument("--hang-s", nargs=2, type=float, default=(8.0, 30.0), help="a SIGSTOP lasts uniform(lo, hi) s")
    p.add_argument("--settle-s", type=float, default=600.0, help="RSS growth is measured from here to the end")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="swarmlm-soak-")))
    args = p.parse_args()
    faults = args.faults if args.faults is not None else [f for f in FAULTS if f != "relay" or args.relays]
    model_dir = str(init_checkpoint("tiny-llama", args.out / "tiny-llama", seed=2))
    config = SoakConfig(model_dir=model_dir, out_dir=args.out, duration_s=args.duration_s,
                        fault_every_s=args.fault_every_s, partition_s=args.partition_s, seed=args.seed,
                        faults=tuple(faults), clients=tuple(args.clients), hang_s=tuple(args.hang_s),
                        relays=args.relays, relayed=tuple(args.relayed))
    end = Soak(config).run()
    result = summary(args.out, args.settle_s, end)
    result["machine"] = {k: v for k, v in machine_info().items() if k in ("cpu", "cores", "flags", "torch")}
    result["command"] = " ".join(sys.argv)
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    plot(args.out)
    (args.out / "report.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
