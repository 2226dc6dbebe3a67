"""Unit tests: the rank-independent data order, and the pipelines that follow it."""
import numpy as np
import pytest
import tensorflow as tf

from conftest import write_dataset
from hvd_sgd.data import batches, datasets
from hvd_sgd.training.plan import RunPlan


def plan(n, batch, size, per_epoch=None, passes=1):
    return RunPlan.build(world_size=size, num_examples=n, per_rank_batch=batch, backward_passes=passes, epochs=1,
                         steps_per_epoch=per_epoch)


def indices(n, batch, size, rank, first, last, seed=3, per_epoch=None, passes=1):
    return batches.rank_batch_indices(plan(n, batch, size, per_epoch, passes), rank, seed, first, last)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_each_example_once_per_epoch(size):
    n, batch = 1000, 16
    per_epoch = plan(n, batch, size).steps_per_epoch
    shards = [indices(n, batch, size, r, 0, per_epoch) for r in range(size)]
    seen = np.concatenate([s.ravel() for s in shards])
    assert all(s.shape == (per_epoch, batch) for s in shards)  # every rank runs the same steps
    assert len(np.unique(seen)) == len(seen) == per_epoch * batch * size  # once each, nothing shared
    assert len(seen) > n - batch * size  # only the incomplete last global batch is dropped


def test_order_is_independent_of_the_number_of_ranks():
    """Step by step, N ranks with batch B see the examples one rank with batch N*B sees."""
    n, steps = 1000, 40  # several epochs
    one_rank = indices(n, 24, 1, 0, 0, steps)
    for size in (2, 3, 4):
        batch = 24 // size
        together = np.concatenate([indices(n, batch, size, r, 0, steps) for r in range(size)], axis=1)
        np.testing.assert_array_equal(together, one_rank)


def test_accumulation_takes_the_examples_of_the_larger_batch():
    """2 ranks x 2 backward passes of 8 take, each step, the 32 examples one rank with batch 32 takes."""
    n, steps = 1000, 40
    assert plan(n, 8, 2, passes=2).steps_per_epoch == plan(n, 32, 1).steps_per_epoch
    accumulated = np.concatenate([indices(n, 8, 2, r, 0, steps, passes=2) for r in (0, 1)], axis=1)
    np.testing.assert_array_equal(accumulated, indices(n, 32, 1, 0, 0, steps))


def test_an_epoch_keeps_its_steps_when_an_elastic_job_changes_size():
    """Epochs fixed at 3 ranks: on 2 ranks each step takes 2 batches of the same permutation, on 4 it wraps."""
    n, batch, per_epoch = 300, 10, 10  # 3 ranks x 10 = 30 a step, 10 steps an epoch
    shrunk = np.concatenate([indices(n, batch, 2, r, 0, 2 * per_epoch, per_epoch=per_epoch) for r in (0, 1)], axis=1)
    assert shrunk.shape == (2 * per_epoch, 20)
    np.testing.assert_array_equal(shrunk[:per_epoch].ravel(), batches.epoch_order(n, 3, 0)[:200])
    np.testing.assert_array_equal(shrunk[per_epoch:].ravel(), batches.epoch_order(n, 3, 1)[:200])
    grown = np.concatenate([indices(n, batch, 4, r, 0, per_epoch, per_epoch=per_epoch) for r in range(4)], axis=1)
    order = batches.epoch_order(n, 3, 0)
    np.testing.assert_array_equal(grown.ravel(), np.concatenate([order, order[:100]]))


def test_epochs_are_reshuffled_and_seeds_differ():
    first, second = batches.epoch_order(500, 3, 0), batches.epoch_order(500, 3, 1)
    assert not np.array_equal(first, second)
    assert sorted(first) == sorted(second) == list(range(500))
    assert not np.array_equal(first, batches.epoch_order(500, 4, 0))


@pytest.mark.parametrize("first,last", [(0, 7), (5, 29), (10, 11), (19, 41), (20, 20)])
def test_a_resumed_run_continues_the_same_sequence(first, last):
    full = indices(640, 16, 2, 1, 0, 50)
    np.testing.assert_array_equal(indices(640, 16, 2, 1, first, last), full[first:last])


def test_a_compiled_step_takes_the_indexed_batches_in_order(tmp_path):
    arrays = write_dataset(tmp_path)
    splits = datasets.read_idx_dir(str(tmp_path), "custom")
    rows = np.array([[3, 1], [0, 7], [5, 5]])
    step = tf.function(batches.step_batches(splits, rows)).get_concrete_function()
    for row in rows:
        images, labels = step()
        assert images.shape == (2, *arrays["x_train"].shape[1:], 1) and images.dtype == tf.float32
        np.testing.assert_allclose(images.numpy()[..., 0], arrays["x_train"][row] / 255, rtol=1e-6)
        np.testing.assert_array_equal(labels.numpy(), arrays["y_train"][row])
    with pytest.raises(tf.errors.InvalidArgumentError):  # past the last row: an error, never a wrap-around
        step()


def test_colour_images_keep_their_channels():
    images = np.arange(2 * 4 * 3 * 3, dtype=np.uint8).reshape(2, 4, 3, 3)
    np.testing.assert_allclose(batches.to_model_input(images).numpy(), images / 255, rtol=1e-6)
    assert batches.to_model_input(images[..., 0]).shape == (2, 4, 3, 1)  # grayscale gets one channel


def test_pipelines_yield_the_indexed_examples_and_run_without_the_autotuner(tmp_path):
    """Without tf.data's autotuner: its thread can hold up the iterator's deletion for seconds."""
    arrays = write_dataset(tmp_path)
    splits = datasets.read_idx_dir(str(tmp_path), "custom")
    rows = np.array([[3, 1], [0, 7]])
    train = batches.train_batches(splits, rows)
    test = batches.test_batches(splits, batch_size=2)
    assert not train.options().autotune.enabled and not test.options().autotune.enabled
    for (images, labels), row in zip(train, rows):
        np.testing.assert_allclose(images.numpy()[..., 0], arrays["x_train"][row] / 255, rtol=1e-6)
        np.testing.assert_array_equal(labels.numpy(), arrays["y_train"][row])
    test_labels = np.concatenate([labels.numpy() for _, labels in test])
    np.testing.assert_array_equal(test_labels, arrays["y_test"])
