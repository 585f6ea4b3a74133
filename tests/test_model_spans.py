"""Blocks loaded by range and run span by span give plain transformers' logits (in one process)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.model.checkpoint import TensorIndex, load_blocks, load_client_modules
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange
from tests.swarm_helpers import reference_model


@pytest.mark.parametrize("family", ["bloom", "llama"])
def test_spans_match_transformers_with_padding_and_cache(checkpoints, family):
    path = checkpoints[family]
    ref = reference_model(path)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(["the quick brown fox jumps", "hello"], return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    assert (mask == 0).any(), "the test needs a padded row"
    stages = [Stage(path, r) for r in (BlockRange(0, 2), BlockRange(2, 5), BlockRange(5, 6))]
    _, _, client = load_client_modules(path)
    states = [s.new_state(s.blocks, 2) for s in stages]

    def through(x_ids, x_mask):
        h = client.embed(x_ids)
        if client.embed_norm is not None:
            h = client.embed_norm(h)
        for stage, state in zip(stages, states):
            h = stage.step(state, h, x_mask)
        return client.lm_head(client.final_norm(h))

    with torch.no_grad():
        got = through(ids, mask)
        full_ids, full_mask = ids, mask
        for _ in range(3):  # decode steps use the servers' caches
            nxt = got[:, -1].argmax(-1, keepdim=True)
            full_ids = torch.cat([full_ids, nxt], 1)
            full_mask = torch.cat([full_mask, torch.ones_like(nxt)], 1)
            got = through(nxt, torch.ones_like(nxt))
        want = ref(input_ids=full_ids, attention_mask=full_mask).logits[:, -1:]
    assert (got - want).abs().max().item() < 1e-4


def test_server_loads_only_its_blocks(tiny_bloom):
    index = TensorIndex(tiny_bloom)
    assert len(set(index.files.values())) > 1, "checkpoint should be sharded for this test"
    _, _, blocks = load_blocks(tiny_bloom, 2, 4)
    assert len(blocks) == 2
    names = {n for n, _ in blocks.named_parameters()}
    assert all(not n.startswith("word_embeddings") for n in names)
    with pytest.raises(ValueError, match="outside"):
        load_blocks(tiny_bloom, 4, 9)


def test_client_modules_tie_head_to_embeddings(tiny_bloom, tiny_llama):
    _, _, bloom = load_client_modules(tiny_bloom)
    assert torch.equal(bloom.lm_head.weight, bloom.embed.weight)  # BLOOM ties them
    _, _, llama = load_client_modules(tiny_llama)
    assert not torch.equal(llama.lm_head.weight, llama.embed.weight)  # tiny-llama has its own head
    assert bloom.lm_head.weight.data_ptr() == bloom.embed.weight.data_ptr()  # one tensor, copied once


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds `t`'s data, if any (Linux /proc/self/maps)."""
    addr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_weights_are_copied_out_of_the_file_unless_mmap_is_asked(tiny_bloom):
    """Weights read from the safetensors file's mapping run slower here than from process memory; servers and
    clients copy them, `mmap=True` keeps the shared mapping (and must still give the same weights)."""
    _, _, copied = load_blocks(tiny_bloom, 0, 2)
    _, _, mapped = load_blocks(tiny_bloom, 0, 2, mmap=True)
    _, _, client = load_client_modules(tiny_bloom)
    for name, weight in copied.named_parameters():
        assert _mapped_file(weight) is None, name
        assert torch.equal(weight, dict(mapped.named_parameters())[name])
    assert any((_mapped_file(w) or "").endswith(".safetensors") for w in mapped.parameters())
    assert _mapped_file(client.lm_head.weight) is None and _mapped_file(client.embed.weight) is None
