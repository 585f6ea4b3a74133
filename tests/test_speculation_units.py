"""Speculation's pure parts, no swarm: prompt-lookup and draft-model drafting, the draft length rule, and the
verification rules (exact for greedy; for sampling the output distribution is the model's own)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmlm.client.decoding.drafting import DraftModel, PromptLookup
from swarmlm.client.decoding.verification import verify_greedy, verify_sampling
from swarmlm.config import MESSAGE_OVERHEAD_S
from swarmlm.perf.model import ComputeProfile, Network, PerfModel
from swarmlm.perf.speculation import AcceptanceByMatch, AcceptanceEstimate, choose_draft_length, expected_tokens
from swarmlm.types import Span

torch.set_num_threads(1)


# ---- drafting by prompt lookup ----------------------------------------------------------------------------------

def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens)


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    lookup = PromptLookup(max_ngram=3)
    # the context ends in 7 8 9, which occurred earlier followed by 4 5 6 1
    assert lookup.draft(ids(7, 8, 9, 4, 5, 6, 1, 2, 7, 8, 9), 3) == [4, 5, 6]
    assert lookup.draft(ids(7, 8, 9, 4, 5, 6, 1, 2, 7, 8, 9), 10) == [4, 5, 6, 1, 2, 7, 8, 9]  # up to the end


def test_prompt_lookup_prefers_the_longest_then_the_latest_match():
    lookup = PromptLookup(max_ngram=2)
    # "3" occurs twice before (followed by 5, then by 6); "2 3" only once (followed by 5): the longer match wins
    assert lookup.draft(ids(2, 3, 5, 3, 6, 2, 3), 1) == [5]
    # only 1-grams match: the latest occurrence of 3 was followed by 6
    assert lookup.draft(ids(2, 3, 5, 3, 6, 9, 3), 2) == [6, 9]
    # lookup also says how long the matched suffix was (the acceptance estimate's kind); 0 without a match
    assert lookup.lookup(ids(2, 3, 5, 3, 6, 2, 3), 1) == ([5], 2)
    assert lookup.lookup(ids(2, 3, 5, 3, 6, 9, 3), 2) == ([6, 9], 1)
    assert lookup.lookup(ids(1, 2, 4), 2) == ([], 0)


def test_prompt_lookup_in_a_repeating_tail_takes_a_match_with_k_tokens_after_it():
    # the latest "1 2" is followed by only "1 2" before the end; an earlier one has the 4 tokens asked for
    assert PromptLookup(max_ngram=2).draft(ids(1, 2, 1, 2, 1, 2, 1, 2), 4) == [1, 2, 1, 2]


def test_prompt_lookup_without_a_match_drafts_nothing():
    lookup = PromptLookup()
    assert lookup.draft(ids(1, 2, 3, 4), 4) == []
    assert lookup.draft(ids(5), 4) == [] and lookup.draft(ids(1, 1), 0) == []
    assert lookup.draft(ids(1, 1), 3) == [1]
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


# ---- drafting with a local model --------------------------------------------------------------------------------

def test_a_draft_model_drafts_its_own_greedy_continuation_and_follows_rollbacks(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    prompt = torch.tensor([5, 17, 42, 9, 33])
    with torch.no_grad():
        want = model.generate(prompt[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    drafter = DraftModel(model)
    drafts, probs = drafter.draft(prompt, 4)
    assert drafts == want[:4] and probs == [None] * 4
    # the swarm accepted 2 drafts and corrected the third to a token of its own: the drafter rolls its cache back
    context = torch.cat([prompt, torch.tensor(want[:2] + [7])])
    again, _ = drafter.draft(context, 2)
    with torch.no_grad():
        ref = model.generate(context[None], max_new_tokens=2, do_sample=False, pad_token_id=0)[0, -2:].tolist()
    assert again == ref and drafter.tokens == context.tolist() + again[:1]


# ---- the draft length rule --------------------------------------------------------------------------------------

def test_expected_tokens_per_pass():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def route_cost(rtt_s: float, decode_s: float, prefill_a_s: float, servers: int = 2):
    spans = [Span(f"s{i}", 4 * i, 4 * i + 4, f"h{i}:1") for i in range(servers)]
    net = Network()
    for s in spans:
        net.set_link("c", s.server_id, rtt_s)
    perf = PerfModel({s.server_id: ComputeProfile(prefill_a_s, 0.0, decode_s) for s in spans}, net)
    return lambda tokens: perf.pass_s("c", spans, tokens)


def test_round_trips_dominate_so_drafts_pay():
    wan = route_cost(rtt_s=0.05, decode_s=0.002, prefill_a_s=0.0005)  # 100 ms of links, 16 ms of compute
    o = 2 * MESSAGE_OVERHEAD_S  # each of the 2 hops' messages (PerfModel.message_overhead_s)
    assert wan(1) == pytest.approx(0.1 + o + 8 * 0.002)
    assert wan(5) == pytest.approx(0.1 + o + 8 * (0.002 + 4 * 0.0005))
    k = choose_draft_length(0.8, wan, k_max=8)
    assert k >= 4
    assert choose_draft_length(0.95, wan, k_max=8) >= k  # more acceptance, longer drafts


def test_compute_dominates_or_drafts_fail_so_k_is_zero():
    local = route_cost(rtt_s=0.0005, decode_s=0.01, prefill_a_s=0.01)  # each extra token costs a whole step
    assert choose_draft_length(0.6, local, k_max=8) == 0
    wan = route_cost(rtt_s=0.05, decode_s=0.002, prefill_a_s=0.0005)
    assert choose_draft_length(0.0, wan, k_max=8) == 0
    # a draft model's own time counts too: at 60 ms per drafted token, drafting does not pay here
    assert choose_draft_length(0.5, wan, k_max=8, draft_s=0.06) == 0
    with pytest.raises(ValueError):
        choose_draft_length(1.5, wan, k_max=8)


def test_acceptance_estimate_counts_tried_drafts_and_forgets():
    est = AcceptanceEstimate()
    assert est.rate == 0.5
    for _ in range(30):
        est.update(proposed=4, accepted=4)  # every draft accepted: no rejection observed
    assert est.rate > 0.9
    for _ in range(30):
        est.update(proposed=4, accepted=0)  # a rejection at once: one draft tried
    assert est.rate < 0.2
    low = est.rate
    for _ in range(30):
        est.update(proposed=0, accepted=0)  # k = 0 passes: back towards the prior, so drafts are tried again
    assert low < est.rate < 0.5
    assert est.passes == 90 and est.drafted == 240 and est.accepted_total == 120
    with pytest.raises(ValueError):
        est.update(proposed=2, accepted=3)


def test_acceptance_by_match_keeps_one_estimate_per_kind_and_decays_all():
    est = AcceptanceByMatch()
    for _ in range(20):
        est.update(3, proposed=6, accepted=6)  # 3-token matches: the quote goes on
        est.update(1, proposed=6, accepted=0)  # 1-token matches: rejected at once
    assert est.rate(3) > 0.9 and est.rate(1) < 0.2 and est.rate(2) == 0.5  # an unseen kind: the prior
    low = est.rate(1)
    for _ in range(20):
        est.update(None, proposed=0, accepted=0)  # passes without drafts: every estimate drifts to the prior
    assert low < est.rate(1) < 0.5 < est.rate(3) < 0.95
    with pytest.raises(ValueError, match="without a kind"):
        est.update(None, proposed=2, accepted=0)


# ---- verification ----------------------------------------------------------------------------------------------

def one_hot_scores(*best: int, vocab: int = 6) -> torch.Tensor:
    scores = torch.zeros(len(best), vocab)
    scores[torch.arange(len(best)), torch.tensor(best)] = 1.0
    return scores


def test_greedy_verification_is_exactly_greedy():
    scores = one_hot_scores(3, 1, 4, 2)  # the model's argmax after each position
    assert verify_greedy([3, 1, 4], scores) == [3, 1, 4, 2]  # all accepted, plus the bonus token
    assert verify_greedy([3, 5, 4], scores) == [3, 1]  # the second draft is wrong: the model's token instead
    assert verify_greedy([0, 1, 4], scores) == [3]
    assert verify_greedy([], scores[:1]) == [3]  # k = 0: plain greedy decoding
    with pytest.raises(ValueError, match="expected scores"):
        verify_greedy([3, 1], scores)


P = torch.tensor([[0.5, 0.3, 0.15, 0.05],  # the model's distribution at each of 3 positions
                  [0.1, 0.2, 0.3, 0.4],
                  [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
Q = torch.tensor([[0.05, 0.15, 0.3, 0.5],  # the drafter's, far from the model's
                  [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)


def _empirical(tokens: list[int], vocab: int = 4) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_sampling_verification_keeps_the_models_distribution(drafter):
    gen = torch.Generator().manual_seed(1234)
    first, second = [], []
    for _ in range(10000):
        if drafter == "sampled":
            drafts = [int(torch.multinomial(Q[i], 1, generator=gen)) for i in range(2)]
            out = verify_sampling(drafts, P, list(Q), gen)
        else:  # prompt lookup: the same drafts every time, q one-hot
            out = verify_sampling([0, 3], P, None, gen)
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    # positions are independent of the prefix here, so each output token must follow P at its position
    assert (_empirical(first) - P[0]).abs().sum() / 2 < 0.03  # total variation; sampling noise ~0.01
    assert len(second) > 1000 and (_empirical(second) - P[1]).abs().sum() / 2 < 0.04
    # what a broken rule would give: always accepting the drafts yields Q, not P
    assert (Q[0] - P[0]).abs().sum() / 2 > 0.3


def test_sampling_verification_accepts_drafts_the_model_agrees_with():
    gen = torch.Generator().manual_seed(0)
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_sampling([1, 2], sure, None, gen) == [1, 2, 0]
    assert verify_sampling([1, 0], sure, None, gen) == [1, 2]  # the rejected draft has p = 0: never kept
