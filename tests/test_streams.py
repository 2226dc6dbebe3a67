"""Image folders and TFRecord shards, streamed: layouts, indexes, the data order across ranks,
np-invariance, resume mid-epoch, evaluation across ranks, memory, and bad input. The sets are
small and made by hvd_sgd's own converter; each image carries its id in two pixels (PNG:
lossless), and a model of the tests' own records the ids each rank trains on (conftest)."""
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

from conftest import (PYTHON, ROOT, assert_same_weights, checkpoint_from_step, ended_within, error_lines, exported,
                      Cgroup, id_images, ids_by_rank, launch, peak_memory, read_json, recorder,
                      run_recorded, saved_weights, start_and_wait, succeeded, write_dataset)
from hvd_sgd.bench import launchers
from hvd_sgd.data import catalogs, convert

# --- layouts, the converter and the indexes --------------------------------------------------

@pytest.mark.parametrize("layout", convert.LAYOUTS)
def test_the_converter_writes_a_layout_that_reads_back_as_the_arrays(layout, tmp_path):
    splits = id_images(30, 7, shape=(6, 5), classes=12)
    image_set = catalogs.open_set(str(exported(tmp_path / layout, layout, splits, shards=4)))
    assert (image_set.layout, image_set.input_shape, image_set.num_classes) == (layout, (6, 5, 1), 12)
    assert (len(image_set.train), len(image_set.test)) == (30, 7)
    if layout == "folder":  # zero-padded class names keep the labels' order when sorted
        assert image_set.class_names == tuple(f"{c:02d}" for c in range(12))
    from hvd_sgd.data import streams
    images, labels = zip(*streams.test_batches(image_set))
    by_id = {int(i): k for k, i in enumerate(splits.x_test[:, 0, 0].astype(int) * 256 + splits.x_test[:, 0, 1])}
    decoded = np.concatenate([np.rint(b.numpy()[..., 0] * 255) for b in images]).astype(np.uint8)
    for image, label in zip(decoded, np.concatenate(labels)):
        k = by_id[int(image[0, 0]) * 256 + int(image[0, 1])]
        np.testing.assert_array_equal(image, splits.x_test[k])  # PNG: exactly the pixels
        assert label == splits.y_test[k]


