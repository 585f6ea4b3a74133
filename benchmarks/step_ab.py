"""A server's one-call decode step (kernels/decode.c) with another build of the kernels beside this tree's, in one
process: SmolLM2's blocks packed once, steps alternated between the builds over the same caches, thread CPU time,
medians. A tool for kernel work (the builds must lay out weights alike and take decode_span's arguments alike: the
rotary table and per-row flag of session 47 on):

    # another tree's kernels, built by that tree itself (its own flags), copied to a file of their own:
    cp "$(cd /tmp/old && PYTHONPATH=$PWD python -c 'from swarmlm.kernels import library; print(library()._name)')" \\
        /tmp/old.so
    PYTHONPATH=$PWD python benchmarks/step_ab.py /tmp/old.so --rows 1,4,5

Steps alternate old, new, new, old, ... so both see the same cache lengths (64 prompt positions, then 120 steps).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", help="path of the other build (.so)")
    p.add_argument("--rows", default="1,2,3,4,5,8")
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    torch.set_num_threads(1)
    import swarmlm.model.decode_span as decode_span
    from swarmlm.kernels import library
    from swarmlm.machine import machine_line
    from swarmlm.model.catalog import DEFAULT_MODEL, fetch
    from swarmlm.model.checkpoint import load_config
    from swarmlm.server.stage import Stage
    from swarmlm.types import BlockRange

    builds = {"other": ctypes.CDLL(args.other), "this": library()}
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    builds["other"].decode_span.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
    builds["other"].decode_span.restype = ctypes.c_int
    for lib in builds.values():
        lib.packed_set_threads(1)
    model = str(fetch(DEFAULT_MODEL))
    blocks = BlockRange(0, int(load_config(model).num_hidden_layers))
    stage = Stage(model, blocks)
    print(f"{model}: a step of all blocks, thread CPU time, median of {args.steps // 2} steps per build; "
          f"{machine_line()}\n\n| rows | other (ms) | this (ms) | speed |\n|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        state = stage.new_state(blocks, rows, 64 + args.steps + 8)
        stage.step(state, torch.randn(rows, 64, stage.hidden_size), torch.ones(rows, 64))
        times: dict[str, list[float]] = {name: [] for name in builds}
        for i in range(args.steps):
            name = ("other", "this")[(i + i // 2) % 2]
            decode_span.threaded_library = lambda lib=builds[name]: lib  # the decoder's one way to its kernels
            x = torch.randn(rows, 1, stage.hidden_size)
            t0 = time.thread_time()
            stage.step(state, x, torch.ones(rows, 1))
            times[name].append(time.thread_time() - t0)
        other, this = (statistics.median(times[name]) for name in builds)
        print(f"| {rows} | {other * 1e3:.2f} | {this * 1e3:.2f} | {other / this:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
