"""FP8 layers with static activation scales: calibration over a set, the in-place rewrite and its undo, the fused
FP8 q, k, v, and LatentSync's `fp8_linear` technique built on them (CPU: the FP8 GEMMs emulated from FP8 operands)."""
import pytest
import torch
from torch import nn

from lab import data
from lab.errors import BackendUnavailable, InputError
from lab.models.latentsync import Attention
from lab.techniques import fp8, fp8_static

pytestmark = pytest.mark.usefixtures("one_thread")


class Two(nn.Module):
    def __init__(self, k: int = 32, n: int = 48):
        super().__init__()
        self.a, self.b = nn.Linear(k, n), nn.Linear(n, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _batches(k=32, n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(5, k, generator=g) * (i + 1),) for i in range(n)]


def test_calibrate_takes_the_largest_input_of_every_batch_and_refuses_what_it_cannot_scale():
    torch.manual_seed(0)
    m, batches = Two(), _batches()
    amax = fp8_static.calibrate(m, batches)
    assert set(amax) == {"a", "b"}
    assert amax["a"] == pytest.approx(max(float(x.abs().max()) for (x,) in batches))
    with torch.no_grad():
        assert amax["b"] == pytest.approx(max(float(torch.relu(m.a(x)).abs().max()) for (x,) in batches))
    with pytest.raises(InputError, match="at least one batch"):
        fp8_static.calibrate(m, [])
    with pytest.raises(InputError, match="tuple of the model's inputs"):
        fp8_static.calibrate(m, [torch.ones(2, 32)])
    with pytest.raises(InputError, match="layer 'a'.*amax of 0.0"):
        fp8_static.calibrate(m, [(torch.zeros(5, 32),)])
    with pytest.raises(InputError, match="layer 'a'.*amax of nan"):
        fp8_static.calibrate(m, [(torch.full((5, 32), float("nan")),)])
    with pytest.raises(InputError, match="no Linear layer"):
        fp8_static.calibrate(nn.ReLU(), batches)


def test_rewrite_computes_the_static_fp8_layer_and_the_undo_gives_the_float_layers_back():
    torch.manual_seed(0)
    m, batches = Two(), _batches()
    a, b = m.a, m.b
    x = batches[1][0]
    with torch.no_grad():
        ref = m(x)
    amax = fp8_static.calibrate(m, batches)
    rows = fp8_static.fp8_rewrite(m, amax, emulate=True)
    assert [r["layer"] for r in rows] == ["a", "b"] and all(r["fp8"] and r["weight_rel_err"] > 0 for r in rows)
    assert isinstance(m.a, fp8.FP8Linear) and m.a.activation == "static" and fp8_static.rewritten(m)
    assert float(m.a.a_scale) == pytest.approx(amax["a"] / fp8.E4M3_MAX)
    assert "plain" not in dict(m.a.named_modules()) and not any("plain" in k for k in m.state_dict())
    twin = fp8.FP8Linear.from_float(a, "per_tensor", "gemm", "static", amax["a"], emulate=True)
    with torch.no_grad():
        torch.testing.assert_close(m.a(x), twin(x), rtol=0, atol=0)   # exactly the static FP8 layer
        out = m(x)
    assert 0 < float((out - ref).norm() / ref.norm()) < 0.1    # approximate: e4m3 keeps 3 mantissa bits
    assert fp8_static.fp8_rewrite(m, amax) == []                  # already FP8: left as it is
    assert fp8_static.plain_layers(m) == 2 and m.a is a and m.b is b and not fp8_static.rewritten(m)
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    s = fp8_static.summary(rows)
    assert s["fp8_layers"] == 2 and s["float_layers"] == 0 and s["amax_max"] == max(amax.values())


def test_a_layer_off_the_fp8_gemm_shapes_stays_float_with_its_reason():
    m = Two(k=24)   # K = 24 is not a multiple of 16
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, _batches(24)), emulate=True)
    assert not rows[0]["fp8"] and "multiples of 16" in rows[0]["reason"] and isinstance(m.a, nn.Linear)
    assert rows[1]["fp8"] and fp8_static.summary(rows)["first_reason"] == rows[0]["reason"]
    with pytest.raises(InputError, match="rewrites nn.Linear and nn.Conv2d"):
        fp8_static.fp8_rewrite(nn.Sequential(nn.ReLU()), {"0": 1.0})


