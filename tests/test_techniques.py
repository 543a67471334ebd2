"""The technique registry: names, their dependency checks, and presets made of them."""
from __future__ import annotations

import pytest

from lab import techniques as T
from lab.errors import InputError


@pytest.fixture
def toy():
    T.declare("t_base", "toyfam", True, "a base rewrite")
    T.declare("t_on_top", "toyfam", True, "needs the base", requires=("t_base",))
    T.declare("t_gpu", "toyfam", True, "a CUDA kernel", device="cuda")
    T.declare("t_rival", "toyfam", False, "an approximation", conflicts=("t_base",))
    T.declare("t_compiled", "toyfam", True, "a compiled fusion", runtime="compile")
    yield "toyfam"
    for k in [k for k in T._REGISTRY if k[0] == "toyfam"]:
        del T._REGISTRY[k]


def test_check_accepts_a_valid_list(toy):
    assert T.check(toy, ["t_base", "t_on_top"]) == ("t_base", "t_on_top")


@pytest.mark.parametrize("names, runtime, device, needle", [
    (("nope",), "eager", None, "no technique 'nope'"),
    (("t_on_top",), "eager", None, "needs ['t_base']"),
    (("t_base", "t_rival"), "eager", None, "cannot be combined"),
    (("t_gpu",), "eager", "cpu", "needs a CUDA device"),
    (("t_compiled",), "graph", None, "needs a runtime with 'compile'"),
    (("t_base", "t_base"), "eager", None, "twice"),
    ((), "jit", None, "Config.runtime must be one of"),
])
def test_check_names_what_is_wrong(toy, names, runtime, device, needle):
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        T.check(toy, names, runtime, device)


def test_a_string_is_not_a_list(toy):
    with pytest.raises(InputError, match="tuple of technique names"):
        T.check(toy, "t_base")


def test_usable_drops_what_a_cpu_cannot_run_and_what_needed_it(toy):
    T.declare("t_after_gpu", "toyfam", True, "needs the kernel", requires=("t_gpu",))
    kept, dropped = T.usable(toy, ("t_base", "t_gpu", "t_after_gpu", "t_compiled"), "eager", "cpu")
    assert kept == ("t_base",)
    assert [d[0] for d in dropped] == ["t_gpu", "t_after_gpu", "t_compiled"]
    assert T.usable_runtime("compile+graph", "cpu") == "compile" and T.usable_runtime("graph", "cuda") == "graph"
    # a preset's runtime was measured on a GPU: a CPU runs it eager, an explicit choice keeps compile
    assert T.usable_runtime("compile+graph", "cpu", preset=True) == "eager"
    assert T.usable_runtime("compile+graph", "cuda", preset=True) == "compile+graph"


def _no_fp8(device):
    return (False, f"{device}: no FP8 tensor cores") if str(device) != "cuda:7" else (True, "")


def test_a_preset_leaves_out_a_technique_whose_hardware_is_missing_and_a_name_still_runs_it(toy, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "toy_hw", types.SimpleNamespace(probe=_no_fp8))
    T.declare("t_fp8", "toyfam", False, "FP8 GEMMs", hardware="toy_hw:probe")
    kept, dropped = T.usable(toy, ("t_base", "t_fp8"), "eager", "cuda:0")
    assert kept == ("t_base",) and dropped == [("t_fp8", "cuda:0: no FP8 tensor cores")]
    assert T.usable(toy, ("t_base", "t_fp8"), "eager", "cuda:7")[0] == ("t_base", "t_fp8")
    assert T.check(toy, ("t_fp8",), "eager", "cpu") == ("t_fp8",)      # asked for by name: it runs as it can
    with pytest.raises(ValueError, match="module:function"):
        T.declare("t_bad", "toyfam", False, "x", hardware="toy_hw.probe")