@pytest.mark.slow
def test_the_converter_command_resizes_and_colours_mnist(tmp_path):
    out = tmp_path / "tf"
    subprocess.run([PYTHON, "-m", "hvd_sgd.data", "export", "--format", "tfrecord", "--from", "mnist",
                    "--train-examples", "40", "--test-examples", "10", "--image-size", "16", "--colour", "--shards", "2",
                    str(out)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    image_set = catalogs.open_set(str(out))
    assert image_set.input_shape == (16, 16, 3) and (len(image_set.train), len(image_set.test)) == (40, 10)
    assert image_set.train.files == tuple(str(out / f"train-0000{k}-of-00002") for k in (0, 1))
    assert image_set.test.files[0] == str(out / "validation-00000-of-00002")


def test_class_folders_are_sorted_to_labels_and_other_files_skipped(tmp_path):
    splits = id_images(9, 3, classes=3)
    root = exported(tmp_path / "set", "folder", splits)
    for split in ("train", "test"):
        for old, new in (("0", "zebra"), ("1", "ant"), ("2", "moth")):
            os.rename(root / split / old, root / split / new)
    (root / "train" / "ant" / "notes.txt").write_text("not an image")
    lines = []
    image_set = catalogs.open_set(str(root), log=lines.append)
    assert image_set.class_names == ("ant", "moth", "zebra")
    assert sorted(image_set.train.labels) == [0] * 3 + [1] * 3 + [2] * 3
    assert lines == [f"{root / 'train'}: skipped 1 file(s) that are not images (.bmp, .gif, .jpeg, .jpg, .png)"]


def test_an_index_is_kept_and_rebuilt_when_its_shard_changes(tmp_path):
    root = exported(tmp_path / "set", "tfrecord", id_images(20, 5), shards=2)
    lines = []
    first = catalogs.open_set(str(root), log=lines.append)
    index = root / catalogs.INDEX_DIR / "train-00000-of-00002.npz"
    built = index.stat().st_mtime_ns
    assert catalogs.open_set(str(root), log=lines.append).train.offsets.tolist() == first.train.offsets.tolist()
    assert index.stat().st_mtime_ns == built and lines == []
    shard = root / "train-00000-of-00002"
    shard.write_bytes(shard.read_bytes() * 2)  # the same records twice: the index no longer matches
    again = catalogs.open_set(str(root), log=lines.append)
    assert len(again.train) == len(first.train) + 10
    assert lines == [f"{shard}: its index no longer matches its files (changed since it was built): rebuilding it"]


def test_an_index_goes_to_the_cache_where_the_data_is_read_only(tmp_path, monkeypatch):
    root = exported(tmp_path / "set", "tfrecord", id_images(20, 5))
    monkeypatch.setenv("HVD_SGD_CACHE", str(tmp_path / "cache"))
    writable = os.access
    monkeypatch.setattr(catalogs.os, "access", lambda path, mode: writable(path, mode) and str(root) not in str(path))
    catalogs.open_set(str(root))
    assert len(list((tmp_path / "cache" / "index").iterdir())) == 2 and not (root / catalogs.INDEX_DIR).exists()


# --- the data order, np-invariance, resume and evaluation -------------------------------------

BATCH = 12  # the global batch: 1 rank x 12, 2 x 6, 3 x 4
EPOCHS = ["--epochs", 2, "--warmup-epochs", 0, "--log-every-steps", 1000]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """144 examples (12 global batches of 12) in 5 shards, a number neither 2 nor 3 ranks divide."""
    tmp = tmp_path_factory.mktemp("shards")
    return tmp, exported(tmp / "set", "tfrecord", id_images(144, 30), shards=5)


@pytest.fixture(scope="module")
def recorded(shards):
    tmp, data = shards
    return {np_: run_recorded(tmp, f"np{np_}", data, np_, BATCH // np_, *EPOCHS) for np_ in (1, 2, 3)}


@pytest.mark.slow
def test_each_epoch_visits_every_example_once_across_ranks_in_the_order_of_one_rank(recorded):
    (one,), _, _ = recorded[1]
    assert one.shape == (24, 12)
    for epoch in (one[:12], one[12:]):
        assert sorted(epoch.ravel()) == list(range(144))  # every example once an epoch
    assert not np.array_equal(np.sort(one[:12], axis=None), one[:12].ravel())  # shuffled
    assert not np.array_equal(one[:12], one[12:])  # and reshuffled
    for np_ in (2, 3):
        ranks, _, _ = recorded[np_]
        np.testing.assert_array_equal(np.concatenate(ranks, axis=1), one)  # step by step, the examples of one rank


@pytest.mark.slow
def test_fewer_shards_than_ranks_still_give_each_rank_its_share(tmp_path):
    data = exported(tmp_path / "set", "tfrecord", id_images(36, 6), shards=2)
    ranks, _, _ = run_recorded(tmp_path, "np3", data, 3, 4, "--epochs", 1)
    assert all(r.shape == (3, 4) for r in ranks)
    assert sorted(np.concatenate(ranks).ravel()) == list(range(36))


@pytest.mark.slow
@pytest.mark.both_stacks
def test_n_ranks_with_batch_b_train_like_one_rank_with_batch_nb_on_streamed_shards(recorded):
    _, one, _ = recorded[1]
    for np_ in (2, 3):
        assert_same_weights(recorded[np_][1], one, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_n_ranks_train_like_one_on_an_image_folder_augmented(tmp_path):
    """Folders, JPEG, with --augment: each example's crop and flip depend on it and its epoch only."""
    data = exported(tmp_path / "set", "folder", id_images(96, 20, shape=(12, 12)), image_format="jpeg")
    augmented = [run_recorded(tmp_path, f"np{n}", data, n, 16 // n, *EPOCHS, "--augment")[1] for n in (1, 2)]
    assert_same_weights(*augmented, rtol=1e-4, atol=1e-5)
    plain = run_recorded(tmp_path, "plain", data, 2, 8, *EPOCHS)[1]
    assert max(np.abs(a - b).max() for a, b in zip(plain, augmented[0])) > 1e-3  # --augment changes the images


@pytest.mark.slow
def test_ranks_evaluate_their_shares_and_the_sum_is_what_one_process_counts(recorded, shards):
    import tensorflow as tf
    from hvd_sgd.data import streams
    _, data = shards
    summary = recorded[2][2]
    model = tf.keras.models.load_model(summary["config"]["save_model"])
    correct = sum(int(tf.reduce_sum(tf.cast(tf.argmax(model(images), -1, output_type=tf.int32) == labels, tf.int32)))
                  for images, labels in streams.test_batches(catalogs.open_set(str(data))))
    assert (summary["test_correct"], summary["test_examples"]) == (correct, 30)
    assert summary["test_accuracy"] == pytest.approx(correct / 30)


@pytest.mark.slow
def test_a_run_stopped_mid_epoch_resumes_with_the_examples_the_epoch_had_not_seen(recorded, shards, tmp_path):
    """Stopped by SIGUSR1 mid-epoch (steps of 0.2 s, epochs of 12 steps), resumed: every example of
    the straight run, none twice, none skipped, and its weights."""
    ids_straight, weights_straight, _ = recorded[2]
    _, data = shards
    recorder(tmp_path)
    ids, checkpoints = tmp_path / "ids", tmp_path / "ckpt"
    ids.mkdir()
    env = launchers.environment(PYTHONPATH=str(tmp_path), IDS_DIR=str(ids), RECORD_SECONDS="0.2")
    args = ["--model", "recorder:model", "--data-dir", data, "--batch-size", 6, "--lr", 0.05, "--no-lr-scaling", *EPOCHS,
            "--checkpoint-dir", checkpoints, "--checkpoint-every-steps", 1, "--save-model", tmp_path / "m.keras"]
    run = start_and_wait(launchers.command("mpirun", 2, "hvd_sgd.train", args), checkpoint_from_step(checkpoints, 14),
                         120, env=env)
    run.send_signal(signal.SIGUSR1)
    status, _, stderr = ended_within(run, 60)
    assert status == 75, stderr[-2000:]
    stopped = ids_by_rank(ids, 2)
    assert 14 <= len(stopped[0]) < 24
    shutil.rmtree(ids)
    ids.mkdir()
    succeeded(launch("mpirun", 2, *args, "--resume", env=dict(PYTHONPATH=str(tmp_path), IDS_DIR=str(ids))))
    resumed = ids_by_rank(ids, 2)
    for rank in range(2):
        np.testing.assert_array_equal(np.concatenate([stopped[rank], resumed[rank]]), ids_straight[rank])
    assert_same_weights(saved_weights(tmp_path / "m.keras"), weights_straight)


# --- memory ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_ranks_memory_does_not_grow_with_the_number_of_images(tmp_path):
    """1,000 and 20,000 images of 32 x 32 x 3 (PNG), streamed: a rank's peak within a few MB."""
    small, large = (exported(tmp_path / str(n), "tfrecord", id_images(n, 100, shape=(32, 32, 3)), shards=4)
                    for n in (1000, 20000))
    (small_rank, _), (large_rank, _) = (peak_memory(data, "--max-steps", 50, job=False) for data in (small, large))
    assert abs(large_rank - small_rank) < 16e6, f"{(large_rank - small_rank) / 1e6:.1f} MB more"


@pytest.mark.slow
def test_a_job_in_a_memory_cgroup_smaller_than_its_data_set_trains_to_the_end(tmp_path):
    """700 MB of JPEG records, a job limited to 560 MB (its ranks need about 470 MB of it): the
    pages read are the kernel's cache, which it reclaims, not the job's."""
    Cgroup.require("memory")
    import tensorflow as tf
    rng = np.random.default_rng(0)
    images = [convert.encoded(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), image_format="jpeg")
              for _ in range(40)]  # noise: about 60 KB a JPEG
    root = tmp_path / "set"
    root.mkdir()
    for split, n, shards in (("train", 11500, 8), ("validation", 200, 1)):
        for shard, part in enumerate(np.array_split(np.arange(n), shards)):
            with tf.io.TFRecordWriter(str(root / f"{split}-{shard:05d}-of-{shards:05d}")) as writer:
                for i in part:
                    writer.write(convert.example(*images[i % 40], int(i % 10), "jpeg").SerializeToString())
    size = sum(p.stat().st_size for p in root.iterdir())
    limit = 560 << 20
    assert size > limit + (100 << 20), size
    _, job = peak_memory(root, "--epochs", 1, "--image-size", 32, "--batch-size", 64, limit=limit)
    assert job <= limit


# --- bad input ---------------------------------------------------------------------------------

def _folder(tmp_path, **options):
    return exported(tmp_path / "set", "folder", id_images(40, 10), image_format="jpeg", **options)


def truncated_jpeg(tmp_path):
    root = _folder(tmp_path)
    image = next((root / "train" / "3").iterdir())
    image.write_bytes(image.read_bytes()[:200])
    return root, [str(image), "truncated JPEG"]


def corrupt_jpeg(tmp_path):
    """Whole, with a good header, but without its quantization table (its marker made an APP5's):
    found when a rank decodes it, and named by that rank."""
    root = _folder(tmp_path)
    image = next((root / "train" / "3").iterdir())
    image.write_bytes(image.read_bytes().replace(b"\xff\xdb", b"\xff\xe5"))
    return root, [str(image), "cannot read or decode the image"]


def only_other_files(tmp_path):
    root = _folder(tmp_path)
    for image in (root / "train" / "4").iterdir():
        image.rename(image.with_suffix(".txt"))
    return root, [str(root / "train" / "4"), "empty class folder"]


def empty_class_folder(tmp_path):
    root = _folder(tmp_path)
    (root / "train" / "extra").mkdir()
    return root, [str(root / "train" / "extra"), "empty class folder"]


def missing_test_split(tmp_path):
    root = _folder(tmp_path)
    shutil.rmtree(root / "test")
    return root, [f"{root}: no test split"]


def tfrecord_without_the_label(tmp_path):
    root = exported(tmp_path / "set", "tfrecord", id_images(40, 10))
    return root, [str(root / "train-00000-of-00001"), "no feature 'image/label'"], ["--tfrecord-features",
                                                                                     "image/encoded,image/label"]


def truncated_tfrecord(tmp_path):
    root = exported(tmp_path / "set", "tfrecord", id_images(40, 10))
    shard = root / "validation-00000-of-00001"
    shard.write_bytes(shard.read_bytes()[:-30])
    return root, [str(shard), "truncated TFRecord"]


BAD = {f.__name__.replace("_", " "): f for f in (truncated_jpeg, corrupt_jpeg, only_other_files, empty_class_folder,
                                                  missing_test_split, tfrecord_without_the_label, truncated_tfrecord)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_files_are_one_line_naming_the_file(case, tmp_path):
    root, words, *args = BAD[case](tmp_path)
    result = launch("mpirun", 2, "--data-dir", root, "--batch-size", 4, "--epochs", 1, *(args[0] if args else ()),
                    "--metrics-file", tmp_path / "m.json", timeout=180)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    [line] = error_lines(result)
    assert all(w in line for w in words), line
    assert not (tmp_path / "m.json").exists()


@pytest.mark.slow
def test_a_glob_of_shards_finds_its_test_shards_by_name(tmp_path):
    root = exported(tmp_path / "set", "tfrecord", id_images(40, 10), shards=2)
    for path in root.iterdir():
        if path.is_file():
            path.rename(root / path.name.replace("train", "mine-train").replace("validation", "mine-validation"))
    image_set = catalogs.open_set(str(root / "mine-train-*"))
    assert (len(image_set.train), len(image_set.test)) == (40, 10)
    metrics = tmp_path / "m.json"
    result = succeeded(launch("python", 1, "--data-dir", root / "mine-train-*", "--batch-size", 8, "--max-steps", 3,
                              "--metrics-file", metrics))
    summary = read_json(metrics)  # the run tested the 10 images of the glob's own test shards
    assert summary["test_examples"] == 10 and summary["steps_per_epoch"] == 40 // 8, summary
    assert not error_lines(result)


def test_the_layout_is_told_by_what_the_path_holds(tmp_path):
    (tmp_path / "idx").mkdir()
    write_dataset(tmp_path / "idx")  # train-images-idx3-ubyte.gz ...: IDX, though it starts with train-
    (tmp_path / "idx-missing-one").mkdir()
    write_dataset(tmp_path / "idx-missing-one")
    (tmp_path / "idx-missing-one" / "train-images-idx3-ubyte.gz").unlink()
    exported(tmp_path / "folder", "folder", id_images(4, 2))
    exported(tmp_path / "shards", "tfrecord", id_images(4, 2))
    np.savez(tmp_path / "arrays.npz", x=np.zeros(1))
    layouts = {name: catalogs.detect(str(tmp_path / name)) for name in
               ("idx", "idx-missing-one", "folder", "shards", "arrays.npz")}
    assert layouts == {"idx": "idx", "idx-missing-one": "idx", "folder": "folder", "shards": "tfrecord",
                       "arrays.npz": "npz"}
    assert catalogs.detect(str(tmp_path / "shards" / "train-*")) == "tfrecord"
    assert catalogs.detect(str(tmp_path)) is None
