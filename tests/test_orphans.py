"""No orphans (swarm/lifetime.py): a SIGKILL of a server's, a DHT node's or a gateway's main process (a crash, the OOM
killer) leaves none of the processes it started alive, and a server restarted in its place finds nothing stale.

Only the main pid is killed, never its process group: what the group would have hidden is what we check. The
process tree is recorded before the kill (after it, survivors are init's children and no longer ours)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from swarmlm.api.process import GatewayProcess
from swarmlm.swarm.lifetime import _listened_on, sweep_stale_p2pd_sockets
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange

GRACE_S = 10.0


def descendants(pid: int) -> list[psutil.Process]:
    tree = psutil.Process(pid).children(recursive=True)
    assert tree, f"{pid} started no process: nothing to check"
    return tree


def p2pd_sockets(tree: list[psutil.Process]) -> list[str]:
    """The unix sockets the tree's p2pd daemons listen on (in their command lines)."""
    found = []
    for p in tree:
        found += re.findall(r"-listen=/unix(/\S+\.sock)", " ".join(p.cmdline()))
    return found


def survivors(tree: list[psutil.Process]) -> list[str]:
    """Processes of `tree` still running (is_running compares creation times: a reused pid is not a survivor)."""
    left = []
    for p in tree:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return left


def kill_main_and_check(pid: int, tree: list[psutil.Process], sig: int = signal.SIGKILL,
                        grace_s: float = GRACE_S) -> None:
    names = [" ".join(p.cmdline())[:80] for p in tree]
    assert not any("torch_shm_manager" in n for n in names), names  # (nothing uses torch's shared memory)
    sockets = p2pd_sockets(tree)
    os.kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while (left := survivors(tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in tree:  # whatever failed the check below must not outlive this test either
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"alive {grace_s:.0f} s after a {signal.Signals(sig).name} of {pid}:\n" + "\n".join(left)
    # each daemon stopped listening (it removes its socket file on SIGTERM almost always; a file it left behind is
    # swept by the next start: test_a_dead_daemons_socket_is_swept_and_a_live_one_kept)
    assert not [s for s in sockets if os.path.exists(s) and _listened_on(s)], sockets


def test_a_dead_daemons_socket_is_swept_and_a_live_one_kept(tmp_path):
    def unix_socket(name: str, listening: bool) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / name))
        if listening:
            sock.listen()
        return sock

    live, dead, young = unix_socket("p-live.sock", True), unix_socket("p-dead.sock", False), unix_socket("p-young.sock", False)
    for s in (live, dead):  # both old enough to be judged
        os.utime(tmp_path / s.getsockname().split("/")[-1], (time.time() - 120,) * 2)
    dead.close(), young.close()  # closed, files left behind (as a daemon killed before it removed its socket)
    try:
        removed = sweep_stale_p2pd_sockets(str(tmp_path / "p-*.sock"), min_age_s=60)
        assert removed == [str(tmp_path / "p-dead.sock")]
        assert (tmp_path / "p-live.sock").exists() and (tmp_path / "p-young.sock").exists()
    finally:
        live.close()


@pytest.mark.slow
def test_a_killed_server_and_dht_node_leave_nothing_running_and_a_restart_starts_clean(tiny_llama, tmp_path):
    with LocalSwarm(tiny_llama, log_dir=tmp_path) as swarm:
        swarm.start_dht()
        server = swarm.start_server(BlockRange(0, 6))
        tree = descendants(server.proc.pid)
        # one daemon: its DHT node runs on its network node's p2pd (a replica), not on a second one
        assert len(p2pd_sockets(tree)) == 1, [p.cmdline() for p in tree]
        kill_main_and_check(server.proc.pid, tree)

        again = swarm.start_server(BlockRange(0, 6))  # in its place: it starts and serves
        assert again.alive and again.address
        kill_main_and_check(swarm.dht_proc.pid, descendants(swarm.dht_proc.pid))


@pytest.mark.slow
def test_a_killed_gateway_leaves_nothing_running(tiny_llama, tmp_path):
    with LocalSwarm(tiny_llama, log_dir=tmp_path) as swarm:
        swarm.start_dht()
        swarm.start_server(BlockRange(0, 6))
        gateway = GatewayProcess(tiny_llama, swarm.initial_peers, log_path=tmp_path / "api.err").start()
        try:
            kill_main_and_check(gateway.proc.pid, descendants(gateway.proc.pid))
        finally:
            gateway.stop()


# a process running a LocalSwarm whose servers a thread started and then ended (PR_SET_PDEATHSIG follows the thread
# that forks: LocalSwarm forks on a spawner thread that lives as long as the process, swarm/lifetime.py). Its DHT
# node and server get SIGTERM and stop in order (withdraw, gRPC's grace, the DHT node's shutdown): with the load
# average at 20 to 27 on 2 cores that took 6 to 13 s, hence a longer wait than a p2pd's.
ORDERLY_STOP_S = 30.0
_SWARM_FROM_A_SHORT_THREAD = """
import sys, threading, time
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange

swarm = LocalSwarm(sys.argv[1], log_dir=sys.argv[2])
starter = threading.Thread(target=lambda: swarm.start([BlockRange(0, 6)]))
starter.start()
starter.join()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_process_running_a_local_swarm_leaves_nothing_running(tiny_llama, tmp_path, sig):
    owner = subprocess.Popen([sys.executable, "-c", _SWARM_FROM_A_SHORT_THREAD, tiny_llama, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready", (tmp_path / "server0.err").read_text()[-2000:]
        tree = descendants(owner.pid)
        assert len([p for p in tree if "swarmlm.cli.main" in " ".join(p.cmdline())]) == 2  # its DHT node, its server
        assert p2pd_sockets(tree)  # and their daemons
        kill_main_and_check(owner.pid, tree, sig, grace_s=ORDERLY_STOP_S)
    finally:
        owner.kill()
        owner.wait(10)
        owner.stdout.close()


SPAWN_BESIDE_GRPC = r"""
import subprocess, sys, threading
import swarmlm  # (first, as every swarmlm process imports it: it sets gRPC's fork handling before gRPC loads)
import grpc
from swarmlm import event_loop
from swarmlm.swarm.lifetime import popen_dying_with_us

async def serve_and_call(ready, stop):
    server = grpc.aio.server()
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {"E": echo})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/t.S/E")
        await call(b"x")
        ready.set()
        while not stop.is_set():
            await call(b"x")
    await server.stop(0)

ready, stop = threading.Event(), threading.Event()
thread = threading.Thread(target=lambda: event_loop.run(serve_and_call(ready, stop)))  # (the loop servers run)
thread.start()
ready.wait(30)
codes = [popen_dying_with_us([sys.executable, "-c", "pass"] if i == 0 else ["true"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL).wait() for i in range(int(sys.argv[1]))]
stop.set()
thread.join()
print(sum(code != 0 for code in codes), codes[:3])
"""


def test_children_forked_beside_live_grpc_calls_all_reach_their_exec():
    """A child forked (for its PR_SET_PDEATHSIG preexec) while another thread's gRPC calls run must exec: with gRPC's
    fork handlers on, ~1 in 5 died of SIGSEGV first (the p2pd "failed to start" of busy test runs)."""
    done = subprocess.run([sys.executable, "-c", SPAWN_BESIDE_GRPC, "200"], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"})
    assert done.returncode == 0, done.stderr[-2000:]
    failed = done.stdout.split()[0]
    assert failed == "0", f"{failed} of 200 children died before their exec: {done.stdout} {done.stderr[-1000:]}"
