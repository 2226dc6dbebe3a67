"""The classic TF1 program on Horovod: accuracy, np-invariance, resuming from checkpoint_dir."""
import numpy as np
import pytest

from conftest import launch, read_json, reported_accuracy, succeeded

V1 = "hvd_sgd.train_v1"


def final_variables(checkpoint_dir):
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(checkpoint_dir))
    return {name: reader.get_tensor(name) for name in ("W", "b", "global_step")}


@pytest.mark.slow
@pytest.mark.both_stacks
def test_two_ranks_reach_the_softmax_ceiling(tmp_path):
    metrics = tmp_path / "m.json"
    result = succeeded(launch("horovodrun", 2, "--lr", "0.5", "--steps", 300, "--metrics-file", metrics, module=V1))
    assert reported_accuracy(result) >= 0.90
    summary = read_json(metrics)
    assert (summary["world_size"], summary["steps"]) == (2, 300)


@pytest.mark.slow
@pytest.mark.both_stacks
def test_one_rank_batch_2b_equals_two_ranks_batch_b(tmp_path):
    common = ["--lr", "0.5", "--steps", 40, "--seed", 5]
    succeeded(launch("python", 1, *common, "--batch-size", 64, "--checkpoint-dir", tmp_path / "np1", module=V1))
    succeeded(launch("mpirun", 2, *common, "--batch-size", 32, "--checkpoint-dir", tmp_path / "np2", module=V1))
    one, two = final_variables(tmp_path / "np1"), final_variables(tmp_path / "np2")
    assert one["global_step"] == two["global_step"] == 40
    np.testing.assert_allclose(one["W"], two["W"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(one["b"], two["b"], rtol=1e-4, atol=1e-6)
    assert np.abs(one["W"]).max() > 1e-3  # it trained


@pytest.mark.slow
@pytest.mark.both_stacks
def test_rerun_with_the_checkpoint_dir_continues_the_global_step(tmp_path):
    common = ["--lr", "0.5", "--batch-size", 50]
    succeeded(launch("mpirun", 2, *common, "--steps", 60, "--checkpoint-dir", tmp_path / "straight", module=V1))
    succeeded(launch("mpirun", 2, *common, "--steps", 25, "--checkpoint-dir", tmp_path / "split", module=V1))
    metrics = tmp_path / "m.json"
    succeeded(launch("mpirun", 2, *common, "--steps", 60, "--checkpoint-dir", tmp_path / "split",
                     "--metrics-file", metrics, module=V1))
    summary = read_json(metrics)
    assert (summary["resumed_from_step"], summary["steps"]) == (25, 60)
    straight, split = final_variables(tmp_path / "straight"), final_variables(tmp_path / "split")
    assert straight["global_step"] == split["global_step"] == 60
    np.testing.assert_allclose(straight["W"], split["W"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(straight["b"], split["b"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "40000"], "larger than a rank's shard"),
])
def test_bad_input_is_one_line(args, message):
    result = launch("mpirun", 2, *args, module=V1, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.count("hvd_sgd.train_v1: error:") == 1 and message in result.stderr


def test_the_program_runs_in_this_process_on_one_rank(tmp_path):
    """The quick tier's run of the TF1 program, in the test's own process (it builds its own graph)."""
    from hvd_sgd import train_v1
    metrics = tmp_path / "m.json"
    train_v1.main(["--steps", "20", "--metrics-file", str(metrics)])
    assert read_json(metrics)["test_accuracy"] > 0.5
