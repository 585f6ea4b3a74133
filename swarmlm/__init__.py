"""swarmlm: one language model served by a swarm of small machines."""

__version__ = "0.1.0"
