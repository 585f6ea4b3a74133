"""Batched sessions speculate: B rows in one session, each with its own drafts, the session cut to the fewest
positions any row keeps and each row's surplus sent again (client/decoding/rows.py). Greedy rows are plain
transformers' greedy decoding up to ties (a batched forward is not bit-identical to a single-row one on CPU:
tests/swarm_helpers.py `assert_greedy_up_to_ties`); rows end at their own time; sampled batches and copies run;
a server SIGKILLed mid-generation changes nothing."""
from __future__ import annotations

import signal

import pytest
import torch

from swarmlm.client.decoding.rows import Row, common_cut, draft_limit, is_left_padded, padded_step, real_tokens
from swarmlm.client.decoding.decoder import Decoder, SpeculationStats
from swarmlm.client.decoding.sampling import Sampling
from tests.swarm_helpers import assert_greedy_up_to_ties, reference_generate, reference_model

torch.set_num_threads(1)

# prompts that quote themselves (prompt lookup drafts at once), of equal length, no bos/eos/pad ids
# (the tiny random models soon repeat a token or a short cycle: drafts of the quoted text get rejected at different
# passes in different rows, drafts of the repetition accepted)
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
           [101, 7, 230, 42, 17, 33, 101, 7, 230, 42, 17, 33, 101, 7]]
NEW_TOKENS = 16


# ---- the bookkeeping, without a swarm ------------------------------------------------------------------------------
def test_a_step_is_right_padded_and_masked():
    ids, mask = padded_step([[1, 2, 3], [4], [5, 6]])
    assert ids.tolist() == [[1, 2, 3], [4, 4, 4], [5, 6, 6]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert padded_step([[1, 2], [3, 4]])[1] is None  # nothing padded: no mask
    with pytest.raises(ValueError):
        padded_step([[1], []])



def test_a_batch_in_auto_drafts_at_its_slowest_rows_pace():
    """In "auto", a batch chooses one k from the lowest acceptance estimate among its rows: a row without a draft,
    or one whose drafts are rarely accepted, keeps every row from drafting (its lead would be resent on every later
    pass); rows that all quote draft together."""
    decoder = Decoder(None, Sampling(NEW_TOKENS, do_sample=False), mode="auto")
    quoting = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # its last 3 tokens were seen: drafts 4, 5, 6, 7, 1, ...
    decoder.rows = [decoder._new_row(r, text) for r, text in enumerate([quoting, quoting, [9, 8, 7, 6, 5]])]
    decoder.live = [0, 1, 2]
    cost = lambda: (lambda tokens: 0.100 + 0.020 * tokens)  # noqa: E731  links, then compute per position
    assert [d for d, _, _ in decoder.policy.draft_rows(decoder.rows, [4, 4, 4], cost, decoder._pick)] == [[], [], []]  # row 2 has no match
    decoder.live = [0, 1]
    drafted = decoder.policy.draft_rows(decoder.rows[:2], [4, 4], cost, decoder._pick)
    (first, _, n0), (second, _, n1) = drafted
    assert first and first == second == [4, 5, 6, 7][:len(first)] and n0 == n1 == 3  # one k for the batch
    for _ in range(6):
        decoder.rows[1].estimate.update(3, 4, 0)  # row 1's quotes are never accepted
    assert [d for d, _, _ in decoder.policy.draft_rows(decoder.rows[:2], [4, 4], cost, decoder._pick)] == [[], []]

def test_the_cut_is_the_fewest_kept_and_the_rest_is_owed():
    # a step of width 6: row 0 sent [last, 5 drafts] and kept 4, row 1 [2 owed, last, 3 drafts] and kept 6 ...
    rows = [Row(text=list(range(10)), sent=9, processors=None, generator=None, drafter=None,
                stats=SpeculationStats()) for _ in range(3)]
    kept = [4, 6, 2]
    for row, k in zip(rows, kept):
        row.text += [100 + i for i in range(k - len(row.head) + 1)]  # the accepted drafts and its own token
    keep = common_cut(kept, 6)
    assert keep == 2
    for row in rows:
        row.sent += keep
    # ... so each row owes what it kept past the cut, then sends its newest token
    assert [len(row.head) for row in rows] == [k - keep + 1 for k in kept] == [3, 5, 1]
    assert rows[2].head == [rows[2].text[-1]]
    with pytest.raises(ValueError):
        common_cut([0, 3], 6)  # every row keeps at least the token it sent last
    with pytest.raises(ValueError):
        common_cut([7], 6)


def test_no_row_owes_more_than_k_max():
    # rows accepting at random, each drafting what draft_limit allows: the backlog stays bounded
    gen = torch.Generator().manual_seed(0)
    k_max, owed = 4, [0, 0, 0]
    for _ in range(200):
        heads = [o + 1 for o in owed]
        drafts = [draft_limit(k_max, h, room=100, free=100) for h in heads]
        assert all(d >= 0 for d in drafts) and max(h + d for h, d in zip(heads, drafts)) <= k_max + 1
        kept = [h + int(torch.randint(0, d + 1, (), generator=gen)) for h, d in zip(heads, drafts)]
        keep = common_cut(kept, max(h + d for h, d in zip(heads, drafts)))
        owed = [k - keep for k in kept]
        assert max(owed) <= k_max
    assert draft_limit(4, 1, room=3, free=100) == 2 and draft_limit(4, 1, room=100, free=3) == 2


def test_prompts_padded_on_the_left_only():
    ids = torch.tensor([[0, 0, 7, 8], [1, 2, 3, 4]])
    assert real_tokens(ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])) == [[7, 8], [1, 2, 3, 4]]
    assert real_tokens(ids, None) == ids.tolist()
    assert not is_left_padded(torch.tensor([[1, 1, 0, 0]]))  # right padding
    assert not is_left_padded(torch.tensor([[1, 0, 1, 1]]))  # a hole
    with pytest.raises(ValueError):
        real_tokens(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))


