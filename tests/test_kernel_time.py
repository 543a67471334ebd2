"""lab.kernel_time: kernel names sorted into kinds, the profiler's events into a split, and a split's bound."""
import math

import pytest

from lab import kernel_time as K
from lab.errors import InputError


def test_kernel_kinds_from_names():
    assert K.kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>") == "attention"
    assert K.kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert K.kind("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc") == "convolution"
    assert K.kind("_conv_tma_body") == "convolution"   # the lab's own Triton FP8 conv
    assert K.kind("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNN") == "GEMM (linear)"
    assert K.kind("triton_red_fused_native_group_norm_12") == "Triton reduction (norms)"
    assert K.kind("triton_poi_fused_add_gelu_mul_7") == "Triton pointwise"
    # the lab's own Triton kernels name what they do
    for name in ("_group_norm_partial_kernel", "_group_norm_apply_kernel", "_block_norm_combine_kernel"):
        assert K.kind(name) == "Triton reduction (norms)"
    assert K.kind("_tf32x3_gemm_kernel") == "GEMM (linear)"
    assert K.kind("_short_attention_kernel") == "attention"
    # a fused pass is a pass whatever ops its name quotes
    assert K.kind("triton_poi_fused__scaled_dot_product_cudnn_attention_3") == "Triton pointwise"
    assert K.kind("triton_poi_fused_convolution_grid_sampler_3d_4") == "Triton pointwise"
    assert K.kind("void regular_fft<256u, EPT<16u>, 16u, 8u>") == K.kind("vector_fft_c2r") == "FFT"
    assert K.kind("void at::native::grid_sampler_3d_kernel<c10::Half>") == "grid_sample"
    assert K.kind("void cudnn::ops::nchwToNhwcKernel<__half>") == "copy / cat / layout"
    assert K.kind("void nhwcAddPaddingKernel<__half, __half, float, true, (cudnnReduceTensorOp_t)0>") == \
        "copy / cat / layout"
    assert K.kind("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps>>") == "reduction (eager)"
    assert K.kind("_fft_contract_kernel") == "FFT"   # the FFT mask conv's own Triton contraction
    assert K.kind("something_else") == "other"


def test_rows_sum_by_kind_with_the_costliest_kernel_and_a_total():
    events = [(3000.0, "sm90_xmma_fprop_implicit_gemm_a", 6), (1500.0, "sm90_xmma_fprop_implicit_gemm_b", 3),
              (900.0, "triton_poi_fused_add_0", 30), (600.0, "vector_fft_r2c", 3)]
    top: list[dict] = []
    rows = K.rows_of(events, runs=3, wall_ms=2.5, top=top, label="x", n_top=2)
    assert [r["kind"] for r in rows] == ["convolution", "Triton pointwise", "FFT", K.TOTAL]
    conv = rows[0]
    assert conv["ms_per_call"] == pytest.approx(1.5) and conv["launches_per_call"] == 3
    assert conv["top_kernel"] == "sm90_xmma_fprop_implicit_gemm_a" and conv["top_kernel_ms"] == pytest.approx(1.0)
    assert rows[-1]["ms_per_call"] == pytest.approx(2.0) and sum(r["pct_of_busy"] for r in rows[:-1]) == pytest.approx(100)
    assert [t["kernel"] for t in top] == ["sm90_xmma_fprop_implicit_gemm_a", "sm90_xmma_fprop_implicit_gemm_b"]
    ms = K.by_kind(rows)
    assert ms == pytest.approx({"convolution": 1.5, "Triton pointwise": 0.3, "FFT": 0.2, "total": 2.0})


def test_a_bound_changes_only_the_kinds_it_names():
    ms = {"convolution": 24.0, "Triton pointwise": 6.0, "FFT": 4.0, "total": 34.0}
    assert K.with_kinds_faster(ms, {}) == pytest.approx(34.0)
    assert K.with_kinds_faster(ms, {"convolution": 2.0}) == pytest.approx(22.0)
    assert K.with_kinds_faster(ms, {"Triton pointwise": math.inf, "FFT": math.inf}) == pytest.approx(24.0)


@pytest.mark.parametrize("faster, match", [({"GEMM (linear)": 2.0}, "not in the split"),
                                           ({"convolution": 0.0}, "must be > 0"),
                                           ({"convolution": float("nan")}, "must be > 0")])
