"""The wire protocol's number: which messages a peer writes and how it reads them (docs/PROTOCOL.md, "Wire protocol").

Servers announce it (`InfoReply.protocol`, `ServerRecord.protocol`); a client refuses a server of another number
(client/remote.py) with one clear message instead of MAC mismatches or parse errors deep in a session, and a
framed connection's HELLO carries it (wire/frames.py MAGIC).
"""
from __future__ import annotations

# Bump on any change that makes an older and a newer peer misread each other's messages: a field's meaning or
# encoding (a tensor format, a MAC's input, what a signature signs), the frame layout, a message a peer must now
# send or understand, a record field's type. A new optional field that older peers ignore and newer ones read as
# "absent" does not need a bump.
# 2: compact STEP / ANSWER frames (wire/compact.py), which a protocol-1 peer cannot read; 3: compact PUSH_STEP frames;
# 4: kept routes (InferenceStep.keep_route: a STEP or PUSH_STEP into a session with a route kept is pushed on, which a
# protocol-3 server would answer without pushing)
PROTOCOL_VERSION = 4
MAX_PROTOCOL = 1 << 16  # what a record may announce at most: a sane bound on a peer's number (0 = announced none)


def protocol_refusal(announced: int) -> str | None:
    """Why a server announcing wire protocol `announced` is refused by this peer, or None if it speaks ours.

    0 (the field absent) is a release from before protocol numbers: refused too. Its wire format is unknown
    (releases before it changed the wire without a number to tell, e.g. the session keys' MAC on every message),
    so routing through it could only fail later and less clearly; refusing it says what to do now."""
    if announced == PROTOCOL_VERSION:
        return None
    what = "announces no wire protocol (a swarmlm release before protocol numbers)" if announced == 0 else \
        f"speaks wire protocol {announced}"
    return (f"it {what}, this swarmlm speaks protocol {PROTOCOL_VERSION}: run the same swarmlm release as the "
            f"swarm's servers (`swarmlm --version` on both sides)")
