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
from lab.progress import tqdm

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


def log_mel(encoder: torch.nn.Module, audio_16k: np.ndarray,
            device: str | torch.device | None = None) -> torch.Tensor:
    """Audio → log-mel windows (chunks, n_mels, frames), one per 30 s chunk, the last zero-padded.

    The STFT and the mel projection run on `device` (default: the encoder's). On a GPU that keeps
    them off the host's thread pool: on the H200 host (16 cores) a 30 s window took 2.4–34 ms there
    and 1.5–2.7 ms on the GPU; the values match the host's to fp32 round-off. The result comes back
    on the host, as transformers' feature extractor returns it.
    """
    dev = torch.device(device) if device is not None else next(encoder.parameters()).device
    n_chunk = _chunk_samples(encoder)
    fe = feature_extractor(int(encoder.config.num_mel_bins), n_chunk // SAMPLE_RATE)
    pieces = [audio_16k[i:i + n_chunk] for i in range(0, len(audio_16k), n_chunk)]
    return fe(pieces, sampling_rate=SAMPLE_RATE, return_tensors="pt", device=str(dev)).input_features


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
                            batch_size: int = 4, pad: str = "repeat", progress: bool = False,
                            align: str = "centred") -> torch.Tensor:
    """MuseTalk's audio prompt: (T, 10·(n_layers+1), d_model) = (T, 50, 384) at full size.

    T = n_video_frames(len(audio), 16000, fps). See the module docstring for the window and
    token order. `pad`: "repeat" (edge frames repeated) or "zeros". `align`: "centred" or
    "upstream" (MuseTalk v1.5's placement, see `window_indices`; with pad="zeros" these are
    upstream's windows). Output on the encoder's device and dtype.
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
    idx = window_indices(n_frames, fps, align).to(feats.device)
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


# ---------------------------------------------------------------- upstream v1.5 windows, streamed

ALIGNS = ("upstream", "centred")
CONTEXT_FRAMES = 2  # video frames of audio context each side (MuseTalk's audio_padding_length left/right)


def upstream_window_starts(frames: int | np.ndarray, fps: float, feature_rate: int = FEATURE_RATE,
                           context: int = CONTEXT_FRAMES) -> np.ndarray:
    """First feature frame of each video frame's window, as MuseTalk v1.5 places it: frame i
    starts at ⌊i·rate/fps⌋ − context·⌈rate/fps⌉ (int64, may be negative: those frames are zero).

    `frames`: a count (frames 0..n-1) or the frame indices. Exact rational arithmetic, so 30 fps
    (rate/fps = 5/3) never lands a hair below an integer.
    """
    from fractions import Fraction

    per = Fraction(feature_rate) / Fraction(fps).limit_denominator(1_000_000)
    i = np.arange(int(frames), dtype=np.int64) if np.ndim(frames) == 0 else np.asarray(frames, dtype=np.int64)
    return (i * per.numerator) // per.denominator - context * math.ceil(per)


def window_indices(frames: int | np.ndarray, fps: float, align: str = "upstream", window: int = WINDOW) -> torch.Tensor:
    """Feature-frame indices (len(frames), window) per video frame, unclamped; `frames` a count
    or the frame indices.

    align="upstream": MuseTalk v1.5's placement (`upstream_window_starts`). Upstream pads the
    features with zeros (2·⌈50/fps⌉ frames left, 6·⌈50/fps⌉ right) and slices; at 50 and 60 fps
    the last frame's slice runs past that right padding and upstream stops one frame short. Here
    every index past the audio reads as zero, so that frame gets a full window whose tail is
    zeros (the zero padding continued) and the clip keeps all n_video_frames frames.
    align="centred": the window centred on the frame's own span (as `frame_windows`).
    """
    i = np.arange(int(frames), dtype=np.int64) if np.ndim(frames) == 0 else np.asarray(frames, dtype=np.int64)
    if align == "centred":
        centre = (i.astype(np.float64) + 0.5) * (FEATURE_RATE / fps)
        start = np.floor(centre - window / 2 + 0.5).astype(np.int64)
    elif align == "upstream":
        start = upstream_window_starts(i, fps)
    else:
        raise InputError(f"align must be one of {ALIGNS}, got {align!r}")
    return torch.from_numpy(start)[:, None] + torch.arange(window)[None, :]


def n_resampled(n_samples: int, sr: int, new_sr: int = SAMPLE_RATE) -> int:
    """Samples after resampling n_samples from sr to new_sr: ⌈n·new/sr⌉, the length torchaudio,
    librosa and scipy's polyphase resampler all return."""
    return -(-int(n_samples) * int(new_sr) // int(sr))


class AudioFeatureStream:
    """MuseTalk's audio prompt (T, 50, D) for any frame range, built 30 s at a time.

    The whole clip's features are never held: the input is resampled to 16 kHz and run through
    Whisper one encoder chunk (30 s) at a time, as the frames that need it come up. A frame's
    window reaches at most a few feature frames into the neighbouring chunk, so two chunks
    resident cover every window; chunks behind the lowest frame still to come are released.
    Memory is O(chunk), whatever the audio length: per resident chunk 1500 × 5 × D values on the
    encoder's device, plus 30 s of 16 kHz audio and its log-mel on the host (computed on the encoder's device).

    Each chunk is cut from the input with `context_s` of extra audio each side (aligned to whole
    resampler periods) and trimmed after resampling, so the 16 kHz samples equal a whole-clip
    resample up to the resampler's float rounding; each chunk's features are exactly what
    `whisper_hidden_states` gives for it (chunks are independent in Whisper).

    `resample(x, sr, new_sr)` does the resampling (e.g. `lab.audio.resample` with a backend);
    `timer` (a lab.timing.StageTimer) times it as "resample" and Whisper as "whisper".
    """

    def __init__(self, encoder: torch.nn.Module, audio: np.ndarray, sr: int, fps: float,
                 resample=None, align: str = "upstream", pad: str = "zeros", timer=None,
                 context_s: float = 0.25):
        from fractions import Fraction

        from lab.audio import n_video_frames

        if pad not in ("repeat", "zeros"):
            raise InputError(f"pad must be 'repeat' or 'zeros', got {pad!r}")
        if align not in ALIGNS:
            raise InputError(f"align must be one of {ALIGNS}, got {align!r}")
        a = np.asarray(audio)
        if a.ndim != 1 or a.size == 0:
            raise InputError(f"audio of shape {a.shape} is not usable; expected mono samples (n,)")
        self.encoder, self.audio, self.sr, self.fps = encoder, a, int(sr), float(fps)
        self.align, self.pad, self.timer = align, pad, timer
        self.resample = resample
        self.n16 = n_resampled(len(a), self.sr) if self.sr != SAMPLE_RATE else len(a)
        self.n_features = self.n16 * FEATURE_RATE // SAMPLE_RATE
        self.n_frames = n_video_frames(self.n16, SAMPLE_RATE, fps)
        self.chunk16 = _chunk_samples(encoder)
        self.chunk_feats = self.chunk16 * FEATURE_RATE // SAMPLE_RATE
        self.n_chunks = max(1, -(-self.n_features // self.chunk_feats))
        # input samples per whole resampler period: chunk cuts on multiples of it keep the
        # 16 kHz grid of every chunk on the whole clip's grid
        r = Fraction(self.sr, SAMPLE_RATE)
        self.unit = r.numerator
        self.ctx = -(-int(context_s * self.sr) // self.unit) * self.unit
        self.chunks: dict[int, torch.Tensor] = {}
        self.floor = 0     # chunks below it are released: no window still to come reads them
        self.computed = 0  # chunk encodes so far (a chunk released and needed again counts twice)
        self.peak_chunks = 0

    def __len__(self) -> int:
        return self.n_frames

    def _stage(self, name: str):
        from contextlib import nullcontext

        return self.timer.stage(name) if self.timer is not None else nullcontext()

    def audio16(self, c: int) -> np.ndarray:
        """16 kHz samples of chunk c (the last one shorter)."""
        o0, o1 = c * self.chunk16, min((c + 1) * self.chunk16, self.n16)
        if self.sr == SAMPLE_RATE:
            return np.ascontiguousarray(self.audio[o0:o1], dtype=np.float32)
        s0 = o0 * self.sr // SAMPLE_RATE  # exact: o0 is a multiple of 30 s
        lo = max(0, s0 - self.ctx)
        hi = min(len(self.audio), o1 * self.sr // SAMPLE_RATE + self.ctx)
        seg = np.ascontiguousarray(self.audio[lo:hi], dtype=np.float32)
        y = np.asarray(self.resample(seg, self.sr, SAMPLE_RATE), dtype=np.float32)
        k0 = (s0 - lo) * SAMPLE_RATE // self.sr
        y = y[k0:k0 + (o1 - o0)]
        return np.pad(y, (0, o1 - o0 - len(y))) if len(y) < o1 - o0 else y

    def _chunk(self, c: int) -> torch.Tensor:
        if c not in self.chunks:
            with self._stage("resample"):
                a16 = self.audio16(c)
            with self._stage("whisper"), torch.inference_mode():
                mel = log_mel(self.encoder, a16)
                p = next(self.encoder.parameters())
                hs = self.encoder(mel.to(p.device, p.dtype), output_hidden_states=True).hidden_states
                n = min(self.chunk_feats, self.n_features - c * self.chunk_feats)
                self.chunks[c] = torch.stack(hs, dim=2)[0, :n]  # (n, L+1, D)
            self.computed += 1
            self.peak_chunks = max(self.peak_chunks, len(self.chunks))
        return self.chunks[c]

    def indices(self, frames: np.ndarray | list[int]) -> torch.Tensor:
        return window_indices(np.asarray(frames, dtype=np.int64).reshape(-1), self.fps, self.align)

    def _first_feature(self, frame: int) -> int:
        lo = int(self.indices([min(max(int(frame), 0), self.n_frames - 1)]).min())
        return min(max(lo, 0), max(self.n_features - 1, 0))

    def release_before(self, frame: int) -> None:
        """Frames below `frame` are done: drop the chunks no later window reads."""
        self.floor = max(self.floor, self._first_feature(frame) // self.chunk_feats)
        for c in [c for c in self.chunks if c < self.floor]:
            del self.chunks[c]

    def prefetch(self, last_frame: int) -> None:
        """Encode the chunks the windows up to `last_frame` read (so it is timed outside the UNet)."""
        hi = int(self.indices([min(max(int(last_frame), 0), self.n_frames - 1)]).max())
        hi = min(max(hi, 0), max(self.n_features - 1, 0))
        for c in range(self.floor, hi // self.chunk_feats + 1):
            self._chunk(c)

    def windows(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Audio prompts (len(frames), 10·(L+1), D) on the encoder's device and dtype."""
        f = np.asarray(frames, dtype=np.int64)
        if len(f) and (f.min() < 0 or f.max() >= self.n_frames):
            raise InputError(f"frames {int(f.min())}..{int(f.max())} outside the clip's {self.n_frames} frames")
        idx = self.indices(f)
        inside = (idx >= 0) & (idx < self.n_features)
        src = idx.clamp(0, max(self.n_features - 1, 0))
        cs = sorted({int(c) for c in torch.unique(src // self.chunk_feats)})
        held = {c: self._chunk(c) for c in cs}
        base = cs[0] * self.chunk_feats
        feats = torch.cat([held[c] for c in cs]) if len(cs) > 1 else held[cs[0]]
        out = feats[(src - base).to(feats.device)]  # (n, W, S, D)
        if self.pad == "zeros":
            out = out * inside.to(out.device)[:, :, None, None].to(out.dtype)
        return out.flatten(1, 2)
