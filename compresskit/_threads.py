"""OpenMP threads that spin only briefly before they sleep (GOMP_SPINCOUNT=1000), for the
processes compress starts: its command and the workers it spawns.

torch's CPU kernels run on libgomp's pool, one thread per core, and a thread that has finished
its share spins (300,000 iterations by default) waiting for the next parallel region. With a
core taken by another process, the spinning threads steal the time the thread on the busy core
needs, and every region waits for it. Measured side by side on a 2-core AMD EPYC
(`python benchmarks/thread_wait.py --reps 3`: median epoch seconds of `compress train` on
digits, the other core idle or running a busy loop):

    model      load          default   GOMP_SPINCOUNT=1000   OMP_WAIT_POLICY=PASSIVE
    LeNet-300  idle          0.027     0.032                 0.088
    VGG        idle          1.109     1.169                 1.621
    LeNet-300  1 core busy   0.143     0.076                 0.037
    VGG        1 core busy   4.658     2.280                 1.940

PASSIVE (sleep at once) wins on a busy machine and loses 46% on an idle one; the short spin
costs about 5% idle (within run-to-run noise in other runs) and halves a busy machine's epoch. The wait policy changes no result,
only how threads wait (the thread count, which float sums depend on, is untouched). libgomp
reads these variables when torch loads it: set before torch is imported (the command) or in a
child's environment (spawned workers), never over OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set,
never in a process whose torch is loaded already.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

SPIN = ("GOMP_SPINCOUNT", "1000")
USERS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either set: the user's choice stands


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def short_spin() -> None:
    """For this process, when torch is not loaded yet and the user chose no policy."""
    if "torch" not in sys.modules and not any(v in os.environ for v in USERS):
        os.environ[SPIN[0]] = SPIN[1]


@contextlib.contextmanager
def short_spin_children() -> Iterator[None]:
    """Processes spawned inside the block start with the short spin (unless the user chose a
    policy); this process's environment is as it was afterwards."""
    if any(v in os.environ for v in USERS):
        yield
        return
    os.environ[SPIN[0]] = SPIN[1]
    try:
        yield
    finally:
        os.environ.pop(SPIN[0], None)
