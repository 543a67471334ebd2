"""The prologue conv on the GPU host (pytest -m gpu): every tile config at the SD-VAE decoder's conv shapes (batch 2)
against the unfused path (the Triton apply pass, then cuDNN's conv), the plain conv against cuDNN's, and the survey
on one small shape."""
import pytest
import torch
import torch.nn.functional as F

from lab.techniques import group_norm as gn
from lab.techniques import norm_conv as nc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(2, 512, 512, 32, 3), (2, 256, 256, 128, 3), (2, 128, 128, 256, 3)])
def test_every_tile_config_equals_the_unfused_path(shape):
    b, cin, cout, hw, _ = shape
    torch.manual_seed(0)
    x = (torch.randn(b, cin, hw, hw, device="cuda") * 2 + 0.5).half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(cout, cin, 3, 3, device="cuda") / (9 * cin) ** 0.5).half()
    bias, gamma, beta = (torch.randn(c, device="cuda").half() for c in (cout, cin, cin))
    stats = gn.group_stats(x, 32, 1e-6)
    a = gn.group_apply(x, stats, gamma, beta, silu=True)
    ref = F.conv2d(a, w.contiguous(memory_format=torch.channels_last), bias, padding=1)
    for cfg in nc.fitting_configs(shape):
        # the same fp16 operands into the matrix multiply: only the summation order and the output rounding differ
        assert _rel(nc.norm_silu_conv3x3(x, stats, gamma, beta, nc.pack_weight(w), bias, cfg), ref) < 2e-3, cfg
        assert _rel(nc.norm_silu_conv3x3(a, None, None, None, nc.pack_weight(w), bias, cfg), ref) < 2e-3, cfg
        assert _rel(nc.norm_silu_conv3x3(x, stats, gamma, beta, nc.pack_weight(w), bias, cfg, True), ref) < 1e-2, cfg


def test_survey_row_on_a_small_shape():
    r = nc.survey_shape((2, 128, 128, 32, 3))
    assert r["rel_err_vs_cudnn"] < 2e-3 and r["fast_sigmoid_rel_err_vs_cudnn"] < 1e-2
    assert r["net_ms"] == pytest.approx(r["apply_ms"] + r["cudnn_ms"] - r["prologue_ms"])
    assert min(r["apply_ms"], r["cudnn_ms"], r["triton_plain_ms"], r["prologue_ms"], r["fast_sigmoid_ms"]) > 0
