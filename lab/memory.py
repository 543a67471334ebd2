"""Host and GPU memory of this process: current and peak RSS (Linux /proc), a resettable peak.

Peak RSS is the kernel's high-water mark (VmHWM), which `reset_peak` sets back to the current RSS
(writing 5 to /proc/self/clear_refs, Linux ≥ 4.0), so a peak can be taken over one call alone,
not over everything the process did before it. RSS counts every resident page, including
memory that torch or numpy allocated outside Python's allocator (tracemalloc sees only part of it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from lab.errors import BackendUnavailable

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    raise BackendUnavailable(f"{key} is not readable from {_STATUS} (RSS figures need Linux /proc)")


def rss_bytes() -> int:
    """Resident set size now."""
    return 1024 * _status_kib("VmRSS")


def peak_rss_bytes() -> int:
    """Resident set size high-water mark since the process started or the last `reset_peak`."""
    return 1024 * _status_kib("VmHWM")


def reset_peak(device: torch.device | str | None = None) -> int:
    """Set the RSS high-water mark (and the CUDA allocator's peak, for a CUDA device) back to now;
    returns the RSS now."""
    try:
        _CLEAR.write_text("5")
    except OSError as e:
        raise BackendUnavailable(f"cannot reset the peak RSS through {_CLEAR}: {e}") from None
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    return rss_bytes()


def gpu_peak_bytes(device: torch.device | str | None) -> int | None:
    """The CUDA caching allocator's peak allocated bytes since the last reset (None off CUDA)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))
