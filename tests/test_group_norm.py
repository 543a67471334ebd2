"""GroupNorm + SiLU on channels-last tensors (lab.techniques.group_norm): the Triton passes under Triton's CPU
interpreter against float64 group_norm (splits that do not divide the pixels, a producer's bias, a large mean),
the module's torch path, the decoder rewrite and its undo, and the MuseTalk pipeline's switch."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.techniques import group_norm as gn
from lab.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")

CHECK = """
import torch, torch.nn.functional as F
from lab.techniques import group_norm as gn
torch.manual_seed(0)
gn.TILE_ELEMS = gn.STATS_TILE_ELEMS = 256   # several tiles per split and a partial last tile at these sizes
worst = 0.0
for programs in (512, 6, 3, 2):   # one split per tile, then splits of several tiles (3 and 6: not powers of two)
    gn.SPLIT_PROGRAMS = programs
    for n, c, h, w, g, silu, off, bias in [(2, 32, 5, 7, 8, True, 0.0, True), (1, 64, 9, 9, 32, False, 300.0, False),
                                           (3, 16, 33, 4, 4, True, -5.0, True)]:
        x = (torch.randn(n, c, h, w) * 3 + off).contiguous(memory_format=torch.channels_last)
        wt, b = torch.randn(c), torch.randn(c)
        pre = torch.randn(c) * 10 if bias else None
        y = gn.group_norm_nhwc_triton(x, wt, b, g, 1e-6, silu, pre)
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.isnan().any()
        xr = x.double() + (pre.double().view(1, -1, 1, 1) if bias else 0)
        ref = F.group_norm(xr, g, wt.double(), b.double(), 1e-6)
        ref = F.silu(ref) if silu else ref
        worst = max(worst, float((y.double() - ref).norm() / ref.norm()))
print(worst)
"""


def test_triton_passes_equal_group_norm_under_the_interpreter(triton_interpreter):
    # fp32 inputs around a mean of 300 with std 3 carry ~1e-5 of their own rounding; the passes add none beyond it
    assert float(triton_interpreter(CHECK).split()[-1]) < 2e-5


def _norm(c=32, g=8):
    torch.manual_seed(1)
    m = nn.GroupNorm(g, c, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    return m


def test_module_torch_path_is_group_norm_then_silu():
    m = _norm()
    x = torch.randn(2, 32, 6, 6)
    pre = nn.Parameter(torch.randn(32))
    assert torch.allclose(gn.FusedGroupNorm(m, silu=True)(x), F.silu(m(x)), atol=1e-6)
    assert torch.allclose(gn.FusedGroupNorm(m)(x), m(x), atol=1e-6)
    assert torch.allclose(gn.FusedGroupNorm(m, silu=True, pre_bias=pre)(x), F.silu(m(x + pre.view(1, -1, 1, 1))), atol=1e-5)


def test_supported_shapes():
    x = torch.randn(2, 32, 4, 4).contiguous(memory_format=torch.channels_last)
    assert gn.supported(x, 8)
    assert not gn.supported(x.contiguous(), 8)                                           # NCHW
    assert not gn.supported(torch.randn(2, 24, 4, 4).contiguous(memory_format=torch.channels_last), 8)  # C not 2^k
    assert not gn.supported(torch.randn(2, 32, 4), 8)
    assert not gn.supported(torch.randn(1, 1024, 2, 2).contiguous(memory_format=torch.channels_last), 32)  # > MAX_CHANNELS


def test_bad_input_is_named():
    with pytest.raises(InputError, match="nn.GroupNorm"):
        gn.FusedGroupNorm(nn.BatchNorm2d(4))
    with pytest.raises(InputError, match="affine"):
        gn.FusedGroupNorm(nn.GroupNorm(2, 4, affine=False))


def test_decoder_rewrite_is_the_same_function_and_undoes():
    from lab.models.vae import load_vae

    vae = load_vae("sd-vae", "random", size="tiny")
    ref = vae.decoder_module()
    fused = copy.deepcopy(vae)
    rows = gn.fuse_group_norms(fused.model.decoder)
    assert rows and all(r["fused"] for r in rows)
    blk = fused.model.decoder.up_blocks[0].resnets[0]
    assert blk.conv1.bias is None and blk.norm2.pre_bias is not None and isinstance(blk.nonlinearity, nn.Identity)
    z = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        assert torch.allclose(fused.decoder_module()(z), ref(z), atol=1e-5)
        assert all(r["reason"] == "already fused" for r in gn.fuse_group_norms(fused.model.decoder) if "resnets" in r["module"])
        assert gn.unfuse_group_norms(fused.model.decoder) == len(rows)
        blk = fused.model.decoder.up_blocks[0].resnets[0]
        assert isinstance(blk.norm2, nn.GroupNorm) and blk.conv1.bias is not None
        assert torch.equal(fused.decoder_module()(z), ref(z))
        assert fused.model.decoder.state_dict().keys() == vae.model.decoder.state_dict().keys()


def test_pipeline_switch_same_frames_and_back():
    from lab.pipelines import Encode
    from lab.pipelines import musetalk as mt

    cfg = mt.Config(size="tiny", frame_size=(128, 192), crop=64, batch_size=4, encode=Encode(writer="null", queue=3),
                    face_crop="geometric")
    e = mt.build(cfg, "cpu")
    av = mt.prepare(e, mt.avatar_loop(6, (128, 192)))
    on = mt.reconfigure(e, techniques=("fused_norm",))
    assert isinstance(on.decoder.model.decoder.conv_norm_out, gn.FusedGroupNorm)
    off = mt.reconfigure(on, techniques=())
    assert isinstance(off.decoder.model.decoder.conv_norm_out, nn.GroupNorm)
    assert off.decoder is e.decoder   # the original decoder, not an unfused copy
    z = torch.randn(4, 4, 16, 16)
    with torch.no_grad():
        assert torch.allclose(on.decoder(z), e.decoder(z), atol=1e-5)
    audio = (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)
    assert mt.run(on, av, audio, 24000, n_frames=8).n_frames == 8
