"""Decoding: how tokens are chosen (sampling.py: one parameters type for generate() and the gateway) and the rows of
one session that choose them (decoder.py)."""
