"""Mixed-precision planning for FP8 (lab.techniques.fp8_mixed): the noise-addition prediction, the greedy
plan, and a measured check on a tiny SD-VAE decoder with exactly emulated FP8 GEMMs."""
import math
import warnings

import pytest
import torch

from lab.experiments import fp8 as FB
from lab.techniques import fp8_mixed as M
from lab.techniques.fp8 import FP8Report, quantize_module
from lab.errors import InputError


def _row(name, psnr, gflops):
    return {"layer": name, "kind": "Conv2d 3×3", "order": 0, "gflops": gflops, "flops_share": 0.0, "psnr_db": psnr}


def test_noise_powers_add():
    rows = [_row("a", 40.0, 1.0), _row("b", 40.0, 1.0)]
    assert M.predicted_psnr(rows, ["a"]) == pytest.approx(40.0)
    assert M.predicted_psnr(rows, ["a", "b"]) == pytest.approx(40.0 - 10 * math.log10(2))
    assert M.predicted_psnr(rows, []) == math.inf
    with pytest.raises(InputError, match="no sensitivity row"):
        M.predicted_psnr(rows, ["c"])


def test_plan_drops_the_noisiest_flop_first_and_meets_the_target():
    # "cheap" is small but noisy (keep it in fp16 first); "big" carries the FLOPs
    rows = [_row("big", 38.0, 100.0), _row("cheap", 36.0, 1.0), _row("mid", 48.0, 10.0)]
    for r in rows:
        r["flops_share"] = r["gflops"] / 111.0
    p = M.plan(rows, 37.5)
    assert p["keep"] == ["cheap"] and set(p["fp8"]) == {"big", "mid"}
    assert p["predicted_db"] >= 37.5 and p["fp8_flops_share"] == pytest.approx(110 / 111)
    assert M.plan(rows, 20.0)["keep"] == []  # already met with everything in FP8
    assert M.plan(rows, 200.0)["fp8"] == []  # unreachable: nothing left in FP8
    c = M.curve(rows, [20.0, 37.5, 200.0])
    assert [x["fp8_layers"] for x in c] == [3, 2, 0]
    with pytest.raises(InputError):
        M.plan([], 40.0)


@pytest.fixture(scope="module")
def tiny(one_thread):
    case = FB.make_case("sd-vae", size="tiny", device="cpu", dtype=torch.float32, batch=2, image=64)
    quant = dict(mode="scaled_mm", emulate=True, conv_impl="im2col")
    with torch.inference_mode():
        ref = case.model(*case.inputs[0]).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, rep = quantize_module(case.model, calibration=case.calib, **quant)
    return case, quant, ref, rep, q


def test_sensitivity_predicts_the_measured_psnr(tiny):
    case, quant, ref, rep, q = tiny
    rows = M.layer_sensitivity(case, ref, rep, q, progress=False)
    with torch.inference_mode():  # every float layer put back: the float output is bit-identical again
        torch.testing.assert_close(case.model(*case.inputs[0]).float(), ref, rtol=0, atol=0)
    assert [r["layer"] for r in rows] == [r.name for r in rep.layers]
    assert all(r["fp8_layers"] == 1 and r["psnr_db"] > 40 for r in rows)  # one layer alone costs little
    assert sum(r["flops_share"] for r in rows) == pytest.approx(1.0)
    everything = M.verify(case, quant, ref, [r["layer"] for r in rows])
    assert everything["fp8_layers"] == rep.n_layers
    assert M.predicted_psnr(rows, [r["layer"] for r in rows]) == pytest.approx(everything["psnr_db"], abs=1.0)
    p = M.plan(rows, 40.0)
    got = M.verify(case, quant, ref, p["fp8"])
    assert 0 < got["fp8_layers"] < rep.n_layers
    assert got["psnr_db"] == pytest.approx(p["predicted_db"], abs=1.0) and got["psnr_db"] > 39.0


def test_quantize_plan_then_verify_the_given_model(tiny):
    case, quant, ref, rep, q = tiny
    keep = rep.layers[0].name
    fp8 = [r.name for r in rep.layers[1:]]
    model, prep = M.quantize_plan(case, quant, fp8)
    assert [r.name for r in prep.layers] == fp8 and keep in {r.name for r in prep.skipped}
    got = M.verify(case, quant, ref, fp8, model=model)
    assert got == M.verify(case, quant, ref, fp8)  # the same quantization, measured once more
    assert got["fp8_layers"] == len(fp8)


def test_sensitivity_of_an_empty_report_is_an_input_error(tiny):
    case, _, ref, rep, q = tiny
    with pytest.raises(InputError, match="no FP8 layers"):
        M.layer_sensitivity(case, ref, FP8Report("per_tensor", "dynamic", "auto", "scaled_mm", "-", "cpu", ""), q)
    with pytest.raises(InputError, match="no FP8 layer"):
        M.layer_sensitivity(case, ref, rep, case.model)  # the float model instead of the quantized one
