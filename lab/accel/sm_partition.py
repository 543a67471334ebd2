"""Split one GPU's SMs between two CUDA streams (CUDA green contexts), so that a latency-bound model and a
throughput-bound one run side by side without waiting for each other's SMs.

Why: a high-priority stream only changes which *queued* thread blocks start first. A chain of thousands of
tiny kernels (Ditto's motion DiT: ~10 000 launches per window, each a few µs) still waits, kernel after
kernel, for an SM that the other stream's large kernels have filled. With the SMs partitioned, the small
chain owns a few SMs outright and the large kernels run on the rest.

    small, large = split_streams(16, device)       # two torch streams: 16 SMs | the remaining SMs
    with torch.cuda.stream(small): ...             # kernels (and graphs captured here) use those SMs only

The SM counts are rounded by the driver to its partition granularity (8 SMs on sm_90); `Partition.sms`
says what was granted. Work captured into a CUDA graph on one of the streams keeps that stream's SMs when
replayed on it. Needs a CUDA 12.4+ driver with the green-context API (`libcuda`'s `cuGreenCtxCreate`);
otherwise `BackendUnavailable` says why, and callers fall back to plain streams.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.errors import BackendUnavailable, InputError

_RESOURCE_BYTES = 256          # CUdevResource is 144 bytes in CUDA 12 and a little more in 13: room for both
_SM_COUNT_OFFSET = 96          # after the resource type (4 bytes) and 92 bytes of internal padding
_TYPE_SM = 1                   # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM (required by cuGreenCtxCreate)
_STREAM_NON_BLOCKING = 1       # CU_STREAM_NON_BLOCKING (required by cuGreenCtxStreamCreate)


@dataclass
class Partition:
    """Two streams on disjoint SM sets of one GPU (keep the object alive while they are used)."""

    small: torch.cuda.Stream
    large: torch.cuda.Stream
    sms: tuple[int, int]                     # SMs granted to (small, large)
    total_sms: int
    _keep: list[Any] = field(default_factory=list, repr=False)


_CACHE: dict[tuple[int, int], Partition] = {}


def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise BackendUnavailable(f"SM partition: the CUDA driver library cannot be loaded ({exc})") from None
    for name in ("cuDeviceGetDevResource", "cuDevSmResourceSplitByCount", "cuDevResourceGenerateDesc",
                 "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
        if not hasattr(lib, name):
            raise BackendUnavailable(f"SM partition: this CUDA driver has no {name} (green contexts need a "
                                     f"CUDA 12.4+ driver)")
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise BackendUnavailable(f"SM partition: {what} failed with CUDA driver error {rc}")


def split_streams(small_sms: int, device: torch.device | str | int = "cuda") -> Partition:
    """Two streams whose kernels run on disjoint SMs: `small_sms` (rounded up by the driver) and the rest.
    Cached per (device, small_sms): green contexts are created once per process."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise BackendUnavailable(f"SM partition: needs a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("SM partition: no CUDA GPU visible to torch")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not isinstance(small_sms, int) or isinstance(small_sms, bool) or not 0 < small_sms < total:
        raise InputError(f"small_sms={small_sms!r}: expected an int between 1 and {total - 1} "
                         f"(this GPU has {total} SMs)")
    key = (index, small_sms)
    if key in _CACHE:
        return _CACHE[key]
    torch.cuda.init()
    torch.zeros(1, device=dev)              # the primary context exists before green ones are made from it
    lib = _driver()
    cu_dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(cu_dev), ctypes.c_int(index)), "cuDeviceGet")
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    _check(lib.cuDeviceGetDevResource(cu_dev, whole, ctypes.c_int(_TYPE_SM)), "cuDeviceGetDevResource")
    group = ctypes.create_string_buffer(_RESOURCE_BYTES)
    rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
    n_groups = ctypes.c_uint(1)
    _check(lib.cuDevSmResourceSplitByCount(group, ctypes.byref(n_groups), whole, rest, ctypes.c_uint(0),
                                           ctypes.c_uint(small_sms)), "cuDevSmResourceSplitByCount")
    if n_groups.value != 1:
        raise BackendUnavailable(f"SM partition: the driver could not split off {small_sms} SMs of {total}")
    streams, keep = [], [lib]
    for res in (group, rest):
        desc = ctypes.c_void_p()
        _check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), res, ctypes.c_uint(1)), "cuDevResourceGenerateDesc")
        ctx = ctypes.c_void_p()
        _check(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, cu_dev, ctypes.c_uint(_GREEN_CTX_DEFAULT_STREAM)),
               "cuGreenCtxCreate")
        stream = ctypes.c_void_p()
        _check(lib.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, ctypes.c_uint(_STREAM_NON_BLOCKING),
                                          ctypes.c_int(0)), "cuGreenCtxStreamCreate")
        keep += [ctx, stream]
        streams.append(torch.cuda.ExternalStream(stream.value, device=dev))
    sms = tuple(int.from_bytes(r.raw[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4], "little") for r in (group, rest))
    part = Partition(small=streams[0], large=streams[1], sms=sms, total_sms=total, _keep=keep)
    _CACHE[key] = part
    return part
