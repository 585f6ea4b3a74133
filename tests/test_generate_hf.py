"""generate() is transformers' own: every option gives what AutoModelForCausalLM.generate gives on the same
checkpoint, through 2 server processes (tiny BLOOM and tiny Llama)."""
from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from transformers import AutoTokenizer, StoppingCriteria, TextIteratorStreamer

from swarmlm import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from swarmlm.swarm.local import even_split
from tests.swarm_helpers import reference_model, server_processes

pytestmark = pytest.mark.slow
PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module", params=["bloom", "llama"])
def swarm(request, checkpoints):
    path = checkpoints[request.param]
    with server_processes(path, even_split(6, 2)) as swarm:
        # the client as users write it (the Auto class, the DHT's peers): what this file checks is theirs
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=swarm.initial_peers)
        ref = reference_model(path)
        tok = AutoTokenizer.from_pretrained(path)
        yield model, ref, tok
        model.close()


def both(model, ref, ids, seed: int | None = None, **kwargs):
    """The same generate() call on the swarm and on plain transformers (the same seed before each)."""
    out = []
    for m in (model, ref):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out.append(m.generate(ids, **kwargs))
    return out


def ids_of(tok, text: str = PROMPT) -> torch.Tensor:
    return tok(text, return_tensors="pt").input_ids


@pytest.mark.parametrize("kwargs", [
    {},
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 10},
    {"do_sample": True, "top_k": 20, "temperature": 0.8},
    {"do_sample": True, "top_p": 0.9, "num_return_sequences": 2},
], ids=["greedy", "repetition_penalty", "no_repeat_ngram", "min_new_tokens", "sampling", "sampling-2-sequences"])
def test_generate_equals_transformers(swarm, kwargs):
    model, ref, tok = swarm
    got, want = both(model, ref, ids_of(tok), seed=7, max_new_tokens=10, **kwargs)
    assert torch.equal(got, want)
    assert model.last_stats.new_tokens == got.shape[1] - ids_of(tok).shape[1] and model.last_stats.ttft_s > 0


def test_stop_strings_and_eos_lists(swarm):
    model, ref, tok = swarm
    ids = ids_of(tok)
    free = model.generate(ids, max_new_tokens=10)[0, ids.shape[1]:]
    # stop at a string the free run produces in the middle, and at a token it produces (eos given as a list)
    stop = tok.decode(free[4:5]).strip() or tok.decode(free[4:5])
    got, want = both(model, ref, ids, max_new_tokens=10, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(got, want)  # (whether it stops early depends on how transformers maps this tokenizer)
    got, want = both(model, ref, ids, max_new_tokens=10, eos_token_id=[int(free[4]), 1])
    assert torch.equal(got, want) and got.shape[1] <= ids.shape[1] + 5


def test_missing_pad_id_falls_back_to_eos(swarm):
    model, ref, tok = swarm
    enc = tok(["hello", PROMPT], return_tensors="pt", padding=True, padding_side="left")
    free = model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=8)
    eos = int(free[0, enc.input_ids.shape[1] + 1])  # row 0 ends early, row 1 goes on: row 0 is padded
    saved = model.generation_config.pad_token_id, ref.generation_config.pad_token_id
    model.generation_config.pad_token_id = ref.generation_config.pad_token_id = None
    try:
        got, want = both(model, ref, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=8,
                         eos_token_id=eos)
    finally:
        model.generation_config.pad_token_id, ref.generation_config.pad_token_id = saved
    assert torch.equal(got, want)


def test_batch_of_prompts_with_left_padding(swarm):
    model, ref, tok = swarm
    enc = tok(["hello", PROMPT], return_tensors="pt", padding=True, padding_side="left")
    assert enc.attention_mask[0, 0] == 0  # the short prompt is padded
    got, want = both(model, ref, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=10)
    assert torch.equal(got, want)


def test_scores_and_dict_output(swarm):
    model, ref, tok = swarm
    got, want = both(model, ref, ids_of(tok), max_new_tokens=6, return_dict_in_generate=True, output_scores=True,
                     output_logits=True, repetition_penalty=1.3)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 6
    for a, b in zip(got.scores + got.logits, want.scores + want.logits):
        assert (a - b).abs().max().item() < 1e-4
    assert got.cache.session.closed  # the session generate() opened is closed when it returns


