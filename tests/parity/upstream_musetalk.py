"""MuseTalk's upstream side: modules and functions imported from a TMElyralab/MuseTalk checkout on sys.path.

Upstream pins diffusers 0.30.2 and transformers 4.39.2; run the generator with those on PYTHONPATH (a
separate target directory, torch from the project's venv):

    pip install --target SITE diffusers==0.30.2 transformers==4.39.2 'huggingface_hub<0.26' accelerate einops
    PYTHONPATH=SITE python tests/parity/make_fixtures.py musetalk --upstream CHECKOUT

The networks' configs are released beside the weights, not in the git checkout (musetalkV15/musetalk.json,
stabilityai/sd-vae-ft-mse, openai/whisper-tiny): their values are written below as facts, and each maker
hands them to upstream's own loader (a config file or folder plus a weights file filled by lab.parity's
procedure). The landmark and face-parsing networks (DWPose through mmpose, BiSeNet) need weights and
packages that are not here: the preprocessing module is imported with stand-ins for mmpose and its face
detector that return the check's seeded landmarks and boxes, and the blend is given the check's seeded
parsing map; everything after those networks is upstream's code. The TAESD check runs madebyollin/taesd's
taesd.py from a checkout beside MuseTalk's (MuseTalk itself has no TAESD).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.parity.core import Unavailable, fill_state_dict, fill_tensor

REPO = "TMElyralab/MuseTalk"

# musetalkV15/musetalk.json (TMElyralab/MuseTalk on Hugging Face)
UNET_JSON = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0.dev0", "act_fn": "silu",
    "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False,
    "cross_attention_dim": 384, "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                     "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 8, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}
# stabilityai/sd-vae-ft-mse config.json (no scaling_factor: diffusers' default 0.18215, which MuseTalk reads)
VAE_JSON = {
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.4.2", "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3,
    "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3, "sample_size": 256,
    "up_block_types": ["UpDecoderBlock2D"] * 4}
# openai/whisper-tiny config.json (the fields that shape the model)
WHISPER_JSON = {
    "d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6, "encoder_ffn_dim": 1536,
    "decoder_layers": 4, "decoder_attention_heads": 6, "decoder_ffn_dim": 1536, "num_mel_bins": 80,
    "max_source_positions": 1500, "max_target_positions": 448, "vocab_size": 51865,
    "activation_function": "gelu", "scale_embedding": False}


def _filled(cls, **cfg) -> torch.nn.Module:
    with torch.device("meta"):
        model = cls(**cfg)
    model.load_state_dict(fill_state_dict(model.state_dict()), strict=True, assign=True)
    return model.eval()


def _bgr(rgb: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(rgb.to(torch.uint8).numpy()[..., ::-1])


def _rgb(bgr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(bgr)[..., ::-1])).float()


# ----------------------------------------------------------------------------- the generator

def positional_encoding(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from musetalk.models.unet import PositionalEncoding

    return {"audio": PositionalEncoding(d_model=384)(x["audio"])}


def _unet(x: dict[str, Any], tmp: str):
    """Upstream's UNet wrapper from a musetalk.json (with the check's overrides) and a unet.pth of the
    procedure's weights, as load_all_model builds it."""
    from diffusers import UNet2DConditionModel
    from musetalk.models.unet import UNet

    cfg = {**UNET_JSON, **{k: list(v) if isinstance(v, tuple) else v for k, v in x["overrides"].items()}}
    Path(tmp, "musetalk.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        keys = UNet2DConditionModel(**cfg).state_dict()
    torch.save(fill_state_dict(keys), Path(tmp, "unet.pth"))
    return UNet(unet_config=str(Path(tmp, "musetalk.json")), model_path=str(Path(tmp, "unet.pth")), device="cpu")


def unet(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from musetalk.models.unet import PositionalEncoding

    with tempfile.TemporaryDirectory() as tmp:
        model = _unet(x, tmp)
    latent_batch = torch.cat([x["masked"], x["ref"]], dim=1)     # get_latents_for_unet's concatenation
    # scripts/inference.py's step: pe on the whisper batch, one UNet call at timesteps = tensor([0])
    audio = PositionalEncoding(d_model=384)(x["audio"])
    return {"latents": model.model(latent_batch, torch.tensor([0]), encoder_hidden_states=audio).sample}


unet_full = unet


# ----------------------------------------------------------------------------- SD-VAE

def _vae(tmp: str, side: int):
    from diffusers import AutoencoderKL
    from musetalk.models.vae import VAE

    _filled(AutoencoderKL, **VAE_JSON).save_pretrained(tmp)
    return VAE(model_path=tmp, resized_img=side)


def _encode(vae, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    img = _bgr(x["face_rgb"][0])          # a cv2 crop (BGR), as scripts/inference.py hands it over
    with torch.no_grad():
        dists = [vae.vae.encode(vae.preprocess_img(img, half_mask=m)).latent_dist for m in (True, False)]
        torch.manual_seed(x["seed"])
        sampled = vae.get_latents_for_unet(img)
    s = vae.scaling_factor
    return {"latents": torch.cat([d.mean for d in dists], 1) * s, "latents_std": torch.cat([d.std for d in dists], 1) * s,
            "latents_sampled": sampled}


def _decode(vae, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"image_u8": _rgb(vae.decode_latents(latents))}


def vae_encode(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        return _encode(_vae(tmp, x["face_rgb"].shape[1]), x)


def vae_decode(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        return _decode(_vae(tmp, 8 * x["latents"].shape[-1]), x["latents"])


def vae_full(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        vae = _vae(tmp, 256)
        return {**_encode(vae, x), **_decode(vae, x["latents"])}


# ----------------------------------------------------------------------------- TAESD (madebyollin/taesd)

def _taesd_checkout(checkout: Path) -> Path:
    for p in (checkout.parent / "madebyollin+taesd", checkout.parent / "taesd"):
        if (p / "taesd.py").is_file():
            return p
    raise Unavailable("upstream MuseTalk has no TAESD, and no madebyollin/taesd checkout was found beside it "
                      f"({checkout.parent}/madebyollin+taesd)")


def taesd(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    root = _taesd_checkout(checkout)
    spec = importlib.util.spec_from_file_location("taesd_upstream", root / "taesd.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    net = mod.TAESD(encoder_path=None, decoder_path=None, latent_channels=4).eval()
    # the released diffusers checkpoint (madebyollin/taesd on Hugging Face) names encoder.{i} encoder.layers.{i}
    # and decoder.{i} decoder.layers.{i-1} (diffusers keeps the clamp outside its Sequential): fill by those names
    for part, shift in ((net.encoder, 0), (net.decoder, -1)):
        name = "encoder" if part is net.encoder else "decoder"
        sd = {}
        for k, v in part.state_dict().items():
            i, rest = k.split(".", 1)
            sd[k] = fill_tensor(f"{name}.layers.{int(i) + shift}.{rest}", tuple(v.shape))
        part.load_state_dict(sd, strict=True)
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    taesd.upstream_code = f"madebyollin/taesd@{commit or 'unknown'} taesd.py (Encoder, Decoder)"
    taesd.upstream = {"repo": "madebyollin/taesd", "commit": commit or "unknown"}   # MuseTalk has no TAESD
    faces = x["face_rgb"].permute(0, 3, 1, 2).float() / 255
    with torch.no_grad():
        return {"latents": net.encoder(faces), "image": net.decoder(x["latents"]).clamp(0, 1)}


# ----------------------------------------------------------------------------- Whisper windows

def _whisper(tmp: str):
    from safetensors.torch import save_file
    from transformers import WhisperConfig, WhisperForConditionalGeneration, WhisperModel

    config = WhisperConfig(**WHISPER_JSON)
    with torch.device("meta"):
        keys = WhisperForConditionalGeneration(config).state_dict()   # the released checkpoint's layout
    config.save_pretrained(tmp)
    save_file(fill_state_dict(keys), f"{tmp}/model.safetensors", metadata={"format": "pt"})
    return WhisperModel.from_pretrained(tmp).eval()


def whisper_windows(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    import soundfile as sf
    from transformers import WhisperFeatureExtractor
    from musetalk.utils.audio_processor import AudioProcessor

    with tempfile.TemporaryDirectory() as tmp:
        whisper = _whisper(tmp)
        WhisperFeatureExtractor(feature_size=80).save_pretrained(tmp)   # whisper-tiny's preprocessor_config
        proc = AudioProcessor(feature_extractor_path=tmp)
        sf.write(f"{tmp}/audio.wav", x["audio"].numpy(), 16000, subtype="FLOAT")
        feats, n = proc.get_audio_feature(f"{tmp}/audio.wav")
    out = {}
    with torch.no_grad():
        # the stacked hidden states get_whisper_chunk slices its windows from (its first lines)
        hs = torch.stack(whisper.encoder(feats[0], output_hidden_states=True).hidden_states, dim=2)
        out["hidden_states"] = hs[0, : int(n / 16000 * 50)]
        for fps, key in zip(x["fps"], ("windows", "stream")):
            out[f"{key}_{fps}fps"] = proc.get_whisper_chunk(feats, "cpu", torch.float32, whisper, n, fps=fps)
    return out


# ----------------------------------------------------------------------------- per-frame transforms

def _preprocessing(keypoints: list[np.ndarray], boxes: list[tuple[int, ...]]):
    """musetalk.utils.preprocessing with stand-ins for mmpose (DWPose) and its face detector that hand back
    the check's landmarks (as whole-body keypoints 23–90) and detector boxes, frame by frame."""
    kp = iter(keypoints)
    det = iter(boxes)

    def topdown(model, image):
        full = np.zeros((1, 133, 2), np.float32)
        full[0, 23:91] = next(kp)
        return types.SimpleNamespace(pred_instances=types.SimpleNamespace(keypoints=full))

    class FaceAlignment:
        def __init__(self, *a, **k):
            pass

        def get_detections_for_batch(self, images):
            return [next(det) for _ in images]

    mods = {"mmpose": {}, "mmpose.apis": {"inference_topdown": topdown, "init_model": lambda *a, **k: None},
            "mmpose.structures": {"merge_data_samples": lambda r: r},
            "face_detection": {"FaceAlignment": FaceAlignment, "LandmarksType": types.SimpleNamespace(_2D=2)}}
    for name, attrs in mods.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attrs)
    sys.modules.pop("musetalk.utils.preprocessing", None)
    import musetalk.utils.preprocessing as pre

    return pre


def crop(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    import cv2

    dets = [tuple(int(v) for v in b) for b in x["detector_boxes"].tolist()]
    pre = _preprocessing(list(x["landmarks"].numpy()), dets)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, f in enumerate(x["frames"]):
            paths.append(f"{tmp}/{i:08d}.png")
            cv2.imwrite(paths[-1], _bgr(f))
        coords, frames = pre.get_landmark_and_bbox(paths, 0)
    boxes, crops = [], []
    for (x1, y1, x2, y2), frame in zip(coords, frames):
        # scripts/inference.py, v15: the extra margin under the chin, the crop, LANCZOS4 to 256²
        y2 = min(y2 + x["extra_margin"], frame.shape[0])
        boxes.append([x1, y1, x2, y2])
        crops.append(_rgb(cv2.resize(frame[y1:y2, x1:x2], (x["size"],) * 2, interpolation=cv2.INTER_LANCZOS4)))
    return {"boxes": torch.tensor(boxes, dtype=torch.float32), "crops": torch.stack(crops)}


def _parsing(region: torch.Tensor):
    """A FaceParsing stand-in: the check's face region over the blending square, whatever the image."""
    from PIL import Image

    def fp(image, mode="raw"):
        assert image.size == (region.shape[1], region.shape[0]), (image.size, tuple(region.shape))
        return Image.fromarray(region.to(torch.uint8).numpy())

    return fp


def blend_mask(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from musetalk.utils.blending import get_image

    x0, y0, x1, y1 = x["box"]
    black = np.zeros((*x["frame_hw"], 3), np.uint8)
    white = np.full((y1 - y0, x1 - x0, 3), 255, np.uint8)
    # a white face pasted into a black frame through the mask leaves the mask itself (PIL's paste is exact there)
    out = get_image(black, white, [x0, y0, x1, y1], mode="jaw", fp=_parsing(x["region"]))
    return {"mask": torch.from_numpy(out[y0:y1, x0:x1, 0].astype(np.float32))}


def blend(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    import cv2
    from musetalk.utils.blending import get_image

    x0, y0, x1, y1 = x["box"]
    # scripts/inference.py: the decoded face resized to the box (cv2's default, bilinear), then get_image
    face = cv2.resize(_bgr(x["face_rgb"]), (x1 - x0, y1 - y0))
    out = _rgb(get_image(_bgr(x["frame_rgb"]), face, [x0, y0, x1, y1], mode="jaw", fp=_parsing(x["region"])))
    return {"face_box": out[y0:y1, x0:x1], "face_box_gpu_path": out[y0:y1, x0:x1], "frame": out}


def frame_schedule(checkout: Path, x: dict[str, Any]) -> dict[str, torch.Tensor]:
    from musetalk.utils.utils import datagen

    n = x["avatar_frames"]
    latents = [torch.tensor([[float(j)]]) for j in range(n)]
    cycle = latents + latents[::-1]      # scripts/inference.py: input_latent_list + input_latent_list[::-1]
    chunks = [torch.zeros(1) for _ in range(x["audio_frames"])]
    got = [b for _, b in datagen(chunks, cycle, batch_size=x["batch_size"], delay_frame=0, device="cpu")]
    return {"avatar_index": torch.cat(got).flatten()}


MAKERS = {"positional_encoding": positional_encoding, "unet": unet, "unet_full": unet_full,
          "vae_encode": vae_encode, "vae_decode": vae_decode, "vae_full": vae_full, "taesd": taesd,
          "whisper_windows": whisper_windows, "crop": crop, "blend_mask": blend_mask, "blend": blend,
          "frame_schedule": frame_schedule}
for _fn, _what in ((positional_encoding, "musetalk/models/unet.py PositionalEncoding"),
                   (unet, "musetalk/models/unet.py UNet (musetalk.json + unet.pth), PositionalEncoding; "
                          "scripts/inference.py's UNet call"),
                   (vae_encode, "musetalk/models/vae.py VAE.preprocess_img, get_latents_for_unet"),
                   (vae_decode, "musetalk/models/vae.py VAE.decode_latents"),
                   (vae_full, "musetalk/models/vae.py VAE (get_latents_for_unet, decode_latents)"),
                   (whisper_windows, "musetalk/utils/audio_processor.py AudioProcessor"),
                   (crop, "musetalk/utils/preprocessing.py get_landmark_and_bbox (DWPose, detector stood in); "
                          "scripts/inference.py's v15 crop"),
                   (blend_mask, "musetalk/utils/blending.py get_image (BiSeNet stood in)"),
                   (blend, "musetalk/utils/blending.py get_image (BiSeNet stood in); scripts/inference.py's resize"),
                   (frame_schedule, "musetalk/utils/utils.py datagen over inference.py's cycle")):
    _fn.upstream_code = _what
