"""`CacheOp` (types.py) on the wire: an optional `cache_op` of an InferenceStep. Range checks against the session
(what it holds, its rows, its reserved batch) are the server's (server/service.py, `check_cache_op`)."""
from __future__ import annotations

from swarmlm.errors import InvalidRequest
from swarmlm.types import CacheOp
from swarmlm.wire import swarm_pb2 as pb


def to_wire(op: CacheOp | None) -> pb.CacheOp | None:
    if op is None:
        return None
    msg = pb.CacheOp(rows=list(op.rows or ()))
    if op.truncate_to is not None:
        msg.truncate_to = op.truncate_to
    return msg


def from_wire(step: pb.InferenceStep, max_rows: int) -> CacheOp | None:
    """The step's op, None when it has none (or an empty one); InvalidRequest for more than `max_rows` rows."""
    if not step.HasField("cache_op"):
        return None
    msg = step.cache_op
    if len(msg.rows) > max_rows:
        raise InvalidRequest(f"cache_op: {len(msg.rows)} rows exceed the limit of {max_rows}")
    truncate_to = msg.truncate_to if msg.HasField("truncate_to") else None
    rows = tuple(msg.rows) or None
    return None if truncate_to is None and rows is None else CacheOp(truncate_to, rows)
