"""Tap form of a narrow 2-D convolution (one matmul + shifted sum): the conv's function, under torch.compile
too, and clear errors for what it cannot compute."""
import pytest
import torch
from torch import nn

from lab.techniques.tap_conv import MAX_OUT, TapConv2d
from lab.errors import InputError


@pytest.mark.parametrize("cin,cout,k,pad,hw", [(40, 1, 7, 3, (16, 16)), (8, 3, (3, 5), (1, 0), (9, 11)),
                                               (5, 2, 3, 0, (6, 7)), (6, 8, 1, 0, (5, 5)), (4, 1, 5, 4, (3, 4))])
def test_equals_the_conv(cin, cout, k, pad, hw):
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, padding=pad)
    x = torch.randn(2, cin, *hw)
    ref, got = conv(x), TapConv2d(conv)(x)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_no_bias_half_and_compiled():
    torch.manual_seed(0)
    conv = nn.Conv2d(12, 1, 7, padding=3, bias=False)
    x = torch.randn(2, 12, 10, 10)
    tap = TapConv2d(conv)
    assert tap.bias is None and torch.allclose(tap(x), conv(x), atol=1e-5)
    y = TapConv2d(conv).half()(x.half())
    assert y.dtype == torch.float16 and (y.float() - conv(x)).abs().max() < 2e-3 * conv(x).abs().max()
    compiled = torch.compile(TapConv2d(conv), backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(x), conv(x), atol=1e-5)


def test_bad_inputs():
    with pytest.raises(InputError, match="stride"):
        TapConv2d(nn.Conv2d(4, 1, 3, stride=2))
    with pytest.raises(InputError, match="groups"):
        TapConv2d(nn.Conv2d(4, 2, 3, groups=2))
    with pytest.raises(InputError, match="padding"):
        TapConv2d(nn.Conv2d(4, 1, 3, padding="same"))
    with pytest.raises(InputError, match="Conv2d"):
        TapConv2d(nn.Conv3d(4, 1, 3))
    with pytest.raises(InputError, match=f"at most {MAX_OUT}"):
        TapConv2d(nn.Conv2d(4, MAX_OUT + 1, 3))
    tap = TapConv2d(nn.Conv2d(4, 1, 3, padding=1))
    with pytest.raises(InputError, match=r"expects \(B, 4, H, W\)"):
        tap(torch.randn(1, 5, 8, 8))
    with pytest.raises(InputError, match="smaller than the kernel"):
        TapConv2d(nn.Conv2d(4, 1, 5))(torch.randn(1, 4, 3, 3))
