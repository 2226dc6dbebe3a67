"""Unit tests: the run plan, the one place a run's derived numbers come from."""
import dataclasses

import pytest

from hvd_sgd import JobError, config
from hvd_sgd.training import schedules
from hvd_sgd.training.plan import RunPlan


def test_the_plan_of_the_default_recipe_on_four_ranks():
    cfg = config.TrainConfig()  # batch 32, 2 epochs, lr 0.05 scaled, 0.4 epochs of warm-up, cosine
    plan = RunPlan.for_training(cfg, 4, 60000)
    assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (128, 468, 936)
    assert (plan.warmup_steps, plan.decay_steps) == (round(0.4 * 468), 936)
    assert (plan.base_lr, plan.peak_lr) == (0.05, pytest.approx(0.2))


def test_backward_passes_count_in_the_global_batch_and_the_peak_rate():
    cfg = config.TrainConfig(batch_size=8, backward_passes_per_step=2, max_steps=30)
    plan = RunPlan.for_training(cfg, 2, 1000)
    assert (plan.rank_batch, plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (16, 32, 31, 30)
    assert plan.peak_lr == pytest.approx(0.05 * 4)
    assert RunPlan.for_training(dataclasses.replace(cfg, lr_scaling=False), 2, 1000).peak_lr == 0.05


def test_max_steps_ends_the_run_but_the_decay_keeps_the_epochs():
    plan = RunPlan.for_training(config.TrainConfig(epochs=3, max_steps=10, batch_size=10), 1, 1000)
    assert (plan.total_steps, plan.decay_steps) == (10, 300)
    assert RunPlan.for_training(config.TrainConfig(lr_decay="none", warmup_epochs=0), 1, 1000).decay_steps == 0


def test_an_elastic_resize_keeps_the_epoch_in_steps_and_plans_the_rest_anew():
    cfg = config.TrainConfig(batch_size=10)
    first = RunPlan.for_training(cfg, 3, 300)
    shrunk = RunPlan.for_training(cfg, 2, 300, steps_per_epoch=first.steps_per_epoch)
    assert (first.steps_per_epoch, shrunk.steps_per_epoch) == (10, 10)
    assert (shrunk.global_batch, shrunk.peak_lr) == (20, pytest.approx(0.1))


def test_the_schedule_follows_the_plan():
    plan = RunPlan.for_training(config.TrainConfig(), 2, 6400)
    schedule = schedules.WarmupCosine.following(plan)
    assert float(schedule.at_step(0)) == pytest.approx(plan.base_lr)
    assert float(schedule.at_step(plan.warmup_steps)) == pytest.approx(plan.peak_lr)
    assert float(schedule.at_step(plan.decay_steps)) == pytest.approx(0, abs=1e-7)


def test_no_full_step_is_a_clear_error():
    def plan(n, batch, size, passes=1):
        return RunPlan.build(world_size=size, num_examples=n, per_rank_batch=batch, backward_passes=passes, epochs=1)
    with pytest.raises(JobError, match="larger than a rank's shard"):
        plan(100, 60, 2)
    with pytest.raises(JobError, match=r"--batch-size 30 x 2 backward passes is larger than a rank's shard"):
        plan(100, 30, 2, passes=2)
    with pytest.raises(JobError, match="4 ranks but only 3 training examples"):
        plan(3, 1, 4)
