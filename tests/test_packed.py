"""Packed weights (swarmlm/model/packed.py, kernels/packed.c): every GGUF type the kernels keep computes what its
dequantized values compute, in layers, blocks and client modules; bad quantized data is one clear error."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from swarmlm.model.checkpoint import load_blocks, load_client_modules
from swarmlm.model.gguf import open_gguf
from swarmlm.model.packed import (DIRECT_ROWS, HUGE_PAGE_BYTES, PACKED_TYPES, PackedEmbedding, PackedError,
                                  PackedLinear, PackedTensor, WeightArena, held_buffer, packed_from_numpy)
from swarmlm.model.quant import weight_bytes
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange
from tests.gguf_fixtures import write_tiny_gguf

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")  # what gguf-py writes; K-quants: synthetic
FILE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")  # the tiny GGUFs' matrices (rows of 64 weights)


ROUNDED_ACTIVATIONS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # kernels/act16.c: activations rounded to int16 per block of 32
ROUNDING_BOUND = 1e-4  # what that rounding may cost a product (relative L2; ~3e-5 measured on random activations)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm())


def int16_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as act16.c rounds it before a Q4_0 / Q4_1 product: per block of 32, scale = max |x| / 32767 and each value
    scale x round(x x 32767 / max |x|) (float32, half to even)."""
    blocks = x.reshape(-1, 32)
    largest = blocks.abs().amax(1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(32767.0) / largest, torch.zeros(()))
    return ((largest / 32767.0) * torch.round(blocks * inverse)).reshape(x.shape)


