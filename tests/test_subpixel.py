"""Folding nearest-2x + 3x3 conv into a transposed conv / phase conv: exactness (float64) against
diffusers' Upsample2D and a whole tiny AutoencoderKL decoder, layouts and dtypes, eligibility,
errors, the FLOP counter."""
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from diffusers.models.upsampling import Upsample2D
from torch import nn

from lab.techniques.subpixel import (
    IMPLS,
    SubpixelUpsampleConv,
    eligible,
    rewrite_upsamplers,
    upsample_conv_flops,
)
from lab.errors import InputError


def _upsampler(c=3, c2=5, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    up = Upsample2D(channels=c, use_conv=True, out_channels=c2, **kw).to(dtype)
    with torch.no_grad():  # default init is small; random weights and bias exercise every tap
        up.conv.weight.normal_()
        if up.conv.bias is not None:
            up.conv.bias.normal_()
    return up


def _tiny_vae():
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
        sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    ).eval()


def test_fold_formula_matches_the_brief():
    # The brief's 1-D kernel [w2, w1+w2, w0+w1, w0] as a transposed conv equals upsample + conv.
    torch.manual_seed(1)
    w = torch.randn(1, 1, 1, 3, dtype=torch.float64)
    x = torch.randn(1, 1, 1, 9, dtype=torch.float64)
    w0, w1, w2 = w.flatten()
    k = torch.stack([w2, w1 + w2, w0 + w1, w0]).view(1, 1, 1, 4)
    ref = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, padding=(0, 1))
    got = F.conv_transpose2d(x, k, stride=(1, 2), padding=(0, 1))
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hw", [(5, 7), (8, 8), (1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_standalone_float64_exact(impl, hw, bias):
    up = _upsampler(bias=bias)
    x = torch.randn(2, 3, *hw, dtype=torch.float64)
    ref = up(x)
    sub = SubpixelUpsampleConv.from_upsample(up, impl)
    out = sub(x)
    assert out.shape == ref.shape == (2, 5, 2 * hw[0], 2 * hw[1])
    assert (out - ref).abs().max().item() < 1e-10
    # the decoder's call forms: output_size equal to 2x takes the folded path, too
    assert (sub(x, (2 * hw[0], 2 * hw[1])) - ref).abs().max().item() < 1e-10
    assert not any(p.shape[-1] == 3 for p in sub.parameters())  # the 3x3 weight is not kept
    assert f"impl='{impl}'" in repr(sub) and "3, 5" in repr(sub)


@pytest.mark.parametrize("impl", IMPLS)
def test_odd_output_size_falls_back_to_the_original_path(impl):
    # UNet up blocks pass the skip connection's size, which may be odd (not a 2x replication).
    up = _upsampler()
    x = torch.randn(1, 3, 5, 7, dtype=torch.float64)
    sub = SubpixelUpsampleConv.from_upsample(up, impl)
    for size in [(9, 13), (10, 13)]:
        assert (sub(x, size) - up(x, size)).abs().max().item() < 1e-10


