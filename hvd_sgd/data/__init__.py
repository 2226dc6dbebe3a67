"""The data: where a run's examples come from, and the batches each rank takes of them.

``sources.load`` gives every rank the run's data, one of two kinds that the training loop uses
alike, through the same interface:

- ``datasets.Splits``: arrays held in memory (MNIST, Fashion-MNIST, IDX files, ``.npz``), one copy a
  node (``shared_data``), ``aligned`` for TensorFlow to take over, batched by ``batches``;
- ``catalogs.ImageSet``: image folders or TFRecord shards, each rank streaming its own batches
  (``streams``), ``augment``-ed on request; ``convert`` writes a set in either layout.

The interface: ``num_train``, ``input_shape``, ``num_classes``, ``subset(train, test)``;
``step_batches(indices, threads, augmentation)``, the rank's train batches for a compiled step
(the data order is ``batches.rank_batch_indices``); ``test_batches(rank, size, threads)``, the
rank's test share; ``undecodable_train(examples)`` and ``undecodable_test(rank, size)``, the
one-line report of an image that does not decode (None for arrays). Nothing outside this room
imports a format's module.

    python -m hvd_sgd.data        # install MNIST and check every dataset (run/setup runs it)
    python -m hvd_sgd.data export --format folder|tfrecord --from mnist OUT
"""
