"""Merged SPADE modulation convs: the same function as the decoder, and a clear error before folding."""
import copy

import pytest
import torch

from lab.techniques.spade_fuse import fuse_spade
from lab.techniques.spectral_fold import fold_spectral_norm
from lab.errors import InputError
from lab.models import ditto as D


def test_fused_decoder_is_the_same_function():
    torch.manual_seed(0)
    dec, _ = D.load_component("decoder", "random", "tiny", seed=3)
    d = D.dims("tiny")
    with pytest.raises(InputError, match="fold the spectral norm"):
        fuse_spade(dec)
    dec = copy.deepcopy(dec)
    fold_spectral_norm(dec)
    fused = fuse_spade(dec)
    # 2 middle blocks × 2 norms share one conv at the low resolution; up blocks have 3 norms each
    assert fused.shared_lo.out_channels == 2 * d.dec_middle * d.dec_hidden
    assert fused.shared_1.out_channels == 3 * d.dec_hidden
    x = torch.randn(2, d.warp_out, d.feature_hw, d.feature_hw)
    with torch.no_grad():
        ref, out = dec(x), fused(x)
    assert out.shape == ref.shape == (2, 3, d.render_hw, d.render_hw)
    assert torch.allclose(out, ref, atol=1e-5)
    with pytest.raises(InputError, match="SPADEDecoder"):
        fuse_spade(torch.nn.Conv2d(1, 1, 1))


def test_lowres_segmap_convs_are_the_same_function():
    torch.manual_seed(0)
    dec, _ = D.load_component("decoder", "random", "tiny", seed=3)
    d = D.dims("tiny")
    dec = dec.double()
    fold_spectral_norm(dec)
    x = torch.randn(2, d.warp_out, d.feature_hw, d.feature_hw, dtype=torch.float64)
    low = fuse_spade(dec, lowres_seg=True)
    with torch.no_grad():
        ref, out = dec(x), low(x)
    assert (out - ref).abs().max() < 1e-10
    # a segmap whose size the decoder's upsampling does not match is refused, not misread
    with pytest.raises(InputError, match="lowres_seg"):
        low._seg(x, torch.zeros(1, 1, 3 * d.feature_hw, 3 * d.feature_hw), 2)


def test_shortcut_folded_into_beta_is_the_same_function():
    torch.manual_seed(0)
    dec, _ = D.load_component("decoder", "random", "tiny", seed=3)
    d = D.dims("tiny")
    dec = dec.double()
    fold_spectral_norm(dec)
    x = torch.randn(2, d.warp_out, d.feature_hw, d.feature_hw, dtype=torch.float64)
    both = fuse_spade(dec, lowres_seg=True, fold_shortcut=True)
    with torch.no_grad():
        ref, out = dec(x), both(x)
    assert (out - ref).abs().max() < 1e-10
    # the shortcut norm's β conv makes the shortcut's fout channels instead of its fin
    for blk, fin, fout in ((both.up_0, 2 * d.dec_ic, d.dec_ic), (both.up_1, d.dec_ic, d.dec_oc)):
        assert blk.fold_shortcut and blk.gb[0].out_channels == fin + fout
    assert not any(b.fold_shortcut for b in both.middle)   # no learned shortcut there


def test_lowres_hidden_maps_reach_their_convs_packed():
    """The low-res shared conv's output is channels-last; its per-norm slices are handed on as packed NHWC
    tensors (cuDNN would copy a strided slice before every γβ conv), with the same values."""
    torch.manual_seed(0)
    dec, _ = D.load_component("decoder", "random", "tiny", seed=3)
    d = D.dims("tiny")
    fold_spectral_norm(dec)
    low = fuse_spade(dec, lowres_seg=True)
    seg = torch.randn(2, d.warp_out, d.feature_hw, d.feature_hw)
    h = low.shared_1(seg)
    assert h.is_contiguous(memory_format=torch.channels_last) and not h.is_contiguous()
    parts = low._split(h, [low.up_1])[0]
    assert len(parts) == 3
    for i, p in enumerate(parts):
        assert p.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(p, torch.relu(h[:, i * d.dec_hidden:(i + 1) * d.dec_hidden]))
    # the 64² map is NCHW: its slices stay views of one relu output (strided NCHW is what cuDNN takes)
    lo = low.shared_lo(seg)
    views = [p for g in low._split(lo, list(low.middle)) for p in g]
    assert len({p.untyped_storage().data_ptr() for p in views}) == 1
