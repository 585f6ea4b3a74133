"""No orphans: every process a swarmlm process starts dies with it, whatever kills it (SIGKILL included).

What a server, a `swarmlm dht` node, a gateway or a client starts, and how each dies with its parent:
- hivemind's DHT: no process at all. The node runs on a thread of its owner (swarm/dht_thread.py); hivemind's
  `DHT` forked a ~320 MB child that outlived a SIGKILLed parent and kept announcing it. Without that child no
  `MPFuture` exists, so torch's shared memory is never used and no `torch_shm_manager` is started (hivemind's
  mpfuture shares its futures' state bytes with torch's "file_system" strategy, which starts that manager).
- p2pd (hivemind's Go daemon, one per DHT node and one per P2PNode, unless one replicates another's): started by
  hivemind with fork+exec; we have the child ask the kernel for SIGTERM when its parent dies (prctl
  PR_SET_PDEATHSIG, kept across exec) before it execs, in a process group of its own (a signal to its owner's
  group is for the owner, which stops it in order). SIGTERM, not SIGKILL: p2pd then removes its unix socket in
  /tmp, as on a clean stop (a SIGKILLed one leaves it behind). The signal follows the death of the *thread* that
  forked it: p2pd is forked by its node's event-loop thread, which lives until the node is shut down (and then
  p2pd is stopped anyway).
A watchdog polling the parent's pid would need one more process (or a thread in a Go binary we do not build);
the kernel's signal needs neither and acts at once.
- LocalSwarm's servers and `swarmlm dht` nodes (the tests', the demo's, the benchmarks' swarm): `popen_dying_with_us`
  asks for the same signal, and forks every one of them on one thread that lives as long as the process (callers
  start servers from any thread, short-lived ones included: a child forked there died with that thread at once, or,
  before this, with nothing: a SIGTERMed or SIGKILLed test run left its swarm running).
- p2pd's unix socket: removed by p2pd on SIGTERM almost always, but not always (seen once in CI after a SIGKILLed
  gateway: the daemon gone, its socket file left). A socket file in /tmp that nobody listens on and that is older than
  a minute is swept by the next process that starts a p2pd (`sweep_stale_p2pd_sockets`); the age keeps a daemon that
  has bound but not yet listened safe from a neighbour's sweep."""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import glob
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import types

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
P2PD_SOCKETS = "/tmp/hivemind-p2pd-*.sock"  # where hivemind's daemons listen (p2p_daemon.py)
STALE_SOCKET_AGE_S = 60.0
_libc = ctypes.CDLL(None, use_errno=True)  # (looked up before any fork: a forked child only calls it)


def die_with_parent(parent_pid: int) -> None:
    """In a freshly forked child: SIGTERM when the forking thread dies; exit now if the parent is already gone."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died between our fork and the prctl: the signal will never come
        os._exit(1)


def popen_dying_with_us(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen_kwargs)` whose child gets SIGTERM when this process dies, whatever kills it and
    whichever thread calls this: the child is forked by this process's spawner thread, which never exits."""
    parent, started = os.getpid(), concurrent.futures.Future()
    _spawner_jobs().put((lambda: subprocess.Popen(args, preexec_fn=lambda: die_with_parent(parent), **popen_kwargs),
                         started))
    return started.result()


_spawner: tuple[int, queue.SimpleQueue] | None = None  # (the pid it runs in: a forked child starts its own, jobs)
_spawner_lock = threading.Lock()


def _spawner_jobs() -> queue.SimpleQueue:
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_spawn_forever, args=(jobs,), name="swarmlm-spawner", daemon=True).start()
            _spawner = (os.getpid(), jobs)
        return _spawner[1]


def _spawn_forever(jobs: queue.SimpleQueue) -> None:
    while True:
        start, started = jobs.get()
        try:
            started.set_result(start())
        except BaseException as exc:  # (the caller raises it)
            started.set_exception(exc)


def _own_group_dying_with(parent_pid: int) -> None:
    """p2pd's start: its own process group, so a signal to ours (`timeout`, Ctrl-C in a terminal) reaches its owner
    alone, which then stops it in order (no daemon dying under a live node: no errors about its closed socket);
    and dead with its owner, whatever kills that."""
    os.setpgid(0, 0)
    die_with_parent(parent_pid)


async def _exec_dying_with_us(program, *args, **kwargs):
    parent = os.getpid()
    return await asyncio.create_subprocess_exec(program, *args, preexec_fn=lambda: _own_group_dying_with(parent),
                                                **kwargs)


def bind_p2pd_to_owner() -> None:
    """Make every p2pd that hivemind starts from now on in this process die with this process (idempotent).

    hivemind starts p2pd with `asyncio.subprocess.create_subprocess_exec` and has no hook for it: its daemon
    module alone gets an `asyncio` whose `subprocess.create_subprocess_exec` adds the parent-death signal.
    Nothing else in the process is touched."""
    from hivemind.p2p import p2p_daemon

    if isinstance(p2p_daemon.asyncio, _AsyncioForP2PD):
        return
    p2p_daemon.asyncio = _AsyncioForP2PD()
    sweep_stale_p2pd_sockets()


def sweep_stale_p2pd_sockets(pattern: str = P2PD_SOCKETS, min_age_s: float = STALE_SOCKET_AGE_S) -> list[str]:
    """Remove the unix socket files matching `pattern` that nobody listens on and that are older than `min_age_s`
    (a dead daemon's leftovers); returns the paths removed. Other users' files and live sockets are left alone."""
    removed = []
    for path in glob.glob(pattern):
        try:
            if time.time() - os.lstat(path).st_mtime < min_age_s or _listened_on(path):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def _listened_on(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOTSOCK):
                return False
            return True  # (a permission error or the like: not ours to judge)
        return True


class _AsyncioForP2PD(types.ModuleType):
    """asyncio, except `subprocess.create_subprocess_exec` (p2pd's start) binds the child to this process."""

    def __init__(self) -> None:
        super().__init__("asyncio")
        sub = types.ModuleType("asyncio.subprocess")
        sub.__dict__.update(asyncio.subprocess.__dict__)
        sub.create_subprocess_exec = _exec_dying_with_us
        self.subprocess = sub

    def __getattr__(self, name: str):
        return getattr(asyncio, name)
