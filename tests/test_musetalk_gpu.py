"""MuseTalk on the GPU host (pytest -m gpu): the sequential mode's copy through its page-locked buffer hands
the writer the frames the async queue does, run after run (the buffer is reused), as upstream's pageable copy does."""
import numpy as np
import pytest
import torch

from lab import data
from lab.pipelines import musetalk as mt
from lab.pipelines.musetalk import loop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_sequential_copy_through_the_pinned_buffer_matches_async(collector, monkeypatch):
    cfg = mt.Config(size="tiny", frame_size=(128, 192), crop=64, batch_size=4, dtype="fp16")
    e = mt.build(cfg, "cuda")
    av = mt.prepare(e, mt.avatar_loop(5, (128, 192)))
    mt.warmup(e, av)
    a, sr = data.default_audio(16000)
    taken = []
    real = loop._take_buffers
    monkeypatch.setattr(loop, "_take_buffers", lambda eng, key, n: taken.append(n) or real(eng, key, n))
    got = {}
    for mode, copy in (("async", "pinned"), ("sequential", "pinned"), ("sequential", "pinned"), ("sequential", "pageable")):
        w = collector()
        del taken[:]
        techs = ("gpu_blend",) + (("async_encode",) if mode == "async" else ()) + (("pinned_copy",) if copy == "pinned" else ())
        r = mt.run(mt.reconfigure(e, techniques=techs), av, a, sr, sink=w, n_frames=10)
        got.setdefault((mode, copy), []).append(np.concatenate(w.frames))
        assert r.n_frames == 10 and "d2h" in r.stages
        if mode == "sequential":   # one page-locked buffer per pinned run, none for the pageable copy
            assert taken == ([1] if copy == "pinned" else [])
    ref = got[("async", "pinned")][0]
    assert ref.shape[0] == 10
    seq = got[("sequential", "pinned")]
    assert np.array_equal(seq[0], ref) and np.array_equal(seq[1], ref)   # the second run reuses the buffer
    assert np.array_equal(got[("sequential", "pageable")][0], ref)
