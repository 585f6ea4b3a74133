"""swarmlm: one language model served by a swarm of small machines.

    from swarmlm import AutoDistributedModelForCausalLM
    model = AutoDistributedModelForCausalLM.from_pretrained("org/name-or-dir", initial_peers=[ADDR])
    model.generate(input_ids, max_new_tokens=20)   # transformers' generate(), the blocks on the swarm
"""

import os

__version__ = "0.1.0"

# gRPC's fork handlers (on by default in grpcio 1.85) restart its poller in every forked child. A child that only
# execs (p2pd, LocalSwarm's servers: forked rather than vforked, since they run a preexec_fn for PR_SET_PDEATHSIG,
# swarm/lifetime.py) then crashed with SIGSEGV before its exec in ~1 of 5 spawns beside live gRPC calls (measured;
# grpc/grpc#43055): the tests' rare "p2pd failed to start". swarmlm never forks a process that goes on using gRPC,
# so the handlers are off unless the user asks for them. gRPC reads this when it is imported: set before it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Imported on first use, so `import swarmlm` (and `swarmlm plan`) does not load torch.
_LAZY = {
    "AutoDistributedModelForCausalLM": "swarmlm.client.auto",
    "DistributedModelForCausalLM": "swarmlm.client.model",
    "AutoTokenizer": "swarmlm.client.auto",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swarmlm' has no attribute {name!r}")
