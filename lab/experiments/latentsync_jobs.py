"""Notebook 07, section 5: what keeping the engine across jobs saves. A new Python process runs two jobs the way a
one-job-per-process command would start (imports, engine from a checkpoint, runners, the first job), then a second
job on the engine it kept. The child reports each stage as it ends, so the cell shows a line per stage with the
elapsed time instead of a minute of silence."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lab.pipelines import latentsync as P
from lab.pipelines.latentsync import sampling
from lab.progress import step

if TYPE_CHECKING:
    from lab.experiments.latentsync import Context

PROGRESS = "@progress "   # the child's stage lines, echoed by the parent as they arrive


def _child(spec_env: dict[str, str]) -> tuple[int, list[str]]:
    """Run the job process, echoing its stage lines as they come; (return code, every other output line)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-c", "from lab.experiments.latentsync_jobs import _job_process; _job_process()"]
    proc = subprocess.Popen(cmd, env=spec_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    lines = []
    for line in proc.stdout:
        if line.startswith(PROGRESS):
            step("new process: " + line[len(PROGRESS):].strip())
        else:
            lines.append(line.rstrip("\n"))
    return proc.wait(), lines


def _say(what: str, t0: float) -> None:
    print(f"{PROGRESS}{what} ({time.perf_counter() - t0:.1f} s)", flush=True)


def job_costs(ctx: Context) -> list[dict]:
    """What keeping the engine across jobs saves (the write-up's runner that reuses the loaded model). A new Python
    process runs two jobs the way a one-job-per-process command would start: imports, the engine built from a UNet
    checkpoint in the release's layout (`state_dict` under a top-level key, fp32, written here with this run's draw:
    same seed, same device), the VAE and Whisper built, the fast runners built with inductor's and Triton's on-disk
    caches empty, the first job (exact20); then a second job on the engine it kept. Same frames and audio as the
    modes. Each stage timed in that process; its first job's latents against its second's."""
    import dataclasses
    import json
    import os
    import tempfile

    from lab.experiments.latentsync import _no_time_for_a_compile, job_config
    from lab.models.latentsync import load_latentsync_unet

    late = _no_time_for_a_compile(ctx) if ctx.prof.full_gpu else None
    if late:
        ctx.res.tables["jobs"] = [{"job": "a job in a new process", "status": late}]
        return ctx.res.tables["jobs"]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        step("writing a UNet checkpoint in the release's layout")
        # the kept model's attention and norms are fused (other keys): the release layout comes from a new draw, same seed
        unet = load_latentsync_unet("random", ctx.prof.size, device=ctx.dev, dtype=torch.float32, seed=ctx.seed)
        ckpt = Path(tmp) / "latentsync_unet.pt"
        torch.save({"state_dict": {k: v.cpu() for k, v in unet.model.state_dict().items()}}, ckpt)
        del unet
        write_s = time.perf_counter() - t0
        cfg = job_config(ctx, {"unet": str(ckpt), "vae": "random", "whisper": "random"})
        spec = {"cfg": dataclasses.asdict(cfg), "device": str(ctx.dev), "sr": ctx.sr,
                "inputs": str(Path(tmp) / "inputs.npz")}
        np.savez(spec["inputs"], frames=ctx.frames, audio=ctx.audio)
        env_vars = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                        TRITON_CACHE_DIR=str(Path(tmp) / "triton"), LAB_JOB_SPEC=json.dumps(spec))
        step(f"checkpoint written ({write_s:.1f} s); a new Python process: imports, engine, runners, two jobs")
        t0 = time.perf_counter()
        code, out = _child(env_vars)
        process_s = time.perf_counter() - t0
    if code != 0:
        why = ([x for x in out if x.strip()] or ["no output"])[-1][:200]
        ctx.res.tables["jobs"] = [{"job": "a job in a new process", "status": f"failed: {why}"}]
        return ctx.res.tables["jobs"]
    d = json.loads(next(x for x in reversed(out) if x.startswith("{")))   # the last JSON line (warnings share the pipe)
    first = d["import_s"] + d["build_s"] + d["first_job_s"]
    rows = [{"job": "first job in a new process: imports + engine from the checkpoint + runners + the job",
             "wall_s": first, "import_s": d["import_s"], "build_s": d["build_s"], "job_s": d["first_job_s"],
             "x_kept": first / d["second_job_s"], "status": "ok"},
            {"job": "next job on the engine it kept", "wall_s": d["second_job_s"], "job_s": d["second_job_s"],
             "x_kept": 1.0, "status": "ok"}]
    ctx.res.tables["jobs"] = rows
    ctx.res.metrics["jobs"] = d | {"checkpoint_write_s": write_s, "process_wall_s": process_s,
                                   "fast": sampling.BACKEND[cfg.runtime],
                                   "compile_caches": "empty (fresh inductor and Triton cache folders)"}
    ctx.partial()
    return rows


def _job_process() -> None:
    """The child of `job_costs`: the spec from LAB_JOB_SPEC, one JSON line of stage times on stdout."""
    import json
    import os

    import psutil

    from lab.timing import sync

    import_s = time.time() - psutil.Process().create_time()   # the interpreter's start to here: the imports
    spec = json.loads(os.environ["LAB_JOB_SPEC"])
    cfg = P.Config(**spec["cfg"])
    dev = torch.device(spec["device"])
    ins = np.load(spec["inputs"])
    frames, audio = ins["frames"], ins["audio"]
    print(f"{PROGRESS}imports done ({import_s:.1f} s since the interpreter started)", flush=True)
    t0 = time.perf_counter()
    eng = P.build(cfg, dev)
    sync(dev)
    build_s = time.perf_counter() - t0
    _say("engine built from the checkpoint", t0)
    out = {"import_s": import_s, "build_s": build_s, "unet_weights": eng.weights.get("latentsync_unet")}
    lat = []
    for key in ("first_job_s", "second_job_s"):
        t0 = time.perf_counter()
        rep = P.run(eng, P.prepare(eng, frames), audio, spec["sr"], keep_faces=True)
        sync(dev)
        out[key] = time.perf_counter() - t0
        _say(("first job" if key == "first_job_s" else "second job, on the engine it kept"), t0)
        lat.append(rep.latents)
    out["second_equals_first"] = bool(torch.equal(lat[0], lat[1]))
    print(json.dumps(out), flush=True)
