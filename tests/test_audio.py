import numpy as np
import pytest
import torch

from lab.audio import (compare_resamplers, is_silent, n_video_frames, reference_resample, resample,
                       rms_per_frame)
from lab.errors import BackendUnavailable, InputError


def tones(sr: int, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)).astype(np.float32)


def test_reference_reproduces_band_limited_tones():
    y = reference_resample(tones(24000), 24000, 16000)
    t = np.arange(len(y)) / 16000
    exact = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)
    assert len(y) == 16000
    assert np.abs(y - exact)[200:-200].max() < 1e-6  # away from the edges the reference is exact


@pytest.mark.parametrize("backend", ["librosa_soxr", "scipy_poly", "torchaudio_cpu"])
def test_cpu_backends_close_to_reference(backend):
    x = tones(24000)
    y = resample(x, 24000, 16000, backend=backend)
    ref = reference_resample(x, 24000, 16000)
    assert y.dtype == np.float32 and abs(len(y) - 16000) <= 1
    n = min(len(y), len(ref))
    assert np.abs(y[100:n - 100] - ref[100:n - 100]).max() < 2e-3


def test_resample_accepts_tensor_and_same_rate_is_identity():
    x = tones(16000, 0.2)
    y = resample(torch.from_numpy(x), 16000, 16000, backend="scipy_poly")
    assert isinstance(y, np.ndarray) and np.array_equal(y, x)


def test_unavailable_backends_say_why():
    import importlib.util

    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="CUDA"):
            resample(tones(24000, 0.1), 24000, 16000, backend="torchaudio_gpu")
    if importlib.util.find_spec("resampy") is None:
        with pytest.raises(BackendUnavailable, match="resampy"):
            resample(tones(24000, 0.1), 24000, 16000, backend="librosa_kaiser_best")
    with pytest.raises(InputError, match="unknown resampling backend"):
        resample(tones(24000, 0.1), 24000, 16000, backend="nope")


def test_compare_resamplers_table():
    rows = compare_resamplers(tones(24000, 0.5), 24000, 16000, repeats=2, passband=0.9)
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"librosa_soxr", "librosa_kaiser_best", "scipy_poly", "torchaudio_cpu", "torchaudio_gpu"}
    for r in rows:
        assert set(r) >= {"backend", "available", "reason", "median_ms", "max_abs_err", "rms_err_db", "snr_db"}
        if r["available"]:
            assert r["median_ms"] > 0 and r["snr_db"] > 40 and r["max_abs_err"] < 1e-2
        else:
            assert r["reason"] and r["median_ms"] is None
    assert by["scipy_poly"]["available"]


def test_n_video_frames():
    assert n_video_frames(16000, 16000, 25) == 25
    assert n_video_frames(16639, 16000, 25) == 25
    assert n_video_frames(16640, 16000, 25) == 26
    assert n_video_frames(0, 16000, 25) == 0
    assert n_video_frames(48000, 48000, 30000 / 1001) == 29
    with pytest.raises(InputError):
        n_video_frames(100, 0, 25)


def test_rms_per_frame_silence_and_tone():
    sr, fps = 16000, 25
    x = np.zeros(sr, np.float32)
    x[sr // 2:] = 0.5 * np.sin(2 * np.pi * 440 * np.arange(sr // 2) / sr)
    rms = rms_per_frame(x, sr, fps)
    assert rms.shape == (25,) and rms.dtype == np.float32
    assert np.all(rms[:12] == 0)
    assert np.allclose(rms[13:], 0.5 / np.sqrt(2), rtol=0.02)  # sine RMS = amplitude / √2
    silent = is_silent(rms)
    assert silent[:12].all() and not silent[13:].any()


def test_rms_matches_per_frame_loop():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(24000 * 2 + 123).astype(np.float32) * 0.1
    rms = rms_per_frame(x, 24000, 30)
    spf = 24000 // 30
    loop = [np.sqrt(np.mean(x[i * spf:(i + 1) * spf].astype(np.float64) ** 2)) for i in range(60)]
    assert np.allclose(rms, loop, rtol=1e-5)


def test_is_silent_threshold():
    assert is_silent(0.0) and is_silent(0.009) and not is_silent(0.011)
    assert not is_silent(0.009, threshold_db=-60)


def test_check_not_silent_names_the_source_and_the_switch():
    from lab.audio import check_not_silent

    sr = 16000
    quiet = (0.003 * np.random.default_rng(0).standard_normal(sr)).astype(np.float32)  # about -50 dBFS
    with pytest.raises(InputError, match=r"take\.wav: the audio is silent throughout \(loudest frame -[45]\d\.\d dBFS"
                                         r".*allow_silence = True"):
        check_not_silent(quiet, sr, "take.wav")
    with pytest.raises(InputError, match=r"zeros: .*loudest frame -240\.0 dBFS"):
        check_not_silent(np.zeros(sr, np.float32), sr, "zeros", fps=30)
    check_not_silent(quiet, sr, "take.wav", allow_silence=True)
    speech = quiet.copy()
    speech[8000:8640] += 0.1  # one loud frame is enough
    check_not_silent(speech, sr, "take.wav")


def test_load_audio_refuses_silence_only_when_asked(tmp_path):
    import soundfile as sf

    from lab.data import load_audio

    p = tmp_path / "silent take.wav"
    sf.write(p, np.zeros((24000, 2), np.float32), 24000)
    x, sr = load_audio(p)  # a loader of audio does not judge it by default
    assert sr == 24000 and not x.any()
    with pytest.raises(InputError, match=r"silent take\.wav: the audio is silent throughout.*allow_silence = True"):
        load_audio(p, sr=16000, allow_silence=False)
    sf.write(p, 0.2 * np.sin(np.arange(24000) / 5)[:, None].repeat(2, 1), 24000)
    assert load_audio(p, allow_silence=False)[0].shape == (24000,)


def test_check_not_silent_on_long_stereo_audio():
    from lab.audio import check_not_silent

    sr = 8000
    x = np.zeros((2, sr * 70), np.float32)  # 70 s: three 30 s blocks
    with pytest.raises(InputError, match="long.wav: the audio is silent throughout"):
        check_not_silent(x, sr, "long.wav", fps=30)
    x[1, sr * 65: sr * 65 + 400] = 0.5  # audible in the last block only, one channel
    check_not_silent(x, sr, "long.wav", fps=30)


def test_resample_without_librosa_is_unavailable_not_a_crash(monkeypatch):
    import importlib.util

    from lab import audio
    from lab.errors import BackendUnavailable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "librosa" else real(name, *a))
    with pytest.raises(BackendUnavailable, match="librosa"):
        audio.resample(np.zeros(1600, np.float32), 24000, 16000, backend="librosa_soxr")
