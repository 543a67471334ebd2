"""Whisper's log-mel on the GPU host (pytest -m gpu): computed on the encoder's device, it matches the
host's to fp32 round-off, and the MuseTalk audio prompt with it matches the host-mel prompt."""
import numpy as np
import pytest
import torch

import lab.models.whisper as W
from lab.metrics import cosine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_log_mel_on_the_gpu_matches_the_host(monkeypatch):
    enc = W.load_whisper(size="full", device="cuda", dtype=torch.float16)[0]
    x = (0.1 * np.random.default_rng(0).standard_normal(16000 * 31)).astype(np.float32)
    gpu, host = W.log_mel(enc, x), W.log_mel(enc, x, device="cpu")
    assert gpu.shape == host.shape == (2, 80, 3000)
    assert (gpu - host).abs().max() < 1e-4  # log10 scale, (x + 4) / 4: values ~ -0.5 .. 1.5
    ref = W.musetalk_audio_features(enc, x, fps=25)
    orig = W.log_mel
    monkeypatch.setattr(W, "log_mel", lambda e, a, device=None: orig(e, a, device="cpu"))
    host_prompt = W.musetalk_audio_features(enc, x, fps=25)
    assert cosine(ref.float(), host_prompt.float()) > 0.99999
