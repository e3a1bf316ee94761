"""Other work on the cores while a benchmark cell was timed, measured over that cell.

The 1-minute load average that the environment block records lags (a job that started or ended
during the run shows up by a fraction) and counts the benchmark itself. What tells whether a
latency figure is the model's or the machine's is how many cores *other* processes kept busy
while the figure was being taken: the busy ticks of the cores this process may run on
(`/proc/stat`, one line per CPU, restricted to `sched_getaffinity`) minus this process's own
CPU time over the same wall-clock window.

Linux only; elsewhere `sample()` returns None and callers fall back to the load average.
`parse_proc_stat` is pure, so the arithmetic is tested on text without a busy machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")

# Ticks are 10 ms (USER_HZ 100) and kernel threads take a little: a cell is flagged only when
# other work took this much more than the cores its timing leaves free.
SLACK_CORES = 0.25


@dataclass(frozen=True)
class Sample:
    wall: float  # time.monotonic(), seconds
    own_cpu: float  # this process's user + system seconds, all its threads
    busy_ticks: int  # busy ticks of the usable cores (all but idle and iowait)
    cpus: int  # how many cores those ticks were summed over


def parse_proc_stat(text: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """(busy ticks, how many cores) summed over the per-CPU lines `cpuN` whose N is in `cpus`
    (all of them when None). Busy is every field but idle (4th) and iowait (5th); guest time is
    already inside user time, so it is not added again."""
    busy = counted = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(f) for f in rest.split()]
        busy += sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)
        counted += 1
    return busy, counted


def sample() -> Sample | None:
    """The counters now, or None where /proc/stat cannot be read (not Linux)."""
    try:
        text = PROC_STAT.read_text(encoding="ascii")
    except OSError:
        return None
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy, counted = parse_proc_stat(text, cpus)
    if not counted:
        return None
    t = os.times()
    return Sample(time.monotonic(), t.user + t.system, busy, counted)


def other_cores(before: Sample | None, after: Sample | None) -> float | None:
    """How many cores, on average over the window, processes other than this one kept busy.
    None when either sample is missing or the window is too short to tell (under 0.1 s)."""
    if before is None or after is None or before.cpus != after.cpus:
        return None
    wall = after.wall - before.wall
    if wall < 0.1:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = (after.busy_ticks - before.busy_ticks) / tick
    own = after.own_cpu - before.own_cpu
    return max(0.0, (busy - own) / wall)


def contended(other: float | None, usable_cores: int, threads: int) -> bool:
    """Did other work take cores the timing needed: more than the cores `threads` leave free."""
    if other is None:
        return False
    return other > max(0, usable_cores - threads) + SLACK_CORES
