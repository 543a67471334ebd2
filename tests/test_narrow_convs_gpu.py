"""The FFT conv's Triton contraction and the tap-form conv on the GPU host (pytest -m gpu): the conv's function at
Ditto's mask- and occlusion-conv shapes, eager and under torch.compile + a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.techniques.fft_conv import FFTConv3d
from lab.techniques.tap_conv import TapConv2d

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_triton_contraction_equals_the_conv_at_ditto_shape():
    torch.manual_seed(0)
    conv = nn.Conv3d(142, 22, 7, padding=3).cuda()
    x = torch.randn(4, 142, 16, 64, 64, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        ref = F.conv3d(x.float(), conv.weight, conv.bias, padding=3)
        tri, bmm = FFTConv3d(conv, (16, 64, 64)), FFTConv3d(conv, (16, 64, 64), contraction="bmm")
        assert tri.contraction == "triton"
        a, b = tri(x), bmm(x)
        assert _rel(a, ref) < 1e-3 and _rel(a, b) < 1e-3   # fp16 output rounding, nothing more
        compiled = torch.compile(tri, dynamic=False)
        assert torch.allclose(compiled(x).float(), a.float(), atol=1e-2)


def test_tap_conv_equals_the_conv_at_ditto_shape():
    torch.manual_seed(0)
    conv = nn.Conv2d(2272, 1, 7, padding=3).cuda().half()
    x = torch.randn(4, 2272, 64, 64, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        ref = F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), padding=3)
        tap = TapConv2d(conv)
        assert _rel(tap(x), ref) < 2e-3 and _rel(torch.compile(tap, dynamic=False)(x), ref) < 2e-3
