"""LatentSync's side of the parity checks: the UNet3D, the VAE's use (conditioning latents, decode and
paste), the initial noise, the whole denoising block, the Whisper audio windows and the face affine,
each on the procedure's weights and inputs (tests/parity/upstream_latentsync.py runs upstream's)."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

import torch

from lab.models import latentsync as L
from lab.parity import check
from lab.parity.core import fill_state_dict, seeded

FAMILY = "latentsync"
PE = ("pos_encoder.pe",)   # the motion modules' fixed sinusoid tables: each side computes its own


def one_thread(fn: Callable) -> Callable:
    """Run a CPU check on one intra-op thread: on a shared 2-core box the small ops of these shapes run
    10-50× slower with two threads spinning against other jobs (35 ms vs 0.3-2 s per tiny UNet call)."""
    @functools.wraps(fn)
    def run(device: str) -> dict[str, torch.Tensor]:
        if torch.device(device).type != "cpu":
            return fn(device)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(device)
        finally:
            torch.set_num_threads(old)
    return run


def upstream_overrides(cfg: L.UNet3DConfig) -> dict[str, Any]:
    """The fields of upstream's stage2_512.yaml `model:` that `cfg` changes, in upstream's names."""
    out: dict[str, Any] = {}
    names = {"block_out_channels": "block_out_channels", "layers_per_block": "layers_per_block",
             "heads": "attention_head_dim", "cross_attention_dim": "cross_attention_dim",
             "norm_groups": "norm_num_groups", "in_channels": "in_channels"}
    for ours, theirs in names.items():
        if getattr(cfg, ours) != getattr(L.FULL, ours):
            out[theirs] = getattr(cfg, ours)
    if cfg.motion_heads != L.FULL.motion_heads:
        out["motion_module_kwargs"] = {"num_attention_heads": cfg.motion_heads}
    return out


def unet_model(cfg: L.UNet3DConfig, device: str) -> torch.nn.Module:
    """The project's UNet for `cfg`, its released key layout filled by the procedure and loaded through the
    checkpoint loader's key and shape checks (built on the meta device: nothing drawn twice)."""
    with torch.device("meta"):
        keys = L.UNet3D(cfg).state_dict()
    sd = {k: v for k, v in fill_state_dict(keys, skip=PE).items() if not k.endswith(PE)}
    u = L.unet_from_state_dict(sd, cfg, "parity weights")
    assert not u.missing and not u.unexpected and len(u.filled) == sum(k.endswith(PE) for k in keys)
    return u.model.to(device)


def _unet_inputs(cfg: L.UNet3DConfig, batch: int, frames: int, side: int) -> dict[str, Any]:
    tag = f"latentsync.unet.{batch}x{frames}x{side}.{cfg.cross_attention_dim}"
    t = torch.tensor([981, 21][:batch] if batch <= 2 else [501] * batch)
    return {"sample": seeded(tag + ".x", (batch, cfg.in_channels, frames, side, side)), "t": t,
            "audio": seeded(tag + ".audio", (batch * frames, L.AUDIO_TOKENS, cfg.cross_attention_dim)),
            "overrides": upstream_overrides(cfg)}


