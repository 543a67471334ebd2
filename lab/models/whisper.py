"""Whisper-tiny encoder as MuseTalk uses it: 16 kHz audio → per-video-frame audio tokens.

Shape contract (full size, 25 fps):

    audio (n,) float32 at 16 kHz
      → log-mel (chunks, 80, 3000)            WhisperFeatureExtractor, 100 Hz, one 30 s window per chunk
      → hidden states (F, 5, 384)             embedding output + each of the 4 encoder layers, 50 Hz,
                                              F = n // 320 (padding frames of the last chunk dropped)
      → audio tokens (T, 50, 384)             T = n_video_frames(n, 16000, fps); per frame a window of
                                              10 feature frames × 5 states, time-major
                                              (token = 5·t + state, as MuseTalk's rearrange orders them)

The window for frame i is centred on the frame's own span of feature frames: at 25 fps frame i
owns features [2i, 2i+2) and the window is [2i-4, 2i+6): two video frames of context each side.
At other rates the window keeps its 10 feature frames (200 ms; the UNet expects 50 tokens) and
stays centred. Indices outside the audio repeat the edge frame. (MuseTalk v1's slicer clamps
indices the same way; `pad="zeros"` gives zero context instead.)

Whisper's encoder only accepts a full 30 s window, so short audio is zero-padded to 30 s (what
upstream does) and long audio runs as a batch of 30 s chunks.

`tiny` size keeps 4 layers (so 5 states × 10 = 50 tokens, as the UNet expects) with d_model 64,
for CPU tests.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lab.errors import InputError, WeightsError

SAMPLE_RATE = 16000
HOP = 160                 # mel hop: 100 Hz mel frames
FEATURE_RATE = 50         # encoder output rate (conv2 has stride 2)
WINDOW = 10               # feature frames per video frame (MuseTalk: 2·(2 + 2 + 1))
HF_ID = "openai/whisper-tiny"

# openai/whisper-tiny config.json, encoder side (the decoder is never built for random weights)
WHISPER_TINY = dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                    num_mel_bins=80, max_source_positions=1500, decoder_layers=4, decoder_attention_heads=6,
                    decoder_ffn_dim=1536, vocab_size=51865, activation_function="gelu", scale_embedding=False)
WHISPER_TEST = dict(WHISPER_TINY, d_model=64, encoder_attention_heads=4, encoder_ffn_dim=256,
                    decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=256)
CONFIGS = {"full": WHISPER_TINY, "tiny": WHISPER_TEST}


def whisper_config(size: str = "full"):
    from transformers import WhisperConfig

    if size not in CONFIGS:
        raise InputError(f"size must be 'full' or 'tiny', got {size!r}")
    return WhisperConfig(**CONFIGS[size])


def _encoder_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the encoder's keys from a whole-model checkpoint, whatever its prefix.

    openai/whisper-tiny (WhisperForConditionalGeneration) prefixes 'model.encoder.', a
    WhisperModel 'encoder.', a bare encoder nothing.
    """
    out = {}
    for k, v in sd.items():
        for prefix in ("model.encoder.", "encoder."):
            if k.startswith(prefix):
                out[k[len(prefix):]] = v
                break
        else:
            if not k.startswith(("model.decoder.", "decoder.", "proj_out.")):
                out[k] = v
    return out


