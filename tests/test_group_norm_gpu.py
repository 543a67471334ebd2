"""The GroupNorm Triton passes on the GPU host (pytest -m gpu): the function at the SD-VAE decoder's shapes against
fp32 group_norm, and the full-size decoder with them, compiled with CUDA graphs, against the same decoder without."""
import copy

import pytest
import torch
import torch.nn.functional as F

from lab.techniques import group_norm as gn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("c,hw", [(128, 256), (256, 128), (512, 64), (512, 32)])
def test_passes_equal_group_norm_at_decoder_shapes(c, hw):
    torch.manual_seed(0)
    x = (torch.randn(16, c, hw, hw, device="cuda") * 2 + 0.5).half().contiguous(memory_format=torch.channels_last)
    w, b, pre = (torch.randn(c, device="cuda").half() for _ in range(3))
    ref = F.silu(F.group_norm(x.float() + pre.float().view(1, -1, 1, 1), 32, w.float(), b.float(), 1e-6))
    assert _rel(gn.group_norm_nhwc_triton(x, w, b, 32, 1e-6, True, pre), ref) < 1e-3   # fp16 output rounding


def test_decoder_compiled_with_the_passes_matches_without(monkeypatch):
    from lab.models.vae import load_vae

    vae = load_vae("sd-vae", "random", size="full", device="cuda", dtype=torch.float16, seed=0)
    base = vae.decoder_module().to(memory_format=torch.channels_last)
    v2 = copy.deepcopy(vae)
    assert sum(r["fused"] for r in gn.fuse_group_norms(v2.model.decoder)) == 15   # 14 ResNet blocks + conv_norm_out
    eager = v2.decoder_module().to(memory_format=torch.channels_last)
    fused = torch.compile(eager, mode="reduce-overhead", dynamic=False)
    z = (torch.randn(16, 4, 32, 32, device="cuda") * 4).half().contiguous(memory_format=torch.channels_last)
    calls = []
    triton_passes = gn.group_norm_nhwc_triton
    monkeypatch.setattr(gn, "group_norm_nhwc_triton", lambda *a: calls.append(a[0].shape) or triton_passes(*a))
    with torch.inference_mode():
        eager(z)
        assert len(calls) == 29   # every norm ran on the Triton passes, none fell back to torch's
        a = base(z)
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            b = fused(z).clone()
    mse = float(((a.float() - b.float()) ** 2).mean())
    assert 10 * torch.log10(torch.tensor(1 / max(mse, 1e-20))).item() > 60