def test_speculative_dict_output_is_transformers_and_refuses_what_it_cannot_give(swarm):
    """speculative="auto" with return_dict_in_generate: transformers' output object, its sequences plain greedy's,
    its scores and logits (one [1, V] per new token, also at the positions a pass verified) plain generate()'s."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from swarmlm.errors import InvalidRequest

    model, ref, tok = swarm
    ids = ids_of(tok, "one two three one two three one two")  # quotes itself: prompt lookup drafts at once
    options = dict(max_new_tokens=8, return_dict_in_generate=True, output_scores=True, output_logits=True,
                   repetition_penalty=1.3)
    with torch.no_grad():
        got = model.generate(ids, speculative="auto", **options)
        want = ref.generate(ids, **options)
    assert isinstance(got, GenerateDecoderOnlyOutput) and model.last_stats.speculation is not None
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(got.logits) == got.sequences.shape[1] - ids.shape[1]
    for a, b in zip(got.scores + got.logits, want.scores + want.logits):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    bare = model.generate(ids, speculative="auto", max_new_tokens=8, return_dict_in_generate=True)
    assert torch.equal(bare.sequences, want.sequences) and bare.scores is None
    for bad, name in ((dict(output_attentions=True), "output_attentions"),
                      (dict(output_scores=True, do_sample=True, num_return_sequences=2), "output_scores")):
        with pytest.raises(InvalidRequest, match=name):
            model.generate(ids, speculative="auto", max_new_tokens=4, return_dict_in_generate=True, **bad)


def test_streamer_sees_the_output(swarm):
    model, _, tok = swarm
    ids = ids_of(tok)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=model.generate(ids, max_new_tokens=10,
                                                                               streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join(60)
    assert text == tok.decode(result["out"][0, ids.shape[1]:], skip_special_tokens=True)


def test_generation_config_json_defaults(swarm, tmp_path):
    """A checkpoint's generation_config.json gives generate()'s defaults, as in transformers (here a copy of the
    checkpoint with its own file: the same model identity, so the same swarm)."""
    model, ref, tok = swarm
    copy = tmp_path / "copy"
    shutil.copytree(model.model_dir, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "no_repeat_ngram_size": 1,
                                                             "max_new_tokens": 7}))
    peers = model.client_config.initial_peers
    other = DistributedModelForCausalLM.from_pretrained(copy, initial_peers=peers)
    try:
        got, want = both(other, reference_model(str(copy)), ids_of(tok))
    finally:
        other.close()
    assert torch.equal(got, want) and got.shape[1] == ids_of(tok).shape[1] + 7
    assert len(set(got[0, -7:].tolist())) == 7


def test_forward_gives_the_local_logits(swarm):
    model, ref, tok = swarm
    enc = tok(["hello", PROMPT], return_tensors="pt", padding=True, padding_side="left")
    got = model(enc.input_ids, attention_mask=enc.attention_mask)
    with torch.no_grad():
        want = ref(enc.input_ids, attention_mask=enc.attention_mask).logits
    real = enc.attention_mask.bool()  # padded positions' outputs are not compared
    assert (got.logits - want)[real].abs().max().item() < 1e-4


def test_beam_search_equals_transformers(swarm):
    """4 beams reorder the servers' rows every step (cache ops, docs/PROTOCOL.md); more families: test_families."""
    model, ref, tok = swarm
    got, want = both(model, ref, ids_of(tok), max_new_tokens=6, num_beams=4, num_return_sequences=4,
                     length_penalty=1.3, early_stopping="never", do_sample=False)
    assert torch.equal(got, want)


class _Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("boom")


def test_the_session_closes_when_generate_raises(swarm, monkeypatch):
    model, _, tok = swarm
    opened = []
    real = DistributedModelForCausalLM.inference_session

    def recording(self, *args, **kwargs):
        opened.append(real(self, *args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(DistributedModelForCausalLM, "inference_session", recording)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(ids_of(tok), max_new_tokens=4, stopping_criteria=[_Boom()])
    assert len(opened) == 1 and opened[0].closed
