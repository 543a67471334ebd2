"""The ResNet block norms' Triton passes on the GPU host (pytest -m gpu): at LatentSync's full-size shapes against a
float64 reference, inside a compiled graph, and the fused tiny UNet against the plain one in fp16 channels-last."""
import copy

import pytest
import torch
import torch.nn.functional as F

from lab.techniques import block_norm as bn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _ref(x, w, b, g, frames, t, silu=True):
    bf, c, h, wd = x.shape
    xr = x.double() + t.double().repeat_interleave(frames, 0)[:, :, None, None]
    y = F.group_norm(xr.reshape(bf // frames, frames, c, h, wd).transpose(1, 2), g, w.double(), b.double(), 1e-5)
    y = y.transpose(1, 2).reshape(bf, c, h, wd)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("bf,c,hw", [(32, 320, 64), (32, 960, 64), (32, 1920, 32), (32, 2560, 8), (16, 320, 64)])
def test_passes_at_the_unets_shapes(bf, c, hw):
    torch.manual_seed(0)
    x = torch.randn(bf, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last) * 2 + 1
    w, b, t = torch.randn(c, device="cuda"), torch.randn(c, device="cuda"), torch.randn(bf // 16, c, device="cuda").half()
    y = bn.block_group_norm(x, w.half(), b.half(), 32, 1e-5, True, 16, t)
    ref = _ref(x, w.half(), b.half(), 32, 16, t)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert float((y.double() - ref).norm() / ref.norm()) < 2e-3   # fp16 output rounding


def test_the_op_inside_a_compiled_graph():
    torch.manual_seed(0)
    x = torch.randn(32, 640, 32, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w, b, t = torch.randn(640, device="cuda").half(), torch.randn(640, device="cuda").half(), torch.randn(2, 640, device="cuda").half()
    f = torch.compile(lambda x, t: bn.block_group_norm(x * 2, w, b, 32, 1e-5, True, 16, t) + 1, fullgraph=True)
    assert torch.allclose(f(x, t), bn.block_group_norm(x * 2, w, b, 32, 1e-5, True, 16, t) + 1, atol=2e-3)


def test_fused_unet_matches_the_plain_unet():
    from lab.pipelines.latentsync.sampling import example_inputs
    from lab.metrics import cosine
    from lab.models.latentsync import build_unet

    model = build_unet("tiny", "cuda").half().eval().to(memory_format=torch.channels_last)
    ex = example_inputs(model, 2, 8, (16, 16), "cuda", torch.float16, seed=0)
    with torch.inference_mode():
        ref = model(*ex).float()
        fused = copy.deepcopy(model)
        assert bn.fuse_block_norms(fused) > 0
        calls = []
        real = bn.block_group_norm_triton
        bn.block_group_norm_triton = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            out = fused(*ex).float()
        finally:
            bn.block_group_norm_triton = real
    assert calls, "the Triton passes did not run"
    assert cosine(out, ref) > 0.99999
