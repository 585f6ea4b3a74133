"""Which maintained int8 kernel is fastest on this CPU for a linear layer, at decode (1 row) and prefill shapes?

Candidates, all measured side by side in one process (interleaved rounds, medians):
- fp32           nn.Linear (the baseline)
- dyn-qint8      torch.ao.quantization.quantize_dynamic as torch ships it, qint8 per-channel weights (fbgemm/x86
                 engine): activations quantized per call to 7 bits (`reduce_range=True`), one range per call
- dyn-8bit       the same kernel asked for 8-bit activations (`reduce_range=False`; safe where fbgemm accumulates
                 in int32, AVX512-VNNI)
- swarmlm        swarmlm/model/quant.py's Int8Linear: the same kernel, 8-bit activations where safe, one range
                 per row (rows mapped to [-1, 1] and back) -- what servers and the client's head run
- int8pack       torch.ops.aten._weight_int8pack_mm: int8 weight-only, per-channel scales, fp32 activations (the
                 CPU kernel behind torchao's int8 weight-only)
- torchao-wo     torchao.quantize_(Int8WeightOnlyConfig()) (needs torchao)
- torchao-dyn    torchao.quantize_(Int8DynamicActivationInt8WeightConfig()) (needs torchao)
- dequant        int8 weights dequantised to fp32 on every call, then an fp32 matmul (the naive weight-only)

Shapes are BLOOMZ-560M's (hidden 1024): qkv 1024->3072, dense 1024->1024, mlp 1024->4096 and 4096->1024, and the
client's LM head 1024->250880.

    .venv/bin/python benchmarks/quant_bench.py --rows 1 128 --rounds 7
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
from torch import nn

from swarmlm.machine import machine_info

SHAPES = {"qkv": (1024, 3072), "dense": (1024, 1024), "mlp_up": (1024, 4096), "mlp_down": (4096, 1024),
          "lm_head": (1024, 250880)}


def _dyn_qint8(lin: nn.Linear) -> nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(nn.Sequential(copy.deepcopy(lin)), {nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)


def _dyn_8bit(lin: nn.Linear):
    packed = _dyn_qint8(lin)[0]._packed_params._packed_params
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, reduce_range=False)


def _swarmlm(lin: nn.Linear) -> nn.Module:
    from swarmlm.model.quant import quantize_linears

    return quantize_linears(nn.Sequential(copy.deepcopy(lin)), "int8")


def _torchao(lin: nn.Linear, dynamic: bool) -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    m = nn.Sequential(copy.deepcopy(lin))
    quantize_(m, Int8DynamicActivationInt8WeightConfig() if dynamic else Int8WeightOnlyConfig())
    return m


def _int8pack(lin: nn.Linear):
    from swarmlm.model.quant import quantize_rows

    q, scale = quantize_rows(lin.weight)
    bias = lin.bias
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale) + (0 if bias is None else bias)


def _dequant(lin: nn.Linear):
    w = lin.weight.detach()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).to(torch.int8)
    bias = lin.bias
    return lambda x: nn.functional.linear(x, q.to(x.dtype) * scale[:, None], bias)


def candidates(lin: nn.Linear, only: list[str] | None = None) -> dict:
    out = {"fp32": lin, "dyn-qint8": _dyn_qint8(lin), "dyn-8bit": _dyn_8bit(lin), "swarmlm": _swarmlm(lin),
           "int8pack": _int8pack(lin), "dequant": _dequant(lin)}
    try:
        out["torchao-wo"] = _torchao(lin, dynamic=False)
        out["torchao-dyn"] = _torchao(lin, dynamic=True)
    except ImportError:
        pass
    return {k: v for k, v in out.items() if only is None or k == "fp32" or k in only}


@torch.inference_mode()
def bench_shape(k: int, n: int, rows: int, rounds: int, reps: int, only: list[str] | None = None
                ) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(k, n, bias=n != 250880)
    nn.init.normal_(lin.weight, std=0.02, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    ref = lin(x)
    # a prompt with one outlier token (x20): the error on the other tokens shows what one range per call costs
    xo = x.clone()
    xo[0] *= 20
    ref_o = lin(xo)[1:]
    impls = candidates(lin, only)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for fn in impls.values():  # warm-up
        fn(x)
    for _ in range(rounds):  # interleaved: load elsewhere hits every candidate alike
        for name, fn in impls.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            times[name].append((time.perf_counter() - t0) / reps)
    out = {}
    for name, fn in impls.items():
        err = float((fn(x) - ref).norm() / ref.norm())
        err_o = float((fn(xo)[1:] - ref_o).norm() / ref_o.norm()) if rows > 1 else err
        out[name] = {"ms": 1e3 * statistics.median(times[name]), "rel_l2": err, "rel_l2_outlier": err_o}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", nargs="+", help="candidates to run besides fp32 (default: all)")
    p.add_argument("--json", help="write results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for rows in args.rows:
        for shape in args.shapes:
            k, n = SHAPES[shape]
            reps = max(1, int(2e7 // (k * n * max(rows, 8))))  # ~equal work per timing
            res = bench_shape(k, n, rows, args.rounds, reps, args.only)
            base = res["fp32"]["ms"]
            line = "  ".join(f"{name} {r['ms']:.3f}ms ({r['ms'] / base:.2f}x, err {r['rel_l2']:.1e}"
                             + (f", outlier prompt {r['rel_l2_outlier']:.1e})" if rows > 1 else ")")
                             for name, r in res.items())
            print(f"rows={rows:<4d} {shape:9s} {line}", flush=True)
            results.append({"rows": rows, "shape": shape, "k": k, "n": n, **res})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "machine": machine_info(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
