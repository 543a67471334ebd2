"""FFT form of a 3-D convolution: the conv's function (any kernel, padding, channel counts), fp32 weights
after a cast to half, one opaque op under torch.compile, clear errors for what it cannot compute."""
import textwrap

import pytest
import torch
from torch import nn

from lab.techniques.fft_conv import FFTConv3d, smooth_size
from lab.errors import InputError


def test_smooth_sizes():
    assert [smooth_size(n) for n in (1, 11, 13, 22, 70, 97)] == [1, 12, 14, 24, 70, 98]


@pytest.mark.parametrize("cin,cout,k,pad,spatial", [(6, 5, 7, 3, (4, 10, 12)), (8, 8, 3, 1, (5, 9, 9)),
                                                    (3, 2, 3, 0, (6, 6, 7)), (4, 3, 5, 1, (6, 8, 8)),
                                                    (2, 3, (3, 5, 1), (1, 2, 0), (5, 7, 6))])
def test_equals_the_conv(cin, cout, k, pad, spatial):
    torch.manual_seed(0)
    conv = nn.Conv3d(cin, cout, k, padding=pad)
    x = torch.randn(2, cin, *spatial)
    ref, got = conv(x), FFTConv3d(conv, spatial)(x)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_half_keeps_fp32_weights_and_compiles_as_one_op():
    conv = nn.Conv3d(6, 5, 7, padding=3)
    x = torch.randn(2, 6, 4, 10, 12)
    f = FFTConv3d(conv, (4, 10, 12)).half()
    assert f.w_hat.dtype == torch.float32
    y = f(x.half())
    assert y.dtype == torch.float16 and (y.float() - conv(x)).abs().max() < 2e-2 * conv(x).abs().max()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.half()), y)


def test_bad_inputs():
    with pytest.raises(InputError, match="stride"):
        FFTConv3d(nn.Conv3d(2, 2, 3, stride=2, padding=1), (4, 8, 8))
    with pytest.raises(InputError, match="groups"):
        FFTConv3d(nn.Conv3d(2, 2, 3, groups=2, padding=1), (4, 8, 8))
    with pytest.raises(InputError, match="padding"):
        FFTConv3d(nn.Conv3d(2, 2, 3, padding="same"), (4, 8, 8))
    with pytest.raises(InputError, match="Conv3d"):
        FFTConv3d(nn.Conv2d(2, 2, 3), (4, 8, 8))
    with pytest.raises(InputError, match="smaller than the kernel"):
        FFTConv3d(nn.Conv3d(2, 2, 7), (4, 8, 8))
    f = FFTConv3d(nn.Conv3d(2, 3, 3, padding=1), (4, 8, 8))
    with pytest.raises(InputError, match="built for inputs"):
        f(torch.randn(1, 2, 4, 8, 9))


CHECK = textwrap.dedent("""
    import torch
    from torch import nn
    from lab.techniques.fft_conv import FFTConv3d
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 3, 3, padding=1)
    x = torch.randn(2, 3, 4, 6, 6)
    f = FFTConv3d(conv, (4, 6, 6), contraction="triton")
    ref = conv(x)
    print(f.contraction, ((f(x) - ref).abs().max() / ref.abs().max()).item())
""")


def test_triton_contraction_under_the_interpreter(triton_interpreter):
    name, err = triton_interpreter(CHECK).split()[-2:]
    assert name == "triton" and float(err) < 1e-5


def test_auto_contraction_is_bmm_off_the_gpu_and_bad_names_are_refused():
    assert FFTConv3d(nn.Conv3d(2, 2, 3, padding=1), (4, 6, 6)).contraction == "bmm"
    with pytest.raises(InputError, match="contraction"):
        FFTConv3d(nn.Conv3d(2, 2, 3, padding=1), (4, 6, 6), contraction="fast")


def test_explicit_transform_sizes_and_too_small_ones_refused():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 2, 3, padding=1)
    x = torch.randn(2, 3, 4, 6, 6)
    f = FFTConv3d(conv, (4, 6, 6), sizes=(8, 9, 10))
    assert f.fft == [8, 9, 10] and (f(x) - conv(x)).abs().max() <= 1e-5 * conv(x).abs().max()
    with pytest.raises(InputError, match="at least input"):
        FFTConv3d(conv, (4, 6, 6), sizes=(5, 8, 8))   # depth needs 4 + 3 − 1 = 6


def test_output_channel_blocks():
    pytest.importorskip("triton")
    from lab.techniques.fft_conv import _o_blocks

    assert _o_blocks(22, True) == (16, 8) and _o_blocks(22, False) == (32, 1)
    assert _o_blocks(8, True) == (8, 1) and _o_blocks(17, True) == (16, 2) and _o_blocks(3, True) == (2, 2)


SPLIT = textwrap.dedent("""
    import torch
    from torch import nn
    from lab.techniques import fft_conv as fc
    torch.manual_seed(0)
    errs = []
    for cout, split, stages in ((22, True, 3), (22, False, 1), (5, True, 2)):
        fc.TRITON_TILE.update(split_o=split, stages=stages, block_f=4)
        conv = nn.Conv3d(3, cout, 3, padding=1)
        x = torch.randn(3, 3, 4, 6, 6)
        ref = conv(x)
        errs.append(((fc.FFTConv3d(conv, (4, 6, 6), contraction="triton")(x) - ref).abs().max() / ref.abs().max()).item())
    print(max(errs))
""")


def test_triton_contraction_channel_split_and_pipeline(triton_interpreter):
    assert float(triton_interpreter(SPLIT).split()[-1]) < 1e-5
