"""Audio feature cache: window grid, fingerprint, LRU, hits and the bad inputs."""
import numpy as np
import pytest
import torch

from lab.serving import feature_cache as fc
from lab.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")
SR = 16000


def _phrase(seed: int, seconds: float = 0.6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * (150 + 50 * seed) * t) * (1 + rng.random(t.size) * 0.1)).astype(np.float32)


def test_bad_inputs_are_named():
    with pytest.raises(InputError, match="larger than the stream"):
        fc.window_starts(1000, SR)                                  # audio shorter than one 200 ms window
    with pytest.raises(InputError, match="larger than the stream"):
        fc.window_starts(SR, SR, window_s=2.0)                      # window larger than the stream
    with pytest.raises(InputError, match="zero-length"):
        fc.window_starts(0, SR)
    with pytest.raises(InputError, match="zero-length"):
        fc.encode_windows(np.zeros(0, np.float32), SR, lambda w: w, fc.LRU(4))
    with pytest.raises(InputError, match="larger than the stream"):
        fc.encode_windows(np.zeros(100, np.float32), SR, lambda w: w, fc.LRU(4))
    with pytest.raises(InputError, match="capacity"):
        fc.LRU(0)
    with pytest.raises(InputError, match="stride_s"):
        fc.window_starts(SR, SR, stride_s=0)


def test_grid_and_utterance_grid():
    s = fc.window_starts(SR, SR)
    assert s[0] == 0 and np.all(np.diff(s) == 2128) and s[-1] + 3200 <= SR
    u = fc.window_starts(2 * SR, SR, utterances=[(100, 100 + 4000), (SR, 2 * SR)])
    assert u[0] == 100 and SR in u


def test_fingerprint_exact_and_level_sensitive():
    x = _phrase(1)[:3200]
    assert fc.fingerprint(x) == fc.fingerprint(x.copy())
    assert fc.fingerprint(x) != fc.fingerprint(x * 0.5)                 # 6 dB: another cell on most bins
    q = fc.quantized_mel(x)
    assert q.dtype == np.uint8 and q.max() < fc.LEVELS and q.shape[1] == fc.N_MELS


def test_lru_evicts_least_recently_used():
    c = fc.LRU(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1          # refreshes a
    c.put("c", 3)                   # evicts b
    assert "b" not in c and "a" in c and c.evictions == 1 and c.hits == 1


def test_repeated_phrase_hits_on_the_utterance_grid_and_hits_are_exact():
    p, q = _phrase(1), _phrase(2)
    gap = np.zeros(1234, np.float32)                 # not a multiple of the 133 ms stride
    a = np.concatenate([p, gap, q, gap, p])
    spans = [(0, p.size), (p.size + gap.size, p.size + gap.size + q.size), (a.size - p.size, a.size)]
    calls = []

    def enc(w):
        calls.append(1)
        return torch.from_numpy(w[::100].copy())

    rep = fc.encode_windows(a, SR, enc, fc.LRU(100), fc.window_starts(a.size, SR, utterances=spans), check_hits=True)
    third = rep.starts >= spans[2][0]
    assert rep.hits[third].all() and not rep.hits[~third].any()
    assert all(torch.equal(rep.features[i], rep.recomputed[i]) for i in rep.recomputed)
    assert len(calls) == (~rep.hits).sum() + rep.hits.sum()    # misses + the check_hits recomputes
    assert np.isnan(rep.encode_s[rep.hits]).all() and (rep.encode_s[~rep.hits] >= 0).all()
    # the free-running grid meets the repeat at another phase: no hits
    grid = fc.encode_windows(a, SR, enc, fc.LRU(100))
    assert grid.hit_rate == 0.0


def test_near_identical_audio_can_collide():
    p = _phrase(3)
    rep = fc.encode_windows(np.concatenate([p, p * np.float32(10 ** (-0.001 / 20))]), SR,
                            lambda w: torch.tensor([float(w.sum())]), fc.LRU(100),
                            fc.window_starts(2 * p.size, SR, utterances=[(0, p.size), (p.size, 2 * p.size)]),
                            check_hits=True)
    assert rep.hits.any()                            # 0.001 dB quieter: same 16-level cells
    assert any(not torch.equal(rep.features[i], rep.recomputed[i]) for i in rep.recomputed)


def test_nearest_window():
    starts = np.array([0, 2128, 4256])
    j = fc.nearest_window(np.array([0.0, 0.1, 0.24, 0.5]), starts, SR)
    assert j.tolist() == [0, 0, 1, 2]


def test_espeak_phrase_script():
    from lab.experiments.serving import espeak_available, phrase_script

    ok, why = espeak_available()
    if not ok:
        pytest.skip(why)
    s = phrase_script(SR, script=[("breaking", "base"), ("breaking", "base"), ("breaking", "rate")])
    assert s["source"] == "espeak-ng"
    (a0, a1), (b0, b1), (c0, c1) = s["spans"]
    assert np.array_equal(s["audio"][a0:a1], s["audio"][b0:b1])      # a repeated take is bit-identical
    assert (c1 - c0) < (a1 - a0)                                      # faster rate: shorter
