"""swarmlm's compiled kernels: packed.c (products from GGUF blocks), act16.c (Q4_0 / Q4_1 / Q8_0 / Q4_K products in
integers over activations rounded to int16 blocks), amx.c (Q4_0 / Q4_1 products of 8+ such rows on AMX tiles),
decode.c (a decode step of a span of Llama-shaped blocks in one call), frame.c (compact frames and their keyed MAC,
frame.h), lane.c (a server's compact decode step answered in one call: values, span, ANSWER frame; the step
lane's step from its frame's bytes to its answer: server/lane.py) and chain.c (a client's relayed decode step: every
hop's STEP written and ANSWER read in one call: client/relay.py), built once per machine with the system C compiler
and loaded with ctypes.

Built with `-O3 -march=native` (the CPU's own vector units: AVX-512 where it has them, else AVX2, else scalar C) into
~/.cache/swarmlm/kernels, named by a hash of the source, the compiler and the flags, so a new CPU or a changed source
builds anew and two processes never load a half-written file (written to a temporary name, then renamed). A build
takes about a second. ctypes releases the GIL during a call, so the kernel runs beside the server's other threads.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from swarmlm.kernels import frame_types, lane

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("packed.c", "act16.c", "amx.c", "decode.c", "frame.c",
                                                                  "lane.c", "chain.c")]
# included by the sources: part of the build's name, not compiled alone
HEADERS = [Path(__file__).with_name(name) for name in ("ahead.h", "frame.h")]
CACHE = Path.home() / ".cache" / "swarmlm" / "kernels"
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11", "-fno-math-errno", "-fopenmp-simd", "-pthread"]


class KernelUnavailable(RuntimeError):
    """No C compiler, or the build failed: packed weights cannot run in this process (the message says why)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise KernelUnavailable("no C compiler found (cc, gcc or clang): install one (Debian: apt-get install gcc) "
                                "or serve dequantized weights with --quant none")
    return cc


def _build(cc: str, march: str) -> Path:
    flags = [*FLAGS, f"-march={march}"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + repr((version, flags, _cpu_flags())).encode()).hexdigest()[:16]
    target = CACHE / f"packed-{key}.so"
    if target.is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"building the kernels with {cc} failed: {done.stderr.strip()[:400]}")
        os.replace(out, target)
    log.debug("built %s", target)
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=4)
def library(march: str = "native") -> ctypes.CDLL:
    """The loaded kernels (built on first use) for this CPU, or for an older x86 level (`march="x86-64-v3"`: AVX2,
    `"x86-64"`: scalar C -- how the tests run another CPU's code paths); KernelUnavailable if they cannot be."""
    lib = ctypes.CDLL(str(_build(_compiler(), march)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.packed_matmul.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64]
    lib.packed_matmul.restype = ctypes.c_int
    lib.packed_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64]
    lib.packed_dequantize.restype = ctypes.c_int
    lib.packed_row_bytes.argtypes = [ctypes.c_int, i64]
    lib.packed_row_bytes.restype = i64
    lib.packed_repack.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    lib.packed_repack.restype = ctypes.c_int
    lib.packed_matmul_threads.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, i64]
    lib.packed_matmul_threads.restype = ctypes.c_int
    lib.packed_matmul_again.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, i64, ctypes.c_int]
    lib.packed_matmul_again.restype = ctypes.c_int
    lib.packed_set_threads.argtypes = [ctypes.c_int]
    lib.packed_set_threads.restype = ctypes.c_int
    lib.packed_threads.argtypes = []
    lib.packed_threads.restype = ctypes.c_int
    lib.packed_isa.argtypes = []
    lib.packed_isa.restype = ctypes.c_int
    lib.packed_set_amx.argtypes = [ctypes.c_int]
    lib.packed_set_amx.restype = ctypes.c_int
    lib.packed_amx.argtypes = []
    lib.packed_amx.restype = ctypes.c_int
    lib.decode_span.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
    lib.decode_span.restype = ctypes.c_int
    frame_types.declare(lib)
    lane.declare(lib)
    # (client/relay.py: the hops' structs, the step's dims and buffers (ChainStep), x, the outputs)
    for chain in (lib.chain_relay, lib.chain_pushed):
        chain.argtypes = [ptr, ptr, ptr, ptr]
        chain.restype = i64
    # what the worker pool was last told (model/packed.py threaded_library), an attribute of this build from the start:
    # a missing one is a failed symbol lookup and an AttributeError each time it is read (cold, ~30 us a decode step)
    lib.pool_threads = lib.packed_threads()
    return lib


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Can this process build and load the kernels? If not, says why once (GGUF blocks are then dequantized)."""
    try:
        library()
        return True
    except KernelUnavailable as exc:
        log.warning("%s; GGUF weights are dequantized to float32", exc)
        return False
