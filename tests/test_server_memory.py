"""Servers sized by memory: a block counts at its bytes as loaded (a GGUF's kept blocks: about their bytes in the file;
dequantized: float32) plus the attention-cache budget; blocks that do not fit --memory-mb are refused in one line
before anything loads; a server reads only its own blocks' tensors from the file."""
from __future__ import annotations

import subprocess
import sys

import pytest

from swarmlm.config import ServerConfig
from swarmlm.errors import MemoryBudgetExceeded
from swarmlm.model.gguf import open_gguf
from swarmlm.model.random_checkpoint import init_gguf
from swarmlm.server.placement import blocks_that_fit, check_fits, model_spec, num_blocks_for, range_bytes
from swarmlm.types import BlockRange

MIB = 1 << 20


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return init_gguf("tiny-llama", tmp_path_factory.mktemp("mem") / "tiny.q4_0.gguf", "q4_0", seed=1)


def _file_bytes(path, blocks: range, matrices_only: bool) -> int:
    import gguf

    total = 0
    for t in gguf.GGUFReader(path).tensors:  # gguf-py's own table
        block = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if block is not None and int(block) in blocks and (len(t.shape) == 2) == matrices_only:
            total += int(t.n_bytes) if matrices_only else int(t.n_elements) * 4
    return total


def test_a_block_counts_at_its_bytes_as_loaded(q4):
    auto = ServerConfig(model_dir=str(q4), blocks=None, dtype="float32", quant="auto")
    none = ServerConfig(model_dir=str(q4), blocks=None, dtype="float32", quant="none")
    blocks = BlockRange(1, 4)
    norms = _file_bytes(q4, range(1, 4), matrices_only=False)  # F32 vectors: float32 either way
    file_bytes = _file_bytes(q4, range(1, 4), matrices_only=True)
    assert range_bytes(auto, blocks) == file_bytes + norms  # Q4_0 held as the file's bytes (model/packed.py)
    floats = 3 * (64 * 64 + 64 * 32 * 2 + 64 * 64 + 64 * 128 * 3) * 4  # 3 blocks' q, k, v, o, MLP at float32
    assert range_bytes(none, blocks) == floats + norms
    assert range_bytes(auto, blocks) * 6 < range_bytes(none, blocks)  # Q4_0: 18 bytes per 32 values, not 128
    # a budget between the two: the packed blocks fit, the dequantized ones do not
    budget = (range_bytes(auto, blocks) + range_bytes(none, blocks)) // 2 + auto.cache_bytes
    check_fits(ServerConfig(**{**auto.__dict__, "memory_bytes": budget}), blocks)
    with pytest.raises(MemoryBudgetExceeded, match="more than the .* MiB of --memory-mb"):
        check_fits(ServerConfig(**{**none.__dict__, "memory_bytes": budget}), blocks)


def test_no_num_blocks_takes_as_many_as_fit(q4):
    config = ServerConfig(model_dir=str(q4), blocks=None, dtype="float32", quant="none", cache_bytes=MIB)
    block = model_spec(config).block_bytes
    tight = ServerConfig(**{**config.__dict__, "memory_bytes": int(MIB + 3.5 * block)})
    assert blocks_that_fit(tight, model_spec(tight)) == 3
    assert 1 <= num_blocks_for(tight, model_spec(tight)) <= 3
    none_fit = ServerConfig(**{**config.__dict__, "memory_bytes": int(MIB + 0.5 * block)})
    with pytest.raises(MemoryBudgetExceeded, match="cannot hold one block"):
        num_blocks_for(none_fit, model_spec(none_fit))


def _server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", "server", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("ask", [["--blocks", "0:6"], ["--num-blocks", "6"]])
def test_a_server_refuses_blocks_beyond_its_memory_in_one_line(q4, ask):
    done = _server("--model", str(q4), *ask, "--memory-mb", "1", "--cache-mb", "1", "--dtype", "float32")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # nothing loaded or logged before it
    assert "of attention cache (--cache-mb)" in lines[0] and "more than the 1 MiB of --memory-mb" in lines[0]


def test_a_server_reads_only_its_blocks_from_the_file(q4):
    from swarmlm.server.stage import Stage

    checkpoint = open_gguf(q4)  # the process's one parse of the file, which the stage uses too

    class Recording(dict):
        touched: set[str] = set()

        def __getitem__(self, name):
            self.touched.add(name)
            return super().__getitem__(name)

    checkpoint.tensors = Recording(checkpoint.tensors)
    packed, dequantized = checkpoint.packed_read_bytes, checkpoint.dequantized_bytes
    stage = Stage(str(q4), BlockRange(2, 4), "float32", "auto")
    assert {name.split(".")[1] for name in Recording.touched} == {"2", "3"}, Recording.touched
    assert checkpoint.packed_read_bytes - packed == _file_bytes(q4, range(2, 4), matrices_only=True)
    assert checkpoint.dequantized_bytes - dequantized == _file_bytes(q4, range(2, 4), matrices_only=False)
    assert stage.weight_bytes == range_bytes(ServerConfig(model_dir=str(q4), blocks=None, dtype="float32"),
                                             BlockRange(2, 4))
