"""Notebook 06 in parts: `sections` names what a run computes; the others say they were left out, the Result holds
only what ran, and end-to-end rows without the renderer table use the exact preset's renderer."""
import pytest

from lab.errors import InputError


@pytest.fixture(scope="module")
def X():
    from lab.experiments import ditto

    return ditto


def test_sections_are_checked_by_name(X, tmp_path):
    with pytest.raises(InputError, match=r"sections\[0\]='renderr'.*did you mean 'renderer'"):
        X.setup("cpu", True, 0, str(tmp_path / "a"), sections=["renderr"])
    with pytest.raises(InputError, match=r"sections\[0\]='everything'"):
        X.setup("cpu", True, 0, str(tmp_path / "b"), sections="everything")
    with pytest.raises(InputError, match="non-empty list"):
        X.setup("cpu", True, 0, str(tmp_path / "c"), sections=[])


def test_a_run_of_some_sections_computes_those_and_says_the_others_were_left_out(X, tmp_path):
    ctx = X.setup("cpu", True, 0, str(tmp_path / "run"), sections="agreement")   # one name: a list of one
    assert ctx.left_out == frozenset(X.SECTIONS) - {"agreement"}
    assert ctx.res.params["renderer"] == X.BEST    # no table to choose from: the exact preset's renderer
    steps = dict(X.waterfall_steps(ctx))
    assert f"+ renderer '{X.BEST}'" in steps
    for fn in (X.renderer_section, X.stage_section, X.waterfall_section, X.silence_section, X.stride_section,
               X.host_section, X.scrubber_section, X.comparison_section):
        out = fn(ctx)
        assert "left out of this run" in out.data, fn.__name__
    assert not ctx.runs and not {"renderer", "stages", "waterfall", "strides"} & set(ctx.res.tables)
    X.agreement_section(ctx)
    assert "upstream_agreement" in ctx.res.tables
    X.finish(ctx)
    assert (ctx.folder / "results.json").exists()


def test_all_sections_is_the_default_and_the_scrubber_says_when_there_is_nothing_to_show(X, tmp_path):
    ctx = X.setup("cpu", True, 0, str(tmp_path / "run"))
    assert ctx.left_out == frozenset() and "renderer" not in ctx.res.params
    assert "no end-to-end run" in X.scrubber_section(ctx).data
