"""FP8 resnet convs on the SD-VAE decoder's fastest exact build (lab.techniques.fp8_resnet): on the CPU the norm's FP8
output, the FP8 conv's arithmetic, the calibration's refusals and the rewrite's undo; on a GPU (pytest -m gpu) the
Triton pass's FP8 output and the compiled FP8 decoder with every graph built by cuDNN."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.errors import InputError
from lab.experiments import fp8_decoder
from lab.runtime import conv_graphs
from lab.techniques import fp8_resnet as FR
from lab.techniques.group_norm import FusedGroupNorm, to_e4m3

E4M3 = torch.float8_e4m3fn


def _norm(c: int = 32) -> FusedGroupNorm:
    torch.manual_seed(0)
    gn = nn.GroupNorm(8, c)
    nn.init.normal_(gn.weight, 1.0, 0.3)
    nn.init.normal_(gn.bias, 0.0, 0.3)
    return FusedGroupNorm(gn, silu=True)


def test_fp8_output_norm_is_the_norm_cast_with_its_scale_and_leaves_the_original_alone():
    norm, x = _norm(), torch.randn(2, 32, 6, 6) * 3 + 1
    twin = norm.fp8_output(0.01)
    with torch.no_grad():
        y = twin(x)
        want = F.silu(F.group_norm(x, 8, norm.weight, norm.bias, norm.eps))
        assert y.dtype == E4M3 and torch.equal(y.float(), to_e4m3(want, 0.01).float())
        assert float(y.float().abs().max()) == 448.0            # saturated values clamp to ±448, not NaN
        assert norm.out_scale is None and norm(x).dtype == torch.float32   # the original still writes float
    assert twin.weight is norm.weight                          # the same parameters


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_fp8_output_refuses_a_scale_that_is_not_finite_and_positive(bad):
    with pytest.raises(InputError, match="scale must be finite and > 0"):
        _norm().fp8_output(bad)


def _graph_conv(cin: int = 16, cout: int = 24, bias: bool = True) -> conv_graphs.GraphConv2d:
    torch.manual_seed(1)
    return conv_graphs.GraphConv2d(nn.Conv2d(cin, cout, 3, padding=1, bias=bias).half())


@pytest.mark.parametrize("residual", [False, True])
def test_fp8_conv_is_the_conv_of_its_dequantized_operands_with_bias_and_skip(residual):
    g = _graph_conv()
    q = FR.FP8GraphConv(g, x_scale=0.02)
    x = torch.randn(2, 16, 7, 7)
    xq = to_e4m3(x, 0.02)
    skip = torch.randn(2, 24, 7, 7).half() if residual else None
    y = q(xq, skip) if residual else q(xq)
    w = q.weight_fp8.float() * (q.descale / 0.02).view(-1, 1, 1, 1)
    want = F.conv2d(xq.float() * 0.02, w, g.bias.float(), padding=1) + (skip.float() if residual else 0)
    assert y.dtype == torch.float16
    assert torch.allclose(y.float(), want, rtol=2e-3, atol=2e-3)
    # and it approximates the fp16 conv within e4m3's rounding of both operands
    ref = F.conv2d(x, g.weight.float(), g.bias.float(), padding=1) + (skip.float() if residual else 0)
    assert (y.float() - ref).norm() / ref.norm() < 0.08


def test_fp8_conv_refuses_fp16_input_a_plain_conv_and_a_bad_scale():
    q = FR.FP8GraphConv(_graph_conv(), 0.02)
    with pytest.raises(InputError, match="reads the e4m3 output of the norm"):
        q(torch.randn(1, 16, 4, 4).half())
    with pytest.raises(InputError, match="takes a GraphConv2d"):
        FR.FP8GraphConv(nn.Conv2d(16, 24, 3), 0.02)
    with pytest.raises(InputError, match="input scale must be finite"):
        FR.FP8GraphConv(_graph_conv(), float("nan"))


def _tiny_vae():
    from lab.models.vae import load_vae

    return load_vae("sd-vae", "random", size="tiny")


def test_fp8_build_approximates_the_exact_build_and_undoes_to_it():
    vae = _tiny_vae()
    zs = fp8_decoder.D.random_latents(2, 8, 3, seed=5, dtype=torch.float16)
    exact, _ = fp8_decoder.build(vae, zs[0], compile=False)
    fp8, report = fp8_decoder.build(vae, zs[0], zs[1:], resnet_convs="fp8", compile=False)
    n_blocks = len(report["blocks"])
    assert n_blocks > 0 and all(r["fp8"] and r["amax_conv1"] > 0 for r in report["blocks"])
    with torch.inference_mode():
        a, b = exact(zs[0]).float(), fp8(zs[0]).float()
    psnr = 10 * math.log10(1.0 / float(((a - b) ** 2).mean()))
    assert 25 < psnr < 80            # close, and not the exact build under another name
    assert FR.plain_resnets(report["module"]) == n_blocks
    with torch.inference_mode():
        assert torch.equal(fp8(zs[0]).float(), a)


def test_calibration_refuses_a_plain_decoder_no_batches_and_a_conv_input_that_stays_zero():
    vae = _tiny_vae()
    with pytest.raises(InputError, match="no GraphResnet"):
        FR.calibrate(vae.model.decoder, [torch.zeros(1, 4, 8, 8)])
    z = torch.randn(1, 4, 8, 8).half().contiguous(memory_format=torch.channels_last)
    dec, report = fp8_decoder.build(vae, z, compile=False)
    inner = report["module"]
    with pytest.raises(InputError, match="no calibration batches"):
        FR.calibrate(inner, [], call=dec)
    name, blk = FR.resnets(inner)[0]
    with torch.inference_mode():     # the build's parameters are inference tensors
        blk.norm2.weight.zero_()
        blk.norm2.bias.zero_()      # conv2 reads silu(0) = 0 everywhere
    with pytest.raises(InputError, match=rf"{name}\.conv2's input \|x\| max is 0"):
        FR.calibrate(inner, [z], call=dec)


def test_build_refuses_an_unknown_resnet_convs_option():
    z = torch.randn(1, 4, 8, 8).half()
    with pytest.raises(InputError, match="resnet_convs must be one of"):
        fp8_decoder.build(_tiny_vae(), z, resnet_convs="int8", compile=False)


def test_keep_faster_keeps_only_blocks_that_gain_enough():
    times = [{"block": "a", "gain": 1.3}, {"block": "b", "gain": 1.02}, {"block": "c", "gain": float("nan")}]
    assert FR.keep_faster(times) == ["a"]


def test_cli_refuses_bad_counts(capsys):
    assert fp8_decoder.main(["--batch", "0", "--device", "cpu"]) == 2
    assert "--batch and --repeats must be ≥ 1" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_pass_writes_the_torch_cast_within_one_e4m3_step():
    norm = _norm(256).cuda().half()
    x = (torch.randn(4, 256, 32, 32, device="cuda") * 2).half().contiguous(memory_format=torch.channels_last)
    twin = norm.fp8_output(0.005)
    y = twin(x)
    want = to_e4m3(F.silu(F.group_norm(x.float(), 8, norm.weight.float(), norm.bias.float(), norm.eps)), 0.005)
    assert y.dtype == E4M3 and y.is_contiguous(memory_format=torch.channels_last)
    d = (y.float() - want.float()).abs()
    # e4m3 steps are 1/8 of the value's power of two: the fp32 statistics' order may move a value one step
    assert float((d > want.float().abs() / 8 + 1e-6).float().mean()) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_fp8_decoder_runs_every_conv_on_cudnn_and_stays_near_the_exact_one():
    from lab.models.vae import load_vae
    from lab.runtime import cudnn_graph

    ok, why = cudnn_graph.available("cuda", "fp8")
    if not ok:
        pytest.skip(why)
    vae = load_vae("sd-vae", "random", size="full", device="cuda", seed=0)
    cudnn_graph.NOTES.clear()
    res = fp8_decoder.measure(vae, batch=4, repeats=3)
    assert res["fallbacks"] == []
    exact, fp8 = res["rows"]
    assert fp8["fp8_blocks"] > 0 and fp8["psnr_vs_exact_db"] > 25
    assert exact["psnr_vs_fp32_db"] > 50
