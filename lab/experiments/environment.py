"""Notebook 00: what this machine is, what it can run, how fast it can go.

    run = start(globals())          # checked parameters, device, run folder
    fingerprint(run)                # GPU / CPU / versions table
    backends(run)                   # which backends run here, and why not for the others
    ceil = measure_ceilings(run)    # dense matmul per dtype + copy bandwidth (headline)
    ceilings_figure(run, ceil)
    compare(run, ceil)              # the datasheet figure beside ours
    inputs_figure(run)              # the bundled speech (waveform + log-mel) and avatar
    finish(run)                     # results.json
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lab import data, env, params
from lab.experiments.common import Run
from lab.experiments.common import start as _start
from lab.plots import table_markdown, title_suffix
from lab.timing import ceilings

NAME = "00_environment"

RULES: dict[str, params.Rule] = {}  # only the common knobs (device, quick, seed, out_dir)

H200_BF16_TFLOPS = 990.0  # NVIDIA's datasheet, dense bf16 (H200 SXM)


def profile(p: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Nothing to decide here: `lab.timing.ceilings` picks the matmul and copy sizes from `quick` and
    the device (n = 8192 on a GPU, 1024 on a CPU; 1024 / 256 quick) and reports the n it ran."""
    return p


def start(namespace: dict[str, Any]) -> Run:
    return _start(NAME, namespace, RULES, profile)


def describe(run: Run) -> str:
    return f"device: {run.device} | {run.machine} | run folder: {run.folder}"


def _md(rows: list[dict], floatfmt: str = ".4g") -> Any:
    from lab.experiments.common import markdown as Markdown

    return Markdown(table_markdown(rows, floatfmt=floatfmt))


def fingerprint_rows() -> list[dict[str, Any]]:
    fp = env.fingerprint()
    rows = [{"item": k, "value": v} for k, v in fp.items() if k != "versions"]
    return rows + [{"item": f"version: {k}", "value": v or "not installed"} for k, v in fp["versions"].items()]


def fingerprint(run: Run) -> Any:
    """The machine and versions (the provenance block every Result carries), as a table."""
    return _md(fingerprint_rows())


def backends(run: Run) -> Any:
    """Which backends can run here; kept in metrics["backends"] with the reason for the others."""
    bk = env.backends()
    run.result.metrics["backends"] = bk
    return _md(bk)


def measure_ceilings(run: Run) -> dict[str, Any]:
    """Dense matmul TFLOP/s per dtype and copy GB/s, measured here; into metrics and the headline."""
    ceil = ceilings(run.device, quick=run.quick)
    run.result.metrics["ceilings"] = ceil
    run.headline(**{f"matmul {k} TFLOP/s": _sig(v) for k, v in ceil["matmul_tflops"].items()})
    run.headline(**{"copy GB/s": round(ceil["copy_gbps"], 0)})
    return ceil


def _sig(v: float, digits: int = 3) -> float:
    """`v` to `digits` significant figures: a CPU's 0.04 TFLOP/s stays 0.04, not 0.0."""
    return float(f"{v:.{digits}g}")


def ceilings_rows(ceil: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"dtype": k, "TFLOP/s": v} for k, v in ceil["matmul_tflops"].items()]
    rows += [{"dtype": k, "TFLOP/s": f"unavailable: {v}"} for k, v in ceil["unavailable"].items()]
    return rows + [{"dtype": "device copy (GB/s, read + write)", "TFLOP/s": ceil["copy_gbps"]}]


def ceilings_table(ceil: dict[str, Any]) -> Any:
    return _md(ceilings_rows(ceil), floatfmt=".3g")


def ceilings_figure(run: Run, ceil: dict[str, Any]) -> Any:
    """Bar chart of the measured matmul rates (ceilings.png)."""
    import matplotlib.pyplot as plt

    rates = ceil["matmul_tflops"]
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.bar(list(rates), list(rates.values()), color="#4c72b0")
    for i, v in enumerate(rates.values()):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("TFLOP/s (measured)")
    quick = " · QUICK" if run.quick else ""
    ax.set_title(f"dense matmul n={ceil['matmul_n']}{title_suffix(machine=run.machine)}{quick}", fontsize=9)
    fig.tight_layout()
    return run.figure(fig, "ceilings")


def compare(run: Run, ceil: dict[str, Any]) -> Any:
    """The H200 datasheet's dense bf16 rate beside ours; a verdict only for a full-size run on an H200.
    Returns the comparison table (re-running replaces the row)."""
    gpu = env.gpu_info()
    ours = ceil["matmul_tflops"].get("bf16")
    row = dict(source="NVIDIA H200 datasheet", claim="dense bf16 matmul rate", their_value=H200_BF16_TFLOPS,
               their_hardware="H200 SXM (datasheet)", our_hardware=run.machine, unit="TFLOP/s")
    run.result.comparisons = []
    if gpu and "H200" in gpu["name"] and ours is not None and not run.quick:
        run.result.compare(**row, our_value=round(ours, 1),
                           verdict="reproduced" if ours > 0.7 * H200_BF16_TFLOPS else "differs",
                           reason=f"measured {100 * ours / H200_BF16_TFLOPS:.0f}% of the datasheet peak on random "
                                  f"data, n={ceil['matmul_n']}")
    else:
        run.result.compare(**row, our_value=ours, verdict="not comparable",
                           reason="not measured on an H200 at full size" + (" (quick profile)" if run.quick else ""))
    return _md([c.__dict__ for c in run.result.comparisons])


def log_mel(audio16: np.ndarray) -> np.ndarray:
    """Whisper's front end: 80 mel bins, 25 ms window, 10 ms hop at 16 kHz, log10."""
    import torchaudio

    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)(torch.from_numpy(audio16))
    return torch.log10(mel.clamp(min=1e-10)).numpy()


def inputs_figure(run: Run) -> Any:
    """The bundled speech (waveform, log-mel) and avatar photo (inputs.png); their facts into metrics."""
    import matplotlib.pyplot as plt

    audio, sr = data.default_audio()
    audio16, _ = data.default_audio(sr=16000)
    logmel = log_mel(audio16)
    avatar = data.default_avatar()
    fig = plt.figure(figsize=(11, 3.2))
    ax1 = fig.add_axes([0.04, 0.58, 0.62, 0.36])
    ax2 = fig.add_axes([0.04, 0.12, 0.62, 0.36])
    ax3 = fig.add_axes([0.70, 0.08, 0.28, 0.88])
    t = np.arange(len(audio)) / sr
    ax1.plot(t, audio, lw=0.4)
    ax1.set_xlim(0, t[-1])
    ax1.set_xticks([])
    ax1.set_title(f"{data.DEFAULT_AUDIO.name}: {len(audio) / sr:.2f} s at {sr} Hz", fontsize=8)
    ax2.imshow(logmel, origin="lower", aspect="auto", extent=[0, t[-1], 0, 80])
    ax2.set_ylabel("mel bin")
    ax2.set_xlabel("s")
    ax3.imshow(avatar)
    ax3.axis("off")
    ax3.set_title(f"default avatar {avatar.shape[1]}×{avatar.shape[0]}", fontsize=8)
    run.result.metrics["audio"] = {"file": data.DEFAULT_AUDIO.name, "seconds": len(audio) / sr, "sample_rate": sr}
    run.result.metrics["avatar_shape"] = list(avatar.shape)
    return run.figure(fig, "inputs")


def finish(run: Run) -> Any:
    """results.json into the run folder; returns the headline table."""
    run.save()
    return run.show_headline()