def load_whisper(weights: str = "random", size: str = "full", device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """The Whisper encoder (transformers `WhisperEncoder`) and where its weights came from.

    weights: "random" (initialized under `seed`), a Hugging Face id such as "openai/whisper-tiny"
    (local cache only: no hub is reachable here), a transformers folder (config.json + weights),
    or a .pt/.pth/.bin/.safetensors state dict of the encoder or of the whole model.
    size: "full" = whisper-tiny exactly; "tiny" = d_model 64 for CPU tests.
    Returns (encoder in eval mode without grads, provenance string such as "random (seed 0)").
    """
    from transformers import WhisperModel
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from lab.models.weights import STATE_DICT_SUFFIXES, read_state_dict, resolve

    config = whisper_config(size)

    def build() -> torch.nn.Module:
        return WhisperEncoder(config)

    p = Path(str(weights)).expanduser()
    if weights != "random" and (p.is_file() or p.suffix in STATE_DICT_SUFFIXES):
        if not p.is_file():
            raise WeightsError(f"{p}: Whisper weights file not found; expected a .pt/.pth/.safetensors state dict "
                               f"of the encoder (or of a whole Whisper model)")
        sd = _encoder_state_dict(read_state_dict(p))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build()
        try:
            missing, unexpected = model.load_state_dict(sd, strict=False)
        except RuntimeError as e:  # shape mismatches raise even with strict=False
            raise WeightsError(f"{p}: does not match the Whisper encoder (size={size!r}): "
                               f"{str(e).splitlines()[-1].strip()[:300]}") from None
        # embed_positions is a fixed sinusoid some exporters drop; anything else missing is a mismatch
        missing = [k for k in missing if k != "embed_positions.weight"]
        if missing or unexpected:
            raise WeightsError(f"{p}: does not match the Whisper encoder (size={size!r}): {len(missing)} missing keys "
                               f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        source = f"local file {p}"
    else:
        looks_like_path = str(weights).startswith(("/", ".", "~")) or p.exists()
        if weights != "random" and looks_like_path and not p.exists():
            raise WeightsError(f"{p}: Whisper weights path not found; expected a transformers folder "
                               f"(config.json + weights) or a .pt/.pth/.safetensors state dict")
        model, source = resolve(str(weights), build,
                                lambda w, local: WhisperModel.from_pretrained(w, local_files_only=local).encoder,
                                seed=seed, hint="(e.g. openai/whisper-tiny) ")
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, source


@lru_cache(maxsize=4)
def feature_extractor(num_mel_bins: int = 80, chunk_seconds: int = 30):
    """WhisperFeatureExtractor from its default config: built locally, nothing downloaded."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE, hop_length=HOP,
                                   chunk_length=chunk_seconds)


def _chunk_samples(encoder: torch.nn.Module) -> int:
    # the encoder accepts exactly max_source_positions · 2 mel frames (30 s for upstream)
    return int(encoder.config.max_source_positions) * 2 * HOP


def log_mel(encoder: torch.nn.Module, audio_16k: np.ndarray) -> torch.Tensor:
    """Audio → log-mel windows (chunks, n_mels, frames), one per 30 s chunk, the last zero-padded."""
    n_chunk = _chunk_samples(encoder)
    fe = feature_extractor(int(encoder.config.num_mel_bins), n_chunk // SAMPLE_RATE)
    pieces = [audio_16k[i:i + n_chunk] for i in range(0, len(audio_16k), n_chunk)]
    return fe(pieces, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features


def _as_audio(audio_16k: np.ndarray | torch.Tensor) -> np.ndarray:
    a = audio_16k.detach().cpu().numpy() if isinstance(audio_16k, torch.Tensor) else np.asarray(audio_16k)
    if a.ndim != 1 or a.size == 0:
        raise InputError(f"audio of shape {a.shape} is not usable; expected mono 16 kHz samples (n,)")
    if not np.isfinite(a).all():
        raise InputError("audio holds NaN or infinite samples; expected finite 16 kHz samples")
    return np.ascontiguousarray(a, dtype=np.float32)


@torch.inference_mode()
def whisper_hidden_states(encoder: torch.nn.Module, audio_16k: np.ndarray | torch.Tensor,
                          batch_size: int = 4, progress: bool = False) -> torch.Tensor:
    """All encoder hidden states at 50 Hz → (F, n_layers + 1, d_model), F = n // 320.

    State 0 is the embedding output (convs + positions); the last is after the final
    layer norm (transformers' convention, which MuseTalk consumes). `batch_size` 30 s chunks
    go through the encoder per call.
    """
    a = _as_audio(audio_16k)
    mel = log_mel(encoder, a)
    p = next(encoder.parameters())
    outs = []
    for i in tqdm(range(0, mel.shape[0], batch_size), desc="whisper", disable=not progress):
        hs = encoder(mel[i:i + batch_size].to(p.device, p.dtype), output_hidden_states=True).hidden_states
        outs.append(torch.stack(hs, dim=2))  # (b, 1500, L+1, D)
    feats = torch.cat(outs).flatten(0, 1)  # chunks back to back in time
    n_feat = len(a) * FEATURE_RATE // SAMPLE_RATE
    return feats[:n_feat]


def frame_windows(n_frames: int, n_features: int, fps: float, window: int = WINDOW,
                  feature_rate: float = FEATURE_RATE) -> torch.Tensor:
    """Feature-frame indices (n_frames, window) for each video frame, centred, unclamped.

    At 25 fps frame i gets [2i-4, ..., 2i+5].
    """
    per = feature_rate / fps
    centre = (torch.arange(n_frames, dtype=torch.float64) + 0.5) * per
    start = torch.floor(centre - window / 2 + 0.5).long()
    return start[:, None] + torch.arange(window)[None, :]


def musetalk_audio_features(encoder: torch.nn.Module, audio_16k: np.ndarray | torch.Tensor, fps: float = 25,
                            batch_size: int = 4, pad: str = "repeat", progress: bool = False) -> torch.Tensor:
    """MuseTalk's audio prompt: (T, 10·(n_layers+1), d_model) = (T, 50, 384) at full size.

    T = n_video_frames(len(audio), 16000, fps). See the module docstring for the window and
    token order. `pad`: "repeat" (edge frames repeated) or "zeros". Output on the encoder's
    device and dtype.
    """
    from lab.audio import n_video_frames

    if pad not in ("repeat", "zeros"):
        raise InputError(f"pad must be 'repeat' or 'zeros', got {pad!r}")
    a = _as_audio(audio_16k)
    n_frames = n_video_frames(len(a), SAMPLE_RATE, fps)
    if n_frames == 0:
        raise InputError(f"audio of {len(a)} samples ({len(a) / SAMPLE_RATE * 1e3:.1f} ms) is shorter than one "
                         f"video frame at {fps} fps; expected at least {math.ceil(SAMPLE_RATE / fps)} samples")
    feats = whisper_hidden_states(encoder, a, batch_size=batch_size, progress=progress)  # (F, S, D)
    idx = frame_windows(n_frames, feats.shape[0], fps).to(feats.device)
    inside = (idx >= 0) & (idx < feats.shape[0])
    out = feats[idx.clamp(0, feats.shape[0] - 1)]  # (T, W, S, D): one gather, no per-frame loop
    if pad == "zeros":
        out = out * inside[:, :, None, None].to(out.dtype)
    return out.flatten(1, 2)


def audio_positional_encoding(x: torch.Tensor, max_len: int = 5000) -> torch.Tensor:
    """x + the Transformer sinusoidal encoding over the token axis (dim -2), as MuseTalk adds
    to its (T, 50, 384) audio prompt before the UNet's cross-attention (the generator applies it:
    `lab.models.musetalk.positional_encoding`; this is the checked entry point for callers).

    Even channels get sin(pos / 10000^(2i/d)), odd channels cos; d = x.shape[-1].
    """
    from lab.models.musetalk import positional_encoding

    if x.ndim < 2:
        raise InputError(f"expected (..., tokens, d_model), got shape {tuple(x.shape)}")
    if x.shape[-2] > max_len:
        raise InputError(f"{x.shape[-2]} tokens exceed the positional encoding's max_len {max_len}")
    return positional_encoding(x.reshape(-1, *x.shape[-2:])).reshape(x.shape)
