"""Renamed wire fields keep their numbers: a peer built before a rename reads the same bytes (docs/PROTOCOL.md)."""
import struct

from swarmlm.wire import swarm_pb2 as pb


def test_timing_parse_s_is_the_old_decode_s_field_3():
    # field 3, wire type 1 (64-bit): tag byte (3 << 3) | 1, then the little-endian double
    assert pb.Timing(parse_s=0.5).SerializeToString() == bytes([(3 << 3) | 1]) + struct.pack("<d", 0.5)
    assert pb.Timing.FromString(bytes([(3 << 3) | 1]) + struct.pack("<d", 0.25)).parse_s == 0.25


def test_timing_batched_steps_is_the_old_batch_size_field_5():
    assert pb.Timing(batched_steps=3).SerializeToString() == bytes([(5 << 3) | 0, 3])  # field 5, varint
