"""FP8 layers with static scales on the GPU host (pytest -m gpu): Ditto's `fp8_conv` decoder runs cuDNN FP8 convs
(not the emulation) inside the compiled, captured renderer and stays near the fp16 renderer it replaces."""
import numpy as np
import pytest
import torch

from lab.metrics import psnr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_ditto_fp8_conv_renderer_compiled_and_captured_stays_near_fp16():
    from lab.pipelines import config
    from lab.pipelines import ditto as P
    from lab.runtime import cudnn_graph
    from lab.techniques import fp8

    for ok, why in (fp8.fp8_supported("cuda"), cudnn_graph.available("cuda", "fp8")):
        if not ok:
            pytest.skip(why)
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
