"""Unit tests: the learning-rate schedule."""
import math

import pytest

from hvd_sgd.training import schedules


def rates(schedule, steps):
    return [float(schedule.at_step(s)) for s in steps]


def test_without_warmup_the_peak_rate_applies_from_the_first_step():
    constant = schedules.WarmupCosine(0.1, 0.4, warmup_steps=0, decay_steps=0)
    assert rates(constant, [0, 1, 50]) == pytest.approx([0.4] * 3)


def test_warmup_ramps_to_the_peak_then_cosine_decays_to_zero():
    schedule = schedules.WarmupCosine(0.1, 0.2, warmup_steps=10, decay_steps=110)
    assert rates(schedule, [0, 5, 10]) == pytest.approx([0.1, 0.15, 0.2])
    assert rates(schedule, [60, 110, 200]) == pytest.approx([0.1, 0.0, 0.0], abs=1e-7)
    assert float(schedule.at_step(35)) == pytest.approx(0.2 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_keras_iterations_count_backward_passes_and_the_schedule_counts_steps():
    schedule = schedules.WarmupCosine(0.1, 0.1, warmup_steps=0, decay_steps=100, backward_passes_per_step=4)
    assert [float(schedule(i)) for i in (200, 201, 203)] == pytest.approx([float(schedule.at_step(50))] * 3)
