"""`lab render`: a video from a voice and a face with any family at a preset, on the bundled inputs and on a
user's files; bad inputs give one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lab.cli import main
from lab.pipelines import PIPELINES, pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", list(PIPELINES))
def test_render_bundled_inputs(family, tmp_path, capsys):
    pytest.importorskip("imageio_ffmpeg")
    out = tmp_path / "o.mp4"
    assert main(["render", family, "--preset", "exact", "--device", "cpu", "--seconds", "0.4", "-o", str(out)]) == 0
    rep = json.loads(capsys.readouterr().out)
    fps = getattr(pipeline(family).Config(), "fps", 25)   # each family at its upstream frame rate
    assert rep["frames"] == int(0.4 * fps + 1e-6) and rep["fps"] > 0 and out.stat().st_size > 0
    assert not list(tmp_path.glob(".*.part*")) and not list(tmp_path.glob(".o.render-*"))


def test_render_users_files(tmp_path, capsys):
    pytest.importorskip("imageio_ffmpeg")
    from PIL import Image
    import soundfile as sf

    from lab.data import default_avatar

    Image.fromarray(np.ascontiguousarray(default_avatar()[:, ::-1])).save(tmp_path / "face.png")   # a face, mirrored
    t = np.arange(int(0.32 * 16000)) / 16000
    sf.write(tmp_path / "voice.wav", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000)
    out = tmp_path / "mine.mp4"
    assert main(["render", "ditto", "--preset", "upstream", "--device", "cpu", "--audio", str(tmp_path / "voice.wav"),
                 "--source", str(tmp_path / "face.png"), "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["frames"] == 8 and out.stat().st_size > 0


@pytest.mark.parametrize("args, needle", [
    (["wav2lip"], "unknown family 'wav2lip'"),
    (["ditto", "--preset", "fastest"], "no preset 'fastest'"),
    (["ditto", "--audio", "/nonexistent/voice.wav"], "voice.wav"),
    (["ditto", "--source", "/nonexistent/face.png"], "face.png"),
    (["ditto", "-o", "/nonexistent/dir/out.mp4"], "does not exist"),
    (["ditto", "-o", "out.avi"], ".mp4"),
    (["ditto", "--weights", "/nonexistent/release"], "not a folder"),
    (["ditto", "--weights", "nonsense=/x.pth"], "no component 'nonsense'"),
    (["ditto", "--seconds", "-1"], "--seconds"),
])
def test_render_bad_input_is_one_line(args, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["render", *args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_render_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "o.mp4"
    out.write_bytes(b"keep me")
    assert main(["render", "ditto", "--device", "cpu", "-o", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_bytes() == b"keep me"


def test_release_folder_layout(tmp_path):
    from lab.pipelines import pipeline
    from lab.pipelines.render import weights_from_folder

    for family in PIPELINES:
        files = pipeline(family).WEIGHT_FILES
        root = tmp_path / family
        for comp, cands in files.items():
            (root / cands[0]).parent.mkdir(parents=True, exist_ok=True)
            (root / cands[0]).write_bytes(b"")
        got = weights_from_folder(family, root)
        assert set(got) == set(files) and all(str(root) in v for v in got.values())
        first = next(iter(files))
        (root / files[first][0]).unlink()
        with pytest.raises(Exception, match=first):
            weights_from_folder(family, root)


def test_a_missing_dependency_is_one_line(tmp_path, capsys, monkeypatch):
    import lab.pipelines.render as R

    def missing(*a, **k):
        import face_alignment_not_installed  # noqa: F401  (stands for any dependency an install lacks)

    monkeypatch.setattr(R, "render_video", missing)
    assert main(["render", "musetalk", "--device", "cpu", "-o", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err.strip()
    assert "face_alignment_not_installed" in err and "make setup" in err and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("family", ["musetalk", "latentsync"])
@pytest.mark.parametrize("fps", [float("inf"), 1e6, 0.001, 0])
def test_a_frame_rate_the_writer_cannot_honour_is_refused(family, fps):
    from lab.errors import InputError

    with pytest.raises(InputError, match="Config.fps=.*frame rate from 0.5 to 120"):
        pipeline(family).Config(fps=fps).check()
