"""What a rank measures about itself, from the Linux kernel's own counters.

Every implementation (one process, DDP, torch FSDP2, fsdp_compose) is measured the
same way, without instrumenting its code:

* **Memory**: the resident-set high-water mark ``VmHWM`` of ``/proc/self/status``,
  reset by writing ``5`` to ``/proc/self/clear_refs`` after ``malloc_trim(0)`` has
  returned freed heap pages to the kernel. ``VmHWM - RSS at reset`` is the memory
  the training steps added on top of what setup left resident.
* **Blocked time** (exposed communication): the kernel's per-thread scheduler
  statistics ``/proc/thread-self/schedstat`` give the nanoseconds the thread ran
  on a CPU and the nanoseconds it was runnable but waiting for a CPU. Wall time
  minus both is the time the thread *slept*: on these CPU-only training steps the
  only thing that puts the training thread to sleep is waiting for a collective
  (gloo's ``Work.wait()`` blocks on a condition variable, it does not spin), so
  this is communication that computation did not hide. It is immune to CPU
  oversubscription (time spent preempted is counted as run delay, not sleep).
* **Loopback traffic**: the ``lo`` byte counters of ``/proc/net/dev``. Every byte
  one rank sends to another over loopback is counted once in ``lo``'s transmit
  counter (and once in its receive counter), for all ranks together.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from dataclasses import dataclass

_libc: ctypes.CDLL | None = None


def malloc_trim() -> None:
    """Returns free heap memory to the kernel (glibc), so RSS reflects live data."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _libc.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Resident-set high-water mark since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> int:
    """Trims the heap, resets ``VmHWM`` to the current RSS, returns that RSS."""
    malloc_trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # "5" resets the peak RSS counter (see proc(5))
    return rss_bytes()


def loopback_tx_bytes() -> int:
    """Bytes transmitted on the loopback interface since boot (all processes)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # rx: 8 fields, then tx bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


@dataclass
class ThreadTimes:
    """Wall, on-CPU and run-queue time of one thread, in seconds."""

    wall: float
    on_cpu: float
    run_delay: float

    @property
    def blocked(self) -> float:
        """Time the thread slept (waited on something other than a CPU)."""
        return max(0.0, self.wall - self.on_cpu - self.run_delay)

    def __sub__(self, other: ThreadTimes) -> ThreadTimes:
        return ThreadTimes(
            self.wall - other.wall, self.on_cpu - other.on_cpu, self.run_delay - other.run_delay
        )


def thread_times() -> ThreadTimes:
    """A snapshot for the calling thread (take differences of two snapshots)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        _on_cpu_ns, run_delay_ns, _slices = (int(v) for v in f.read().split())
    # schedstat's on-CPU field of a *running* thread is only brought up to date at
    # scheduler ticks, so it is read from CLOCK_THREAD_CPUTIME_ID instead (exact).
    # The run delay is exact: it only grows while the thread is not running.
    return ThreadTimes(time.perf_counter(), time.thread_time(), run_delay_ns / 1e9)


def schedstat_available() -> bool:
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")