def test_a_gpu_without_fp8_tensor_cores_is_refused_up_front(monkeypatch):
    assert fp8_static.emulated("cpu")
    monkeypatch.setattr(fp8, "fp8_supported", lambda dev: (False, "compute capability 8.0 < 8.9"))
    with pytest.raises(BackendUnavailable, match="FP8 tensor cores: compute capability 8.0"):
        fp8_static.emulated("cuda")


def test_self_attention_q_k_v_fuse_into_one_fp8_gemm_and_cross_attention_does_not():
    torch.manual_seed(0)
    att, cross = Attention(32, 2), Attention(32, 2, kv_dim=48)
    x, ctx = torch.randn(2, 6, 32), torch.randn(2, 5, 48)
    root = nn.ModuleDict({"s": att, "c": cross})
    root.forward = lambda x, c: (att(x), cross(x, c))
    amax = fp8_static.calibrate(root, [(x, ctx)])
    fp8_static.fp8_rewrite(root, amax, emulate=True)
    with torch.no_grad():
        three = att(x)
    assert fp8_static.fused_qkv(root, True) == 1
    assert isinstance(att.qkv, fp8.FP8Linear) and att.qkv.out_features == 96 and cross.qkv is None
    assert "qkv" not in dict(att.named_children())               # unregistered: the state dict keeps to_q / to_k / to_v
    assert fp8_static.fused_qkv(root, True) == 0                 # idempotent
    with torch.no_grad():
        one = att(x)
    # one weight scale for the three (per tensor): close to the three GEMMs, not bit-equal
    assert float((one - three).norm() / three.norm()) < 0.05
    assert fp8_static.plain_layers(root) == 8 and att.qkv is None and isinstance(att.to_q, nn.Linear)
    fp8_static.fp8_rewrite(root, amax, emulate=True)
    assert fp8_static.fusable_qkv(root) == {"s.to_q", "s.to_k", "s.to_v"}    # the self-attention's, not the cross one's
    fp8_static.plain_layers(root)
    assert fp8_static.fusable_qkv(root) == set()                             # float layers: nothing to fuse in FP8


# ----------------------------------------------------------------------------- LatentSync's fp8_linear


@pytest.fixture(scope="module")
def ls():
    from lab.pipelines import latentsync as P

    return P, P.build(P.Config(size="tiny", mode="ddim2", block=4))


def test_latentsync_fp8_linear_is_close_to_exact_and_reconfiguring_back_restores_it(ls):
    from lab.avatar import avatar_loop
    from lab.models.latentsync import Attention as Att

    P, engine = ls
    a, sr = data.default_audio()
    avatar = P.prepare(engine, avatar_loop(3, (128, 192)))
    ref = P.run(engine, avatar, a[:int(sr * 0.4)], sr, max_frames=4, keep_faces=True)
    eng = P.reconfigure(engine, techniques=("guided_shortcuts", "fused_qkv", "fp8_linear"))
    model = eng.unet.model
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    twins = [m for m in model.modules() if isinstance(m, fp8.FP8Linear)]
    assert twins and not lin and all(t.activation == "static" and t.emulate for t in twins)
    fused = [m for m in model.modules() if isinstance(m, Att) and isinstance(m.qkv, fp8.FP8Linear)]
    assert fused and all(m.qkv.out_features == 3 * m.to_q.out_features for m in fused)
    assert engine.unet.model is not model and not fp8_static.rewritten(engine.unet.model)
    rep = P.run(eng, avatar, a[:int(sr * 0.4)], sr, max_frames=4, keep_faces=True)
    cos = torch.nn.functional.cosine_similarity(rep.latents.flatten().double(), ref.latents.flatten().double(), dim=0)
    assert 0.99 < float(cos) < 1.0                                   # approximate, and close
    assert (rep.faces.int() - ref.faces.int()).abs().max() > 0
    # the calibration saw the guided calls at every timestep of CALIBRATION_STEPS with the sentence's features
    from lab.pipelines.latentsync.engine import CALIBRATION_STEPS, fp8_calibration

    calls = fp8_calibration(eng)
    assert [int(c[1][0]) for c in calls] == list(CALIBRATION_STEPS)
    assert all(torch.equal(c[2][:4], torch.zeros_like(c[2][:4])) and c[2][4:].abs().max() > 0 for c in calls)
    back = P.reconfigure(eng, techniques=("guided_shortcuts", "fused_qkv"))
    assert not fp8_static.rewritten(back.unet.model)
    again = P.run(back, avatar, a[:int(sr * 0.4)], sr, max_frames=4, keep_faces=True)
    torch.testing.assert_close(again.latents, ref.latents, rtol=1e-4, atol=1e-4)


