"""A 3×3 conv of a nearest-upsampled map computed on the map itself: the same function, fewer taps."""
import pytest
import torch
import torch.nn.functional as F

from lab.techniques.nearest_conv import FoldedUpsample, NearestConv, fold_upsamplers, taps
from lab.errors import InputError


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_same_function_as_upsample_then_conv(scale):
    torch.manual_seed(scale)
    conv = torch.nn.Conv2d(5, 7, 3, padding=1).double()
    x = torch.randn(2, 5, 6, 9, dtype=torch.float64)   # not square: rows and columns indexed apart
    ref = conv(F.interpolate(x, scale_factor=scale, mode="nearest"))
    out = NearestConv(conv, scale)(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-12
    # a conv without bias, and a channels-last input
    conv.bias = None
    xc = x.contiguous(memory_format=torch.channels_last)
    assert torch.allclose(NearestConv(conv, scale)(xc), conv(F.interpolate(x, scale_factor=scale)), atol=1e-12)


def test_fewer_taps_and_half_precision_rounds_once():
    assert taps(2) == (36, 16) and taps(4) == (144, 36)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 8, 3, padding=1)
    x = torch.randn(1, 16, 8, 8)
    ref = conv.double()(F.interpolate(x.double(), scale_factor=4))
    half = NearestConv(conv.double().to(torch.bfloat16), 4)
    assert half.weight.dtype == torch.bfloat16
    err = (half(x.to(torch.bfloat16)).double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2


def test_bad_convs_are_refused():
    with pytest.raises(InputError, match="3×3 conv with padding 1"):
        NearestConv(torch.nn.Conv2d(2, 2, 3, padding=0), 2)
    with pytest.raises(InputError, match="3×3 conv with padding 1"):
        NearestConv(torch.nn.Conv2d(2, 2, 1), 2)
    with pytest.raises(InputError, match="integer upsampling factor"):
        NearestConv(torch.nn.Conv2d(2, 2, 3, padding=1), 1)
    with pytest.raises(InputError, match="spectral norm"):
        NearestConv(torch.nn.utils.spectral_norm(torch.nn.Conv2d(2, 2, 3, padding=1)), 2)


def test_latentsync_upsamplers_fold_and_unfold():
    from lab.models.latentsync import Upsample, build_unet

    torch.manual_seed(0)
    model = build_unet("tiny").double()
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    ups = [m for m in model.modules() if isinstance(m, Upsample)]
    x = torch.randn(2, ups[0].conv.in_channels, 4, 4, dtype=torch.float64)
    ref = ups[0](x)
    assert fold_upsamplers(model) == len(ups) > 0
    folded = [m for m in model.modules() if isinstance(m, FoldedUpsample)]
    assert (folded[0](x) - ref).abs().max() < 1e-12
    sd = model.state_dict()   # the checkpoint's keys and tensors, nothing added
    assert sd.keys() == keys.keys() and all(torch.equal(sd[k], keys[k]) for k in keys)
    weights = [m.folded_weight for m in folded]
    assert fold_upsamplers(model) == len(ups)          # folding twice changes nothing
    assert fold_upsamplers(model, on=False) == 0
    # unfolded, the same modules run upsample + conv, and their folded kernels stay allocated: a graph
    # captured while folded keeps reading live memory
    after = [m for m in model.modules() if isinstance(m, FoldedUpsample)]
    assert after == folded and all(m.folded_weight is w for m, w in zip(after, weights))
    assert torch.equal(after[0](x), ref)
    assert fold_upsamplers(model) == len(ups)
