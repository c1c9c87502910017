"""``DAggerSchedule``: the beta decay shapes, the t_max ramp and its guard, eval's knobs."""

from __future__ import annotations

import math

import pytest

from engine.dagger_schedule import DAggerSchedule, eval_knobs
from engine.errors import ConfigError


def betas(schedule: DAggerSchedule, n: int) -> list[float]:
    return [schedule.beta(i) for i in range(n)]


def test_linear_decays_evenly_then_holds() -> None:
    s = DAggerSchedule(beta_start=1.0, beta_end=0.2, decay="linear", decay_iterations=4)
    assert betas(s, 7) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2])


def test_cosine_is_flat_at_both_ends_and_half_way_in_the_middle() -> None:
    s = DAggerSchedule(beta_start=1.0, beta_end=0.0, decay="cosine", decay_iterations=4)
    got = betas(s, 6)
    want = [(1 + math.cos(math.pi * min(i / 4, 1))) / 2 for i in range(6)]
    assert got == pytest.approx(want)
    assert got[2] == pytest.approx(0.5)
    # slower than linear early, faster in the middle
    assert got[1] > 0.75 and got[0] - got[1] < got[1] - got[2]
    assert got[4:] == [0.0, 0.0]


def test_exp_multiplies_each_iteration_down_to_the_floor() -> None:
    s = DAggerSchedule(beta_start=0.8, beta_end=0.1, decay="exp", gamma=0.5)
    assert betas(s, 6) == pytest.approx([0.8, 0.4, 0.2, 0.1, 0.1, 0.1])


def test_step_holds_for_step_iterations_then_drops() -> None:
    s = DAggerSchedule(beta_start=1.0, beta_end=0.0, decay="step", gamma=0.5, step_iterations=3)
    assert betas(s, 8) == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25])


def test_t_max_ramps_linearly_to_its_cap() -> None:
    s = DAggerSchedule(t_max_start=1, t_max_step=2, t_max_cap=6)
    assert [s.t_max(i) for i in range(5)] == [1, 3, 5, 6, 6]
    assert s.knobs(1) == {"dagger_beta": pytest.approx(0.9), "t_max": 3}


def test_no_ramp_publishes_no_t_max() -> None:
    """The guard: t_max_step 0 leaves a statically configured t_max alone (no t_max=0)."""
    s = DAggerSchedule(t_max_start=0, t_max_step=0)
    assert s.t_max(5) is None
    assert s.knobs(5) == {"dagger_beta": pytest.approx(0.5)}
    assert "t_max" not in s.knobs(0)


def test_eval_pops_beta_unless_an_eval_beta_is_given() -> None:
    knobs = DAggerSchedule(t_max_step=1).knobs(2)
    assert eval_knobs(knobs) == {"t_max": 2}
    assert eval_knobs(knobs, eval_beta=0.25) == {"t_max": 2, "eval_dagger_beta": 0.25}
    assert "dagger_beta" in knobs  # the training knobs are not modified


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"beta_start": 1.5}, "beta_start"),
        ({"beta_start": 0.2, "beta_end": 0.5}, "beta_end"),
        ({"decay": "sigmoid"}, "decay"),
        ({"decay_iterations": 0}, "decay_iterations"),
        ({"gamma": 0.0}, "gamma"),
        ({"t_max_step": -1}, "t_max_step"),
        ({"t_max_start": 4, "t_max_cap": 2}, "t_max_cap"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        DAggerSchedule(**kwargs)  # type: ignore[arg-type]


def test_bad_iterations_are_refused() -> None:
    s = DAggerSchedule()
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="iteration"):
            s.beta(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="eval_beta"):
        eval_knobs({}, eval_beta=2.0)
