"""The SD-VAE decoder's FP8 tier on its fastest exact build: notebook 02's best decoder with FP8 resnet convs.

    python -m lab.experiments.fp8_decoder --json fp8_decoder.json          # a GPU, full size, random weights
    result = measure(vae, batch=16)                                         # the same from a notebook

Builds notebook 02's `compile_subpixel_graph` decoder (subpixel upsamplers, GroupNorm + SiLU as Triton passes, cuDNN
graph convs with the skip adds in their epilogues, compiled into CUDA graphs) twice: as is (the exact row) and with
`lab.techniques.fp8_resnet` (each resnet conv in FP8 e4m3 where its kernel is measurably faster, fed in FP8 by the
norm pass before it, static scales calibrated on latents other than the timed ones). Each row: FPS at the median of
`repeats` timed decodes with their min–max, and the FP8 row's PSNR / SSIM / cosine against the exact row's images and
against the strict fp32 decode. On seeded random weights and random latents: the speed is the engine's, the error a
bound on the arithmetic, not a quality finding.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

import torch

from lab import metrics
from lab.errors import BackendUnavailable, InputError
from lab.experiments import decoders as D
from lab.progress import step as progress_step
from lab.timing import bench
from lab.techniques import fp8_resnet

BASE = "compile_subpixel_graph"   # notebook 02's fastest exact SD-VAE build (its variants table)
LATENT_HW = 32                    # MuseTalk's 256² faces


RESNET_CONVS = ("fp16", "fp8")   # the resnet blocks' convs: as the exact build runs them, or lab.techniques.fp8_resnet
EAGER_TWIN = "cuda_graph_subpixel_graph"   # BASE's rewrites without torch.compile: with graph=False, the module itself


def build(vae: Any, example: torch.Tensor, calibration: Sequence[torch.Tensor] = (), resnet_convs: str = "fp16",
          compile: bool = True) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, Any]]:
    """Notebook 02's BASE build (`decoders.build_decoder`: fp16, channels-last), its resnet convs in FP8 if
    `resnet_convs` is "fp8" (calibrated on `calibration`); compiled into CUDA graphs on a GPU when `compile`, else the
    same rewrites eager. Returns (decode, report: the variant built, the blocks' rows and kernel times, the rewritten
    decoder)."""
    if resnet_convs not in RESNET_CONVS:
        raise InputError(f"resnet_convs must be one of {RESNET_CONVS}, got {resnet_convs!r}")
    report: dict[str, Any] = {"blocks": [], "times": [], "module": None}

    def then(dec: torch.nn.Module) -> None:   # on the built module, before torch.compile sees it
        report["module"] = inner = dec.model.decoder
        if resnet_convs == "fp8":
            amax = fp8_resnet.calibrate(inner, calibration, call=dec)
            only = None
            if example.is_cuda:   # a block stays fp16 where FP8 does not pay (measured); a CPU keeps every block
                report["times"] = fp8_resnet.block_times(inner, amax)
                only = fp8_resnet.keep_faster(report["times"])
            report["blocks"] = fp8_resnet.fp8_resnets(inner, amax, only)

    compiled = compile and example.is_cuda
    report["variant"] = BASE if compiled else f"{EAGER_TWIN}, eager"
    with torch.inference_mode():
        fn = D.build_decoder(vae, BASE if compiled else EAGER_TWIN, "fp16", example, graph=compiled, then=then)
    return fn, report


def _quality(out: torch.Tensor, ref: torch.Tensor, prefix: str) -> dict[str, float]:
    a, b = out.float().cpu().clamp(0, 1), ref.float().cpu().clamp(0, 1)
    return {f"psnr_vs_{prefix}_db": metrics.psnr(a, b, 1.0), f"ssim_vs_{prefix}": metrics.ssim(a, b, 1.0),
            f"cosine_vs_{prefix}": metrics.cosine(a, b)}


def measure(vae: Any, batch: int = 16, repeats: int = 20, seed: int = 0, compile: bool = True,
            latent_hw: int = LATENT_HW) -> dict[str, Any]:
    """The exact and FP8 rows (FPS median of `repeats` with min–max, the FP8 row's error) and the FP8 build's
    per-block report. Timed latents, calibration latents and the scored latents are distinct sets."""
    dev = next(vae.model.parameters()).device
    timed = D.random_latents(batch, latent_hw, 4, seed=seed + 1, device=dev, dtype=torch.float16)
    calib = D.random_latents(batch, latent_hw, 2, seed=seed + 2, device=dev, dtype=torch.float16)
    timed = [z.contiguous(memory_format=torch.channels_last) for z in timed]
    fp32 = D._reference(vae, timed[0])
    rows, outs, report = [], {}, {}
    with D._flags(cudnn_benchmark=True):   # as notebook 02 builds it: the upsamplers' transposed convs are torch's
        for name, convs in (("exact", "fp16"), ("fp8 resnet convs", "fp8")):
            rows.append(_row(vae, name, convs, timed, calib, batch, repeats, compile, fp32, outs, report))
    rows[1]["speedup_vs_exact"] = rows[1]["fps"] / rows[0]["fps"]
    from lab.runtime import cudnn_graph

    return {"rows": rows, "blocks": report.get("blocks", []), "times": report.get("times", []),
            "fallbacks": cudnn_graph.notes(),   # specs cuDNN declined (torch ran them): none, if the speed is cuDNN's
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}


def _row(vae: Any, name: str, convs: str, timed: Sequence[torch.Tensor], calib: Sequence[torch.Tensor], batch: int,
         repeats: int, compile: bool, fp32: torch.Tensor, outs: dict[str, torch.Tensor], report: dict[str, Any]
         ) -> dict[str, Any]:
    """One build timed and scored (the FP8 one also against the exact one's images, its report kept in `report`)."""
    dev = timed[0].device
    progress_step(f"sd-vae {name}: build …")
    fn, rep = build(vae, timed[0], calib, resnet_convs=convs, compile=compile)
    with torch.inference_mode():
        outs[name] = fn(timed[0]).float().cpu()
    progress_step(f"sd-vae {name}: {repeats} timed decodes …")
    b = bench(fn, inputs=[(z,) for z in timed], warmup=3, iters=repeats, device=dev)
    row = {"variant": f"{rep['variant']} ({name})", "batch": batch, "fps": batch / b.median_s,
           "fps_min": batch / b.max_s,
           "fps_max": batch / b.min_s, "ms_per_batch": 1e3 * b.median_s, "repeats": b.iters,
           **_quality(outs[name], fp32, "fp32")}
    spread = f"{row['fps_min']:.1f}–{row['fps_max']:.1f}"
    progress_step(f"sd-vae {name}: {row['fps']:.1f} FPS (median of {b.iters}, {spread})")
    if convs == "fp8":
        row.update(_quality(outs[name], outs["exact"], "exact"))
        row["fp8_blocks"] = sum(r["fp8"] for r in rep["blocks"])
        report.update(rep)
    del fn
    torch._dynamo.reset()
    return row


def table(result: dict[str, Any]) -> str:
    """The rows as Markdown, then the blocks' FP8 / fp16 conv times."""
    from lab.plots import table_markdown

    cols = ["variant", "fps", "fps_min", "fps_max", "repeats", "psnr_vs_fp32_db", "psnr_vs_exact_db", "ssim_vs_exact",
            "fp8_blocks", "speedup_vs_exact"]
    text = table_markdown(result["rows"], cols)
    if result["times"]:
        text += "\n\n" + table_markdown(result["times"], ["block", "shape", "fp16_ms", "fp8_ms", "gain"])
    fell = result.get("fallbacks") or []
    text += f"\n\ncuDNN declined {len(fell)} conv spec(s), run by torch: {fell[:3]}" if fell else ""
    return text + f"\n\n{result['device']}, seeded random weights and latents: a speed figure and an arithmetic bound."


HEADLINE = "sd-vae fastest exact build"   # the headline keys' prefix (notebook 03's ledger rows)
EST_S = {"cuda": 150.0, "cpu": 30.0}      # two builds (compile, cuDNN plans, calibration) and their timed decodes


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The two rows as headline figures: both FPS (their spread in the tables), the FP8 row's speed-up over the exact
    one in the same process and its error against it."""
    exact, fp8 = result["rows"]
    return {f"{HEADLINE}: exact FPS": round(exact["fps"], 1), f"{HEADLINE}: FP8 resnet convs FPS": round(fp8["fps"], 1),
            f"{HEADLINE}: FP8/exact speed-up": round(fp8["speedup_vs_exact"], 3),
            f"{HEADLINE}: FP8 PSNR vs exact (dB)": round(fp8["psnr_vs_exact_db"], 2),
            f"{HEADLINE}: FP8 SSIM vs exact": round(fp8["ssim_vs_exact"], 4),
            f"{HEADLINE}: FP8 blocks": fp8["fp8_blocks"]}


def section(run: Any) -> Any:
    """Notebook 03's §3c: `measure` on the run's SD-VAE at its batch and image size (on a CPU batch 2, eager) within
    the time budget; tables `best_build_fp8` and `best_build_fp8_blocks`, headline figures in
    the run's metrics (`finish` adds them). Returns the Markdown shown."""
    from lab.experiments.fp8 import _md
    from lab.models.vae import load_vae
    from lab.runtime import cudnn_graph

    run.budget.section("§3c the fastest exact SD-VAE build with FP8 resnet convs")
    gpu = run.device.type == "cuda"
    why = ("sd-vae is not among `models`" if "sd-vae" not in run.models else
           "" if not gpu else cudnn_graph.available(run.device, "fp8")[1])
    if why:
        return _md(f"*Skipped: {why}.*")

    def go() -> dict[str, Any]:
        vae = load_vae("sd-vae", run.weights["sd-vae"], size=run.size, device=run.device, seed=run.seed)
        return measure(vae, run.batch if gpu else 2, run.iters if gpu else 2, run.seed, compile=gpu,
                       latent_hw=run.image_size // 8)

    r = run.budget.run("sd-vae fastest exact build, FP8 resnet convs", EST_S[run.device.type], go)
    if not r.ok:
        return _md(f"*Not measured ({r.status}): {r.reason}*")
    run.result.tables["best_build_fp8"] = r.value["rows"]
    run.result.tables["best_build_fp8_blocks"] = r.value["times"] or r.value["blocks"]
    run.result.metrics["best_build_fp8"] = {"headline": headline(r.value), "fallbacks": r.value["fallbacks"]}
    return _md(f"**`{BASE}` as is and with FP8 resnet convs** (batch {r.value['rows'][0]['batch']}{run.suffix()})\n\n"
               + table(r.value))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.experiments.fp8_decoder", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20, help="timed decodes per row (median, min–max)")
    ap.add_argument("--size", default="full", help="full (upstream config) or tiny (CPU check)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the result to this file")
    a = ap.parse_args(argv)
    try:
        if a.batch < 1 or a.repeats < 1:
            raise InputError(f"--batch and --repeats must be ≥ 1, got {a.batch} and {a.repeats}")
        if a.device == "cuda":
            from lab.runtime import cudnn_graph

            cudnn_graph.require("cuda", "fp8")
        from lab.models.vae import load_vae

        vae = load_vae("sd-vae", "random", size=a.size, device=a.device)
        result = measure(vae, a.batch, a.repeats, compile=a.device == "cuda")
    except (InputError, BackendUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
