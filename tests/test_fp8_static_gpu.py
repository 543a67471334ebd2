"""FP8 layers with static scales on the GPU host (pytest -m gpu): Ditto's `fp8_conv` decoder runs cuDNN FP8 convs
(not the emulation) inside the compiled, captured renderer and stays near the fp16 renderer it replaces."""
import numpy as np
import pytest
import torch

from lab.metrics import psnr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fp8_convs_or_skip():
    from lab.runtime import cudnn_graph
    from lab.techniques import fp8

    for ok, why in (fp8.fp8_supported("cuda"), cudnn_graph.available("cuda", "fp8")):
        if not ok:
            pytest.skip(why)


def _choice_follows_the_times(m, rows, shapes, x, twin_type):
    """keep_faster on the GPU: every layer timed both ways, FP8 kept exactly where it was MIN_GAIN × as fast, the
    model's layers as the rows say, and the model still computing."""
    from lab.techniques import fp8_static

    rows = fp8_static.keep_faster(m, rows, shapes)
    for r in rows:
        assert r["fp8_ms"] > 0 and r["float_ms"] > 0
        assert r["fp8"] == (r["float_ms"] >= fp8_static.MIN_GAIN * r["fp8_ms"]), r
        assert isinstance(m.get_submodule(r["layer"]), twin_type) == r["fp8"]
    with torch.inference_mode():
        assert torch.isfinite(m(x)).all()


def test_ditto_fp8_conv_renderer_compiled_and_captured_stays_near_fp16(monkeypatch):
    from lab.pipelines import config
    from lab.pipelines import ditto as P
    from lab.pipelines.ditto import engine as ditto_engine
    from lab.techniques import fp8, fp8_static

    _fp8_convs_or_skip()
    monkeypatch.setattr(fp8_static, "MIN_GAIN", 1e-6)   # every eligible conv FP8: the tiny shapes would not pay
    monkeypatch.setattr(ditto_engine, "FP8_FLOOR_DB", 1.0)   # nor be judged by their error: the captured FP8 graph
    cfg = config("ditto", "exact", device="cuda", size="tiny", batch_size=4, frame_size=(128, 192))
    engine = P.build(cfg, "cuda")
    avatar = P.prepare(engine)
    q = P.reconfigure(engine, techniques=cfg.techniques + ("fp8_conv",))
    d, src = engine.dims, np.zeros(4, dtype=np.int64)
    from lab.pipelines.ditto.avatar import _gather_fs
    from lab.pipelines.ditto.engine import stage_fn

    fs = _gather_fs(engine, avatar, src)
    ks = avatar.kp_s[:1].expand(4, -1, -1).half()
    kd = ks + 0.02 * torch.randn(ks.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).half()
    with torch.inference_mode():
        ref = stage_fn(engine, "render", 4)(fs, ks, kd).float().clone()
        got = stage_fn(q, "render", 4)(fs, ks, kd).float().clone()
    decs = [v for k, v in engine.variants.items() if k[:2] == ("module", "decoder") and k[-4]]
    twins = [m for m in decs[0].modules() if isinstance(m, fp8.FP8Conv2d)]
    assert twins and all(t.path == "cudnn" and not t.emulate for t in twins)
    assert torch.isfinite(got).all() and got.shape == ref.shape == (4, 3, d.render_hw, d.render_hw)
    assert 20 < psnr(got, ref, data_range=1.0) < 100


def test_fp8_convs_stay_only_where_their_cudnn_kernel_is_faster():
    """Per layer on the GPU: each conv's cuDNN FP8 kernel against its fp16 conv at the calibrated shape (the survey on
    an H100: 1.27× at 512 → 512, 128²; 0.83× at 256 → 64, 256²); the decision follows the measured times."""
    from torch import nn

    from lab.techniques import fp8, fp8_static

    _fp8_convs_or_skip()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(512, 512, 3, padding=1), nn.Conv2d(512, 256, 1), nn.Upsample(scale_factor=2),
                      nn.Conv2d(256, 64, 3, padding=1)).cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(8, 512, 128, 128, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    shapes = {}
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, [(x,)], types=(nn.Conv2d,), shapes=shapes))
    assert all(r["fp8"] and r["path"] == "cudnn" for r in rows)
    _choice_follows_the_times(m, rows, shapes, x, fp8.FP8Conv2d)


def test_fp8_linears_stay_only_where_their_gemm_is_faster():
    """The same choice for Linear layers (LatentSync's `fp8_linear`): `_scaled_mm` at the calibrated shape against
    the fp16 GEMM, a large GEMM and a small one; the decision follows the measured times."""
    from torch import nn

    from lab.techniques import fp8, fp8_static

    if not fp8.fp8_supported("cuda")[0]:
        pytest.skip(fp8.fp8_supported("cuda")[1])
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 64), nn.Linear(64, 64)).cuda().half()
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.float16)
    shapes = {}
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, [(x,)], shapes=shapes))
    assert all(r["fp8"] for r in rows) and shapes["2"] == (8192, 64)
    _choice_follows_the_times(m, rows, shapes, x, fp8.FP8Linear)


def test_fp8_convs_stay_only_while_the_output_clears_its_floor():
    """The error half on the GPU (cuDNN FP8 convs, fp16 around them): the plan's reported PSNR is the model's, and a
    floor above what the whole FP8 model reaches puts some convs back, a floor nothing reaches all of them."""
    import math

    from torch import nn

    from lab.techniques import fp8, fp8_static

    _fp8_convs_or_skip()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(128, 128, 3, padding=1),
                      nn.LeakyReLU(0.2), nn.Conv2d(128, 64, 3, padding=1), nn.Sigmoid()).cuda().half()
    m = m.to(memory_format=torch.channels_last)
    batches = [(torch.randn(4, 64, 64, 64, device="cuda", dtype=torch.float16)
                .contiguous(memory_format=torch.channels_last),) for _ in range(2)]
    with torch.inference_mode():
        ref = torch.cat([m(*b).float().flatten() for b in batches])
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,)))
    assert all(r["fp8"] and r["path"] == "cudnn" for r in rows)
    every = fp8_static.keep_within(m, rows, batches, 1.0)
    alone = sorted(r["alone_db"] for r in rows)
    assert every["kept"] == 3 and every["psnr_db"] < alone[0]
    floor = (every["psnr_db"] + alone[-1]) / 2                     # between all FP8 and the gentlest layer alone
    fp8_static.plain_layers(m)
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,)))
    plan = fp8_static.keep_within(m, rows, batches, floor)
    with torch.inference_mode():
        got = torch.cat([m(*b).float().flatten() for b in batches])
    assert 1 <= plan["kept"] < 3 and plan["psnr_db"] >= floor
    assert sum(isinstance(x, fp8.FP8Conv2d) for x in m) == plan["kept"]
    assert abs(psnr(got, ref, data_range=1.0) - plan["psnr_db"]) < 1e-3
    fp8_static.plain_layers(m)
    rows = fp8_static.fp8_rewrite(m, fp8_static.calibrate(m, batches, types=(nn.Conv2d,)))
    assert fp8_static.keep_within(m, rows, batches, 200.0) == {"psnr_db": math.inf, "kept": 0, "of": 3}
