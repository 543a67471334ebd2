import numpy as np
import pytest
import soundfile as sf

from lab import data
from lab.errors import InputError


def test_default_audio_is_10s_24k_mono():
    x, sr = data.default_audio()
    assert sr == 24000 and x.ndim == 1 and x.dtype == np.float32
    assert 9.0 < len(x) / sr < 12.0
    assert np.abs(x).max() > 0.05


def test_default_avatar():
    img = data.default_avatar()
    assert img.shape == (512, 512, 3) and img.dtype == np.uint8


def test_resample_44k_stereo_to_16k_mono(tmp_path):
    sr = 44100
    t = np.arange(int(0.5 * sr)) / sr
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    right = 0.25 * np.sin(2 * np.pi * 440 * t)
    sf.write(tmp_path / "st.wav", np.stack([left, right], 1), sr)
    x, out_sr = data.load_audio(tmp_path / "st.wav", sr=16000)
    assert out_sr == 16000 and x.ndim == 1 and x.dtype == np.float32
    assert abs(len(x) - 8000) <= 1
    ref = 0.375 * np.sin(2 * np.pi * 440 * np.arange(len(x)) / 16000)
    mid = slice(200, -200)  # filter edges
    assert np.max(np.abs(x[mid] - ref[mid])) < 1e-2


@pytest.fixture
def wav(tmp_path):
    p = tmp_path / "ok.wav"
    sf.write(p, (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32), 16000)
    return p


def test_empty_file(tmp_path):
    p = tmp_path / "empty.wav"
    p.write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.wav.*empty"):
        data.load_audio(p)


def test_not_audio(tmp_path):
    p = tmp_path / "notes.wav"
    p.write_text("this is not audio at all " * 50)
    with pytest.raises(InputError, match=r"notes\.wav.*not readable as audio"):
        data.load_audio(p)


def test_truncated(tmp_path, wav):
    p = tmp_path / "cut.wav"
    p.write_bytes(wav.read_bytes()[:20000])
    with pytest.raises(InputError, match=r"cut\.wav.*truncated"):
        data.load_audio(p)


def test_nan_and_inf(tmp_path):
    x = np.zeros(8000, np.float32)
    x[100] = np.nan
    x[200] = np.inf
    p = tmp_path / "nan.wav"
    sf.write(p, x, 16000, subtype="FLOAT")
    with pytest.raises(InputError, match=r"nan\.wav.*2 samples are NaN or infinite"):
        data.load_audio(p)


def test_too_short(tmp_path):
    p = tmp_path / "short.wav"
    sf.write(p, np.zeros(800, np.float32), 16000)  # 50 ms
    with pytest.raises(InputError, match=r"short\.wav.*50\.0 ms.*100 ms"):
        data.load_audio(p)


def test_missing(tmp_path):
    with pytest.raises(InputError, match="nope.wav.*not found"):
        data.load_audio(tmp_path / "nope.wav")


def test_load_image_errors(tmp_path):
    p = tmp_path / "x.png"
    p.write_text("not an image")
    with pytest.raises(InputError, match=r"x\.png.*not readable as an image"):
        data.load_image(p)
    with pytest.raises(InputError, match="not found"):
        data.load_image(tmp_path / "none.png")


def test_load_image_grey_to_rgb(tmp_path):
    import imageio.v3 as iio

    iio.imwrite(tmp_path / "g.png", np.full((32, 40), 7, np.uint8))
    img = data.load_image(tmp_path / "g.png")
    assert img.shape == (32, 40, 3) and (img == 7).all()
