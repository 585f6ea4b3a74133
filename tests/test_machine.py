"""swarmlm/machine.py: what a result records about its machine, and which int8 kernel fbgemm runs."""
from __future__ import annotations

import json

import pytest
import torch

import swarmlm.machine as machine


def test_machine_info_names_the_cpu_its_flags_and_kernels():
    info = machine.machine_info()
    json.dumps(info)  # goes into result files as it is
    assert info["cpu"] and info["cores"] >= 1 and set(info["flags"]) == set(machine.FLAGS_OF_INTEREST)
    assert info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["quantized_engine"] == torch.backends.quantized.engine
    assert info["torch_threads"] == torch.get_num_threads()
    kind_flag = {"amx": "amx_tile", "avx512-vnni": "avx512_vnni", "avx512": "avx512f", "avx2": "avx2"}
    assert info["cpu_kind"] == "other" or info["flags"][kind_flag[info["cpu_kind"]]]
    assert info["packed_kernels"] in ("avx512-vnni", "avx512-vnni+amx", "avx512", "avx512+amx", "avx2", "scalar")
    assert not info["packed_kernels"].endswith("+amx") or info["flags"]["amx_int8"]  # AMX only where the CPU has it
    line = machine.machine_line(info)
    assert info["cpu"] in line and info["fbgemm_isa"] in line and f"packed {info['packed_kernels']}" in line


def test_fbgemm_isa_follows_its_setting_but_never_beyond_the_cpu(monkeypatch):
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("fbgemm's x86 kernels only")
    monkeypatch.delenv("FBGEMM_ENABLE_INSTRUCTIONS", raising=False)
    native = machine.fbgemm_isa()
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "avx2")  # fbgemm reads it case-insensitively
    assert machine.fbgemm_isa() == "avx2"
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "NOT_AN_ISA")
    assert machine.fbgemm_isa() == native
    # a CPU without VNNI (or AVX512) is not made one by asking
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setattr(machine, "cpu_flags", lambda: dict.fromkeys(machine.FLAGS_OF_INTEREST, False))
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512_E1")
    assert machine.fbgemm_isa() == "avx2"
