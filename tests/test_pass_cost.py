"""MeasuredPassCost: the model's pass price corrected by a session's measured passes (perf/speculation.py)."""
import pytest

from swarmlm.perf.speculation import MeasuredPassCost, choose_draft_length


def model(tokens: int) -> float:  # a route priced at 100 ms + 5 ms per further position
    return 0.100 + 0.005 * (tokens - 1)


def test_without_passes_the_price_is_the_model():
    cost = MeasuredPassCost().corrected(model)
    assert [cost(n) for n in (1, 2, 5)] == [model(n) for n in (1, 2, 5)]


def test_plain_passes_scale_and_wide_passes_add_their_own_price():
    measured = MeasuredPassCost()
    for _ in range(20):
        measured.observe(1, model(1), 0.120)  # the route runs 1.2x the model
        measured.observe(3, model(3), 1.2 * model(3) + 0.030)  # and a wide pass 30 ms more
    cost = measured.corrected(model)
    assert cost(1) == pytest.approx(0.120, rel=1e-3)
    assert cost(3) == pytest.approx(1.2 * model(3) + 0.030, rel=1e-2)
    assert cost(7) == pytest.approx(1.2 * model(7) + 0.030, rel=1e-2)
    assert measured.plain_passes == measured.wide_passes == 20


def test_a_wide_pass_faster_than_predicted_adds_nothing():
    measured = MeasuredPassCost()
    measured.observe(4, model(4), 0.05)
    assert measured.wide_s == 0.0


def test_a_measured_extra_position_cost_turns_weak_drafts_off():
    """At 15 % acceptance, drafts pay on the model's price of an extra position but not at the measured one."""
    assert choose_draft_length(0.15, model, 8) > 0
    measured = MeasuredPassCost()
    for _ in range(5):
        measured.observe(1, model(1), model(1))
        measured.observe(2, model(2), model(2) + 0.030)
    assert choose_draft_length(0.15, measured.corrected(model), 8) == 0
    assert choose_draft_length(0.85, measured.corrected(model), 8) > 0  # long matches still draft


def test_a_stalled_pass_is_not_learned_from():
    measured = MeasuredPassCost()
    measured.observe(1, model(1), model(1))
    measured.observe(1, model(1), 30 * model(1))  # a failover's pass
    measured.observe(2, model(2), 30 * model(2))
    assert measured.scale == 1.0 and measured.wide_s == 0.0 and measured.wide_passes == 0


def test_bad_observations_are_refused():
    measured = MeasuredPassCost()
    for tokens, predicted, seconds in ((0, 0.1, 0.1), (1, 0.0, 0.1), (2, 0.1, -1.0)):
        with pytest.raises(ValueError):
            measured.observe(tokens, predicted, seconds)
    with pytest.raises(ValueError):
        MeasuredPassCost(decay=1.0)