def _run_unet(cfg: L.UNet3DConfig, x: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
    model = unet_model(cfg, device)
    return {"eps": model(x["sample"].to(device), x["t"].to(device), x["audio"].to(device))}


# the stage2 config with narrow widths (every other field upstream's): the whole wiring in a second on a CPU
NARROW = replace(L.FULL, block_out_channels=(64, 64, 128, 128))


def unet_inputs() -> dict[str, Any]:
    return _unet_inputs(NARROW, 2, 2, 8)


@check(FAMILY, "unet", unet_inputs, "stage2 config at widths 64-64-128-128 (13 in, audio 384, 8 heads, "
       "32 groups), B 2 × 2 frames × 8² latents, t 981 / 21 → eps")
@one_thread
def unet(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(NARROW, unet_inputs(), device)


def unet_tiny_inputs() -> dict[str, Any]:
    return _unet_inputs(L.TINY, 2, 3, 8)


@check(FAMILY, "unet_tiny", unet_tiny_inputs, "the lab's tiny config (widths 32-32-64-64, 1 layer, 2 heads, "
       "audio 64, 8 groups), B 2 × 3 frames × 8² latents → eps")
@one_thread
def unet_tiny(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(L.TINY, unet_tiny_inputs(), device)


def unet_full_inputs() -> dict[str, Any]:
    return _unet_inputs(L.FULL, 2, 2, 8)


@check(FAMILY, "unet_full", unet_full_inputs, "full stage2 config (1.27 B), B 2 × 2 frames × 8² latents → eps",
       slow=True)
def unet_full(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(L.FULL, unet_full_inputs(), device)


def unet_full_shape_inputs() -> dict[str, Any]:
    return _unet_inputs(L.FULL, 1, 16, 64)


@check(FAMILY, "unet_full_shape", unet_full_shape_inputs, "full stage2 config at the released shape: 16 frames "
       "× 64² latents (512² faces) → eps", slow=True)
def unet_full_shape(device: str) -> dict[str, torch.Tensor]:
    return _run_unet(L.FULL, unet_full_shape_inputs(), device)


# ----------------------------------------------------------------------------- the VAE's use and the noise

def _engine(vae_size: str, mask: torch.Tensor, device: str, unet: Any = None, block: int = 16):
    """A pipeline Engine holding the SD-VAE (procedure weights) and the given keep-mask (1 = keep)."""
    from lab.models.vae import SD_VAE_CONFIG, SD_VAE_TINY, load_vae
    from lab.pipelines import latentsync as P

    vae = load_vae("sd-vae", "random", size=vae_size)
    vae.model.load_state_dict(fill_state_dict(vae.model.state_dict()), strict=True)
    vae.model.to(device)
    cfg = P.Config(size="full", dtype="fp32", block=block)
    eng = P.Engine(cfg, torch.device(device), torch.float32, unet, vae, None, mask=mask.to(device))
    eng.vae_config = dict(SD_VAE_CONFIG if vae_size == "full" else SD_VAE_TINY)
    return eng


def vae_inputs() -> dict[str, Any]:
    from lab.models.vae import SD_VAE_CONFIG
    from lab.pipelines.latentsync import fixed_mask

    side, frames = 64, 2
    return {"faces_u8": seeded("latentsync.faces64", (frames, 3, side, side), "int", 0, 256).to(torch.uint8),
            "mask": fixed_mask(side), "latents": seeded("latentsync.latents8", (1, 4, frames, side // 8, side // 8)),
            "seed": 11, "vae_config": dict(SD_VAE_CONFIG)}


@check(FAMILY, "vae", vae_inputs, "SD-VAE (sd-vae-ft-mse config), 2 faces 64² and the fixed mask → conditioning "
       "(mask ‖ masked ‖ reference latents, posterior samples, ×0.18215) and latents → decoded faces, the kept "
       "pixels pasted back")
@one_thread
def vae(device: str) -> dict[str, torch.Tensor]:
    from lab.pipelines import latentsync as P

    x = vae_inputs()
    eng = _engine("full", x["mask"], device)
    faces = (x["faces_u8"].float() / 255).to(device)
    gen = torch.Generator().manual_seed(x["seed"])   # a CPU stream, as upstream's fixture drew it, on any device
    return {"conditioning": P.encode(eng, faces, gen), "faces": P.decode(eng, x["latents"].to(device), faces)}


def noise_inputs() -> dict[str, Any]:
    return {"seed": 1247, "frames": 5, "size": 512}


@check(FAMILY, "initial_noise", noise_inputs, "seed 1247 → the initial latents (1, 4, 5 frames, 64²): one draw "
       "repeated over the frames, × the scheduler's init sigma")
@one_thread
def initial_noise(device: str) -> dict[str, torch.Tensor]:
    from lab.pipelines.latentsync import sampling

    x = noise_inputs()
    h = x["size"] // 8
    z = sampling.initial_noise((1, 4, h, h), x["frames"], x["seed"], device)
    return {"latents": z * sampling.make_scheduler("ddim").init_noise_sigma}


# ----------------------------------------------------------------------------- the denoising block

def block_inputs() -> dict[str, Any]:
    from lab.models.vae import SD_VAE_TINY
    from lab.pipelines.latentsync import fixed_mask

    # 128² faces: 2² latents at the deepest level, so the tiny config's motion norms (2 channels a group at
    # 64 wide) pool over more than two values and the 20 steps do not amplify fp32 round-off past 1e-4
    side, n_video, n_audio = 128, 2, 3
    return {"faces_u8": seeded("latentsync.block.faces", (n_video, 3, side, side), "int", 0, 256).to(torch.uint8),
            "audio": seeded("latentsync.block.audio", (n_audio, L.AUDIO_TOKENS, L.TINY.cross_attention_dim)),
            "mask": fixed_mask(side), "block": 2, "guidance": 1.5, "seed": 1247, "vae_config": dict(SD_VAE_TINY),
            "overrides": upstream_overrides(L.TINY)}


def _block(device: str, exact: bool) -> dict[str, torch.Tensor]:
    """What `run` does per block between alignment and restore: encode, the guided DDIM 20 loop, decode and
    paste; the video (2 faces) ping-ponged to the audio's 3 frames, blocks of 2 (the last one short)."""
    from lab.pipelines.latentsync import sampling
    from lab.pipelines import latentsync as P

    x = block_inputs()
    unet = L.LatentSyncUNet(unet_model(L.TINY, device), "parity weights", "tiny")
    eng = _engine("tiny", x["mask"], device, unet, block=x["block"])
    eng.cfg.techniques = ("guided_shortcuts", "fused_qkv") if exact else ()
    if exact:
        L.fuse_qkv(unet.model)
    eng.unet_fn = P.eager_unet(eng)
    side = x["faces_u8"].shape[-1]
    shape = (1, 4, side // 8, side // 8)
    noise = sampling.initial_noise(shape, x["block"], x["seed"], device)
    # upstream draws the initial noise and then every posterior sample from one generator: the same (CPU) stream
    gen = torch.Generator().manual_seed(x["seed"])
    torch.randn((1, 4, 1) + shape[2:], generator=gen)
    avatar = P.Avatar(x["faces_u8"].permute(0, 2, 3, 1).numpy(), None, side)
    job = P.Job(avatar, None, x["audio"], len(x["audio"]), noise)
    lat, faces = [], []
    for s, e in P.blocks(job.n_out, x["block"]):
        idx = job.source_index(torch.arange(s, e).numpy())
        face = (x["faces_u8"][idx].float() / 255).to(device)
        cond = P.encode(eng, face, gen)
        z = sampling.denoise(P._loop_unet(eng, e - s), noise[:, :, : e - s], cond, x["audio"][s:e].to(device),
                             eng.cfg.mode, x["guidance"])
        lat.append(z)
        faces.append(P.decode(eng, z, face))
    return {"latents": torch.cat(lat, dim=2), "faces": torch.cat(faces)}


@check(FAMILY, "block", block_inputs, "tiny UNet and tiny SD-VAE (procedure weights), 2 aligned 128² faces "
       "ping-ponged to 3 audio frames, blocks of 2: noise, conditioning, DDIM 20 with guidance 1.5 on null audio, "
       "decode and paste → final latents and faces (upstream: LipsyncPipeline.__call__)")
@one_thread
def block(device: str) -> dict[str, torch.Tensor]:
    return _block(device, exact=False)


@check(FAMILY, "block_exact", block_inputs, "as `block`, with the exact preset's CPU switches on (guided "
       "shortcuts: null-audio cross-attention as its bias and the shared prefix; fused q/k/v)")
@one_thread
def block_exact(device: str) -> dict[str, torch.Tensor]:
    return _block(device, exact=True)


# ----------------------------------------------------------------------------- audio

OPENAI_TINY = {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 384, "n_audio_head": 6, "n_audio_layer": 4,
               "n_vocab": 51865, "n_text_ctx": 448, "n_text_state": 384, "n_text_head": 6, "n_text_layer": 4}


def openai_whisper_keys(dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The encoder's keys and shapes in OpenAI's checkpoint layout (what LatentSync's tiny.pt holds)."""
    d, n, m = dims["n_audio_state"], dims["n_audio_layer"], dims["n_mels"]
    keys = {"encoder.conv1.weight": (d, m, 3), "encoder.conv1.bias": (d,), "encoder.conv2.weight": (d, d, 3),
            "encoder.conv2.bias": (d,), "encoder.positional_embedding": (dims["n_audio_ctx"], d),
            "encoder.ln_post.weight": (d,), "encoder.ln_post.bias": (d,)}
    for i in range(n):
        b = f"encoder.blocks.{i}."
        for lin in ("query", "key", "value", "out"):
            keys[b + f"attn.{lin}.weight"] = (d, d)
            if lin != "key":
                keys[b + f"attn.{lin}.bias"] = (d,)
        for ln in ("attn_ln", "mlp_ln"):
            keys[b + f"{ln}.weight"], keys[b + f"{ln}.bias"] = (d,), (d,)
        keys[b + "mlp.0.weight"], keys[b + "mlp.0.bias"] = (4 * d, d), (4 * d,)
        keys[b + "mlp.2.weight"], keys[b + "mlp.2.bias"] = (d, 4 * d), (d,)
    return keys


def whisper_inputs() -> dict[str, Any]:
    # 31 s: two encoder windows (the second 1 s of audio and 29 s of padding); quiet, then four times louder,
    # so the log-mel's 8-decade floor (set by the whole clip's peak) reaches into the quiet part
    n = 31 * 16000
    env = torch.where(torch.arange(n) < 12 * 16000, 0.02, 0.08)
    tone = torch.sin(torch.arange(n) * (2 * torch.pi * 220 / 16000)) * 0.5
    return {"audio": (seeded("latentsync.audio31s", (n,)) * env + tone * env).numpy(), "fps": 25,
            "dims": dict(OPENAI_TINY)}


@check(FAMILY, "whisper", whisper_inputs, "whisper-tiny (OpenAI layout → the encoder), 31 s of audio → per-frame "
       "windows (775, 50, 384) at 25 fps: whole-clip log-mel, 30 s pieces padded in the mel domain, the "
       "layers' outputs before the final LayerNorm, 10 feature frames a video frame, edges clamped")
@one_thread
def whisper(device: str) -> dict[str, torch.Tensor]:
    from lab.models.whisper import load_whisper
    from lab.pipelines import latentsync as P

    x = whisper_inputs()
    keys = openai_whisper_keys(x["dims"])
    sd = fill_state_dict({k: torch.empty(s, device="meta") for k, s in keys.items()})
    enc, _ = load_whisper("random", size="full")
    enc.load_state_dict(P.whisper_keys_from_openai(sd), strict=True)
    return {"tokens": P.audio_features(enc.to(device), x["audio"], x["fps"])}


# ----------------------------------------------------------------------------- face geometry

def affine_inputs() -> dict[str, Any]:
    # brow centres and nose of a face in a 1280×720 frame, drifting and jittering over 6 frames
    base = torch.tensor([[560.0, 300.0], [720.0, 296.0], [641.0, 395.0]])
    drift = torch.arange(6.0)[:, None, None] * torch.tensor([3.0, -1.5])
    return {"points": base + drift + 2.5 * seeded("latentsync.landmarks", (6, 3, 2)), "face": 512}


@check(FAMILY, "affine", affine_inputs, "three landmarks (brows, nose) over 6 frames → frame → 512² face "
       "affines: similarity onto upstream's template, smoothed nose bias, crop 420×560 resized to 512²")
def affine(device: str) -> dict[str, torch.Tensor]:
    from lab.pipelines import latentsync as P

    x = affine_inputs()
    return {"affine": torch.from_numpy(P.face_transforms(x["points"].numpy().astype(float), x["face"])).float()}