def test_latentsync_fast_takes_fp8_linear_only_where_fp8_tensor_cores_are():
    from lab.pipelines import config
    from lab.techniques import fp8

    assert config("latentsync", "fast").techniques[-1] == "fp8_linear"     # the preset as a GPU runs it
    assert T.registry("latentsync")["fp8_linear"].hardware == "lab.techniques.fp8:fp8_supported"
    assert "fp8_linear" not in config("latentsync", "fast", device="cpu").techniques
    assert T.registry("latentsync")["fp8_linear"].native("cpu") == fp8.fp8_supported("cpu")


def test_config_on_a_cpu_runs_a_preset_eager_unless_asked():
    from lab.pipelines import PIPELINES, config, preset

    for fam in PIPELINES:
        assert config(fam, "exact", device="cpu").runtime == "eager"
        if "compile" in preset(fam, "exact").runtime:
            assert config(fam, "exact", device="cpu", runtime="compile").runtime == "compile"


def test_a_name_declared_twice_differently_is_refused(toy):
    with pytest.raises(ValueError, match="declared twice"):
        T.declare("t_base", "toyfam", False, "something else")


def test_decorator_registers_with_the_docstring(toy):
    @T.technique("t_fn", family="toyfam", exact=True)
    def rewrite(m):
        """Rewrite a module.

        Details that stay out of the table."""
        return m

    assert T.registry("toyfam")["t_fn"].doc == "Rewrite a module." and rewrite(3) == 3


@pytest.mark.parametrize("family", ["musetalk", "ditto", "latentsync"])
def test_every_family_has_its_presets_and_they_check(family):
    from lab.pipelines import PRESET_NAMES, config, pipeline, preset

    P = pipeline(family)
    assert set(PRESET_NAMES) <= set(P.PRESETS)
    reg = T.registry(family)
    for name in PRESET_NAMES:
        p = preset(family, name)
        T.check(family, p.techniques, p.runtime)                      # a preset is a valid list, in order
        assert all(reg[t].exact for t in p.techniques) or name == "fast"
        cfg = config(family, name, device="cpu", size="tiny")         # what a CPU runs of it
        assert set(cfg.techniques) <= set(p.techniques)
    assert not preset(family, "upstream").techniques
    assert any(not reg[t].exact for t in preset(family, "fast").techniques) or preset(family, "fast").knobs


def test_waterfall_is_the_prefixes_of_a_preset():
    from lab.pipelines import PIPELINES, preset, waterfall

    for family in PIPELINES:
        rows = waterfall(family, "exact")
        techs = preset(family, "exact").techniques
        assert rows[0][0] == "upstream" and rows[-1][1]["techniques"] == tuple(techs)
        steps = [r[1]["techniques"] for r in rows if r[0].startswith("+ ")]
        assert steps == [tuple(techs[: i + 1]) for i in range(len(techs))]


def test_unknown_family_and_preset_are_named():
    from lab.pipelines import config, pipeline

    with pytest.raises(InputError, match="unknown family 'wav2lip'"):
        pipeline("wav2lip")
    with pytest.raises(InputError, match="no preset 'fastest'"):
        config("ditto", "fastest")
    with pytest.raises(InputError, match="no field"):
        config("ditto", "exact", nonsense=1)


def test_the_techniques_page_is_generated_from_the_registry_and_presets():
    from lab.pipelines import techniques_page
    from lab.results import ROOT

    page = techniques_page()
    for fam in ("ditto", "latentsync", "musetalk"):
        assert f"## {fam}" in page and f"lab render {fam} --preset NAME" in page
    assert all(f"`{t.name}`" in page for t in T.registry().values()) and len(T.registry()) > 40
    # the committed page is what `lab report --docs` writes now (a technique or preset changed: regenerate)
    assert (ROOT / "docs" / "techniques.md").read_text(encoding="utf-8") == page


def test_lab_report_docs_writes_the_techniques_page(tmp_path):
    import shutil

    from lab.cli import main
    from lab.pipelines import techniques_page
    from lab.results import ROOT

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "docs" / "techniques.md").write_text("stale", encoding="utf-8")
    assert main(["report", "--docs", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "docs" / "techniques.md").read_text(encoding="utf-8") == techniques_page()
