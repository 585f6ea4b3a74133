"""The client's transmission policy: decode-first link scheduling (swarmlm/wire/links.py) configured from a
ClientConfig. The scheduler itself lives on the wire floor because a server pushing outputs on uses it too."""
from __future__ import annotations

from swarmlm.wire.links import TransmissionPolicy


def transmission_policy(config) -> TransmissionPolicy:
    """From a ClientConfig. Without chunking a prefill is one message and nothing holds it back (the window paces
    chunks only), so chunking off + decode-first off is the plain arrival-order client."""
    chunking = config.prefill_chunk_tokens != 0
    return TransmissionPolicy(decode_first=config.decode_first, max_decode_burst=config.max_decode_burst,
                              prefill_window=config.prefill_window if chunking else None)

