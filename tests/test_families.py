"""Every family through 2 server processes equals plain transformers (fp32), each loaded by hub id from an offline
HF cache: logits of `model(ids)` for a left-padded batch of 2, and greedy generation. The split [0, 1) + [1, 4)
puts global block 1 first on the second server (Gemma 2's and Qwen2's per-layer attention types must follow the
global index); prompt + generation outrun the 8-token sliding windows of tiny-mistral, -qwen2 and -gemma2.
BLOOM and Llama: tests/test_swarm_exact.py (1-3 servers)."""
from __future__ import annotations

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoTokenizer

from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.model.presets import PRESETS
from swarmlm.types import BlockRange
from tests.hub_layout import add_to_hub_cache
from tests.swarm_helpers import assert_greedy_up_to_ties, reference_model, running_swarm

pytestmark = pytest.mark.slow
FAMILY_PRESETS = ["tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-falcon",
                  "tiny-gemma2"]
PROMPTS = ["the quick brown fox jumps over the lazy dog while the farmer watches", "hello"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory):
    """Every preset as hub repo `swarmlm-tests/<preset>` in a fresh HF cache; offline, for this process (the
    library reads huggingface_hub's constants) and the servers it starts (they read the environment)."""
    root = tmp_path_factory.mktemp("hf-home")
    cache = root / "hub"
    for preset in FAMILY_PRESETS:
        src = init_checkpoint(preset, root / "src" / preset, seed=3, max_shard_size="100KB")
        add_to_hub_cache(cache, f"swarmlm-tests/{preset}", src)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(root))
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        yield cache


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def swarm(request, offline_hub):
    preset = request.param
    repo = f"swarmlm-tests/{preset}"
    snapshot = next((offline_hub / f"models--swarmlm-tests--{preset}" / "snapshots").iterdir())
    with running_swarm(repo, [BlockRange(0, 1), BlockRange(1, 4)], dht=False) as (_, client):
        tok = AutoTokenizer.from_pretrained(snapshot)
        if tok.pad_token is None:  # Llama-3 style: no pad token; pad with eos as transformers users do
            tok.pad_token = tok.eos_token
        yield preset, client, reference_model(str(snapshot)), tok


def test_forward_logits_of_a_padded_batch_equal_transformers(swarm):
    preset, client, ref, tok = swarm
    assert client.config.model_type == PRESETS[preset].family
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert enc.attention_mask[1, 0] == 0, "the short prompt is left-padded"
    out = client(enc.input_ids, attention_mask=enc.attention_mask)
    got = out.logits if hasattr(out, "logits") else out
    with torch.no_grad():
        want = ref(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits
    real = enc.attention_mask.bool()  # padded positions' logits are meaningless on both sides
    assert (got[real] - want[real]).abs().max().item() < 1e-4


def test_greedy_generation_of_a_padded_batch_equals_transformers(swarm):
    _, client, ref, tok = swarm
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    got = client.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        want = ref.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=NEW_TOKENS,
                            do_sample=False)
    got = got.sequences if hasattr(got, "sequences") else got
    assert torch.equal(got, want)


def test_speculative_generation_of_a_padded_batch_is_greedy(swarm):
    """Batched speculation (client/decoding/rows.py): steps right-padded per row, the prompts left-padded; every row is
    its unpadded prompt's greedy continuation up to ties (a batch is not bit-identical to one row on CPU)."""
    _, client, ref, tok = swarm
    text = [PROMPTS[0] + " the quick brown fox", PROMPTS[1]]  # one repeats itself: prompt lookup drafts at once
    enc = tok(text, return_tensors="pt", padding=True)
    got = client.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, speculative=4)
    assert client.last_stats.speculation["drafted"] > 0
    width = enc.input_ids.shape[1]
    for ids, mask, row in zip(enc.input_ids, enc.attention_mask, got.tolist()):
        assert_greedy_up_to_ties(ref.name_or_path, ids[mask.bool()].tolist(), row[width:])


CACHE_OP_MODES = {  # transformers' decoding modes that edit the cache (the servers' cache ops, issue 29)
    "beam search": dict(num_beams=3, num_return_sequences=2, length_penalty=0.8, early_stopping=True),
    "sampling, 3 sequences": dict(do_sample=True, num_return_sequences=3, top_k=20),
    "prompt lookup": dict(prompt_lookup_num_tokens=3),
    "assisted": dict(),  # a local draft model: see below
}


@pytest.mark.parametrize("mode", CACHE_OP_MODES)
def test_decoding_that_edits_the_cache_equals_transformers(swarm, mode):
    """Beam search reorders the servers' rows, sampling n sequences shares a prompt, prompt lookup and assisted
    decoding roll rejected drafts back: the same tokens as transformers with its own cache."""
    _, client, ref, tok = swarm
    args = dict(CACHE_OP_MODES[mode], max_new_tokens=8)
    if mode == "assisted":  # a plain local transformers model of the same vocabulary, other weights
        torch.manual_seed(7)
        args["assistant_model"] = type(ref)(ref.config).eval()
    args.setdefault("do_sample", False)
    # the padded batch for beam search and sampling; prompt lookup and assisted decoding take one sequence (one
    # that repeats itself: prompt lookup finds drafts)
    batched = mode in ("beam search", "sampling, 3 sequences")
    enc = tok(PROMPTS if batched else [PROMPTS[0] + " the quick brown fox"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        want = ref.generate(enc.input_ids, attention_mask=enc.attention_mask, **args)
    torch.manual_seed(0)
    got = client.generate(enc.input_ids, attention_mask=enc.attention_mask, **args)
    assert torch.equal(got, want)


def test_llama3_tokens_no_pad_id_and_an_eos_list_end_rows_as_transformers(swarm):
    preset, client, ref, tok = swarm
    if preset != "tiny-llama3":
        pytest.skip("Llama-3 style tokens: tiny-llama3 only")
    assert client.config.pad_token_id is None and len(client.config.eos_token_id) == 2
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    args = dict(attention_mask=enc.attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        free = ref.generate(enc.input_ids, **args)
        # row 0's third new token becomes an end-of-sequence id: row 0 ends early, the other row goes on
        eos = [client.config.eos_token_id[0], int(free[0, enc.input_ids.shape[1] + 2])]
        want = ref.generate(enc.input_ids, eos_token_id=eos, **args)
    got = client.generate(enc.input_ids, eos_token_id=eos, **args)
    got = got.sequences if hasattr(got, "sequences") else got
    assert torch.equal(got, want)
    assert (want[0, enc.input_ids.shape[1] + 3:] == eos[0]).all()  # no pad id: finished rows get eos[0]
