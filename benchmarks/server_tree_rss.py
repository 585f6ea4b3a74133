"""The processes a ready server runs and their summed RSS (one tiny-llama block), and those of the DHT-only node
(`swarmlm dht`) beside it: `python benchmarks/server_tree_rss.py`. A forked child's shared pages count in both RSSes, as `ps` shows them."""
from __future__ import annotations

import tempfile
import time

import psutil

from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange


def main() -> None:
    model = init_checkpoint("tiny-llama", tempfile.mkdtemp(prefix="swarmlm-rss-"), seed=2)
    with LocalSwarm(str(model)) as swarm:
        swarm.start_dht()
        server = swarm.start_server(BlockRange(0, 1))
        time.sleep(5)  # (settled: its announcer has run)
        for name, pid in (("server", server.proc.pid), ("DHT-only node", swarm.dht_proc.pid)):
            show_tree(name, pid)


def show_tree(name: str, pid: int) -> None:
    main_process = psutil.Process(pid)
    tree = [main_process, *main_process.children(recursive=True)]
    for p in tree:
        print(f"  {p.pid} {p.memory_info().rss / 2**20:7.1f} MiB  {' '.join(p.cmdline())[:70]}")
    total = sum(p.memory_info().rss for p in tree) / 2**20
    print(f"{name} tree: {len(tree)} processes, summed RSS {total:.0f} MiB")


if __name__ == "__main__":
    main()