def test_batch_stats_sum_the_rows_and_count_trips():
    a, b = SpeculationStats(), SpeculationStats()
    a.record(3, 4, 4)
    b.record(1, 4, 1)
    b.resent = 3
    total = SpeculationStats.of_rows([a, b], passes=1)
    assert (total.passes, total.drafted, total.accepted, total.n_tokens, total.resent) == (1, 8, 5, 7, 3)
    assert [r["accepted"] for r in total.to_dict()["rows"]] == [4, 1]
    assert "rows" not in a.to_dict()


# ---- through server processes ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm(twice_covered_swarm):
    return twice_covered_swarm


@pytest.mark.slow
def test_a_batch_speculates_and_gives_greedy_tokens(swarm):
    _, client, path, _ = swarm
    out = client.generate(torch.tensor(PROMPTS), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          speculative=4)
    assert out.shape == (len(PROMPTS), len(PROMPTS[0]) + NEW_TOKENS)
    for prompt, row in zip(PROMPTS, out.tolist()):
        assert_greedy_up_to_ties(path, prompt, row[len(prompt):])
    spec = client.last_stats.speculation
    rows = spec["rows"]
    assert spec["passes"] < NEW_TOKENS - 1  # several tokens per trip
    assert spec["drafted"] > 0 and 0 < spec["accepted"] < spec["drafted"]  # drafts kept and drafts rolled back
    # in some pass the rows kept different numbers of positions (a row sends tokens again only then), and the
    # rows' own counts differ
    assert spec["resent"] > 0 and len({(r["drafted"], r["accepted"], r["resent"]) for r in rows}) > 1
    assert sum(r["tokens"] for r in rows) == spec["tokens"] == len(PROMPTS) * (NEW_TOKENS - 1)


@pytest.mark.slow
def test_left_padded_prompts_speculate(swarm):
    _, client, path, _ = swarm
    prompts = [PROMPTS[0], PROMPTS[1][:9], PROMPTS[2][:11]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = client.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          speculative=4)
    assert client.last_stats.speculation["drafted"] > 0
    for prompt, row in zip(prompts, out.tolist()):
        assert_greedy_up_to_ties(path, prompt, row[width:])


@pytest.mark.slow
def test_a_batch_drafts_with_a_draft_model(swarm):
    _, client, path, _ = swarm
    out = client.generate(torch.tensor(PROMPTS), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          speculative=3, draft_model=reference_model(path))  # each row its own draft cache
    spec = client.last_stats.speculation
    assert spec["drafted"] > 0 and list(spec["by_kind"]) == ["0"]  # the draft model's kind
    for prompt, row in zip(PROMPTS, out.tolist()):
        assert_greedy_up_to_ties(path, prompt, row[len(prompt):])


