"""LatentSync's audio: Whisper-tiny's encoder (transformers' layout, or OpenAI's checkpoint as LatentSync ships it)
and the per-frame audio tokens (T, 50, 384) its UNet's cross-attention reads."""
from __future__ import annotations

import numpy as np
import torch

from lab.pipelines.latentsync.config import SAMPLE_RATE

AUDIO_CONTEXT = 2           # video frames of audio context each side (upstream's audio_feat_length [2, 2])
MEL_CHUNK = 3000            # mel frames per encoder call (30 s)


def whisper_keys_from_openai(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenAI's Whisper layout (LatentSync's checkpoints/whisper/tiny.pt) → transformers' WhisperEncoder
    keys; the decoder's keys are dropped."""
    import re

    subs = [(r"^encoder\.positional_embedding$", "embed_positions.weight"), (r"^encoder\.ln_post\.", "layer_norm."),
            (r"^encoder\.blocks\.(\d+)\.attn\.query\.", r"layers.\1.self_attn.q_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn\.key\.", r"layers.\1.self_attn.k_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn\.value\.", r"layers.\1.self_attn.v_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn\.out\.", r"layers.\1.self_attn.out_proj."),
            (r"^encoder\.blocks\.(\d+)\.attn_ln\.", r"layers.\1.self_attn_layer_norm."),
            (r"^encoder\.blocks\.(\d+)\.mlp\.0\.", r"layers.\1.fc1."), (r"^encoder\.blocks\.(\d+)\.mlp\.2\.", r"layers.\1.fc2."),
            (r"^encoder\.blocks\.(\d+)\.mlp_ln\.", r"layers.\1.final_layer_norm."), (r"^encoder\.", "")]
    out = {}
    for k, v in sd.items():
        if not k.startswith("encoder."):
            continue
        for pat, rep in subs:
            new, n = re.subn(pat, rep, k)
            if n:
                out[new] = v
                break
    return out


def load_audio_encoder(weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """Whisper's encoder as `lab.models.whisper.load_whisper` loads it, and also from OpenAI's own
    checkpoint format (a .pt holding "dims" and "model_state_dict": what LatentSync ships as
    checkpoints/whisper/tiny.pt), its keys renamed to transformers' and loaded strictly."""
    from pathlib import Path

    from lab.errors import WeightsError
    from lab.models.whisper import load_whisper

    p = Path(str(weights)).expanduser()
    ck = None
    if weights != "random" and p.is_file() and p.suffix in (".pt", ".pth"):
        try:
            ck = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception:
            ck = None  # not this format: load_whisper names the problem
    if not (isinstance(ck, dict) and "model_state_dict" in ck and "dims" in ck):
        return load_whisper(weights, size=size, device=device, dtype=dtype, seed=seed)
    from lab.models.weights import check_finite

    check_finite(ck["model_state_dict"], p)
    enc, _ = load_whisper("random", size=size, seed=seed)
    try:
        enc.load_state_dict(whisper_keys_from_openai(ck["model_state_dict"]), strict=True)
    except RuntimeError as e:
        raise WeightsError(f"{p}: an OpenAI Whisper checkpoint that does not match the encoder (size={size!r}): "
                           f"{str(e).splitlines()[-1].strip()[:300]}") from None
    return enc.to(device=device, dtype=dtype).eval().requires_grad_(False), f"local file {p}"


def log_mel(audio_16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(80, n // 160) log-mel of the whole clip, as upstream's Whisper computes it: one STFT over all of the
    audio (no padding to 30 s first), and the dynamic range clipped to 8 decades below the clip's peak."""
    from lab.models.whisper import feature_extractor

    a = torch.as_tensor(np.asarray(audio_16k, dtype=np.float32))
    spec = torch.stft(a, 400, 160, window=torch.hann_window(400), center=True, pad_mode="reflect",
                      return_complex=True)[:, :-1].abs() ** 2
    mel = torch.from_numpy(feature_extractor(80, 30).mel_filters.T.astype(np.float32)) @ spec
    logm = mel.clamp_min(1e-10).log10()
    return (torch.maximum(logm, logm.max() - 8.0) + 4.0) / 4.0


@torch.inference_mode()
def encoder_states(encoder: torch.nn.Module, mel: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Log-mel (80, M) → (M // 2, 5, D) at 50 Hz: the embedding and each layer's output, the last one before
    the final LayerNorm (upstream reads the blocks' outputs, not the normed encoder output). The mel runs in
    30 s pieces, each zero-padded in the log-mel domain, as upstream's transcribe loop feeds them."""
    p = next(encoder.parameters())
    pieces = [mel[:, i:i + MEL_CHUNK] for i in range(0, mel.shape[1], MEL_CHUNK)]
    keep = [x.shape[1] // 2 for x in pieces]
    padded = torch.stack([torch.nn.functional.pad(x, (0, MEL_CHUNK - x.shape[1])) for x in pieces])
    outs = []
    for i in range(0, len(padded), batch):
        got: list[torch.Tensor] = []
        hooks = [encoder.layers[0].register_forward_pre_hook(lambda m, a: got.append(a[0]))]
        hooks += [layer.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
                  for layer in encoder.layers]
        try:
            encoder(padded[i:i + batch].to(p.device, p.dtype))
        finally:
            for h in hooks:
                h.remove()
        outs.append(torch.stack(got, dim=2))                  # (b, 1500, L + 1, D)
    states = torch.cat(outs)
    return torch.cat([states[j, :k] for j, k in enumerate(keep)])


def audio_windows(states: torch.Tensor, n_frames: int, fps: float = 25.0) -> torch.Tensor:
    """(F, S, D) states → (n_frames, 10·S, D): frame i reads the 10 feature frames from ⌊50·i/fps⌋ − 4,
    indices clamped to the clip (the edge frame repeated), time-major (token = S·t + state)."""
    i = torch.arange(n_frames, dtype=torch.float64)
    start = torch.floor(i * 50 / fps).long() - 2 * AUDIO_CONTEXT
    idx = (start[:, None] + torch.arange(2 * (2 * AUDIO_CONTEXT + 1))[None]).clamp(0, len(states) - 1)
    return states[idx.to(states.device)].flatten(1, 2)


def audio_features(encoder: torch.nn.Module, audio_16k: np.ndarray, fps: float = 25.0) -> torch.Tensor:
    """LatentSync's per-frame audio tokens (T, 50, D), T = the whole video frames the audio covers."""
    from lab.audio import n_video_frames

    n = n_video_frames(len(audio_16k), SAMPLE_RATE, fps)
    return audio_windows(encoder_states(encoder, log_mel(audio_16k)), n, fps)
