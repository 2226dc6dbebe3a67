"""The run plan: every number a run derives from its flags, the world size and the data set's size.

Computed once, when the run starts (and again, whole, when an elastic job changes size), and
printed in one line (``describe``); the schedule, the batches, the checkpoints' compatibility
check, the progress lines and the metrics file read it. Nothing else computes these numbers:
train_v1 and the bench take them from here too (the functions below the plan).
"""
import dataclasses
import math
from typing import Optional

from hvd_sgd import JobError


@dataclasses.dataclass(frozen=True)
class RunPlan:
    world_size: int
    num_examples: int  # training examples
    per_rank_batch: int  # --batch-size: examples a rank takes per backward pass
    backward_passes: int  # --backward-passes-per-step
    steps_per_epoch: int
    total_steps: int  # the run's last global step
    warmup_steps: int
    decay_steps: int  # the cosine reaches 0 here; 0: no decay
    base_lr: float  # --lr: the rate for one rank's --batch-size, where the warm-up starts
    peak_lr: float  # the rate the warm-up reaches: scaled with the global batch (linear scaling rule)

    @property
    def rank_batch(self):
        """Examples a rank takes per step, over its backward passes."""
        return self.per_rank_batch * self.backward_passes

    @property
    def global_batch(self):
        """Examples per step, over all ranks: the batch one rank would need to train the same."""
        return global_batch(self.per_rank_batch, self.world_size, self.backward_passes)

    def epoch(self, step):
        return step / self.steps_per_epoch

    def describe(self):
        """The plan in one line, for the start of a run."""
        passes = f" x {self.backward_passes} backward passes" if self.backward_passes > 1 else ""
        scaled = f" after scaling ({self.base_lr:g} for one rank's batch)" if self.peak_lr != self.base_lr else ""
        return (f"global batch {self.global_batch} ({self.per_rank_batch} a rank{passes}), "
                f"{self.steps_per_epoch} steps an epoch, {self.total_steps} in all, "
                f"learning rate {self.peak_lr:g}{scaled}, warm-up {self.warmup_steps} steps")

    @classmethod
    def build(cls, *, world_size, num_examples, per_rank_batch, backward_passes=1, lr=0.0, lr_scaling=True,
              epochs=None, max_steps=None, warmup_epochs=0.0, cosine_decay=False, steps_per_epoch=None):
        """The plan of ``epochs`` passes over ``num_examples`` (or ``max_steps``, if fewer).

        ``steps_per_epoch``: an elastic job's epoch, fixed in steps when the job first started (an
        epoch then covers fewer or more examples at another size); None: full global batches of the
        data. A data set too small for one global batch is a JobError."""
        if world_size > num_examples:
            raise JobError(f"{world_size} ranks but only {num_examples} training examples")
        if steps_per_epoch is None:
            steps_per_epoch = num_examples // global_batch(per_rank_batch, world_size, backward_passes)
        if steps_per_epoch == 0:
            batch = f"--batch-size {per_rank_batch}" + (
                f" x {backward_passes} backward passes" if backward_passes > 1 else "")
            raise JobError(f"{batch} is larger than a rank's shard "
                           f"({num_examples} examples / {world_size} ranks = {num_examples // world_size})")
        planned = epochs * steps_per_epoch if epochs is not None else math.inf
        total_steps = min(planned, max_steps or math.inf)
        assert total_steps < math.inf, "a run needs epochs or max_steps"
        return cls(world_size=world_size, num_examples=num_examples, per_rank_batch=per_rank_batch,
                   backward_passes=backward_passes, steps_per_epoch=steps_per_epoch, total_steps=int(total_steps),
                   warmup_steps=round(warmup_epochs * steps_per_epoch),
                   decay_steps=int(planned) if cosine_decay else 0, base_lr=float(lr),
                   peak_lr=scaled_lr(lr, world_size * backward_passes, lr_scaling))

    @classmethod
    def for_training(cls, cfg, world_size, num_examples, steps_per_epoch: Optional[int] = None):
        """The plan of ``hvd_sgd.train``'s optimisation section ``cfg`` (hvd_sgd.config) on ``world_size`` ranks."""
        return cls.build(world_size=world_size, num_examples=num_examples, per_rank_batch=cfg.batch_size,
                         backward_passes=cfg.backward_passes_per_step, lr=cfg.lr, lr_scaling=cfg.lr_scaling,
                         epochs=cfg.epochs, max_steps=cfg.max_steps, warmup_epochs=cfg.warmup_epochs,
                         cosine_decay=cfg.lr_decay == "cosine", steps_per_epoch=steps_per_epoch)


def global_batch(per_rank_batch, world_size, backward_passes=1):
    """Examples per step over all ranks."""
    return per_rank_batch * backward_passes * world_size


def scaled_lr(lr, factor, lr_scaling=True):
    """The linear scaling rule: ``lr`` for a batch ``factor`` times larger (unchanged without scaling)."""
    return float(lr) * (factor if lr_scaling else 1)


def per_rank_batch(global_batch_size, world_size):
    """The per-rank batch of ``global_batch_size`` examples a step over ``world_size`` ranks."""
    return global_batch_size // world_size


def epochs_covering(steps, global_batch_size, num_examples):
    """The whole epochs that ``steps`` steps of ``global_batch_size`` need over ``num_examples``."""
    return -(-steps * global_batch_size // num_examples)
