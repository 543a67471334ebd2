"""A run that will encode video refuses at once where it cannot, and a notebook section whose runs all failed says
so instead of raising from deep inside."""
import sys

import pytest

from lab import env
from lab.errors import BackendUnavailable


def test_a_missing_encoder_is_named_with_its_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)   # the import fails as where it is not installed
    with pytest.raises(BackendUnavailable, match=r"^the video encoding of notebook X needs ffmpeg .*imageio-ffmpeg.*pip install imageio-ffmpeg"):
        env.require_encoder("notebook X")
    listed = {b["backend"]: b for b in env.backends.__wrapped__()}["video encoder"]
    assert listed["available"] is False and "imageio_ffmpeg" in listed["detail"]


def test_the_encoder_installed_here_passes():
    env.require_encoder("anything")   # a dependency of the lab: CI installs it
    assert {b["backend"]: b for b in env.backends.__wrapped__()}["video encoder"]["available"]


def test_notebook_06_refuses_before_it_builds_or_times_anything(tmp_path, monkeypatch):
    from lab.experiments import ditto as X

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    monkeypatch.setattr(X.P, "build", lambda *a, **k: pytest.fail("built an engine before checking the encoder"))
    with pytest.raises(BackendUnavailable, match="06_ditto's end-to-end rows"):
        X.setup("cpu", True, 0, str(tmp_path / "run"))


@pytest.mark.parametrize("notebook", ["01", "08"])
def test_the_other_notebooks_that_encode_refuse_at_their_start(notebook, tmp_path, monkeypatch):
    from lab.experiments import profiling, serving

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(BackendUnavailable, match="01_profiling's encoder ceiling" if notebook == "01" else
                       "08_serving_techniques's streaming section"):
        if notebook == "01":
            profiling.start({"device": "cpu", "quick": True, "out_dir": str(tmp_path / "run")})
        else:
            serving.setup("cpu", True, 0, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()   # no run folder opened for a run that cannot finish


def test_notebook_06_draws_no_easing_strip_when_no_end_to_end_run_finished(tmp_path):
    from lab.experiments import ditto as X

    ctx = X.setup("cpu", True, 0, str(tmp_path / "run"))
    assert not ctx.runs
    X.silence_section(ctx)   # took a face from the first run and raised StopIteration when there was none
    names = {p.stem for p in ctx.folder.iterdir()}
    assert "silence_plan" in names and "easing_strip" not in names