def test_latentsync_keeps_each_fp8_linear_only_where_its_gemm_is_faster(monkeypatch):
    """The engine judges every FP8 Linear by its measured GEMM time at its calibrated shape, except the q, k, v it
    fuses into one GEMM (kept FP8 together). A CPU has no kernel speed to judge: a timer is injected here."""
    from lab.models.latentsync import Attention as Att

    from lab.pipelines import latentsync as P

    real, judged = fp8_static.keep_faster, []

    def slower_everywhere(model, rows, shapes, min_gain=None, timer=None):
        def timer(layer, which, fn):   # every FP8 GEMM slower than its fp16 one
            out = fn()                 # computed at the layer's calibrated shape, through the layer's own GEMM
            judged.append((layer, tuple(out.shape)))
            return 2.0 if which == "fp8" else 1.0
        return real(model, rows, shapes, min_gain, timer)

    monkeypatch.setattr(fp8_static, "keep_faster", slower_everywhere)
    eng = P.build(P.Config(size="tiny", mode="ddim2", block=4, techniques=("guided_shortcuts", "fused_qkv", "fp8_linear")))
    model = eng.unet.model
    fused = [m for m in model.modules() if isinstance(m, Att) and isinstance(m.qkv, fp8.FP8Linear)]
    assert fused and all(isinstance(m.to_q, fp8.FP8Linear) for m in fused)       # kept FP8, unjudged
    names = {id(m): n for n, m in model.named_modules()}
    one_gemm = {names[id(p)] for m in fused for p in (m.to_q, m.to_k, m.to_v)}
    assert judged and not one_gemm & {layer for layer, _ in judged}
    assert all(isinstance(model.get_submodule(layer), nn.Linear) for layer, _ in judged)   # put back to fp16
    assert any("not 1.05× as fast" in line for line in eng.notes["fp8_linear"])
    from lab.avatar import avatar_loop

    a, sr = data.default_audio()
    rep = P.run(eng, P.prepare(eng, avatar_loop(3, (128, 192))), a[:int(sr * 0.2)], sr, max_frames=2, keep_faces=True)
    assert torch.isfinite(rep.latents).all()    # fp16 Linear layers beside the fused FP8 q, k, v run as one model


def test_latentsync_lists_fp8_linear_as_approximate():
    from lab.techniques import registry

    t = registry("latentsync")["fp8_linear"]
    assert not t.exact and t.where == "lab.techniques.fp8_static"


def test_notebook_step_compares_static_and_dynamic_scales_and_says_when_fp8_is_missing(tmp_path, monkeypatch):
    from lab.experiments import latentsync as L

    ctx = L.setup("cpu", quick=True, out_dir=str(tmp_path / "run"))
    rows = L.fp8_linear(ctx)
    assert rows[0]["status"].startswith("unavailable: device is cpu") and ctx.res.tables["fp8_linear"] == rows
    # as on an FP8 GPU (here: the static copy emulated, the dynamic one weight-only): three eager rows, then the
    # compiled comparison, skipped without a compiled exact runner
    monkeypatch.setattr(fp8, "fp8_supported", lambda dev=None: (True, "test"))
    rows = L.fp8_linear(ctx)
    assert [r["variant"].split(",")[0] for r in rows[:3]] == ["eager fp32", "FP8 linear layers", "FP8 linear layers"]
    assert "static activation scales (fp8_linear)" in rows[1]["variant"] and "dynamic" in rows[2]["variant"]
    n_linear = sum(isinstance(m, nn.Linear) for m in ctx.engine.unet.model.modules())
    assert f"(fp8_linear), {n_linear} layers" in rows[1]["variant"]
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in rows[:3]) and rows[0]["speedup"] == 1.0
    assert 0.99 < rows[1]["cosine_vs_eager"] < 1.0
    assert rows[3]["status"].startswith("skipped: no compiled exact runner")