@pytest.mark.slow
def test_rows_end_at_their_own_eos_and_are_padded(swarm):
    _, client, path, _ = swarm
    plain = [reference_generate(path, torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
             [0, len(p):].tolist() for p in PROMPTS]
    # an eos that row 0 generates (mid-way if it can) and row 1 never does: row 0 ends first, row 1 runs to the end
    eos = next((t for t in plain[0][3:] if t not in plain[0][:3] + plain[1]), plain[0][0])
    assert eos not in plain[1]
    pad = 3
    out = client.generate(torch.tensor(PROMPTS), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                          pad_token_id=pad, speculative=4)
    lengths = []
    for prompt, row in zip(PROMPTS, out.tolist()):
        new = row[len(prompt):]
        end = new.index(eos) + 1 if eos in new else len(new)
        assert all(t == pad for t in new[end:])  # transformers' padding after a row's eos
        assert_greedy_up_to_ties(path, prompt, new[:end])
        lengths.append(end)
    assert lengths[0] < lengths[1] == NEW_TOKENS and out.shape[1] == len(PROMPTS[0]) + NEW_TOKENS


@pytest.mark.slow
def test_sampled_batches_and_copies_speculate(swarm):
    _, client, _, _ = swarm
    vocab = client.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    out = client.generate(torch.tensor(PROMPTS), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.7,
                          eos_token_id=None, speculative=4, generator=gen)
    assert out.shape == (3, len(PROMPTS[0]) + NEW_TOKENS) and 0 <= int(out.min()) and int(out.max()) < vocab
    assert client.last_stats.speculation["drafted"] > 0
    # num_return_sequences: one prefill, its cache copied to 3 rows that sample on their own
    out = client.generate(torch.tensor(PROMPTS[:1]), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.5,
                          num_return_sequences=3, eos_token_id=None, speculative=4, generator=gen)
    assert out.shape == (3, len(PROMPTS[0]) + NEW_TOKENS)
    assert (out[:, :len(PROMPTS[0])] == torch.tensor(PROMPTS[:1])).all()
    spec = client.last_stats.speculation
    assert len(spec["rows"]) == 3 and spec["drafted"] > 0
    prefills = [r for r in client.last_stats.steps if r.n_tokens == len(PROMPTS[0])]
    assert len(prefills) == 1  # the prompt went through the swarm once


def batched_greedy(client, session, on_tokens=None) -> list[list[int]]:
    """The batch's greedy rows through the decoder's own loop in `session`; on_tokens(row, tokens) after each."""
    decoder = Decoder(client, Sampling(NEW_TOKENS, do_sample=False), 4, session=session)
    return decoder.generate_rows(torch.tensor(PROMPTS), None, NEW_TOKENS, on_tokens=on_tokens)


@pytest.mark.slow
def test_a_server_killed_during_batched_speculation_changes_nothing(swarm):
    local, client, path, ranges = swarm
    length = len(PROMPTS[0]) + NEW_TOKENS + 16
    with client.inference_session(max_length=length, batch_size=len(PROMPTS)) as session:
        before = batched_greedy(client, session)
    with client.inference_session(max_length=length, batch_size=len(PROMPTS)) as session:
        killed, seen = [], []

        def kill_after_a_pass(row: int, tokens: list[int]) -> None:
            seen.append(row)
            if not killed and len(seen) == 2 * len(PROMPTS):  # the prompts' step and one pass came back
                victim_id = session.spans[1].span.server_id
                killed.append(next(s for s in local.servers if s.server_id == victim_id))
                local.kill(killed[0], signal.SIGKILL)
                killed[0].proc.wait(60)

        after = batched_greedy(client, session, kill_after_a_pass)
        failovers = sum(r.failovers for r in session.steps)
    assert killed and failovers >= 1
    for prompt, want, got in zip(PROMPTS, before, after):
        assert_greedy_up_to_ties(path, prompt, got, want)
    local.servers.remove(killed[0])  # restore: every block served twice again
    local.start_server(ranges[1])
