"""Weights named as a release lays them out, and a user's voice / face / weights taken by notebooks 06 and 07: the
release folder or one file means what the parameter's comment says, a wrong file is named as what it is, the other
decoder of notebook 01's waterfall never gets the SD-VAE checkpoint, and every path is checked before a kernel."""
from pathlib import Path

import numpy as np
import pytest
import torch

from lab import data, runner
from lab.errors import InputError, WeightsError
from lab.experiments import inputs
from lab.pipelines import latentsync as P
from lab.pipelines.weights import component_path, one_source

pytestmark = pytest.mark.usefixtures("one_thread")
NB = runner.NOTEBOOKS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny LatentSync UNet checkpoint and a tiny SD-VAE state dict, as released (the UNet under state_dict)."""
    from lab.models.latentsync import load_latentsync_unet
    from lab.models.vae import load_vae

    d = tmp_path_factory.mktemp("weights")
    unet = d / "latentsync_unet.pt"
    torch.save({"state_dict": load_latentsync_unet("random", "tiny", seed=1).model.state_dict()}, unet)
    vae = d / "diffusion_pytorch_model.pt"
    torch.save(load_vae("sd-vae", "random", "tiny", seed=2).model.state_dict(), vae)
    return unet, vae


def _release(root: Path, unet: Path, sub: str = "checkpoints") -> Path:
    (root / sub).mkdir(parents=True, exist_ok=True)
    (root / sub / "latentsync_unet.pt").write_bytes(unet.read_bytes())
    return root


# ----------------------------------------------------------------------------- 5. weight paths

@pytest.mark.parametrize("sub", ["checkpoints", "."])
def test_a_latentsync_release_folder_loads_its_unet(tmp_path, files, sub):
    root = _release(tmp_path / "release", files[0], sub)
    eng = P.build(P.Config(size="tiny", block=4, weights={"unet": str(root)}))      # {"unet": DIR}
    assert eng.weights["latentsync_unet"].endswith("latentsync_unet.pt") and eng.unet.missing == []
    got = inputs.weights_for("latentsync", str(root), "unet", ("unet",), log=None)  # -p weights DIR
    assert set(got) == {"unet"} and Path(got["unet"]) == root / sub / "latentsync_unet.pt"
    from lab.models.latentsync import load_latentsync_unet                              # the model's own loader too

    assert Path(load_latentsync_unet(str(root), "tiny").weights.removeprefix("local file ")) == \
        root / sub / "latentsync_unet.pt"


def test_one_latentsync_file_is_the_unet_and_a_folder_says_what_stays_random(tmp_path, files):
    said = []
    assert inputs.weights_for("latentsync", str(files[0]), "unet", ("unet",), log=said.append) == {"unet": str(files[0])}
    root = _release(tmp_path / "r", files[0])
    assert set(inputs.weights_for("latentsync", str(root), "unet", ("unet",), log=said.append)) == {"unet"}
    assert said and "whisper" in said[-1] and "vae" in said[-1] and "random" in said[-1]
    with pytest.raises(WeightsError, match=r"lacks unet.*latentsync_unet\.pt"):
        (tmp_path / "empty").mkdir()
        inputs.weights_for("latentsync", str(tmp_path / "empty"), "unet", ("unet",), log=None)
    with pytest.raises(WeightsError, match="one hub id"):
        one_source(P.WEIGHT_FILES, "owner/name")


def test_a_file_for_the_wrong_component_is_named_as_what_it_is(files):
    unet, vae = files
    with pytest.raises(WeightsError, match=r"holds the LatentSync vae weights.*\{'vae'"):
        P.build(P.Config(size="tiny", block=4, weights={"unet": str(vae)}))
    with pytest.raises(WeightsError, match=r"AutoencoderKL.*holds the LatentSync unet weights"):
        P.build(P.Config(size="tiny", block=4, weights={"vae": str(unet)}))


def test_component_paths_of_every_family(tmp_path):
    from lab.pipelines import ditto, musetalk

    mt = tmp_path / "musetalk"
    (mt / "models/musetalkV15").mkdir(parents=True)
    (mt / "models/musetalkV15/unet.pth").write_bytes(b"x")
    assert component_path(musetalk.WEIGHT_FILES, "unet", str(mt)) == str(mt / "models/musetalkV15/unet.pth")
    (tmp_path / "diffusers").mkdir()
    (tmp_path / "diffusers/config.json").write_text("{}")
    assert component_path(musetalk.WEIGHT_FILES, "vae", str(tmp_path / "diffusers")) == str(tmp_path / "diffusers")
    assert component_path(musetalk.WEIGHT_FILES, "vae", "stabilityai/sd-vae-ft-mse") == "stabilityai/sd-vae-ft-mse"
    with pytest.raises(WeightsError, match=r"holds no MuseTalk unet weights.*musetalkV15/unet\.pth"):
        component_path(musetalk.WEIGHT_FILES, "unet", str(mt / "models/musetalkV15"), "MuseTalk")
    with pytest.raises(WeightsError, match="no such file or folder"):
        component_path(musetalk.WEIGHT_FILES, "unet", str(tmp_path / "nope.pth"))
    # Ditto: one file is the network its release name says; any other name is refused naming the release's
    (tmp_path / "decoder.pth").write_bytes(b"x")
    (tmp_path / "mine.pth").write_bytes(b"x")
    assert one_source(ditto.WEIGHT_FILES, str(tmp_path / "decoder.pth")) == {"decoder": str(tmp_path / "decoder.pth")}
    with pytest.raises(WeightsError, match=r"none of the release's.*warp_network\.pth"):
        one_source(ditto.WEIGHT_FILES, str(tmp_path / "mine.pth"))


def test_a_ditto_release_folder_loads_every_network(tmp_path):
    from lab.models import ditto as D
    from lab.pipelines import ditto

    models = tmp_path / "ditto_pytorch" / "models"
    models.mkdir(parents=True)
    for i, comp in enumerate(D.COMPONENTS):
        name, wrapper = D.RELEASED[comp]
        sd = D.build(comp, "tiny", "cpu", 100 + i).state_dict()
        torch.save({wrapper: sd} if wrapper else sd, models / name)
    eng = ditto.build(ditto.Config(size="tiny", weights=inputs.weights_for("ditto", str(tmp_path), log=None)))
    assert all(eng.weights[c] == f"local file {models / D.RELEASED[c][0]}" for c in D.COMPONENTS)
    assert eng.weights["hubert"].startswith("random")
    assert D.load_component("decoder", tmp_path, "tiny")[1] == f"local file {models / 'decoder.pth'}"
    (models / "decoder.pth").unlink()
    with pytest.raises(InputError, match=r"weights: .*lacks decoder.*decoder\.pth"):
        runner.check_parameters(runner.find_notebook("06"), {"weights": str(tmp_path)})


def test_the_waterfalls_other_decoder_never_gets_the_sd_vae_checkpoint(tmp_path):
    from lab.experiments import profiling as ex
    from lab.models.vae import load_vae
    from lab.pipelines import musetalk as mt

    vae = tmp_path / "sd_vae.pt"
    torch.save(load_vae("sd-vae", "random", "tiny", seed=5).model.state_dict(), vae)
    cfg = mt.Config(size="tiny", frame_size=(128, 192), crop=64, batch_size=4, dtype="fp32", face_crop="geometric",
                    encode=mt.Config().encode.__class__(writer="null"), weights={"vae": str(vae)})
    eng = mt.build(cfg, "cpu")
    mt.prepare(eng, mt.avatar_loop(3, cfg.frame_size))
    a, sr = data.default_audio()
    rows = ex.waterfall(eng, a[: sr], sr, 4, steps=[ex.WATERFALL[1], ex.WATERFALL[-1]], progress=False)
    assert eng.weights["sd-vae"] == f"local file {vae}"
    assert "taesd: random (seed 0)" in rows[-1]["note"] and "sd-vae's" in rows[-1]["note"]
    assert "taesd" not in rows[0]["note"]


# ----------------------------------------------------------------------------- 12. a user's voice and face

@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """A 3-s voice, a 300-frame face video, an audio-only MP4 and a file that is no audio."""
    import av

    from lab.avatar import avatar_loop
    from lab.video import FFmpegWriter

    d = tmp_path_factory.mktemp("clips")
    t = np.arange(3 * 22050) / 22050
    import soundfile as sf

    sf.write(d / "voice.wav", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 22050)
    with FFmpegWriter(d / "face300.mp4", 25, (128, 192)) as w:
        w.write(avatar_loop(300, (128, 192)))
    c = av.open(str(d / "audio_only.mp4"), "w")
    s = c.add_stream("aac", rate=16000)
    s.layout = "mono"
    fr = av.AudioFrame.from_ndarray(np.zeros((1, 16000), np.float32), format="fltp", layout="mono")
    fr.sample_rate = 16000
    for p in [*s.encode(fr), *s.encode(None)]:
        c.mux(p)
    c.close()
    (d / "noise.wav").write_bytes(b"RIFF not really")
    return d


def test_a_video_with_no_frames_says_so(clips, tmp_path):
    with pytest.raises(InputError, match=r"audio_only\.mp4: holds no video frames \(only audio streams\)"):
        data.load_source(clips / "audio_only.mp4")
    import subprocess

    import imageio_ffmpeg

    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-f", "lavfi", "-i", "color=s=64x64:r=25",
                    "-frames:v", "0", str(tmp_path / "empty.mp4")], check=True)   # a container with no streams at all
    with pytest.raises(InputError, match=r"empty\.mp4: holds no video frames"):
        data.load_video(tmp_path / "empty.mp4")


def test_a_long_source_video_is_cut_and_says_so(clips):
    said = []
    frames = data.load_source(clips / "face300.mp4", note=said.append)
    assert len(frames) == 250 and said == [said[0]] and "300 frames; the first 250" in said[0]
    said.clear()
    assert len(data.load_source(clips / "face300.mp4", max_frames=None, note=said.append)) == 300 and not said


@pytest.mark.parametrize("nb", ["06", "07"])
def test_voice_and_face_are_parameters_checked_before_the_kernel(clips, nb, tmp_path):
    path = runner.find_notebook(nb)
    ok = {"audio_path": str(clips / "voice.wav"), "source": str(clips / "face300.mp4"), "allow_silence": False}
    assert runner.check_parameters(path, ok) == ok
    for bad, match in [({"audio_path": str(clips / "noise.wav")}, r"audio_path: .*noise\.wav: not readable as audio"),
                       ({"source": str(clips / "audio_only.mp4")}, r"source: .*holds no video frames"),
                       ({"audio_path": str(clips / "none.wav")}, r"audio_path=.*no such file"),
                       ({"weights": str(tmp_path / "gone.pt")}, r"weights: .*gone\.pt: no such file or folder"),
                       ({"weights": {"unet": 3}}, r"weights=")]:
        with pytest.raises(InputError, match=match):
            runner.run_notebook(path, tmp_path / "out", bad)
        assert not (tmp_path / "out").exists()


def test_latentsync_notebook_takes_your_video_and_voice(clips, tmp_path, capsys):
    from lab.experiments import latentsync as X

    ctx = X.setup("cpu", True, 0, str(tmp_path / "o"), source=str(clips / "face300.mp4"),
                  audio_path=str(clips / "voice.wav"))
    out = capsys.readouterr().out
    want = data.load_audio(clips / "voice.wav", sr=16000)[0][: ctx.audio.size]
    assert ctx.frames.shape[0] == 250 and "300 frames; the first 250" in out
    assert np.array_equal(ctx.audio, want) and "voice.wav: 3.00 s; its first" in out
    assert ctx.res.params["audio"].endswith("voice.wav") and ctx.job.n_out == ctx.prof.n_frames


def test_ditto_notebook_takes_your_voice_as_it_is(clips, tmp_path):
    from lab.experiments import ditto as X

    ctx = X.setup("cpu", True, 0, str(tmp_path / "o"), audio_path=str(clips / "voice.wav"), clip_s=2.0)
    want = data.load_audio(clips / "voice.wav", sr=16000)[0][: 2 * 16000]
    assert np.array_equal(ctx.audio, want) and ctx.prof.pauses == () and ctx.prof.clip_s == 2.0
    long = X.setup("cpu", True, 0, str(tmp_path / "p"), audio_path=str(clips / "voice.wav"), clip_s=10.0)
    assert long.audio.size == 3 * 16000 and long.prof.clip_s == 3.0      # a shorter file: used whole
