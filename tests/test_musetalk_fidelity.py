"""MuseTalk v1.5 fidelity: audio windows as upstream places them (checked against a reference
written from the rules), streamed features equal to whole-clip ones, bounded memory, the
landmark face crop and the jaw blend mask."""
import math

import numpy as np
import pytest
import torch

from lab.errors import InputError
from lab.models import whisper as W

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return W.load_whisper(size="tiny")[0]


def speechlike(seconds: float, sr: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(round(sr * seconds)))).astype(np.float32)


def upstream_reference(hidden: torch.Tensor, n_samples: int, fps: int) -> tuple[torch.Tensor, list[int]]:
    """MuseTalk v1.5's windows from the rules: T = ⌊n·fps/16000⌋ frames; the 50 Hz states are
    zero-padded by 2·c frames on the left and 6·c on the right (c = ⌈50/fps⌉); frame i takes the
    10 padded frames from ⌊i·50/fps⌋. Frames whose slice comes out short are where upstream's
    code fails; they are returned, and filled here with zeros (the lab's documented choice)."""
    c = math.ceil(50 / fps)
    z = torch.zeros(1, *hidden.shape[1:], dtype=hidden.dtype)
    padded = torch.cat([z.expand(2 * c, -1, -1), hidden, z.expand(6 * c, -1, -1)])
    out, short = [], []
    for i in range(n_samples * fps // 16000):
        w = padded[(i * 50) // fps:(i * 50) // fps + 10]
        if len(w) < 10:
            short.append(i)
            w = torch.cat([w, z.expand(10 - len(w), -1, -1)])
        out.append(w.flatten(0, 1))
    return torch.stack(out), short


@pytest.mark.parametrize("seconds", [2.0, 31.3])
def test_windows_equal_upstream_rules_at_any_fps(tiny, seconds):
    x = speechlike(seconds)
    hidden = W.whisper_hidden_states(tiny, x)
    for fps in (24, 25, 30, 50, 60):
        ref, short = upstream_reference(hidden, len(x), fps)
        got = W.musetalk_audio_features(tiny, x, fps=fps, pad="zeros", align="upstream")
        assert got.shape == ref.shape, fps
        assert torch.equal(got, ref), fps
        # upstream's own slicing fails exactly where the reference file says: the last frame at 50/60 fps
        assert short == ([len(ref) - 1] if fps in (50, 60) else []), (fps, short)
        if short:  # our behaviour there: the window's tail past the audio is zeros, the frame is kept
            assert torch.equal(got[-1, -5:], torch.zeros_like(got[-1, -5:]))


def test_upstream_starts_and_centred_differ_where_expected():
    s25 = W.upstream_window_starts(10, 25)
    assert s25.tolist() == [2 * i - 4 for i in range(10)]  # 25 fps: same as the centred window
    assert torch.equal(W.window_indices(10, 25, "upstream"), W.window_indices(10, 25, "centred"))
    up, ce = W.window_indices(30, 30, "upstream"), W.window_indices(30, 30, "centred")
    assert 0 < int((up[:, 0] != ce[:, 0]).sum()) < 30  # 30 fps: a share of frames one feature frame off
    assert bool((W.window_indices(24, 24, "upstream")[:, 0] != W.window_indices(24, 24, "centred")[:, 0]).all())
    with pytest.raises(InputError, match="align"):
        W.window_indices(3, 25, "middle")


def test_stream_equals_whole_clip_features(tiny):
    x = speechlike(31.3)
    whole = W.musetalk_audio_features(tiny, x, fps=30, pad="zeros", align="upstream")
    st = W.AudioFeatureStream(tiny, x, 16000, fps=30)
    assert len(st) == len(whole)
    got = []
    for s in range(0, len(st), 64):  # in order, releasing what is behind, as the pipeline does
        st.release_before(s)
        st.prefetch(min(s + 63, len(st) - 1))
        got.append(st.windows(np.arange(s, min(s + 64, len(st)))))
    assert torch.equal(torch.cat(got), whole)
    assert st.computed == 2 and st.peak_chunks <= 2
    with pytest.raises(InputError, match="outside"):
        st.windows([len(st)])


def test_stream_resamples_chunkwise_like_the_whole_clip(tiny):
    from lab import audio as lab_audio

    x24 = speechlike(61.0, sr=24000)
    rs = lambda a, sr, new: lab_audio.resample(a, sr, new, backend="torchaudio_cpu")  # noqa: E731
    st = W.AudioFeatureStream(tiny, x24, 24000, fps=25, resample=rs)
    whole = rs(x24, 24000, 16000)
    assert st.n16 == len(whole)
    pieces = np.concatenate([st.audio16(c) for c in range(st.n_chunks)])
    assert pieces.shape == whole.shape
    assert np.abs(pieces - whole).max() < 1e-5
