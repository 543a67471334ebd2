import numpy as np
import pytest
import torch

from lab.errors import InputError, WeightsError
from lab.models.whisper import (audio_positional_encoding, frame_windows, load_whisper, log_mel,
                                musetalk_audio_features, whisper_hidden_states)


@pytest.fixture(scope="module")
def tiny():
    return load_whisper(size="tiny")[0]


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)


def test_full_size_shapes_match_upstream():
    enc, source = load_whisper(size="full")
    assert source == "random (seed 0)"
    cfg = enc.config
    assert (cfg.d_model, cfg.encoder_layers, cfg.encoder_attention_heads, cfg.num_mel_bins,
            cfg.max_source_positions) == (384, 4, 6, 80, 1500)
    feats = musetalk_audio_features(enc, speechlike(1.0), fps=25)
    assert feats.shape == (25, 50, 384) and feats.dtype == torch.float32


def test_random_weights_are_seeded():
    a, _ = load_whisper(size="tiny", seed=1)
    b, _ = load_whisper(size="tiny", seed=1)
    c, _ = load_whisper(size="tiny", seed=2)
    assert torch.equal(a.conv1.weight, b.conv1.weight)
    assert not torch.equal(a.conv1.weight, c.conv1.weight)


def test_hidden_states_rate_and_count(tiny):
    hs = whisper_hidden_states(tiny, speechlike(1.0))
    assert hs.shape == (50, 5, 64)  # 50 Hz, embedding + 4 layers


def test_log_mel_on_the_encoders_device_by_default(tiny, monkeypatch):
    import lab.models.whisper as W

    seen = []
    real = W.feature_extractor

    def spy(*a):
        fe = real(*a)
        return lambda *x, **k: seen.append(k["device"]) or fe(*x, **k)
    monkeypatch.setattr(W, "feature_extractor", spy)
    x = speechlike(31.0)
    mel = log_mel(tiny, x)
    assert seen == [str(next(tiny.parameters()).device)]   # the encoder's device, handed to the extractor
    assert mel.shape == (2, 80, 3000) and mel.device.type == "cpu"  # two 30 s windows, the last zero-padded
    assert torch.equal(mel, log_mel(tiny, x, device="cpu"))
    # each window is scaled by its own maximum: the second equals the last second alone
    assert torch.allclose(mel[1], log_mel(tiny, x[30 * 16000:])[0], atol=1e-6)


def test_windows_centred_on_frame():
    w = frame_windows(3, 100, fps=25)
    assert w[0].tolist() == list(range(-4, 6))
    assert w[2].tolist() == list(range(0, 10))
    # any fps: 10 feature frames centred on the frame's own span
    w30 = frame_windows(30, 50, fps=30)
    centre = (w30.float().mean(1) + 0.5)
    assert torch.all((centre - (torch.arange(30) + 0.5) * 50 / 30).abs() <= 0.5)


def test_window_content_and_edge_repetition(tiny):
    x = speechlike(0.4)
    hs = whisper_hidden_states(tiny, x)  # (20, 5, 64)
    feats = musetalk_audio_features(tiny, x, fps=25)  # (10, 50, 64)
    assert feats.shape == (10, 50, 64)
    win = feats.reshape(10, 10, 5, 64)  # tokens are time-major: token = 5·t + state
    assert torch.equal(win[5], hs[6:16])
    assert torch.equal(win[0, :4], hs[0:1].expand(4, 5, 64))  # left edge repeats frame 0
    assert torch.equal(win[9, -1], hs[-1])  # right edge repeats the last frame
    zeros = musetalk_audio_features(tiny, x, fps=25, pad="zeros").reshape(10, 10, 5, 64)
    assert torch.all(zeros[0, :4] == 0) and torch.equal(zeros[5], win[5])


def test_long_audio_runs_in_30s_chunks(tiny):
    x = speechlike(31.0)
    hs = whisper_hidden_states(tiny, x, batch_size=1)
    assert hs.shape[0] == 31 * 50
    # the first chunk does not see the second: its features equal those of the first 30 s alone
    first = whisper_hidden_states(tiny, x[:30 * 16000])
    assert torch.allclose(hs[:1500], first, atol=1e-5)
    feats = musetalk_audio_features(tiny, x, fps=25, batch_size=2)
    assert feats.shape == (31 * 25, 50, 64)


def test_audio_too_short_or_bad(tiny):
    with pytest.raises(InputError, match="shorter than one video frame"):
        musetalk_audio_features(tiny, np.zeros(100, np.float32))
    with pytest.raises(InputError, match="mono"):
        musetalk_audio_features(tiny, np.zeros((2, 16000), np.float32))


def test_positional_encoding():
    x = torch.zeros(3, 50, 384)
    y = audio_positional_encoding(x)
    assert y.shape == x.shape
    assert torch.allclose(y[0, 0, 0::2], torch.zeros(192)) and torch.allclose(y[0, 0, 1::2], torch.ones(192))
    assert torch.allclose(y[1, 7, 0], torch.sin(torch.tensor(7.0)))
    assert torch.allclose(y[1, 7, 1], torch.cos(torch.tensor(7.0)))
    assert torch.allclose(y[2, 7, 2], torch.sin(torch.tensor(7.0) / 10000 ** (2 / 384)))


def test_missing_weights_path(tmp_path):
    missing = tmp_path / "nope" / "whisper.pth"
    with pytest.raises(WeightsError, match=str(missing)):
        load_whisper(str(missing))
    with pytest.raises(WeightsError, match="not found"):
        load_whisper(str(tmp_path / "no_such_folder"))


def test_hub_id_without_cache_says_no_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(WeightsError, match="no hub"):
        load_whisper("openai/whisper-tiny-not-cached-here")


def test_state_dict_roundtrip(tmp_path, tiny):
    # a whole-model checkpoint (prefixed keys, decoder included) loads into the encoder
    sd = {f"model.encoder.{k}": v for k, v in tiny.state_dict().items()}
    sd["model.decoder.embed_tokens.weight"] = torch.zeros(3, 3)
    torch.save(sd, tmp_path / "whisper.pt")
    enc, source = load_whisper(str(tmp_path / "whisper.pt"), size="tiny", seed=123)
    assert source.startswith("local file")
    assert torch.equal(enc.conv1.weight, tiny.conv1.weight)
    with pytest.raises(WeightsError, match="does not match"):
        load_whisper(str(tmp_path / "whisper.pt"), size="full")
