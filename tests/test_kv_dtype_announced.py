"""Servers announce what their attention caches hold (InfoReply.kv_dtype; ServerRecord.dtype and kv_dtype): a float16
cache beside float32 blocks rounds K/V, so its steps differ slightly from its weights' own. A client can tell, and
one with require_full_precision routes around it as around int8 weights; `swarmlm status` / GET /v1/swarm show it.
Before, such a server announced nothing: full-precision clients routed through it, and a session failing over
between it and a float32-cache server went on with other values than either alone would give."""
from __future__ import annotations

import contextlib
import io

import pytest

from swarmlm.api.swarm_view import SwarmWatcher
from swarmlm.cli.status_cmd import render, table_console
from swarmlm.client.router import SwarmView
from swarmlm.config import ClientConfig
from swarmlm.swarm.records import ServerRecord, record_from_info
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.protocol import PROTOCOL_VERSION
from tests.swarm_helpers import InProcessSwarm, client_of, greedy_reference, in_process_server

NEW_TOKENS = 4


def _record(sid: str = "QmServer", **fields) -> ServerRecord:
    return ServerRecord(server_id=sid, address="127.0.0.1:1", start=0, end=2, protocol=PROTOCOL_VERSION, **fields)


def test_records_carry_both_dtypes_and_an_older_servers_announce_none():
    info = pb.InfoReply(server_id="QmServer", start_block=0, end_block=2, dtype="float32", kv_dtype="float16")
    record = record_from_info(info, "127.0.0.1:1")
    assert (record.dtype, record.kv_dtype, record.narrowed_cache) == ("float32", "float16", True)
    assert ServerRecord.from_dict(record.to_dict()) == record
    # a server from before the field: its Info has a dtype but no kv_dtype; its caches held its blocks' dtype
    older = record_from_info(pb.InfoReply(server_id="QmServer", start_block=0, end_block=2, dtype="float32"), "h:1")
    assert (older.dtype, older.kv_dtype, older.narrowed_cache) == ("float32", "", False)
    written_before = {k: v for k, v in record.to_dict().items() if k not in ("dtype", "kv_dtype")}
    before = ServerRecord.from_dict(written_before)
    assert (before.dtype, before.kv_dtype, before.narrowed_cache) == ("", "", False)
    # caches of the blocks' own dtype compute the weights' values, whatever that dtype
    for dtype in ("float32", "bfloat16", "float16"):
        assert not _record(dtype=dtype, kv_dtype=dtype).narrowed_cache


@pytest.mark.parametrize("fields, match", [
    ({"kv_dtype": "float8"}, "record kv_dtype 'float8' is not one of float32, bfloat16, float16"),
    ({"kv_dtype": "FLOAT16"}, "record kv_dtype 'FLOAT16' is not one of"),
    ({"kv_dtype": "auto"}, "record kv_dtype 'auto' is not one of"),  # a setting, never what a cache holds
    ({"kv_dtype": "x" * 5000}, "record kv_dtype 'x{80}' is not one of"),  # (the error quotes 80 characters)
    ({"dtype": "int8"}, "record dtype 'int8' is not one of"),
    ({"kv_dtype": 16}, "record field kv_dtype has type int"),
    ({"kv_dtype": None}, "record field kv_dtype has type NoneType"),
    ({"dtype": ["float32"]}, "record field dtype has type list"),
    ({"dtype": "", "kv_dtype": "float16"}, "record kv_dtype 'float16' without its blocks' dtype"),
])
def test_hostile_dtypes_in_a_record_are_refused_with_one_clear_error(fields, match):
    base = _record(dtype="float32", kv_dtype="float32").to_dict()
    with pytest.raises(ValueError, match=match):
        ServerRecord.from_dict({**base, **fields})


def test_full_precision_clients_leave_out_narrowed_caches_as_quantized_weights():
    records = {
        "wide": _record("wide", dtype="float32", kv_dtype="float32"),
        "narrowed": _record("narrowed", dtype="float32", kv_dtype="float16"),
        "half-blocks": _record("half-blocks", dtype="float16", kv_dtype="float16"),  # its own dtype: not narrowed
        "older": _record("older"),  # announces neither (before the fields)
        "int8": _record("int8", quant="int8", dtype="float32", kv_dtype="float32"),
    }
    strict = SwarmView(ClientConfig(require_full_precision=True))
    strict.update(records)
    assert set(strict.records) == {"wide", "half-blocks", "older"}
    lenient = SwarmView(ClientConfig())
    lenient.update(records)
    assert set(lenient.records) == set(records)


@pytest.fixture(scope="module")
def narrowed_and_wide(tiny_bloom):
    """All 6 blocks twice: from a server with float16 caches and from one with float32 caches."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(in_process_server(tiny_bloom, BlockRange(0, 6), kv_dtype=kv))
                   for kv in ("float16", "float32")]
        yield InProcessSwarm(tiny_bloom, servers)


def test_a_float16_cache_server_announces_it_and_full_precision_clients_route_around_it(narrowed_and_wide,
                                                                                         tiny_bloom):
    narrowed, wide = narrowed_and_wide.servers
    assert (narrowed.service.info().dtype, narrowed.service.info().kv_dtype) == ("float32", "float16")
    assert wide.service.info().kv_dtype == "float32"

    lenient = client_of(narrowed_and_wide)
    try:
        lenient.remote.refresh()
        assert lenient.remote.view.records[narrowed.server_id].narrowed_cache  # its record, read from its Info
        view = SwarmWatcher(lenient.remote).read()  # `swarmlm status`, GET /v1/swarm
        rows = {s["id"]: s for s in view["servers"]}
        assert (rows[narrowed.server_id]["kv_dtype"], rows[narrowed.server_id]["dtype"]) == ("float16", "float32")
        assert rows[wide.server_id]["kv_dtype"] == "float32" and rows[wide.server_id]["quant"] == "none"
        out = io.StringIO()
        render(view, tiny_bloom, table_console(out))
        row = next(line for line in out.getvalue().splitlines() if narrowed.server_id[-8:] in line)
        assert "float16" in row  # its KV column
    finally:
        lenient.close()

    ids, want = greedy_reference(tiny_bloom, "full precision only", NEW_TOKENS)
    strict = client_of(narrowed_and_wide, require_full_precision=True)
    try:
        out = strict.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert out[0, ids.shape[1]:].tolist() == want
        assert set(strict.remote.view.records) == {wide.server_id}
        assert {hop.server_id for hop in strict.last_stats.route} == {wide.server_id}
    finally:
        strict.close()
