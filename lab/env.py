"""Hardware + software fingerprint: the provenance block of every Result.

Also says which acceleration backends can run here, with the reason when one cannot, so an
experiment can skip it and say why instead of failing.
"""
from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata as md
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from lab.errors import BackendUnavailable

ROOT = Path(__file__).resolve().parent.parent


def pick_device(device: str = "auto") -> torch.device:
    """'auto' → cuda when present, else cpu. Asking for cuda on a machine without one is an error."""
    from lab.errors import InputError

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device={device!r} was asked for but no CUDA GPU is visible; use device='cpu' or 'auto'")
    return d


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """Short commit of the checkout (+ '-dirty'); LAB_GIT_COMMIT stands in where no .git travelled (GPU host)."""
    if os.environ.get("LAB_GIT_COMMIT"):
        return os.environ["LAB_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_info() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    i = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(i)
    return {"name": p.name, "sm": f"sm_{p.major}{p.minor}", "capability": [p.major, p.minor],
            "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
            "count": torch.cuda.device_count()}


def arch_tag() -> str:
    """'sm_90' on an H100/H200, 'cpu' without a GPU: the key engine caches are filed under."""
    g = gpu_info()
    return g["sm"] if g else "cpu"


def _check(name: str, fn) -> dict[str, Any]:
    try:
        detail = fn()
        return {"backend": name, "available": True, "detail": detail or ""}
    except Exception as e:  # the reason is the point: report it, never raise
        return {"backend": name, "available": False, "detail": f"{type(e).__name__}: {e}".strip()[:300]}


def _cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch")
    return f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"


def _compile():
    import torch._dynamo  # noqa: F401

    from torch._inductor import config  # noqa: F401

    if torch.cuda.is_available():
        import triton

        return f"inductor with triton {triton.__version__}"
    # inductor on CPU generates C++; it needs a compiler
    import shutil

    cc = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
    if not cc:
        raise RuntimeError("inductor on CPU needs a C++ compiler (g++/clang++) on PATH")
    return f"inductor (CPU, C++ via {cc})"


def _cudagraph():
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA GPU")
    return "torch.cuda.CUDAGraph"


def _onnxruntime():
    ort = importlib.import_module("onnxruntime")
    return f"onnxruntime {ort.__version__}: {', '.join(ort.get_available_providers())}"


def _tensorrt():
    trt = importlib.import_module("tensorrt")
    if not hasattr(trt, "Builder"):
        raise ImportError("the 'tensorrt' package here is a stub without the builder (install NVIDIA's wheels)")
    if not torch.cuda.is_available():
        raise RuntimeError("TensorRT needs a CUDA GPU")
    return f"TensorRT {trt.__version__}"


def _fp8():
    if not torch.cuda.is_available():
        raise RuntimeError("FP8 matrix multiply needs a CUDA GPU with compute capability >= 8.9")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise RuntimeError(f"compute capability {cap[0]}.{cap[1]} < 8.9: no FP8 tensor cores")
    return "torch._scaled_mm (float8_e4m3fn)"


def _encoder():
    import imageio_ffmpeg

    return f"ffmpeg {imageio_ffmpeg.get_ffmpeg_version()} at {imageio_ffmpeg.get_ffmpeg_exe()} (imageio-ffmpeg)"


def require_encoder(what: str) -> None:
    """Refuse at once where `what` will encode video and cannot: a run that times renderers for minutes must not
    find the missing encoder at its first end-to-end row."""
    row = _check("video encoder", _encoder)
    if not row["available"]:
        raise BackendUnavailable(f"the video encoding of {what} needs ffmpeg through imageio-ffmpeg, which is not "
                                 f"usable here ({row['detail']}); install it: pip install imageio-ffmpeg")


@lru_cache(maxsize=1)
def backends() -> list[dict[str, Any]]:
    """Which backends can run here; `detail` carries the reason for the ones that cannot."""
    return [_check("cuda", _cuda), _check("torch.compile", _compile), _check("cuda graphs", _cudagraph),
            _check("fp8 matmul", _fp8), _check("onnxruntime", _onnxruntime), _check("tensorrt", _tensorrt),
            _check("video encoder", _encoder)]


def fingerprint() -> dict[str, Any]:
    """Machine + versions. Cheap enough to call once per Result."""
    return {
        "host": platform.node(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu_info(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "versions": {d: _version(d) for d in ("torchaudio", "diffusers", "transformers", "onnxruntime",
                                               "numpy", "tensorrt", "face-alignment", "talking-head-lab")},
    }


def machine_label() -> str:
    """One line for tables and figure titles: 'NVIDIA H200 (sm_90)' or 'CPU: <model>'."""
    g = gpu_info()
    return f"{g['name']} ({g['sm']})" if g else f"CPU: {_cpu_name()} ×{os.cpu_count()}"


def provenance(**extra: Any) -> dict[str, Any]:
    d = {"machine": machine_label(), "fingerprint": fingerprint(), "backends": backends(),
         "git_commit": git_commit(), "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    d.update(extra)
    return d