def test_convs_take_per_channel_weight_scales_and_the_ones_off_the_fp8_shapes_stay_float():
    torch.manual_seed(0)

    class Sub(nn.Conv2d):
        pass

    m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(32, 8, 3, padding=1),
                      nn.Conv2d(8, 16, 1), Sub(16, 16, 1))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 16, 12, 12, generator=g),) for _ in range(2)]
    x = batches[0][0]
    with torch.no_grad():
        ref = m[:2](x)
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,)), emulate=True)
    by = {r["layer"]: r for r in rows}
    assert by["0"]["fp8"] and by["0"]["path"] == "im2col" and by["0"]["kind"] == "Conv2d"
    assert not by["2"]["fp8"] and "multiples of 16" in by["2"]["reason"]        # 8 output channels
    assert not by["3"]["fp8"] and "multiples of 16" in by["3"]["reason"]        # 8 input channels
    assert not by["4"]["fp8"] and "not a plain Conv2d" in by["4"]["reason"]
    q = m[0]
    assert isinstance(q, fp8.FP8Conv2d) and q.scheme == "per_channel" and q.w_scale.shape == (32,)
    with torch.no_grad():
        out = m[:2](x)
    assert 0 < float((out - ref).norm() / ref.norm()) < 0.1
    assert fp8_static.plain_layers(m) == 1 and type(m[0]) is nn.Conv2d


def _three_convs():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(32, 16, 1))
    g = torch.Generator().manual_seed(1)
    batches, shapes = [(torch.randn(2, 16, 12, 12, generator=g),) for _ in range(2)], {}
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,), shapes=shapes), emulate=True)
    return m, batches, shapes, rows


def test_each_layer_stays_fp8_only_where_its_kernel_is_measurably_faster():
    m, batches, shapes, rows = _three_convs()
    assert shapes == {"0": (2, 16, 12, 12), "2": (2, 32, 12, 12), "4": (2, 32, 12, 12)}
    # per layer (fp8 ms, float ms): 1.3× (stays), 1.02× (within the margin: back to float), 0.8× (slower: back)
    times = {"0": (1.0, 1.3), "2": (1.0, 1.02), "4": (1.0, 0.8)}
    seen = []

    def timer(layer, which, fn):
        out = fn()                                    # each call computes the layer at its calibrated shape
        seen.append((layer, which, tuple(out.shape)))
        return times[layer][which == "float"]

    rows = fp8_static.keep_faster(m, rows, shapes, timer=timer)
    by = {r["layer"]: r for r in rows}
    assert seen[:2] == [("0", "fp8", (2, 32, 12, 12)), ("0", "float", (2, 32, 12, 12))] and len(seen) == 6
    assert by["0"]["fp8"] and isinstance(m[0], fp8.FP8Conv2d) and (by["0"]["fp8_ms"], by["0"]["float_ms"]) == (1.0, 1.3)
    for name in ("2", "4"):
        assert not by[name]["fp8"] and "not 1.05× as fast" in by[name]["reason"] and type(m[int(name)]) is nn.Conv2d
    assert fp8_static.plain_layers(m) == 1 and all(type(m[i]) is nn.Conv2d for i in (0, 2, 4))
    # a stricter margin, and bad input
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,)), emulate=True)
    assert not fp8_static.keep_faster(m, rows, shapes, min_gain=1.5, timer=timer)[0]["fp8"]
    with pytest.raises(InputError, match="min_gain"):
        fp8_static.keep_faster(m, rows, shapes, min_gain=0, timer=timer)
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,)), emulate=True)
    with pytest.raises(InputError, match="no calibrated input shape for FP8 layer '0'"):
        fp8_static.keep_faster(m, rows, {}, timer=timer)


def _db_of(m, batches, ref):
    from lab.metrics import psnr

    with torch.no_grad():
        return psnr(torch.cat([m(*b).flatten() for b in batches]), ref, data_range=1.0)