@pytest.mark.parametrize("impl", IMPLS)
def test_whole_decoder_float64(impl):
    vae = _tiny_vae().to(torch.float64)
    z = torch.randn(2, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    n_up = sum(isinstance(m, Upsample2D) for m in vae.decoder.modules())
    with torch.no_grad():
        ref = vae.decode(z).sample
        rows = rewrite_upsamplers(vae.decoder, impl=impl)
        out = vae.decode(z).sample
    assert n_up >= 1 and len(rows) == n_up
    assert all(r["status"] == "rewritten" for r in rows)
    assert not any(isinstance(m, Upsample2D) for m in vae.decoder.modules())
    assert sum(isinstance(m, SubpixelUpsampleConv) for m in vae.decoder.modules()) == n_up
    assert rows[0]["flops_saved_fraction"] == pytest.approx(1 - 16 / 36)
    assert {"name", "status", "reason", "c_in", "c_out", "flops_saved_fraction"} <= rows[0].keys()
    assert (out - ref).abs().max().item() < 1e-9


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_channels_last_and_half(impl):
    vae = _tiny_vae()
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = vae.decode(z).sample
        rewrite_upsamplers(vae.decoder, impl=impl)
        vae = vae.to(memory_format=torch.channels_last)
        sub = next(m for m in vae.decoder.modules() if isinstance(m, SubpixelUpsampleConv))
        assert sub.weight.is_contiguous(memory_format=torch.channels_last)
        x = torch.randn(1, sub.channels, 6, 6).to(memory_format=torch.channels_last)
        assert sub(x).is_contiguous(memory_format=torch.channels_last)
        out = vae.decode(z.to(memory_format=torch.channels_last)).sample
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4

    vae = vae.to(torch.float16)
    assert sub.weight.dtype == torch.float16
    try:
        with torch.no_grad():
            half = vae.decode(z.half()).sample
    except RuntimeError as e:  # some CPU builds lack half kernels for these ops
        pytest.skip(f"float16 decode not supported on this CPU build: {e}")
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    assert ((half.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_half_weight_built_in_float32_then_cast():
    up = _upsampler(dtype=torch.float16)
    sub = SubpixelUpsampleConv.from_upsample(up, "transpose")
    w = up.conv.weight.double()
    a = torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    assert torch.equal(sub.weight, (a @ w @ a.T).transpose(0, 1).half())  # one rounding only


@pytest.mark.parametrize("kw, reason", [
    (dict(use_conv=False), "use_conv=False"),
    (dict(use_conv=True, use_conv_transpose=True), "conv_transpose"),
    (dict(use_conv=True, norm_type="ln_norm", eps=1e-5, elementwise_affine=True), "norm"),
    (dict(use_conv=True, kernel_size=5, padding=2), "kernel 5x5"),
    (dict(use_conv=True, padding=0), "padding"),
    (dict(use_conv=True, interpolate=False), "interpolate=False"),
])
def test_ineligible_upsamplers_are_skipped_and_untouched(kw, reason):
    torch.manual_seed(0)
    up = Upsample2D(channels=4, **kw)
    ok, why = eligible(up)
    assert not ok and reason in why
    model = nn.Sequential(nn.Identity(), up)
    rows = rewrite_upsamplers(model)
    assert model[1] is up
    assert rows == [{"name": "1", "status": "skipped", "reason": why, "c_in": 4, "c_out": 4,
                     "flops_saved_fraction": 0.0}]
    with pytest.raises(InputError, match=reason):
        SubpixelUpsampleConv.from_upsample(up)


def test_eligible_reasons_for_non_upsamplers():
    assert eligible(nn.Conv2d(3, 3, 3)) == (False, "not an Upsample2D (Conv2d)")
    assert eligible(_upsampler()) == (True, "nearest 2x + 3x3 conv")


def test_model_without_upsamplers_and_root_upsampler():
    assert rewrite_upsamplers(nn.Sequential(nn.Conv2d(3, 3, 3))) == []
    up = _upsampler()
    (row,) = rewrite_upsamplers(up)
    assert row["status"] == "skipped" and "model itself" in row["reason"]


def test_bad_impl_is_an_input_error():
    for call in (lambda: rewrite_upsamplers(nn.Identity(), impl="fft"),
                 lambda: SubpixelUpsampleConv.from_upsample(_upsampler(), impl="fft"),
                 lambda: upsample_conv_flops(4, 4, 8, 8, "fft")):
        with pytest.raises(InputError, match="transpose") as e:
            call()
        assert "phases" in str(e.value)


def test_flop_counter_ratio():
    naive = upsample_conv_flops(512, 512, 64, 64, "naive")
    assert naive == 2 * 512 * 512 * 9 * 128 * 128
    assert naive / upsample_conv_flops(512, 512, 64, 64, "transpose") == 36 / 16
    phases = upsample_conv_flops(512, 512, 64, 64, "phases")
    assert phases / upsample_conv_flops(512, 512, 64, 64, "transpose") == (65 * 65) / (64 * 64)
    with pytest.raises(InputError):
        upsample_conv_flops(0, 4, 8, 8, "naive")


def test_flop_counter_agrees_with_torch():
    from torch.utils.flop_counter import FlopCounterMode

    up = _upsampler(c=4, c2=6, dtype=torch.float32)
    x = torch.randn(1, 4, 8, 10)
    for impl, module in [("naive", up), ("transpose", SubpixelUpsampleConv.from_upsample(up))]:
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            module(x)
        assert fc.get_total_flops() == upsample_conv_flops(4, 6, 8, 10, impl)
