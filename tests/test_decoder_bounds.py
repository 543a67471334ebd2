"""Notebook 02's bounds: the fastest exact SD-VAE decoder's kernel split, what it bounds, and its ledger figures."""
import math
from types import SimpleNamespace

import pytest
import torch

from lab import kernel_time
from lab.experiments import decoder_bounds as B
from lab.experiments import decoders as D
from lab.ledger import rows_from_result
from lab.models.vae import load_vae


def _row(variant, fps, decoder="sd-vae", batch=16, dtype="fp16", status="ok", gflops=300.0):
    return dict(decoder=decoder, variant=variant, fps=fps, batch=batch, dtype=dtype, status=status,
                gflops_per_frame=gflops, ms_per_batch=batch * 1e3 / fps)


ROWS = [_row("eager", 200.0), _row("compile_subpixel_graph", 850.0), _row("compile_subpixel", 700.0),
        _row("compile_subpixel_autotune", 990.0, status="failed"), _row("eager", 3000.0, decoder="taesd"),
        _row("compile_subpixel_graph", 400.0, batch=8)]


class FakeRun:
    def __init__(self, device="cuda", dtype="fp16", batch=16):
        self.device, self.headline_batch, self.headline_dtype = torch.device(device), batch, dtype
        self.result = SimpleNamespace(tables={}, headline={})

    def table(self, name, rows, show=True):
        self.result.tables[name] = [dict(r) for r in rows]

    def headline(self, **kv):
        self.result.headline.update(kv)

    def suffix(self):
        return " · random weights"

    def figure(self, fig, name):
        self.figures = getattr(self, "figures", []) + [name]
        return fig


def test_the_fastest_sd_vae_row_that_ran_is_profiled():
    assert B.profiled_row(ROWS, 16, "fp16")["variant"] == "compile_subpixel_graph"
    assert B.profiled_row(ROWS, 4, "fp16") is None
    wrong = [dict(r, psnr_vs_fp32=35.0) if r["variant"] == "compile_subpixel_graph" else r for r in ROWS]
    assert B.profiled_row(wrong, 16, "fp16")["variant"] == "compile_subpixel"   # not the fast one that is not exact


@pytest.mark.parametrize("device, dtype, rows, why", [
    ("cpu", "fp16", ROWS, "needs a CUDA device"),
    ("cuda", "fp32", ROWS, "headline dtype is fp32"),
    ("cuda", "fp16", ROWS[-2:], "no SD-VAE variant ran at batch 16"),
])
def test_no_split_without_a_gpu_fp16_or_a_row(device, dtype, rows, why):
    run = FakeRun(device, dtype)
    out = B.kernels(run, rows)
    assert out[0]["status"] == "skipped" and why in out[0]["reason"]
    assert "decoder_bound" not in run.result.tables and run.result.headline == {}
    assert "not profiled here" in B.tables_text(run) and B.show(run) is None