def test_each_layer_stays_fp8_only_while_the_output_stays_within_the_floor():
    import math

    m, batches, shapes, rows = _three_convs()
    fp8_static.plain_layers(m)
    with torch.no_grad():
        ref = torch.cat([m(*b).flatten() for b in batches])
    m, batches, shapes, rows = _three_convs()
    everything = fp8_static.keep_within(m, rows, batches, 1.0)          # a floor every plan clears: all stay FP8
    assert everything["kept"] == everything["of"] == 3 and all(isinstance(m[i], fp8.FP8Conv2d) for i in (0, 2, 4))
    alone = {r["layer"]: r["alone_db"] for r in rows}
    assert all(20 < db < 100 for db in alone.values())
    assert abs(everything["psnr_db"] - _db_of(m, batches, ref)) < 1e-6
    assert everything["psnr_db"] < min(alone.values())                  # the layers' errors add up
    # the time saved per unit of error decides: with the budget of one layer's noise, that layer alone stays FP8
    for fast in ("0", "4"):
        m, batches, shapes, rows = _three_convs()
        for r in rows:
            r["fp8_ms"], r["float_ms"] = 1.0, (101.0 if r["layer"] == fast else 1.06)
        floor = alone[fast] - 10 * math.log10(1.001)
        plan = fp8_static.keep_within(m, rows, batches, floor, shapes=shapes)
        by = {r["layer"]: r for r in rows}
        assert plan["kept"] == 1 and plan["psnr_db"] >= floor and by[fast]["fp8"]
        assert isinstance(m[int(fast)], fp8.FP8Conv2d)
        for other in {"0", "2", "4"} - {fast}:
            assert not by[other]["fp8"] and type(m[int(other)]) is nn.Conv2d
            assert by[other]["reason"].startswith(f"put back to keep the output within {floor:g} dB PSNR")
        assert abs(plan["psnr_db"] - _db_of(m, batches, ref)) < 1e-6
    # a floor no FP8 layer clears: every layer back to float, the float function exactly
    m, batches, shapes, rows = _three_convs()
    none = fp8_static.keep_within(m, rows, batches, 300.0)
    assert none == {"psnr_db": math.inf, "kept": 0, "of": 3} and fp8_static.plain_layers(m) == 0


def test_a_plan_that_misses_its_floor_when_measured_gives_back_its_least_efficient_layer(monkeypatch):
    from lab import metrics

    m, batches, shapes, rows = _three_convs()
    fp8_static.keep_within(m, rows, batches, 1.0)
    alone = {r["layer"]: r["alone_db"] for r in rows}
    real = metrics.psnr
    m, batches, shapes, rows = _three_convs()

    def correlated(a, b, data_range=None):   # errors that add worse than the prediction once two layers are FP8
        return real(a, b, data_range=data_range) - 6.0 * (sum(isinstance(x, fp8.FP8Conv2d) for x in m) >= 2)

    monkeypatch.setattr(metrics, "psnr", correlated)
    for r in rows:
        r["fp8_ms"], r["float_ms"] = 1.0, {"0": 50.0, "2": 40.0, "4": 1.06}[r["layer"]]
    floor = min(alone["0"], alone["2"]) - 4.0       # predicted: 0 and 2 together clear it; measured they miss
    plan = fp8_static.keep_within(m, rows, batches, floor, shapes=shapes)
    by = {r["layer"]: r for r in rows}
    assert plan["kept"] == 1 and plan["psnr_db"] >= floor and by["0"]["fp8"] and not by["2"]["fp8"]


def test_the_error_floor_refuses_what_it_cannot_measure():
    m, batches, shapes, rows = _three_convs()
    for bad in (0, -3.0, float("inf"), float("nan")):
        with pytest.raises(InputError, match="min_db is the PSNR floor"):
            fp8_static.keep_within(m, rows, batches, bad)
    with pytest.raises(InputError, match="at least one batch"):
        fp8_static.keep_within(m, rows, [], 40.0)

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = m

        def forward(self, x):
            return self.c(x), x

    with pytest.raises(InputError, match="returns one tensor, got tuple"):
        fp8_static.keep_within(Pair(), [{**r, "layer": "c." + r["layer"]} for r in rows], batches, 40.0)


def test_emulated_fp8_is_never_judged_by_its_speed():
    m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1))
    batches, shapes = [(torch.randn(2, 16, 8, 8),)], {}
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,), shapes=shapes), emulate=True)
    assert fp8_static.keep_faster(m, rows, shapes)[0]["fp8"] and isinstance(m[0], fp8.FP8Conv2d)   # a CPU: no timer


def test_a_gpu_without_cudnn_fp8_convs_is_refused_for_convs_only(monkeypatch):
    from lab.runtime import cudnn_graph

    monkeypatch.setattr(fp8, "fp8_supported", lambda dev: (True, "test"))
    monkeypatch.setattr(cudnn_graph, "available", lambda dev, io="fp16": (False, "nvidia-cudnn-frontend not installed"))
    assert fp8_static.emulated("cuda") is False
    with pytest.raises(BackendUnavailable, match="cuDNN's graph API: nvidia-cudnn-frontend not installed"):
        fp8_static.emulated("cuda", convs=True)


# ----------------------------------------------------------------------------- Ditto's fp8_conv


