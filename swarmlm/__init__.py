"""swarmlm: one language model served by a swarm of small machines.

    from swarmlm import AutoDistributedModelForCausalLM
    model = AutoDistributedModelForCausalLM.from_pretrained("org/name-or-dir", initial_peers=[ADDR])
    model.generate(input_ids, max_new_tokens=20)   # transformers' generate(), the blocks on the swarm
"""

__version__ = "0.1.0"

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
