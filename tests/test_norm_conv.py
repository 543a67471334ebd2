"""GroupNorm + SiLU in a 3×3 conv's prologue (lab.techniques.norm_conv): the Triton implicit-GEMM conv under
Triton's CPU interpreter against conv2d(silu(group_norm(x))) in float64 (borders, several channel steps, two
samples with their own statistics), the plain conv by the same kernel, the weight packing, refusals and the
survey's command line."""
import pytest
import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.techniques import norm_conv as nc

pytestmark = pytest.mark.usefixtures("one_thread")

CHECK = """
import torch, torch.nn.functional as F
from lab.techniques import norm_conv as nc
from lab.techniques import group_norm as gn
torch.manual_seed(0)
worst_pro = worst_plain = 0.0
# (N, C, Cout, H, W, groups): C over several BK steps, a non-square image, samples with different means
for n, c, co, h, w, g in [(2, 32, 16, 4, 8, 4), (1, 64, 32, 8, 6, 16), (3, 16, 16, 2, 8, 8)]:
    x = torch.randn(n, c, h, w) * 2 + torch.arange(n).view(n, 1, 1, 1) * 5.0
    x = x.contiguous(memory_format=torch.channels_last)
    wt, b = torch.randn(co, c, 3, 3) / (9 * c) ** 0.5, torch.randn(co)
    gamma, beta = 1 + 0.3 * torch.randn(c), 0.3 * torch.randn(c)
    y = nc.norm_silu_conv3x3(x, gn.group_stats(x, g, 1e-6), gamma, beta, nc.pack_weight(wt), b)
    assert y.shape == (n, co, h, w) and y.is_contiguous(memory_format=torch.channels_last)
    a = F.silu(F.group_norm(x.double(), g, gamma.double(), beta.double(), 1e-6))
    ref = F.conv2d(a, wt.double(), b.double(), padding=1)
    worst_pro = max(worst_pro, float((y.double() - ref).norm() / ref.norm()))
    yp = nc.norm_silu_conv3x3(x, None, None, None, nc.pack_weight(wt), None)
    refp = F.conv2d(x.double(), wt.double(), None, padding=1)
    worst_plain = max(worst_plain, float((yp.double() - refp).norm() / refp.norm()))
print(worst_pro, worst_plain)
"""


def test_prologue_conv_equals_conv_of_the_normalized_input_under_the_interpreter(triton_interpreter):
    pro, plain = (float(v) for v in triton_interpreter(CHECK).split()[-2:])
    assert pro < 1e-5 and plain < 1e-5


def test_pack_weight_is_tap_major():
    w = torch.randn(5, 3, 3, 3)
    p = nc.pack_weight(w)
    assert p.shape == (27, 5)
    # row t·Cin + c, column o holds w[o, c, t // 3, t % 3]
    assert torch.equal(p[4 * 3 + 2], w[:, 2, 1, 1]) and torch.equal(p[8 * 3 + 0], w[:, 0, 2, 2])
    with pytest.raises(InputError, match="Cout, Cin, 3, 3"):
        nc.pack_weight(torch.randn(5, 3, 1, 1))


def test_reference_rounds_between_norm_and_conv():
    torch.manual_seed(0)
    x = torch.randn(1, 8, 4, 4).half()
    w, g, b = torch.randn(4, 8, 3, 3), torch.ones(8), torch.zeros(8)
    a = F.silu(F.group_norm(x.float(), 2, g, b, 1e-6)).half().float()
    assert torch.equal(nc.reference(x, w, None, g, b, 2, 1e-6), F.conv2d(a, w, None, padding=1))


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(1, 16, 4, 4), torch.randn(144, 8)), "channels-last"),
    (lambda: (torch.randn(1, 16, 4, 4).contiguous(memory_format=torch.channels_last), torch.randn(16, 8)), "pack_weight"),
    (lambda: (torch.randn(1, 16, 3, 5).contiguous(memory_format=torch.channels_last), torch.randn(144, 16)), "H·W a multiple"),
])
def test_bad_inputs_are_named(make, match):
    x, w = make()
    with pytest.raises(InputError, match=match):
        nc.norm_silu_conv3x3(x, None, None, None, w, None)


def test_bad_statistics_and_a_cpu_tensor_are_named():
    x = torch.randn(2, 32, 4, 4).contiguous(memory_format=torch.channels_last)
    w = nc.pack_weight(torch.randn(16, 32, 3, 3))
    g = torch.ones(32)
    with pytest.raises(InputError, match=r"stats: expected .*\(N=2, groups, 2\) float32"):
        nc.norm_silu_conv3x3(x, torch.zeros(1, 4, 2), g, g, w, None, config=(16, 16, 16, 1, 1))
    with pytest.raises(InputError, match="stats: expected"):
        nc.norm_silu_conv3x3(x, torch.zeros(2, 4, 2, dtype=torch.float16), g, g, w, None, config=(16, 16, 16, 1, 1))
    # a well-formed call on a CPU tensor outside the interpreter: refused before any launch
    with pytest.raises(InputError, match="CUDA tensor"):
        nc.norm_silu_conv3x3(x, torch.zeros(2, 4, 2), g, g, w, None, config=(16, 16, 16, 1, 1))


@pytest.mark.parametrize("shape, match", [((16, 128, 128, 64, 1), "3×3 only"), ((16, 96, 128, 64, 3), "power of two"),
                                          ((16, 1024, 128, 64, 3), "power of two"), ((16, 128, 96, 64, 3), "Cout by"),
                                          ((16, 128, 128, 7, 3), "H² by")])
def test_survey_refuses_shapes_no_tile_fits(shape, match):
    with pytest.raises(InputError, match=match):
        nc.fitting_configs(shape)


def test_survey_tries_only_the_tiles_that_divide_the_shape():
    fits = nc.fitting_configs((16, 128, 128, 256, 3))
    assert fits and all(c[1] <= 128 for c in fits)          # no 256-wide output tile for 128 output channels
    assert len(nc.fitting_configs((16, 512, 512, 32, 3))) == len(nc.CONFIGS)


def test_survey_command_refuses_bad_shapes_and_a_missing_gpu(capsys, monkeypatch):
    assert nc.main(["--shape", "16,128,128"]) == 2
    assert "batch,Cin,Cout,H,k" in capsys.readouterr().err
    assert nc.main(["--shape", "16,128,96,64,3"]) == 2
    assert "no tile config" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nc.main(["--shape", "16,128,128,256,3"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_table_says_what_the_fusion_saves():
    row = {"shape": [16, 128, 128, 256, 3], "apply_ms": 0.3, "cudnn_ms": 0.46, "cudnn_tflops": 670.0,
           "triton_plain_ms": 0.55, "triton_plain_tflops": 560.0, "prologue_ms": 0.9, "prologue_tflops": 343.0,
           "net_ms": -0.14, "fast_sigmoid_ms": 0.7}
    t = nc.table([row])
    assert "16, 128 → 128, 256², 3" in t and "-0.140 ms" in t and "| 0.700 ms |" in t