def product_reference(type_name: str, x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """What a packed product of x [R, cols] computes: x (rounded where the kernels round it) times the values."""
    rounded = type_name in ROUNDED_ACTIVATIONS and x.shape[0] <= DIRECT_ROWS
    return (int16_blocks(x) if rounded else x) @ want.T


def tolerance(type_name: str) -> float:
    """relative L2 between a packed and a dequantized layer, block or head"""
    return ROUNDING_BOUND if type_name in ROUNDED_ACTIVATIONS else 1e-5


def raw_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, file row bytes] of `type_name`: gguf-py's quantization of random weights, or for K-quants random
    quants with small positive scales (every bit pattern of quants and sub-scales is a valid block)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if type_name == "F16":
        return values.astype(np.float16).view(np.uint8)
    if type_name in QUANTIZABLE:
        return quantize(values, GGMLQuantizationType[type_name])
    if type_name == "Q8_M":
        from swarmlm.model.quant import quantize_q8_m

        return quantize_q8_m(values)
    _, block, size = PACKED_TYPES[type_name]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = (0.01 * rng.random((rows, cols // block, 2)) + 1e-3).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":  # d is the block's last two bytes
        raw[..., size - 2:] = scales[..., :2]
    else:  # d and dmin lead the block
        raw[..., :4] = scales
    return raw.reshape(rows, -1)


def reference_values(type_name: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """gguf-py's dequantization of `raw`; Q8_M (swarmlm's own): d q + m from its float32 header."""
    if type_name == "Q8_M":
        blocks = raw.reshape(rows, cols // 32, 40)
        d, m = blocks[..., :4].copy().view(np.float32), blocks[..., 4:8].copy().view(np.float32)
        exact = d.astype(np.float64) * blocks[..., 8:] + m.astype(np.float64)  # fma(d, q, m): rounded once
        return torch.from_numpy(exact.astype(np.float32).reshape(rows, cols))
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols).astype(np.float32))


@pytest.mark.parametrize("type_name", list(PACKED_TYPES))
@pytest.mark.parametrize("width", ["super-chunks", "other"])
def test_every_type_unpacks_to_gguf_pys_values_and_multiplies_as_they_do(type_name, width):
    """Both layouts of a row: whole super-chunks of 16 blocks (Q4_0 / Q4_1 / Q8_0: one lane per block on AVX-512),
    and widths that are not (chunks of 4 blocks, a partial last chunk: 18 blocks; the K-quants' 3 super-blocks)."""
    block = PACKED_TYPES[type_name][1]
    rows, cols = 48, 512 if width == "super-chunks" else (576 if block == 32 else 768)
    raw = raw_blocks(type_name, rows, cols)
    want = reference_values(type_name, raw, rows, cols)
    packed = packed_from_numpy(type_name, raw, cols)
    assert torch.equal(packed.dequantize(), want)  # bit for bit
    assert torch.equal(packed.dequantize(5, 9), want[5:9])
    assert packed.nbytes * 144 <= raw.nbytes * 148  # the file's bytes; Q4_K's split is the largest: 148 / 144
    if type_name == "Q8_M":  # asymmetric 8-bit: every weight within half a step of the float value
        values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        step = (np.ptp(values.reshape(rows, -1, 32), axis=-1) / 255).repeat(32, -1).reshape(rows, cols)
        assert (np.abs(want.numpy() - values) <= 0.5 * step + 1e-6).all()
    for batch in (1, 3, 5, DIRECT_ROWS, DIRECT_ROWS + 7):  # the kernel (decode), and dequantize + GEMM (prefill)
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
        x[:, 7] *= 40  # an outlier: its blocks' other values keep 1/65534 of it
        got = packed.matmul(x)
        assert rel_l2(got, product_reference(type_name, x, want)) < 1e-5, batch
        assert rel_l2(got, x @ want.T) < tolerance(type_name), batch


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("cols", [544, 576])
def test_a_one_lane_rows_short_tail_is_shared_by_two_weight_rows_and_alone_by_the_last(type_name, cols):
    """Rows of a super-chunk and a tail of 1 or 2 blocks: the tiles of two weight rows multiply both rows' tails in
    one chunk, an odd last row alone (act16.c pair_tail_sums); both equal the reference, at 1-9 activation rows (a
    tile of each size up to act16.c's LANE_ROWS (6), then two: 4 + 3, 4 + 4, 5 + 4)."""
    rows = 9
    raw = raw_blocks(type_name, rows, cols, seed=3)
    want = reference_values(type_name, raw, rows, cols)
    packed = packed_from_numpy(type_name, raw, cols)
    for batch in range(1, 10):
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
        assert rel_l2(packed.matmul(x), product_reference(type_name, x, want)) < 1e-5, batch


def amx_expected() -> bool:
    """Should the kernels multiply on AMX tiles here? Asked apart from them: the CPU's flags, a compiler that knows
    AMX at -march=native, and Linux lending this process the tiles (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)."""
    import ctypes
    import platform
    import shutil
    import subprocess

    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    if platform.machine() != "x86_64" or "amx_tile" not in flags or "amx_int8" not in flags:
        return False
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    macros = subprocess.run([cc, "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True).stdout
    return "__AMX_INT8__" in macros and ctypes.CDLL(None).syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_products_of_8_rows_or_more_run_on_amx_tiles_where_the_cpu_has_them_and_equal_act16s(type_name):
    """kernels/amx.c: Q4_0 / Q4_1 rows of a super-chunk or more, 8+ activation rows, on AMX where this CPU and OS
    allow it (else act16.c: the switch says which; 7 rows always act16.c). Both equal the reference of int16-rounded
    activations; shapes with an odd or even tail, whole super-chunks, weight rows not a multiple of 16 and
    activation rows not of 8."""
    from swarmlm.kernels import library

    lib = library()
    assert lib.packed_set_amx(1) == amx_expected()
    try:
        for rows, cols in ((9, 544), (33, 576), (20, 1024)):
            raw = raw_blocks(type_name, rows, cols, seed=5)
            want = reference_values(type_name, raw, rows, cols)
            packed = packed_from_numpy(type_name, raw, cols)
            for batch in (7, 8, 9, 16, 17, 40):
                x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
                x[:, 3] *= 40
                lib.packed_set_amx(1)
                tiles = packed.matmul(x)
                lib.packed_set_amx(0)
                vectors = packed.matmul(x)
                reference = product_reference(type_name, x, want)
                assert rel_l2(tiles, reference) < 1e-5 and rel_l2(vectors, reference) < 1e-5, (rows, cols, batch)
                assert rel_l2(tiles, vectors) < 1e-5, (rows, cols, batch)
    finally:
        lib.packed_set_amx(1)


def test_rounding_activations_to_int16_blocks_is_what_changes_a_q4_product():
    """The mutation check of the reference above: the rounding is real (a float product misses it by more than the
    kernels' summation order) and small (far below bfloat16's)."""
    raw = raw_blocks("Q4_0", 64, 256)
    want = reference_values("Q4_0", raw, 64, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    got = packed_from_numpy("Q4_0", raw, 256).matmul(x)
    assert rel_l2(got, int16_blocks(x) @ want.T) < 1e-6 < rel_l2(got, x @ want.T)
    assert rel_l2(got, x @ want.T) < rel_l2(x.bfloat16().float() @ want.T, x @ want.T) / 20
    assert torch.equal(int16_blocks(torch.zeros(1, 32)), torch.zeros(1, 32))


def test_a_packed_linear_is_the_linear_of_its_dequantized_weight_with_gradients():
    raw = raw_blocks("Q4_1", 40, 96)
    packed = packed_from_numpy("Q4_1", raw, 96)
    bias = torch.randn(40)
    ref = torch.nn.Linear(96, 40)
    ref.weight.data, ref.bias.data = packed.dequantize(), bias.clone()
    layer = PackedLinear(packed, bias)
    x = torch.randn(2, 5, 96, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 5, 40) and rel_l2(y, ref(x)) < ROUNDING_BOUND
    y.square().sum().backward()
    got = x.grad.clone()
    x.grad = None
    ref(x).square().sum().backward()
    assert rel_l2(got, x.grad) < ROUNDING_BOUND  # the input's gradient flows through the dequantized weight (2 y)
    with torch.inference_mode():
        assert layer(torch.randn(3, 96, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert layer(torch.randn(0, 96)).shape == (0, 40)  # no rows: an empty answer, as nn.Linear gives
        assert layer(torch.randn(2, 0, 96)).shape == (2, 0, 40)


def test_a_packed_embedding_looks_up_dequantized_rows():
    raw = raw_blocks("Q8_0", 100, 64)
    packed = packed_from_numpy("Q8_0", raw, 64)
    ids = torch.tensor([[3, 99, 3], [0, 1, 50]])
    assert torch.equal(PackedEmbedding(packed)(ids), torch.nn.functional.embedding(ids, packed.dequantize()))
    assert torch.equal(PackedEmbedding(packed, scale=2.0)(ids), 2.0 * packed.dequantize()[ids])
    with pytest.raises(IndexError, match="out of range"):
        PackedEmbedding(packed)(torch.tensor([100]))


def test_bad_or_truncated_quantized_data_is_one_clear_error():
    raw = raw_blocks("Q4_0", 4, 64)
    with pytest.raises(PackedError, match="w.q: Q4_0 rows of 64 weights take 36 bytes in the file, got 30"):
        packed_from_numpy("Q4_0", raw[:, :30], 64, "w.q")  # a truncated row
    with pytest.raises(PackedError, match="not 48"):
        PackedTensor("Q4_0", torch.zeros(4, 30, dtype=torch.uint8), 48)  # not whole blocks
    with pytest.raises(PackedError, match="take 36 bytes in memory"):
        PackedTensor("Q4_0", torch.zeros(4, 40, dtype=torch.uint8), 64)  # rows of another size
    with pytest.raises(PackedError, match="not a packed type"):
        packed_from_numpy("IQ2_XS", raw, 64)


# ---- a tiny Llama written as GGUF with every matrix in one type --------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    return str(init_checkpoint("tiny-llama", tmp_path_factory.mktemp("packed") / "checkpoint", seed=2))


@pytest.fixture(scope="module", params=FILE_TYPES)
def tiny_gguf(request, tiny_checkpoint, tmp_path_factory) -> tuple[str, str]:
    out = tmp_path_factory.mktemp("packed-gguf") / f"tiny-{request.param}.gguf"
    return request.param, str(write_tiny_gguf(tiny_checkpoint, out, matrix_type=request.param))


def test_small_weights_share_huge_page_regions_each_in_bytes_of_its_own():
    arena = WeightArena(chunk_bytes=1 << 20)
    sizes = [300_000, 1, 500_000, 300_000, 64, 999_999]
    held = [arena.take(n) for n in sizes]
    for n, t in zip(sizes, held):
        t.fill_(n % 251)
    assert [t.numel() for t in held] == sizes and all(t.data_ptr() % WeightArena.ALIGN == 0 for t in held)
    assert [int(t[0]) for t in held] == [n % 251 for n in sizes]  # nothing written over another's bytes
    regions = [t.untyped_storage().data_ptr() for t in held]
    assert regions[0] == regions[1] == regions[2] != regions[3]  # 800_064 + 300_000 > 1 MiB: a new region
    assert regions[3] == regions[4] != regions[5]
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in held)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))
    whole = held_buffer(2, HUGE_PAGE_BYTES // 2 + 64)  # a huge page or more: its own region, from a page's start
    assert whole.shape == (2, HUGE_PAGE_BYTES // 2 + 64) and whole.data_ptr() % HUGE_PAGE_BYTES == 0
    assert held_buffer(0, 40).shape == (0, 40)


def test_packed_blocks_and_client_compute_what_the_dequantized_file_computes(tiny_gguf):
    type_name, path = tiny_gguf
    packed, plain = Stage(path, BlockRange(0, 4), quant="auto"), Stage(path, BlockRange(0, 4), quant="none")
    linears = [m for m in packed.modules.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * 7 and {m.packed.type_name for m in linears} == {type_name}
    assert packed.announced_quant == plain.announced_quant == "none"  # the same values: the same function
    file_bytes = sum(open_gguf(path).packed_bytes(f"model.layers.{b}.{n}.weight") for b in range(4)
                     for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    norms = sum(p.nbytes for p in plain.modules.parameters() if p.dim() == 1)
    assert packed.weight_bytes <= 1.25 * file_bytes + norms < plain.weight_bytes
    hidden = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9)
    assert rel_l2(packed.forward(BlockRange(0, 4), hidden, mask),
                  plain.forward(BlockRange(0, 4), hidden, mask)) < tolerance(type_name)
    # decode steps (rows <= DIRECT_ROWS: straight from the blocks) after a prefill
    states = [s.new_state(BlockRange(1, 3), 2, 16) for s in (packed, plain)]
    for t in (5, 1, 1):
        step = torch.randn(2, t, 64)
        got, want = (s.step(st, step, torch.ones(2, t)) for s, st in zip((packed, plain), states))
        assert rel_l2(got, want) < tolerance(type_name)
    _, _, client = load_client_modules(path, quant="auto")
    _, _, reference = load_client_modules(path, quant="none")
    assert isinstance(client.embed, PackedEmbedding) and isinstance(client.lm_head, PackedLinear)
    assert weight_bytes(client.lm_head) < weight_bytes(reference.lm_head)
    ids = torch.tensor([[1, 7, 300, 511]])
    assert torch.equal(client.embed(ids), reference.embed(ids))
    h = torch.randn(1, 4, 64)
    assert rel_l2(client.lm_head(h), reference.lm_head(h)) < tolerance(type_name)


def test_a_gguf_server_reads_its_blocks_packed_and_nothing_else(tiny_gguf):
    type_name, path = tiny_gguf
    checkpoint = open_gguf(path)
    before_packed, before_float = checkpoint.packed_read_bytes, checkpoint.dequantized_bytes
    load_blocks(path, 1, 3)
    matrices = [k for k in checkpoint.keys() if k.startswith(("model.layers.1.", "model.layers.2."))
                and k.endswith("_proj.weight")]
    assert checkpoint.packed_read_bytes - before_packed == sum(checkpoint.packed_bytes(k) for k in matrices)
    norms = [k for k in checkpoint.keys() if k.startswith(("model.layers.1.", "model.layers.2.")) and "norm" in k]
    assert checkpoint.dequantized_bytes - before_float == 4 * 64 * len(norms)  # only the float32 norms


def test_int8_and_int4_on_a_gguf_are_refused(tiny_gguf):
    _, path = tiny_gguf
    with pytest.raises(ValueError, match="served in its own blocks"):
        Stage(path, BlockRange(0, 1), quant="int8")


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA, and plain C: other CPUs' code paths
def test_the_avx2_and_scalar_builds_compute_the_same_values(march, monkeypatch):
    import swarmlm.model.packed as packed_module
    from swarmlm.kernels import library

    other = library(march)
    assert other.packed_isa() == {"x86-64-v3": 1, "x86-64": 0}[march]
    monkeypatch.setattr(packed_module, "library", lambda: other)
    for type_name in PACKED_TYPES:
        raw = raw_blocks(type_name, 9, 256)
        want = reference_values(type_name, raw, 9, 256)
        packed = packed_from_numpy(type_name, raw, 256)
        assert torch.equal(packed.dequantize(), want), type_name
        for rows in (3, 6):  # integer products (vector builds), rounded activations x blocks (plain C)
            x = torch.randn(rows, 256)
            assert rel_l2(packed.matmul(x), product_reference(type_name, x, want)) < 1e-5, type_name


def test_without_a_c_compiler_a_gguf_is_served_dequantized(tiny_gguf, monkeypatch):
    import swarmlm.model.gguf as gguf_module

    _, path = tiny_gguf
    monkeypatch.setattr(gguf_module, "kernels_available", lambda: False)
    stage = Stage(path, BlockRange(0, 2), quant="auto")
    assert not any(isinstance(m, PackedLinear) for m in stage.modules.modules())
    assert stage.announced_quant == "none"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_large_product_split_between_threads_computes_what_one_thread_does(type_name):
    """Products of THREADED_MIN_WEIGHTS or more are split by output rows between the kernels' worker threads, which
    read the activations the calling thread prepared (rounded to int16 blocks where the type rounds them)."""
    from swarmlm.model.packed import THREADED_MIN_WEIGHTS

    rows, cols = 2 * THREADED_MIN_WEIGHTS // 1024, 1024
    raw = raw_blocks(type_name, rows, cols)
    packed = packed_from_numpy(type_name, raw, cols)
    want = reference_values(type_name, raw, rows, cols)
    before = torch.get_num_threads()
    try:
        for batch in (1, 6, 8):  # 8: Q4_0 on AMX tiles where the CPU has them, 16 weight rows per thread's chunk
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
            torch.set_num_threads(1)
            alone = packed.matmul(x)
            torch.set_num_threads(2)
            split = packed.matmul(x)
            assert torch.equal(split, alone), batch  # each output row is computed whole by one thread
            assert rel_l2(split, product_reference(type_name, x, want)) < 1e-5, batch
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 8, 16])  # 8+: AMX tiles where the CPU has them
def test_products_that_share_their_input_share_its_preparation(rows):
    """kernels/packed.c `packed_matmul_again` (decode.c's k and v after q, up after gate): a product told that x is
    the previous product's input takes that preparation when it was laid out alike, else prepares its own, and
    equals the same product prepared afresh -- across types whose layouts are equal (Q4_0 / Q4_1: AMX or one lane
    at 768 columns) or not (Q4_K, Q8_0 one lane, Q5_0: none)."""
    from swarmlm.kernels import library

    lib, cols = library(), 768  # whole K-quant blocks, 24 blocks of 32: a super-chunk and a tail
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))

    def product(type_name: str, again: int) -> torch.Tensor:
        packed = packed_from_numpy(type_name, raw_blocks(type_name, 48, cols, seed=len(type_name)), cols)
        y = torch.empty(rows, packed.rows)
        assert lib.packed_matmul_again(packed.ggml_type, packed.data.data_ptr(), packed.data.shape[1], x.data_ptr(),
                                       rows, cols, y.data_ptr(), packed.rows, 1 << 62, again) == 0
        return y

    sequence = ["Q4_0", "Q4_1", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q4_0"]
    fresh = [product(name, 0) for name in sequence]
    shared = [product(name, int(i > 0)) for i, name in enumerate(sequence)]
    for name, want, got in zip(sequence, fresh, shared):
        assert torch.equal(got, want), name



def test_threaded_products_back_to_back_of_changing_sizes_each_take_their_own_rows(tiny_llama):
    """The pool's workers never take (nor count) rows of a product other than the one they joined: a worker the OS
    delayed between its last chunk of one product and its last look at the shared row counter used to take rows of
    the next product before the caller reset that counter, and the caller then waited for rows nobody would count
    (a llama-1b server's 2-thread decode hung there). The one-call decoder runs a block's products back to back in C,
    of changing sizes (k, v, then o); here every one of them is split between 2 threads (no size threshold), many
    steps, in a child process so that a hang fails the test instead of stopping the suite; each step's output
    equals one thread's."""
    import subprocess
    import sys

    script = f"""
import torch
import swarmlm.model.decode_span as decode_span
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.types import BlockRange
decode_span.THREADED_MIN_WEIGHTS = 0  # every product split between the threads, however small
stage = Stage({tiny_llama!r}, BlockRange(0, 2), quant="int8")
assert stage._span_decoder(slice(0, 2)) is not None
x = torch.randn(1, 1, stage.hidden_size, generator=torch.Generator().manual_seed(0))
def steps(threads, n):
    torch.set_num_threads(threads)
    state = stage.new_state(stage.blocks, 1, n + 1)
    with torch.inference_mode():
        return [stage.step_batch([StepRequest(state, x, torch.ones(1, 1), None)])[0] for i in range(n)]
want = steps(1, 400)
for _ in range(10):
    assert all(torch.equal(a, b) for a, b in zip(steps(2, 400), want))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
