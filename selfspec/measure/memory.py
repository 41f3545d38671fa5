"""Peak memory of a block of code, on a GPU or for the whole CPU process."""

from __future__ import annotations

import os
import platform
import resource
import threading

import torch


class PeakMemory:
    """Peak memory while the block runs, in MiB (`peak_mb`), and what was measured (`kind`):

    - cuda_max_allocated: torch.cuda.max_memory_allocated, its peak reset on entry (tensors
      only, not the allocator's cache);
    - cpu_peak_rss_sampled: the process's resident set size (weights, caches, Python), read
      from /proc every `interval_s` by a thread: short spikes between samples can be missed;
    - cpu_lifetime_peak_rss: where /proc is missing, the process's peak RSS since it started.
    """

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.02):
        self.device, self.interval_s = torch.device(device), interval_s
        self.peak_mb, self.kind = 0.0, ""
        self._peak, self._done, self._thread = 0, threading.Event(), None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            self.kind = "cuda_max_allocated"
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _rss_bytes() is not None:
            self.kind = "cpu_peak_rss_sampled"
            self._peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        else:
            self.kind = "cpu_lifetime_peak_rss"
        return self

    def __exit__(self, *exc) -> None:
        if self.kind == "cuda_max_allocated":
            self._peak = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is not None:
            self._done.set()
            self._thread.join()
            self._peak = max(self._peak, _rss_bytes() or 0)
        else:  # ru_maxrss is KiB on Linux, bytes on macOS
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self._peak = rss if platform.system() == "Darwin" else rss * 1024
        self.peak_mb = self._peak / 2**20

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self._peak = max(self._peak, _rss_bytes() or 0)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
