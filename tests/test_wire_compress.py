"""Compressed hidden states on the wire (swarmlm/wire/compress.py): each format within its documented bound,
float32 exact, peers' malformed packed tensors refused; through a real 2-server swarm against fp32 transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.config import ClientConfig
from swarmlm.errors import InvalidRequest
from swarmlm.swarm.local import even_split
from swarmlm.wire import codec, compress
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import in_process_swarm, reference_model

# logits relative L2 against fp32 transformers through 2 servers (docs/PROTOCOL.md "Compressed hidden states")
LOGITS_BOUND = {"float32": 1e-5, "float16": 0.005, "bfloat16": 0.03, "int8": 0.03}


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 64), (3, 5, 100), (1, 1, 3)])
def test_int8_blockwise_error_within_half_a_step(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 5
    x.view(-1)[0] = 300.0  # an outlier only widens its own block's step
    msg = compress.pack_int8(x)
    assert msg.dtype == compress.INT8_BLOCK and len(msg.data) == compress.packed_bytes(x.numel())
    got = codec.decode(msg)
    assert got.dtype == torch.float32 and got.shape == x.shape
    flat, err = x.reshape(-1), (got - x).reshape(-1).abs()
    for start in range(0, flat.numel(), compress.BLOCK):
        block = slice(start, start + compress.BLOCK)
        assert err[block].max() <= flat[block].abs().max() / 254 * (1 + 1e-5)


def test_float_formats_and_range_fallback():
    x = torch.randn(2, 3, 64)
    assert torch.equal(codec.decode(compress.encode_hidden(x, "float32")), x)
    half = codec.decode(compress.encode_hidden(x, "float16"))
    assert half.dtype == torch.float16 and ((half.float() - x).abs() <= x.abs() * 2 ** -11 + 1e-7).all()
    bf = codec.decode(compress.encode_hidden(x, "bfloat16"))
    assert bf.dtype == torch.bfloat16 and ((bf.float() - x).abs() <= x.abs() * 2 ** -8 + 1e-7).all()
    big = x * 1e5  # beyond fp16's range: sent exactly rather than as infinities
    assert torch.equal(codec.decode(compress.encode_hidden(big, "float16")), big)
    # a server answers in its request's format
    for name in ("float32", "float16", "bfloat16", compress.INT8_BLOCK):
        assert compress.encode_like(x, name).dtype == name


def test_malformed_packed_tensors_are_refused():
    good = compress.pack_int8(torch.randn(1, 2, 64))
    short = pb.Tensor(data=good.data[:-1], dtype=good.dtype, shape=good.shape)
    with pytest.raises(InvalidRequest, match="bytes"):
        codec.decode(short)
    for bad_scale in (np.nan, np.inf, -1.0):
        scales = np.frombuffer(good.data[:8], dtype=np.float32).copy()
        scales[0] = bad_scale
        msg = pb.Tensor(data=scales.tobytes() + good.data[8:], dtype=good.dtype, shape=good.shape)
        with pytest.raises(InvalidRequest, match="scales"):
            codec.decode(msg)
    with pytest.raises(InvalidRequest, match="shape"):
        codec.header(pb.Tensor(data=b"", dtype=compress.INT8_BLOCK, shape=[1 << 40]))


def test_auto_is_exact_on_every_link_and_auto_lossy_chooses_by_bandwidth():
    # (issue 39, hole 8: "auto" once went int8 on a slow-measured link, and a gateway's greedy answers changed)
    for bandwidth, address in ((10e9, ""), (100e6, "p2p/12D3Koo"), (1e6, "10.0.0.2:4000"), (10e6, "127.0.0.1:1")):
        assert compress.choose("auto", bandwidth, address, 1 << 20) == "float32"
    assert compress.choose("auto-lossy", 10e9) == "float32"  # loopback / fast LAN: exact
    assert compress.choose("auto-lossy", 100e6) == "float16"
    assert compress.choose("auto-lossy", 10e6) == "int8"
    assert compress.choose("auto-lossy", 10e6, "127.0.0.1:4000") == "float32"  # loopback stays exact, even measured slow
    assert compress.choose("auto-lossy", 10e6, "[::1]:4000") == "float32"
    assert compress.choose("auto-lossy", 10e6, "10.0.0.2:4000") == "int8"
    assert compress.choose("auto-lossy", 10e6, "127.214.20.1:4000") == "int8"  # netem relay-only: an emulated slow link
    assert compress.choose("int8", 10e9, "127.0.0.1:4000") == "int8"  # an explicit setting is kept
    with pytest.raises(ValueError, match="wire_dtype"):
        compress.choose("fp8", 1e9)
    with pytest.raises(ValueError, match="wire_dtype"):
        ClientConfig(wire_dtype="int4")


def test_a_clients_auto_link_stays_exact_whatever_its_measured_bandwidth():
    from swarmlm.client.channels import Channels

    got = []
    for setting in ("auto", "auto-lossy"):
        channels = Channels(ClientConfig(wire_dtype=setting))  # (no channel is opened)
        channels.bandwidth("p2p/12D3KooWx").observe(4 << 20, 0.5)  # a link measured at ~67 Mbit/s (a loaded relay)
        got.append(channels.wire_dtype_for("p2p/12D3KooWx", 4 << 20))
    assert got == ["float32", "float16"]  # lossy only when asked for


def test_auto_lossy_keeps_messages_that_cross_the_link_fast_exact():
    decode, prefill = 4 * 1024, 4 * 1024 * 256  # float32 bytes of one token / 256 tokens of a 1024-wide state
    assert compress.choose("auto-lossy", 100e6, "10.0.0.2:4000", decode) == "float32"  # 0.33 ms on the link
    assert compress.choose("auto-lossy", 100e6, "10.0.0.2:4000", prefill) == "float16"
    assert compress.choose("auto-lossy", 10e6, "10.0.0.2:4000", decode) == "int8"  # 3.3 ms: worth packing
    assert compress.choose("float16", 100e6, "10.0.0.2:4000", decode) == "float16"  # an explicit setting is kept


def test_bytes_per_value_match_the_encoded_messages():
    hidden = torch.randn(2, 64, 96)
    for wire_dtype in ("float32", "float16", "bfloat16", "int8"):
        data = compress.encode_hidden(hidden, wire_dtype).data
        assert len(data) == hidden.numel() * compress.bytes_per_value(wire_dtype), wire_dtype


def test_a_client_switches_to_compression_once_it_measures_a_slow_link():
    """Channels.wire_dtype_for under auto-lossy: float32 until the link is measured, then by the measured rate (the
    estimate is fed what SpanStream.receive feeds it: a message's bytes and its network time)."""
    from swarmlm.client.channels import Channels
    from swarmlm.config import ClientConfig

    channels = Channels(ClientConfig(max_message_bytes=1 << 20, wire_dtype="auto-lossy"))
    address, prefill = "10.0.0.2:4000", 4 * 1024 * 256
    assert channels.wire_dtype_for(address, prefill) == "float32"  # not measured yet: assumed fast
    link = channels.bandwidth(address)
    link.observe(8 << 10, 0.050)  # a decode step: the path's 50 ms round trip
    for _ in range(3):
        link.observe(2 * prefill, 0.050 + 2 * prefill * 8 / 90e6)  # 2 MB at 90 Mbit/s on top of it
    assert 80e6 < link.bandwidth_bps < 100e6
    assert channels.wire_dtype_for(address, prefill) == "float16"
    assert channels.wire_dtype_for(address, 4 * 1024) == "float32"  # a decode step stays exact
    for _ in range(4):  # the link slows down to 5 Mbit/s: the byte-weighted median follows
        link.observe(2 * prefill, 0.050 + 2 * prefill * 8 / 5e6)
    assert channels.wire_dtype_for(address, prefill) == "int8"
    assert channels.wire_dtype_for("127.0.0.1:4000", prefill) == "float32"  # loopback: exact


@pytest.fixture(scope="module")
def swarm(tiny_bloom):
    with in_process_swarm(tiny_bloom, even_split(6, 2)) as swarm:  # the wire between client and servers
        yield tiny_bloom, swarm


@pytest.mark.parametrize("wire_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_swarm_logits_within_bound_per_wire_dtype(swarm, wire_dtype):
    path, local = swarm
    ref = reference_model(path)
    client = DistributedModelForCausalLM.from_pretrained(path, servers=local.addresses, wire_dtype=wire_dtype)
    ids = torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    try:
        with client.inference_session(max_length=ids.shape[1] + 3, batch_size=2) as session:
            got = client.step_logits(session, ids)
            for step in range(4):
                with torch.no_grad():
                    want = ref(ids).logits[:, -got.shape[1]:]
                err = float((got.float() - want).norm() / want.norm())
                if wire_dtype == "float32":
                    assert (got - want).abs().max().item() < 1e-4, step  # exact, as without compression
                else:
                    assert 0 < err < LOGITS_BOUND[wire_dtype], (step, err)
                if step == 3:
                    break
                nxt = want[:, -1:].argmax(-1)
                ids = torch.cat([ids, nxt], 1)
                got = client.step_logits(session, nxt)
    finally:
        client.close()


@pytest.mark.parametrize("wire_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_decode_refuses_non_finite_values_in_every_format(wire_dtype):
    x = torch.randn(1, 3, 64)
    assert torch.equal(codec.decode(compress.encode_hidden(x, wire_dtype), finite=True),
                       codec.decode(compress.encode_hidden(x, wire_dtype)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[0, 2, 5] = bad
        msg = compress.encode_hidden(y, wire_dtype)
        if wire_dtype == "int8":  # a non-finite value makes its block's scale non-finite: refused either way
            with pytest.raises(InvalidRequest):
                codec.decode(msg, finite=True)
            continue
        assert not torch.isfinite(codec.decode(msg)).all()  # decoded as sent without the check...
        with pytest.raises(InvalidRequest, match="NaN or infinite"):
            codec.decode(msg, "hidden", finite=True)  # ...refused with it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_finiteness_check_finds_one_bad_value_anywhere_and_passes_huge_finite_ones(dtype):
    # (the check is a dot product with zeros: a value that overflows when summed or squared must still pass)
    biggest = torch.finfo(dtype).max
    for count in (1, 7, 4096, codec.MAX_KEPT_ZEROS + 3):  # a kept row of zeros and a new one
        x = torch.full((1, 1, count), biggest, dtype=dtype)
        x[0, 0, ::2] = -biggest
        assert torch.equal(codec.decode(codec.encode(x), finite=True), x)
        for where in {0, count // 2, count - 1}:
            for bad in (float("nan"), float("inf"), -float("inf")):
                y = x.clone()
                y[0, 0, where] = bad
                with pytest.raises(InvalidRequest, match="NaN or infinite"):
                    codec.decode(codec.encode(y), "hidden", finite=True)


def test_encode_sends_strided_and_grad_tensors_as_their_values():
    x = torch.randn(4, 6, 8)
    for view in (x.transpose(0, 2), x[:, ::2, 1:5], x.bfloat16().transpose(1, 2),
                 x.clone().requires_grad_(True)):
        assert torch.equal(codec.decode(codec.encode(view)), view.detach())


def test_all_ones_recognises_only_integer_or_bool_tensors_of_ones():
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        assert codec.all_ones(codec.encode(torch.ones(2, 3, dtype=dtype)))
        assert not codec.all_ones(codec.encode(torch.tensor([[1, 1, 0]], dtype=dtype)))
    assert codec.all_ones(codec.encode(torch.ones(1, 5000, dtype=torch.long)))  # beyond the cached sizes
    assert not codec.all_ones(codec.encode(torch.tensor([[1, 2, 1]])))
    assert not codec.all_ones(codec.encode(torch.ones(1, 3)))  # floats are never a mask
    # a message whose bytes do not match its shape is not "all ones"
    assert not codec.all_ones(pb.Tensor(data=np.ones(2, dtype=np.int64).tobytes(), dtype="int64", shape=[1, 3]))
