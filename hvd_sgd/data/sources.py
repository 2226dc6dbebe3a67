"""Where a run's examples come from: arrays held in memory, or image files streamed.

- MNIST, Fashion-MNIST, IDX files and ``.npz``: arrays (hvd_sgd.data.datasets), one copy a node in
  shared memory (hvd_sgd.data.shared_data);
- image folders and TFRecord shards: a catalog (hvd_sgd.data.catalogs) that rank 0 reads or builds and
  sends to the others; each rank then streams its own batches from the files (hvd_sgd.data.streams).
"""
import functools
import glob
import os

from hvd_sgd import JobError
from hvd_sgd.data import catalogs, datasets, shared_data


def location(cfg):
    """The file or directory the run reads its data from (a glob's directory)."""
    if cfg.data_dir and glob.has_magic(cfg.data_dir):
        return os.path.dirname(cfg.data_dir) or "."
    return datasets.location(cfg.dataset, cfg.data_dir)


def streamed(cfg):
    """Whether ``cfg``'s data are image files, streamed, rather than arrays."""
    return bool(cfg.data_dir) and catalogs.detect(cfg.data_dir) in ("folder", "tfrecord")


def load(cfg, world, elastic=False):
    """The run's data on every rank of ``world``, as the configuration's data section ``cfg`` says: a
    datasets.Splits or a catalogs.ImageSet, cut to --train-examples/--test-examples. A collective (the
    same on every rank), but in ``elastic`` mode, where no rank may meet the others before training
    starts: there each rank reads alone."""
    read = _reader(cfg, world.log)
    if elastic:
        data = read()
    else:
        data = _from_rank_0(read, world) if streamed(cfg) else shared_data.load(read)
    return data.subset(cfg.train_examples, cfg.test_examples)


def read(cfg, log=print):
    """The data as one process reads it alone (the bench's measurements)."""
    return _reader(cfg, log)()


def _reader(cfg, log):
    if streamed(cfg):
        size = (cfg.image_size, cfg.image_size) if cfg.image_size else None
        return functools.partial(catalogs.open_set, cfg.data_dir, size, cfg.tfrecord_features.split(","), log)
    return functools.partial(datasets.load, cfg.dataset, cfg.data_dir)


def _from_rank_0(read, world):
    """``read()`` on rank 0, sent to every rank; its JobError raised on every rank."""
    import horovod.tensorflow as hvd
    result = None
    if world.is_chief:
        try:
            result = read(), None
        except JobError as e:
            result = None, str(e)
    data, error = hvd.broadcast_object(result, root_rank=0)
    if error:
        raise JobError(error)
    return data