def _split(run, variant):
    assert variant == "compile_subpixel_graph"
    events = [(us * 3e3, name, 3) for us, name in ((14.0, "sm90_xmma_fprop_implicit_gemm_f16"),
                                                   (1.0, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"),
                                                   (3.0, "triton_red_fused_native_group_norm_2"),
                                                   (2.0, "triton_poi_fused_add_silu_4"))]
    return kernel_time.rows_of(events, runs=3)


def test_the_split_feeds_the_bound_table_and_the_ledger(monkeypatch):
    monkeypatch.setattr(B, "_split_of", _split)
    monkeypatch.setattr(D, "ceiling_tflops", lambda dtype, dev, quick=False: (750.0, dtype))
    monkeypatch.setattr(B.common, "fp8_matrix_ratio", lambda dev, tf: 1.8 if tf == 750.0 else None)
    run = FakeRun()
    rows = B.kernels(run, ROWS)
    assert [r["kind"] for r in rows][:2] == ["convolution", "Triton reduction (norms)"]
    h = run.result.headline
    assert h["sd-vae kernels: GPU busy per batch (ms)"] == 20.0
    assert h["sd-vae kernels: passes between convolutions per batch (ms)"] == 6.0
    assert h["sd-vae kernels: FPS bound: passes between convolutions free"] == round(16e3 / 14, 1)
    assert h["sd-vae kernels: FPS bound: every convolution sped up by the FP8 / fp16 matrix rate"] == \
        round(16e3 / (6 + 14 / 1.8), 1)
    assert h["sd-vae kernels: time to take off per batch to reach sdvae-exact (ms)"] == round(20 - 16e3 / 1000, 2)
    assert h["sd-vae kernels: time to take off per batch to reach sdvae-fp8 (ms)"] == round(20 - 16e3 / 1200, 2)
    # the timed row's wall time (850 FPS in its graph) against its 20 ms busy: the gaps, and the distance that counts
    assert h["sd-vae kernels: wall time per batch (its timed median) (ms)"] == round(16e3 / 850, 2)
    assert h["sd-vae kernels: gaps between kernels per batch (wall − busy) (ms)"] == round(16e3 / 850 - 20, 2)
    assert h["sd-vae kernels: time to take off the wall time per batch to reach sdvae-exact (ms)"] == \
        round(16e3 / 850 - 16, 2)
    # 300 GFLOP per frame × 16 over 15 ms in convs and attention
    assert h["sd-vae kernels: TFLOP/s in the matrix kernels (convolution, GEMM, attention)"] == 320.0
    assert h["sd-vae kernels: matrix kernels' rate as % of the measured fp16 matrix rate"] == round(32000 / 750, 2)
    led = {r.metric: (r.value, r.unit) for r in rows_from_result({"headline": h}, "02_taesd_vs_vae", "lab run 02")}
    assert len(led) == len(h) and all(math.isfinite(v) for v, _ in led.values())
    units = {k.split(": ", 1)[1]: u for k, (_, u) in led.items()}
    assert units["GPU busy per batch (ms)"] == "ms" and units["FP8 / fp16 matrix-rate ratio"] == "×"
    assert units["TFLOP/s in the matrix kernels (convolution, GEMM, attention)"] == "TFLOP/s"
    assert units["matrix kernels' rate as % of the measured fp16 matrix rate"] == "%"
    assert all(u == "FPS" for k, u in units.items() if "FPS" in k)
    text = B.tables_text(run)
    assert "compile_subpixel_graph" in text and "What that split bounds" in text and "random weights" in text
    fig = B.show(run)
    assert run.figures == ["decoder_kernels"] and fig.axes[0].get_title().startswith("sd-vae decoder")


def test_a_failing_split_is_a_row_with_its_reason(monkeypatch):
    def broken(run, variant):
        raise RuntimeError("cuDNN declined the plan")

    monkeypatch.setattr(B, "_split_of", broken)
    run = FakeRun()
    out = B.kernels(run, ROWS)
    assert out[0]["status"] == "failed" and "cuDNN declined the plan" in out[0]["reason"]
    assert "decoder_bound" not in run.result.tables and run.result.headline == {}


def test_no_matrix_rate_without_flops_or_matrix_kernels():
    no_matrix = {"FFT": 2.0, "total": 2.0}
    figs = [r["figure"] for r in B.bound_rows(no_matrix, {"gflops_per_frame": 300.0}, 16, None, None, [])]
    assert not any("TFLOP/s" in f for f in figs)
    figs = [r["figure"] for r in B.bound_rows({"convolution": 2.0, "total": 2.0}, {}, 16, None, None, [])]
    assert not any("TFLOP/s" in f for f in figs)


def test_a_decoder_built_without_its_graph(monkeypatch):
    vae = load_vae("sd-vae", "random", size="tiny")
    z = torch.randn(2, 4, 4, 4)
    dec = D.build_decoder(vae, "cuda_graph", "fp32", z, graph=False)   # no capture, so it runs on a CPU
    assert isinstance(dec, torch.nn.Module) and dec(z).shape == (2, 3, 32, 32)
    modes = []

    def compiled(module, mode, dynamic):
        modes.append(mode)
        return module

    monkeypatch.setattr(D.compile_budget, "compiled", compiled)
    for variant, graph in (("compile_cudagraphs", False), ("compile_subpixel_autotune", False),
                           ("compile_cudagraphs", True)):
        D.build_decoder(vae, variant, "fp32", z, graph=graph)
    assert modes == ["default", "max-autotune-no-cudagraphs", "reduce-overhead"]


def test_no_fp8_ratio_without_an_fp16_rate_or_fp8(monkeypatch):
    assert B.common.fp8_matrix_ratio("cpu", 700.0) is None
    assert B.common.fp8_matrix_ratio("cpu", None) is None
    from lab import timing
    from lab.techniques import fp8

    monkeypatch.setattr(fp8, "fp8_supported", lambda dev: (True, ""))   # a GPU with FP8: the measured rates' ratio
    monkeypatch.setattr(timing, "matmul_ceiling", lambda dtype, dev: 1400.0 if dtype == torch.float8_e4m3fn else 0.0)
    assert B.common.fp8_matrix_ratio("cpu", 700.0) == 2.0
    assert B.common.fp8_matrix_ratio("cpu", None) is None