def test_a_bound_refuses_kinds_the_split_lacks_and_bad_factors(faster, match):
    with pytest.raises(InputError, match=match):
        K.with_kinds_faster({"convolution": 1.0, "total": 1.0}, faster)


def test_a_split_needs_a_profiled_call():
    with pytest.raises(InputError, match="runs=0"):
        K.split(lambda: None, (), "cpu", runs=0)


EXACT = {"convolution": 24.0, "Triton pointwise": 6.0, "FFT": 4.0, "grid_sample": 1.0, "total": 35.0}


def test_bounds_from_the_split():
    rows = {r["figure"]: (r["value"], r["unit"]) for r in
            K.bounds(EXACT, {"convolution": 20.0, "total": 31.0}, 16, 1.6, [("t480", 480.0), ("t560", 560.0)],
                     subject="renderer")}
    assert rows["GPU busy per batch"] == (35.0, "ms")
    assert rows["passes between convolutions per batch"] == (11.0, "ms")
    assert rows["FPS at the GPU busy time"][0] == pytest.approx(16e3 / 35)
    assert rows["FPS bound: passes between convolutions free"][0] == pytest.approx(16e3 / 24)
    assert rows["FPS bound: every convolution sped up by the FP8 / fp16 matrix rate"][0] == pytest.approx(16e3 / 26)
    assert rows["FPS bound: the exact renderer with the FP8 build's convolution time"][0] == pytest.approx(16e3 / 31)
    assert rows["time to take off per batch to reach t480"][0] == pytest.approx(35 - 16e3 / 480)
    assert rows["time to take off per batch to reach t560"][0] == pytest.approx(35 - 16e3 / 560)


def test_bounds_without_fp8_or_convs_leave_those_rows_out():
    figs = [r["figure"] for r in K.bounds(EXACT, None, 16, None, [])]
    assert not any("FP8" in f for f in figs) and len(figs) == 5
    figs = [r["figure"] for r in K.bounds({"FFT": 2.0, "total": 2.0}, None, 16, 1.7, [])]
    assert not any("bound" in f for f in figs)   # nothing to bound without a conv in the split


def test_the_fp8_build_row_names_its_subject():
    rows = K.bounds(EXACT, {"convolution": 20.0}, 16, None, [], subject="decoder")
    assert rows[-1]["figure"] == "FPS bound: the exact decoder with the FP8 build's convolution time"


def test_bound_headline_names_ms_rows_and_drops_non_finite_ones():
    rows = K.bounds(EXACT, None, 16, 1.5, [("t", 400.0)])
    rows.append({"figure": "broken", "value": float("nan"), "unit": "FPS"})
    h = K.bound_headline(rows, "sd-vae kernels")
    assert h["sd-vae kernels: GPU busy per batch (ms)"] == 35.0
    assert h["sd-vae kernels: FPS at the GPU busy time"] == round(16e3 / 35, 1)
    assert h["sd-vae kernels: time to take off per batch to reach t (ms)"] == round(35 - 16e3 / 400, 2)
    assert h["sd-vae kernels: FP8 / fp16 matrix-rate ratio"] == 1.5
    assert "sd-vae kernels: broken" not in h and len(h) == len(rows) - 1



def test_a_known_wall_time_adds_the_gaps_and_the_wall_distance_to_each_target():
    rows = {r["figure"]: r["value"] for r in K.bounds(EXACT, None, 16, None, [("t", 480.0)], wall_ms=38.0)}
    assert rows["wall time per batch (its timed median)"] == 38.0
    assert rows["gaps between kernels per batch (wall − busy)"] == pytest.approx(3.0)
    assert rows["time to take off per batch to reach t"] == pytest.approx(35 - 16e3 / 480)
    assert rows["time to take off the wall time per batch to reach t"] == pytest.approx(38 - 16e3 / 480)
    assert not any("wall" in f for f in (r["figure"] for r in K.bounds(EXACT, None, 16, None, [("t", 480.0)])))


def test_by_run_splits_a_table_of_several_runs():
    rows = [dict(r, run=run) for run, us in (("a", 3e3), ("b", 6e3))
            for r in K.rows_of([(us, "sm90_xmma_fprop_implicit_gemm", 3)], runs=3)]
    rows.append({"run": "c", "status": "skipped", "reason": "needs a GPU"})
    got = K.by_run(rows)
    assert list(got) == ["a", "b"] and got["b"] == pytest.approx({"convolution": 2.0, "total": 2.0})