@pytest.fixture(scope="module")
def ditto():
    from lab.pipelines import Encode
    from lab.pipelines import ditto as P

    cfg = P.Config(size="tiny", precision="fp32", batch_size=4, frame_size=(128, 192), sampling_steps=2,
                   encode=Encode(writer="null"), techniques=("batch_cfg", "vram_pool", "gpu_putback", "fold_spectral_norm",
                                                             "fuse_spade", "lowres_seg", "fold_shortcut"))
    eng = P.build(cfg, "cpu")
    return P, eng, P.prepare(eng)


def test_ditto_fp8_conv_runs_the_decoder_convs_in_fp8_calibrated_on_the_warped_features(ditto):
    from lab.metrics import psnr
    from lab.pipelines.ditto.engine import CALIBRATION_FRAMES, fp8_calibration

    P, engine, avatar = ditto
    a, sr = data.default_audio(16000)
    a = a[:int(0.8 * sr)]
    ref = P.run(engine, avatar, a, sr, keep_faces=True)
    eng = P.reconfigure(engine, techniques=engine.cfg.techniques + ("fp8_conv",))
    rep = P.run(eng, avatar, a, sr, keep_faces=True)
    decs = [v for k, v in engine.variants.items() if k[:2] == ("module", "decoder") and k[-4]]
    assert len(decs) == 1
    twins = [m for m in decs[0].modules() if isinstance(m, fp8.FP8Conv2d)]
    assert twins and all(t.activation == "static" and t.scheme == "per_channel" and t.emulate for t in twins)
    assert type(decs[0].conv_img[0]) is nn.Conv2d                  # 12 output channels: not an FP8 shape
    assert any(n.startswith("fp8_conv: ") and "conv_img.0" in n and "channels (cuDNN's FP8 convs" in n
               for n in rep.notes) and not ref.notes
    from lab.experiments.ditto_variants import renderer_notes   # notebook 06's renderer rows carry the same note

    assert "conv_img.0" in renderer_notes(eng) and renderer_notes(engine) == ""
    import re

    plan = next(filter(None, (re.search(r"(\d+) of the decoder's (\d+) convs in FP8: its faces ([\d.]+) dB PSNR from "
                                        r"the fp32 decoder's on the calibration frames \(floor 50 dB\)", n)
                              for n in rep.notes)))
    kept, convs, db = int(plan[1]), int(plan[2]), float(plan[3])
    assert 0 < kept == len(twins) < convs and db >= 50.0                 # the error half of the per-layer choice
    p = psnr(rep.faces.float() / 255, ref.faces.float() / 255)
    assert 20 < p < 100                                             # approximate (random weights: a bound, no finding)
    calls = fp8_calibration(engine, "fp32", ())
    assert len(calls) == -(-CALIBRATION_FRAMES // 4) and calls[0][0].shape[0] == 4
    assert float(calls[0][0].std()) > 0


def test_ditto_fp8_conv_is_refused_without_its_requirements_or_beside_graph_convs(ditto):
    from types import SimpleNamespace

    from lab.pipelines.ditto.engine import _fp8_decoder

    P, engine, _ = ditto
    with pytest.raises(InputError, match=r"'fp8_conv' needs \['fuse_spade'\]"):
        P.reconfigure(engine, techniques=("fold_spectral_norm", "fp8_conv"))
    with pytest.raises(InputError, match=r"'fp8_conv' cannot be combined with \['graph_conv'\]"):
        P.reconfigure(engine, techniques=engine.cfg.techniques + ("graph_conv", "fp8_conv"))
    gpu = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(InputError, match="precision='fp16', got 'autocast'"):
        _fp8_decoder(gpu, nn.Identity(), "autocast", ())


def test_notebook_06_never_builds_its_exact_rows_on_an_approximate_renderer():
    from types import SimpleNamespace

    from lab.experiments import ditto as X
    from lab.experiments.ditto_variants import BEST, VARIANT_TEXT, VARIANTS, exact

    assert exact(BEST) and exact(BEST + "+gconv") and not exact(BEST + "+fp8")
    assert set(VARIANT_TEXT) == set(VARIANTS)
    rows = [{"variant": v, "batch": 16, "fps": fps, "status": "ok"} for v, fps in
            ((BEST, 400.0), (BEST + "+fp8", 450.0), (BEST + "+gconv", 410.0))]
    ctx = SimpleNamespace(res=SimpleNamespace(tables={"renderer": rows}, params={}), prof=SimpleNamespace(batch=16))
    assert X.best_variant(ctx)[0] == BEST + "+gconv"
    rows[2]["status"] = "failed"
    assert X.best_variant(ctx)[0] == BEST
