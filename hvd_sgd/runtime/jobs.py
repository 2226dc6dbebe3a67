"""The job around the ranks: Horovod started, a signal that stops every rank after the same step,
and a watchdog that ends the job when a rank freezes or a file system hangs."""
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Optional

from hvd_sgd import JobError
from hvd_sgd.runtime import announced, preemption, startup
from hvd_sgd.runtime.preemption import StopRequest
from hvd_sgd.runtime.watchdog import Watchdog

if TYPE_CHECKING:  # world imports Horovod's extension, which startup.start checks first
    from hvd_sgd.runtime.world import World


@dataclasses.dataclass(frozen=True)
class Job:
    """Where a run happens: the ranks, and what ends or stops it."""
    world: "World"
    watchdog: Watchdog
    stop: Optional[StopRequest]  # None in elastic mode: a signalled worker is a lost one
    elastic: bool

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        """However the run ended, its watchdog stops: a process that goes on (a notebook, a test,
        another fit) must not be ended for the silence of a run that is over."""
        self.watchdog.stop()

    def together(self):
        """A block whose JobError on any rank stops every rank (World.agreement). Not in elastic mode:
        a worker that joins mid-run first meets the others in the broadcast that (re)starts training,
        so no rank may enter a collective before it; a worker failing a check alone leaves the job."""
        return contextlib.nullcontext() if self.elastic else self.world.agreement()


def start(ranks, timeline=False):
    """The job as the configuration's ``ranks`` section says (and Horovod's timeline ready to record,
    if ``timeline``): from here on a signal stops every rank
    after the same step, with a checkpoint of it (elastic mode: a signalled worker is a lost one, and
    the others go on); Horovod starts; a frozen rank, or a hung file system, ends the job. hvd_sgd's
    watchdog, not Horovod's stall check, watches for stalls; elastic mode runs none (Horovod handles
    lost workers) and keeps Horovod's check."""
    if ranks.elastic and not announced.elastic():
        raise JobError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np MIN --max-np MAX "
                       "--host-discovery-script run/discover-hosts python -m hvd_sgd.train --elastic")
    stop = None if ranks.elastic else preemption.listen(ranks.stall_timeout)
    world = startup.start(ranks.threads_per_rank, ranks.stall_timeout if ranks.elastic else None, ranks.bind_cpus,
                          timeline)
    watchdog = Watchdog(world, None if ranks.elastic else ranks.stall_timeout, ranks.trace_timeout)
    return Job(world, watchdog.start(), stop, ranks.elastic)
