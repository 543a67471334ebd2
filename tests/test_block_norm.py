"""LatentSync's ResNet GroupNorm over a block's frames + SiLU (lab.techniques.block_norm): the Triton passes under Triton's
CPU interpreter against a float64 reference (groups of 3–10 channels, a strip of 64 that does not divide C, splits
and tiles that do not divide the rows, a per-item time-embedding shift, a large mean), the module's torch path, the
UNet rewrite (same output, same state dict) and its undo, and the switches that use it."""
import copy

import pytest
import torch
import torch.nn.functional as F

from lab.techniques import block_norm as bn
from lab.errors import InputError
from lab.models.latentsync import BlockGroupNorm, build_unet

pytestmark = pytest.mark.usefixtures("one_thread")

CHECK = """
import torch, torch.nn.functional as F
from lab.techniques import block_norm as bn
torch.manual_seed(0)
bn.ROW_TILE = 16
worst = 0.0
for programs in (4096, 3):   # one split per tile, then few splits of several tiles
    bn.PARTIAL_PROGRAMS = programs
    for bf, frames, c, g, h, w, silu, off, shift in [(4, 2, 40, 4, 5, 7, True, 0.0, "item"),
                                                     (3, 3, 96, 32, 3, 5, False, 300.0, None),
                                                     (2, 1, 80, 8, 9, 2, True, -5.0, "one")]:
        x = (torch.randn(bf, c, h, w) * 3 + off).contiguous(memory_format=torch.channels_last)
        wt, b = torch.randn(c), torch.randn(c)
        n = bf // frames
        t = torch.randn(n if shift == "item" else 1, c) * 10 if shift else None
        y = bn.block_group_norm_triton(x, wt, b, g, 1e-5, silu, frames, t)
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.isnan().any()
        xr = x.double() + (t.double().repeat_interleave(frames if t.shape[0] > 1 else bf, 0)[:, :, None, None] if shift else 0)
        ref = F.group_norm(xr.reshape(n, frames, c, h, w).transpose(1, 2), g, wt.double(), b.double(), 1e-5)
        ref = ref.transpose(1, 2).reshape(bf, c, h, w)
        ref = F.silu(ref) if silu else ref
        worst = max(worst, float((y.double() - ref).norm() / ref.norm()))
        # a channels-first input (what inductor may hand over): the same values, the output in the input's strides
        y2 = bn.block_group_norm_triton(x.contiguous(), wt, b, g, 1e-5, silu, frames, t)
        assert y2.stride() == x.contiguous().stride() and torch.equal(y2, y)
print(worst)
"""


def test_triton_passes_equal_the_block_norm_under_the_interpreter(triton_interpreter):
    # fp32 inputs around a mean of 300 with std 3 carry ~1e-5 of their own rounding; the passes add none beyond it
    assert float(triton_interpreter(CHECK).split()[-1]) < 2e-5


def _norm(c=40, g=4):
    torch.manual_seed(1)
    m = BlockGroupNorm(g, c, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    return m


def test_module_torch_path_is_the_block_norm_then_silu():
    m = _norm()
    x, t = torch.randn(4, 40, 3, 3), torch.randn(2, 40)
    f = bn.FusedBlockGroupNorm(m)
    assert torch.equal(f(x, 2, t), F.silu(m(x, 2, t)))
    assert torch.equal(f(x, 4), F.silu(m(x, 4)))
    f.silu = False
    assert torch.equal(f(x.contiguous(memory_format=torch.channels_last), 2), m(x.contiguous(memory_format=torch.channels_last), 2))


def test_supported_shapes_and_bad_input():
    x = torch.randn(4, 40, 3, 3).contiguous(memory_format=torch.channels_last)
    assert bn.supported(x, 4, 2)
    assert not bn.supported(x.contiguous(), 4, 2)       # NCHW
    assert not bn.supported(x, 3, 2)                    # groups do not divide C
    assert not bn.supported(x, 4, 3)                    # frames do not divide the batch
    with pytest.raises(InputError, match="BlockGroupNorm"):
        bn.FusedBlockGroupNorm(torch.nn.GroupNorm(4, 40))


def test_unet_rewrite_is_the_same_function_and_undoes():
    from lab.pipelines.latentsync.sampling import example_inputs

    model = build_unet("tiny").eval()
    keys = list(model.state_dict())
    x, t, a = example_inputs(model, 2, 4, (8, 8), "cpu", torch.float32, seed=0)
    with torch.inference_mode():
        ref = model(x, t, a)
    fused = copy.deepcopy(model)
    n = bn.fuse_block_norms(fused)
    assert n == 2 * sum(1 for m in model.modules() if type(m).__name__ == "ResnetBlock3D") + 1
    assert bn.fuse_block_norms(fused) == 0 and bn.fused(fused)
    assert list(fused.state_dict()) == keys
    with torch.inference_mode():
        assert torch.equal(fused(x, t, a), ref)   # off the GPU the fused modules run BlockGroupNorm's own code
    assert bn.set_triton(fused, False) == n
    assert bn.unfuse_block_norms(fused) == n and not bn.fused(fused)
    with torch.inference_mode():
        assert torch.equal(fused(x, t, a), ref)


def test_pipeline_switch_builds_the_fused_unet():
    from lab.pipelines import latentsync as P

    eng = P.build(P.Config(size="tiny", dtype="fp32", techniques=("fused_norms",)), "cpu")
    assert bn.fused(eng.unet.model)
    assert not bn.fused(P.build(P.Config(size="tiny", dtype="fp32"), "cpu").unet.model)


UNET = """
import copy, torch
from lab.techniques import block_norm as bn
from lab.pipelines.latentsync import sampling as sampling
from lab.models.latentsync import build_unet
torch.manual_seed(0)
model = build_unet("tiny").eval()
ex = sampling.guided_example(model, 4, (16, 16), "cpu", torch.float32, seed=0)
with torch.inference_mode():
    ref = model(*ex)
fused = copy.deepcopy(model).to(memory_format=torch.channels_last)
n = bn.fuse_block_norms(fused)
calls = []
real = bn.block_group_norm_triton
bn.block_group_norm_triton = lambda *a, **k: calls.append(a[-1] is not None) or real(*a, **k)
with torch.inference_mode():
    worst = max(float((f(*ex) - ref).abs().max()) for f in (fused, sampling.GuidedShortcuts(fused)))
print(n, len(calls), sum(calls), worst / float(ref.abs().max()))
"""


def test_fused_unet_through_the_passes_under_the_interpreter(triton_interpreter):
    # the tiny UNet (channels-last) with its frame-pooled norms on the passes, norm2's with the time embedding,
    # plain and with the guided shortcuts: the plain model's output. The norms after a motion module read its
    # channels-first sum and stay on BlockGroupNorm's code, so not every norm takes the passes
    n, calls, shifted, err = triton_interpreter(UNET).split()[-4:]
    assert 0 < int(calls) <= 2 * int(n) and int(calls) % 2 == 0   # the same norms in both calls
    assert 0 < int(shifted) < int(calls)                           # norm2 with its shift, norm1 without
    assert float(err) < 1e-5
