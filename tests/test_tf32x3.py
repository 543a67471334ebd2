"""Split-TF32 linear and short attention (lab.techniques.tf32x3): the Triton kernels under Triton's CPU interpreter
against float64 (ragged M, N and K, with and without a bias, strided inputs; queries and keys of different lengths),
their fallbacks, bad shapes, and the Ditto motion model's switches (the sampler arrangement with its GEMMs and
attention handed over gives the fp32 window)."""
import pytest
import torch
import torch.nn.functional as F

from lab.techniques import tf32x3
from lab.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")

CHECK = """
import torch
from lab.techniques import tf32x3
torch.manual_seed(0)
worst = 0.0
for m, n, k, bias, strided in [(37, 45, 70, True, False), (160, 33, 32, False, True), (5, 64, 530, True, True)]:
    x = torch.randn(m, 2 * k)[:, ::2] if strided else torch.randn(2, m, k)
    w, b = torch.randn(n, k), (torch.randn(n) if bias else None)
    y = tf32x3.linear_triton(x, w, b, tuned=False)
    assert y.shape == (*x.shape[:-1], n) and y.dtype == torch.float32
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    worst = max(worst, float((y.double() - ref).abs().max() / ref.abs().max()))
print(worst)
"""


ATTENTION_CHECK = """
import torch, torch.nn.functional as F
from lab.techniques import tf32x3
torch.manual_seed(0)
worst = 0.0
for n, lq, lk, heads, d in [(2, 80, 82, 4, 16), (1, 20, 7, 2, 24), (3, 33, 33, 1, 64)]:
    q = torch.randn(n, lq, heads * d)
    kv = torch.randn(n, lk, 2 * heads * d)
    k, v = kv[..., :heads * d], kv[..., heads * d:]     # views with a row stride, as a fused projection gives
    y = tf32x3.attention_triton(q, k, v, heads)
    sp = lambda t: t.double().unflatten(-1, (heads, -1)).transpose(1, 2)
    ref = F.scaled_dot_product_attention(sp(q), sp(k), sp(v)).transpose(1, 2).flatten(-2)
    assert y.shape == q.shape
    worst = max(worst, float((y.double() - ref).abs().max() / ref.abs().max()))
print(worst)
"""


def test_attention_kernel_equals_attention_under_the_interpreter(triton_interpreter):
    assert float(triton_interpreter(ATTENTION_CHECK).split()[-1]) < 2e-6


def test_attention_falls_back_to_sdpa_and_refuses_bad_shapes():
    from lab.models.ditto import heads_attention

    q, k, v = torch.randn(2, 9, 32), torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    assert torch.equal(tf32x3.attention(q, k, v, 4), heads_attention(q, k, v, 4))
    with pytest.raises(InputError, match="Lk ≤ 128"):
        tf32x3.attention_triton(q, torch.randn(2, 129, 32), torch.randn(2, 129, 32), 4)
    with pytest.raises(InputError, match="divisible by the heads"):
        tf32x3.attention_triton(q, k, torch.randn(2, 6, 32), 3)


def test_kernel_equals_the_product_under_the_interpreter(triton_interpreter):
    # the interpreter multiplies in fp32 (no tensor cores): this checks tiles, masks, strides and the bias
    assert float(triton_interpreter(CHECK).split()[-1]) < 1e-6


