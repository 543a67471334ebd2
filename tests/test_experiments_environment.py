"""lab.experiments.environment (notebook 00): parameter checks, the comparison row, tables."""
import pytest

from lab import params
from lab.errors import InputError
from lab.experiments import environment as ex
from lab.experiments.common import notebook_path


def _check(**values):
    return params.check(values, params.notebook_defaults(notebook_path(ex.NAME)), ex.RULES, where=ex.NAME)


@pytest.mark.parametrize("bad, name", [(dict(quick="yes"), "quick"), (dict(seed=-1), "seed"),
                                       (dict(seed=1.5), "seed"), (dict(device="gpu"), "device"),
                                       (dict(out_dir=3), "out_dir"), (dict(quik=True), "quik")])
def test_bad_parameters_are_refused_by_name(bad, name):
    with pytest.raises(InputError, match=name):
        _check(**bad)


def test_start_checks_and_keeps_the_parameters(tmp_path):
    run = ex.start({"device": "cpu", "quick": True, "seed": 3, "out_dir": str(tmp_path / "r")})
    assert run.quick and run.seed == 3 and run.device.type == "cpu" and run.folder == tmp_path / "r"
    assert run.result.name == "00_environment" and "cpu" in ex.describe(run)
    with pytest.raises(InputError, match="quick"):
        ex.start({"quick": 1, "out_dir": str(tmp_path / "s")})


def test_compare_is_not_comparable_off_an_h200_and_replaces_its_row(tmp_path):
    run = ex.start({"device": "cpu", "quick": True, "out_dir": str(tmp_path / "r")})
    ceil = {"matmul_tflops": {"fp32": 0.1, "bf16": 0.05}, "unavailable": {}, "matmul_n": 256, "copy_gbps": 5.0}
    ex.compare(run, ceil)
    view = ex.compare(run, ceil)
    (c,) = run.result.comparisons
    assert c.verdict == "not comparable" and c.our_value == 0.05 and "quick" in c.reason
    assert "dense bf16 matmul rate" in view.data


def test_ceilings_rows_name_unavailable_dtypes_and_copy():
    rows = ex.ceilings_rows({"matmul_tflops": {"fp32": 1.0}, "unavailable": {"fp8_e4m3": "no FP8"}, "copy_gbps": 9.0})
    assert [r["dtype"] for r in rows][:2] == ["fp32", "fp8_e4m3"] and "no FP8" in rows[1]["TFLOP/s"]
    assert rows[-1]["TFLOP/s"] == 9.0


def test_quick_auto_is_quick_on_a_cpu_and_says_so(tmp_path, capsys):
    import torch

    from lab import params

    run = ex.start({"device": "cpu", "out_dir": str(tmp_path / "r")})   # the notebook's default: quick = "auto"
    assert run.quick is True and run.p["quick"] is True and "QUICK profile" in capsys.readouterr().out
    run = ex.start({"device": "cpu", "quick": False, "out_dir": str(tmp_path / "f")})   # asked for: kept
    assert run.quick is False and "QUICK" not in capsys.readouterr().out
    assert params.resolve_quick("auto", torch.device("cuda")) is False
    with pytest.raises(InputError, match="quick='yes'.*True, False or 'auto'"):
        ex.start({"quick": "yes", "out_dir": str(tmp_path / "s")})
