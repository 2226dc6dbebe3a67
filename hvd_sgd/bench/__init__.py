"""Benchmarks: hvd_sgd side by side with plain Keras, independent processes and MWMS.

    python -m hvd_sgd.bench [--quick] [--results-dir results/bench] [--suites overhead,scaling,...]

Every suite runs its contenders back to back in this one invocation, on the same model, data,
global batch and number of timed steps (all but the first, which traces the graph), and reports
ratios: this machine is shared and noisy, so absolute times mean little.

1. overhead   hvd_sgd on 1 rank vs a plain Keras ``fit`` loop without Horovod
2. scaling    hvd_sgd on 2 ranks vs two 1-rank hvd_sgd runs at once: the same work, nothing to all-reduce
3. peer       hvd_sgd on 2 ranks vs tf.distribute.MultiWorkerMirroredStrategy with 2 workers
4. allreduce  bus bandwidth of hvd.allreduce (MPI and Gloo controllers) vs mpi4py's Allreduce
5. tta        the default recipe from the command to the target test accuracy: hvd_sgd on 1 and
              2 ranks and the same recipe in plain Keras, with where the start-up's seconds go
6. lever      (not by default) the scaling suite and the MPI all-reduce without and with an
              environment variable (--lever; Open MPI's single copy off unless it names another)
7. network    (not by default: root) across 2 nodes of run/cluster, links unshaped, 10 and 1 Gbit/s:
              all-reduce as in 4, and hvd_sgd on 2 nodes vs two independent processes as in 2
8. project    (after network) a ring all-reduce cost model and a compute model fitted to network's
              measurements, checked against them, and projected to 8, 64 and 512 ranks
9. input      (not by default) the same model and images from memory, image folders and TFRecords,
              hvd_sgd on 2 ranks; images decoded a second, on one call and on every core; evaluation
              by rank 0 alone and by both ranks; Fashion-MNIST's recipe, arrays vs a JPEG folder (3 seeds)
10. precision (not by default) float32 against mixed_bfloat16: throughput on 1 and 2 ranks, the
              default recipe's accuracy on MNIST and Fashion-MNIST (3 seeds) and time to 0.99

Modules: ``contenders`` starts each contender as its own process tree, ``workers`` is what
those processes run (``python -m hvd_sgd.bench worker KIND …``), ``protocol`` is how they
report, ``suites`` pairs and repeats them, ``network`` runs them across nodes, ``project`` models and
projects them, ``report`` writes results.json, results.md and plots.
"""