def test_motion_model_gemms_take_the_fixed_tile_and_deeper_ones_are_autotuned(monkeypatch):
    """The motion model's 160-row GEMMs launch one fixed tile (per-process autotuning picked slower tiles at random);
    deeper GEMMs go through the autotuner. Launches are recorded, nothing runs."""
    pytest.importorskip("triton")
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((self.name, grid if isinstance(grid, tuple) else "by config", kw))

    monkeypatch.setattr(tf32x3, "_tf32x3_gemm_kernel", Recorder("fixed"))
    monkeypatch.setattr(tf32x3, "_tuned", Recorder("autotuned"))
    w = torch.randn(512, 530)
    tf32x3.linear_triton(torch.randn(2, 80, 530), w)
    tf32x3.linear_triton(torch.randn(1000, 530), w)
    tf32x3.linear_triton(torch.randn(1000, 530), w, tuned=False)
    assert [s[0] for s in seen] == ["fixed", "autotuned", "fixed"]
    t = tf32x3.SMALL_M_TILE
    assert seen[0][1] == (-(-160 // t["BM"]), 512 // t["BN"])
    assert all(seen[0][2][key] == t[key] for key in t)


def test_linear_falls_back_to_f_linear_off_the_gpu():
    x, w, b = torch.randn(3, 7, 16), torch.randn(5, 16), torch.randn(5)
    assert not tf32x3.applies(x, w)
    assert torch.equal(tf32x3.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(tf32x3.linear(x.double(), w.double()), F.linear(x.double(), w.double()))


def test_bad_shapes_name_the_operands():
    with pytest.raises(InputError, match="weight \\(5, 16\\)"):
        tf32x3.linear_triton(torch.randn(3, 15), torch.randn(5, 16))
    with pytest.raises(InputError, match="bias"):
        tf32x3.linear_triton(torch.randn(3, 16), torch.randn(5, 16), torch.randn(4))


def test_motion_window_with_the_switch_is_the_fp32_window():
    # on a CPU the kernel falls back to F.linear, so this pins the arrangement the GPU path takes: the sampler
    # form of the LMDM with every GEMM passed through `linear` gives the eager fp32 window to fp32 rounding
    from lab.models import ditto as D
    from lab.pipelines import ditto as P

    engine = P.build(P.Config(size="tiny", sampling_steps=3, techniques=("batch_cfg",)), "cpu")   # one call per step
    torch.manual_seed(3)
    L = engine.dims.seq_frames
    cond = torch.randn(L, engine.dims.cond_dim)
    cf = torch.randn(D.MOTION_DIM)
    noises = torch.randn(3, 1, L, D.MOTION_DIM)
    x = torch.randn(1, L, D.MOTION_DIM)
    sched = D.Schedule.make(3)
    ref = P.sample_window(engine, cf, cond, sched, noises, None, x=x)
    calls = []
    real = tf32x3.linear

    def counting(*a):
        calls.append(a[1].shape)
        return real(*a)

    tf32x3_engine = P.reconfigure(engine, techniques=("batch_cfg", "motion_tf32x3"))
    try:
        tf32x3.linear = counting   # the pipeline looks the function up when it builds the step
        got = P.sample_window(tf32x3_engine, cf, cond, sched, noises, None, x=x)
    finally:
        tf32x3.linear = real
    layers = engine.dims.lm_layers
    assert len(calls) == 3 * (2 + 7 * layers)   # per step: input and final projections, 7 GEMMs per layer
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    att_calls = []
    real_att = tf32x3.attention
    try:
        tf32x3.attention = lambda *a: att_calls.append(a[1].shape) or real_att(*a)
        both = P.sample_window(P.reconfigure(engine, techniques=("batch_cfg", "motion_tf32x3", "motion_triton_attention")),
                               cf, cond, sched, noises, None, x=x)
    finally:
        tf32x3.attention = real_att
    assert len(att_calls) == 3 * 2 * layers   # self- and cross-attention per layer and step
    assert torch.allclose(both, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    with pytest.raises(InputError, match="no technique 'motion_flash_attention'"):
        P.reconfigure(engine, techniques=("motion_flash_attention",))


def test_waterfall_adds_the_attention_row_only_where_the_motion_table_measured_it_faster():
    from types import SimpleNamespace

    from lab.experiments import ditto as X

    def ctx(rows, dev="cuda"):
        res = SimpleNamespace(tables={"motion": rows}, metrics={}, params={"renderer": "upstream"})
        return SimpleNamespace(res=res, dev=torch.device(dev), prof=SimpleNamespace(batch=8))

    gemm = {"variant": X.GEMM_ROW, "status": "ok", "ms_per_window": 57.0}
    faster = {"variant": X.ATTENTION_ROW, "status": "ok", "ms_per_window": 50.0}
    # the copy-stream row closes every GPU waterfall (after the motion rows); off the GPU it is absent
    last = lambda c: [n for n, _ in X.waterfall_steps(c) if n != X.COPY_STREAM][-1]   # noqa: E731
    gpu_steps = X.waterfall_steps(ctx([gemm, faster]))
    assert gpu_steps[-1][0] == X.COPY_STREAM and "copy_stream" in gpu_steps[-1][1]["techniques"]
    assert not any(n == X.COPY_STREAM for n, _ in X.waterfall_steps(ctx([gemm, faster], "cpu")))
    assert X.motion_attention_helps(ctx([gemm, faster]))
    assert last(ctx([gemm, faster])) == X.MOTION_ATTENTION
    assert "motion_triton_attention" in X.waterfall_steps(ctx([gemm, faster]))[-1][1]["techniques"]
    for rows in ([gemm, faster | {"ms_per_window": 60.0}], [gemm, {"variant": X.ATTENTION_ROW, "status": "failed"}], [gemm], []):
        assert not X.motion_attention_helps(ctx(rows))
        assert last(ctx(rows)) == X.MOTION_TF32X3
    assert last(ctx([gemm, faster], "cpu")) != X.MOTION_ATTENTION   # no split-TF32 row off the GPU, so no attention row
    # PDL: a row after the attention row only where the table measured the window faster with it
    pdl = {"variant": X.PDL_ROW, "status": "ok", "ms_per_window": 46.0}
    assert last(ctx([gemm, faster, pdl])) == X.MOTION_PDL
    assert "motion_pdl" in X.waterfall_steps(ctx([gemm, faster, pdl]))[-1][1]["techniques"]
    assert last(ctx([gemm, faster, pdl | {"ms_per_window": 51.0}])) == X.MOTION_ATTENTION
    assert last(ctx([gemm, faster | {"ms_per_window": 60.0}, pdl])) == X.MOTION_TF32X3   # no attention row: no PDL row


def test_headline_holds_stride_3_against_the_encoder_on_its_own_frames():
    from types import SimpleNamespace

    from lab.experiments import ditto as X

    def ctx(enc):
        tables = {"e2e_final": [{"step": "final", "fps": 310.0}],
                  "strides": [{"step": "stride 3", "stride": 3, "space": "output", "fps": 369.0}]}
        res = SimpleNamespace(tables=tables, metrics={"encoder_ceiling": enc}, params={"renderer": "upstream"}, headline={})
        return SimpleNamespace(res=res, prof=SimpleNamespace(full_gpu=True, size="full", batch=16))

    # the stride-3 frames encode faster than the dense ones: the dense frames' ceiling would call 90 % met
    h = X.headline(ctx({"encoder_fps": 400.0, "stride3": {"encoder_fps": 420.0}}))
    assert h["stride 3 / encoder ceiling"] == round(369 / 420, 3) and h["stride 3 / dense frames' encoder ceiling"] == round(369 / 400, 3)
    assert h["target stride 3 ≥ 90 % of the encoder"] == "not met"
    assert h["target e2e dense ≥ 90 % of the encoder"] == "not met"
    h = X.headline(ctx({"encoder_fps": 400.0, "stride3": {"encoder_fps": 405.0}}))
    assert h["target stride 3 ≥ 90 % of the encoder"] == "met"
    # a Result from before the second measurement: stride 3 against the dense frames' ceiling, said as before
    h = X.headline(ctx({"encoder_fps": 400.0}))
    assert h["stride 3 / encoder ceiling"] == round(369 / 400, 3) and "encoder ceiling on stride 3's frames FPS" not in h


def test_dense_budget_sets_renderer_and_motion_work_against_the_encoder():
    from types import SimpleNamespace

    from lab.experiments import ditto as X

    tables = {"renderer": [{"variant": "compile+graph", "batch": 16, "fps": 400.0, "status": "ok"},
                           {"variant": "upstream", "batch": 16, "fps": 100.0, "status": "ok"}],
              "motion": [{"variant": X.ATTENTION_ROW, "ms_per_window": 42.0, "new_frames_per_window": 70, "status": "ok"},
                         {"variant": "compiled + CUDA graph, bf16 autocast", "ms_per_window": 30.0,
                          "new_frames_per_window": 70, "status": "ok"},     # approximate: not the exact bound
                         {"variant": X.GEMM_ROW, "ms_per_window": 50.0, "new_frames_per_window": 70, "status": "ok"}]}
    ctx = SimpleNamespace(res=SimpleNamespace(tables=tables, params={}), prof=SimpleNamespace(batch=16))
    b = X.dense_budget(ctx, 400.0)
    assert b["dense ms per frame allowed (90 % of the encoder)"] == round(1e3 / 360, 2)
    assert b["renderer alone ms per frame"] == 2.5 and b["motion model ms per new frame"] == 0.6
    assert b["renderer + motion ms per frame"] == 3.1
    assert "final run render stage ms per frame" not in b   # no end-to-end row yet
    tables["motion"] = [{"variant": X.ATTENTION_ROW, "ms_per_window": 42.0, "status": "ok"}]   # a Result from before the column
    assert "motion model ms per new frame" not in X.dense_budget(ctx, 400.0)
    # the last ok end-to-end row's stages per clip frame; its per-frame stages alone against the encoder
    tables["e2e_final"] = [{"step": "a", "fps": 300.0, "render_ms": 3.0, "putback_encode_ms": 0.5, "writer_close_ms": 0.2},
                           {"step": "b", "fps": 350.0, "render_ms": 2.3, "putback_encode_ms": 0.2, "writer_close_ms": 0.1},
                           {"step": "c", "status": "failed", "reason": "x"}]
    b = X.dense_budget(ctx, 400.0)
    assert b["final run render stage ms per frame"] == 2.3 and b["final run putback + hand-off ms per frame"] == 0.2
    assert b["final run writer drain ms per frame"] == 0.1
    assert b["final run per-frame stages alone / encoder ceiling"] == round(1e3 / 2.5 / 400.0, 3)
    tables["waterfall"] = [{"step": "w", "fps": 200.0, "render_ms": 4.0, "putback_encode_ms": 1.0}]   # the notebook's own rows first
    b = X.dense_budget(ctx, 400.0)
    assert b["final run render stage ms per frame"] == 4.0 and "final run writer drain ms per frame" not in b
