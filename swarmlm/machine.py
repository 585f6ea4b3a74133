"""What this machine is and which CPU kernels torch and swarmlm's packed weights run on it: written into every
benchmark's result file.

The same numbers come out differently on an AVX2-only AMD, an AVX512-VNNI Xeon or an AMX one (int8 error, bf16
speed, batching gains), so a result names its CPU, flags and kernels. Libraries may be told to use fewer
instructions than the CPU has (FBGEMM_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA); that is how
one machine runs the kernels of another CPU kind (tests/test_quant.py), and the result records it.
"""
from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

# fbgemm's names for FBGEMM_ENABLE_INSTRUCTIONS -> its instruction sets, widest last (fbgemm src/Utils.cc)
FBGEMM_ISAS = {"AVX2": "avx2", "AVX512": "avx512", "AVX512_256": "avx512_ymm", "AVX512_E1": "avx512_vnni",
               "AVX512_E1_256": "avx512_vnni_ymm"}
_ISA_RANK = {"avx2": 0, "avx512": 1, "avx512_ymm": 1, "avx512_vnni": 2, "avx512_vnni_ymm": 2}
# the library settings that change which kernels run, recorded with every result
KERNEL_ENV = ("FBGEMM_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# CPU flags (as /proc/cpuinfo spells them) that decide which kernels exist: fp32/int8 SIMD, int8 dot products
# accumulating in int32 (VNNI), bf16 dot products, AMX matrix tiles
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
                     "amx_int8", "amx_bf16")


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's entries of /proc/cpuinfo (empty where there is none: not Linux)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> dict[str, bool]:
    """The flags of FLAGS_OF_INTEREST this CPU has (all False where /proc/cpuinfo is missing)."""
    have = set(_cpuinfo().get("flags", "").split())
    return {flag: flag in have for flag in FLAGS_OF_INTEREST}


def cpu_kind() -> str:
    """One word for the int8/bf16 hardware: "amx", "avx512-vnni", "avx512", "avx2" (or "other")."""
    flags = cpu_flags()
    for kind, flag in (("amx", "amx_tile"), ("avx512-vnni", "avx512_vnni"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flags[flag]:
            return kind
    return "other"


def fbgemm_isa() -> str:
    """The instruction set fbgemm's int8 GEMM runs with in this process: the widest the CPU has, or the one
    FBGEMM_ENABLE_INSTRUCTIONS asks for when the CPU has it (fbgemm reads that variable once, at its first GEMM; a
    process changing it later is not followed). "avx512_vnni*" accumulates u8 x s8 products in int32; the others
    add pairs of them in a saturating int16 first."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return "none"
    vnni = getattr(torch.cpu, "_is_vnni_supported", None)  # private: the flags answer where it is gone
    if vnni() if vnni is not None else cpu_flags()["avx512_vnni"]:
        detected = "avx512_vnni"
    else:
        detected = "avx512" if all(cpu_flags()[f] for f in ("avx512f", "avx512bw")) else "avx2"
    forced = FBGEMM_ISAS.get(os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper())
    return forced if forced is not None and _ISA_RANK[forced] <= _ISA_RANK[detected] else detected


def machine_info() -> dict:
    """CPU model, flags and torch's kernel choices: what a benchmark result records about where it ran."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    info = _cpuinfo()
    return {
        "cpu": cpu_model(), "cpu_id": f"family {info.get('cpu family', '?')} model {info.get('model', '?')}",
        "cpu_kind": cpu_kind(), "cores": os.cpu_count(), "flags": cpu_flags(),
        "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "quantized_engine": torch.backends.quantized.engine, "fbgemm_isa": fbgemm_isa(),
        "packed_kernels": _packed_kernels(),
        "torch_amx": bool(amx()), "torch_threads": torch.get_num_threads(),
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
    }


def machine_line(info: dict | None = None) -> str:
    """machine_info in one line, for a RESULTS table: "AMD EPYC (avx512-vnni; torch AVX512, fbgemm avx512_vnni)"."""
    info = info or machine_info()
    forced = ", ".join(f"{k}={v}" for k, v in info["kernel_env"].items())
    return (f"{info['cpu']} ({info['cpu_kind']}; torch {info['torch_cpu_capability']}, fbgemm {info['fbgemm_isa']}"
            f", packed {info['packed_kernels']}" + (f"; forced {forced}" if forced else "") + ")")


def _packed_kernels() -> str:
    """The vector unit swarmlm's packed-weight kernels were built for here, "+amx" where 8-row Q4_0 / Q4_1 products
    run on AMX tiles ("unavailable": no C compiler)."""
    from swarmlm.kernels import KernelUnavailable, library

    try:
        lib = library()
        isa = {3: "avx512-vnni", 2: "avx512", 1: "avx2"}.get(lib.packed_isa(), "scalar")
        return isa + ("+amx" if lib.packed_amx() else "")
    except KernelUnavailable:
        return "unavailable"
