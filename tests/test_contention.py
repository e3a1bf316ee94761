"""Other work on the cores while bench timed a cell: /proc/stat arithmetic, the note it makes,
and one real measurement of a CPU hog."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from compresskit.compressor.measure import contention, grid

STAT = """cpu  900 0 300 5000 50 0 10 0 0 0
cpu0 400 0 100 2000 20 0 5 0 0 0
cpu1 500 0 200 3000 30 0 5 0 7 0
cpu12 1 2 3 4 5 6 7 8 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_ticks_are_the_usable_cores_all_but_idle_and_iowait():
    # cpu0: 400 + 100 + 5; cpu1: 500 + 200 + 5 (guest 7 is inside user already); the
    # aggregate "cpu" line and other counters are not CPUs
    assert contention.parse_proc_stat(STAT, {0, 1}) == (505 + 705, 2)
    assert contention.parse_proc_stat(STAT, {1}) == (705, 1)
    # cpu12: 1 + 2 + 3 + 6 + 7 + 8, not cpu1 by prefix
    assert contention.parse_proc_stat(STAT, {12}) == (27, 1)
    assert contention.parse_proc_stat(STAT, None) == (505 + 705 + 27, 3)
    assert contention.parse_proc_stat(STAT, {5}) == (0, 0)


def test_other_cores_is_the_machines_busy_time_less_this_process():
    tick = os.sysconf("SC_CLK_TCK")
    before = contention.Sample(wall=10.0, own_cpu=1.0, busy_ticks=0, cpus=2)
    # 2 s of wall time: 3 core-seconds busy on the usable cores, 1 of them ours
    after = contention.Sample(wall=12.0, own_cpu=2.0, busy_ticks=3 * tick, cpus=2)
    assert contention.other_cores(before, after) == pytest.approx(1.0)
    # never below zero (ticks are coarser than os.times)
    mine = contention.Sample(wall=12.0, own_cpu=5.0, busy_ticks=3 * tick, cpus=2)
    assert contention.other_cores(before, mine) == 0.0
    # too short a window, a missing sample, or the affinity changed between them: unknown
    assert contention.other_cores(before, contention.Sample(10.05, 1.0, 0, 2)) is None
    assert contention.other_cores(None, after) is None
    assert contention.other_cores(before, contention.Sample(12.0, 2.0, 3 * tick, 1)) is None


def test_a_cell_is_flagged_when_other_work_took_the_cores_its_threads_needed():
    # 2 usable cores: one thread leaves one core free for one hog; two threads leave none
    assert not contention.contended(1.0, usable_cores=2, threads=1)
    assert contention.contended(1.6, usable_cores=2, threads=1)
    assert contention.contended(0.5, usable_cores=2, threads=2)
    assert not contention.contended(0.2, usable_cores=2, threads=2)  # ticks, kernel threads
    assert not contention.contended(None, usable_cores=2, threads=2)


def _row(batch, threads, other):
    return {"model": "m", "provider": "ORT-CPU", "p50_ms": 1.0, "batch": batch,
            "threads": threads, "other_cores": other}  # fmt: skip


def test_the_note_names_the_contended_cells_and_not_the_load_average():
    env = {"usable_cores": 2, "load_average_1min": 5.0}  # a stale load average: not the word
    rows = [_row(1, 1, 0.9), _row(32, 1, 1.7), _row(1, 2, 0.6), _row(32, 2, 0.1)]
    notes = grid.notes(env, rows)
    assert len(notes) == 1
    assert notes[0].startswith("other processes kept cores busy while these were timed, on 2")
    assert (
        "batch 1 at 2 threads (0.6 cores busy), batch 32 at 1 thread (1.7 cores busy);"
        in (notes[0])
    )
    assert "batch 1 at 1 thread" not in notes[0] and "load average" not in notes[0]
    # measured and quiet: nothing said, whatever the load average
    assert grid.notes(env, [_row(1, 1, 0.9), _row(1, 2, 0.1)]) == []
    # not measured (not Linux): the load average decides, as before
    assert "load average 5.0" in grid.notes(env, [_row(1, 1, None)])[0]


@pytest.mark.skipif(contention.sample() is None, reason="needs /proc/stat (Linux)")
def test_a_cpu_hog_beside_the_timing_is_measured():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the hog is spinning
        before = contention.sample()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # this process busy too: its time is not "other"
            pass
        other = contention.other_cores(before, contention.sample())
    finally:
        hog.kill()
        hog.wait()
    # the hog holds a core (less when the machine has one core for two spinners)
    assert other is not None and other >= (0.5 if len(os.sched_getaffinity(0)) > 1 else 0.3)
    assert other < len(os.sched_getaffinity(0)) + contention.SLACK_CORES
