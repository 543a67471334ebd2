"""Quality measures every notebook reuses: fidelity (PSNR, SSIM, LPIPS, cosine), colour drift,
blend seams and temporal flicker.

Input conventions (one rule, so layouts are never guessed from sizes):
  - numpy arrays are channel-last: (H, W), (H, W, C) or (N, H, W, C);
  - torch tensors are channel-first: (H, W), (C, H, W) or (N, C, H, W);
  - integer data (uint8 frames) spans 0..255; floating data is taken to span [0, 1] unless a
    `data_range` is given (e.g. 2.0 for [-1, 1] VAE space).
Element-wise measures (`psnr`, `mae`, `max_abs`, `cosine`) only need equal shapes and work on
any tensor (latents too). Differences are taken in float64, so uint8 never wraps around.

Section 4.1 of the TAESD write-up (000) reports "neon-pink oversaturation and boundary
artifacts": `color_drift` and `seam_energy` put numbers on those two failure modes.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.errors import BackendUnavailable, InputError

Roi = tuple[slice, slice]


# ----------------------------------------------------------------------------- input handling

def _check_kind(x: Any, name: str) -> None:
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        raise InputError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if (x.size if isinstance(x, np.ndarray) else x.numel()) == 0:
        raise InputError(f"{name} is empty")


_INT_RANGES = {"uint8": 255.0, "uint16": 65535.0}


def _default_range(x: np.ndarray | torch.Tensor) -> float:
    """255 for uint8, 65535 for uint16, 1.0 for floats and bools. Other integer types carry no
    convention (an int64 array may hold 0..255 or anything), so they need an explicit range."""
    name = str(x.dtype).replace("torch.", "")
    if name in _INT_RANGES:
        return _INT_RANGES[name]
    floating = np.issubdtype(x.dtype, np.floating) if isinstance(x, np.ndarray) else x.dtype.is_floating_point
    if floating or name == "bool":
        return 1.0
    raise InputError(f"no default value range for {name} data: convert to uint8 (0..255) or float (0..1), "
                     f"or pass data_range")


def _nonfinite(x: Any) -> int:
    """How many NaN / inf values x holds (0 for integer data)."""
    t = torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x.detach()
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    return int((~torch.isfinite(t)).sum())


def _range_or_raise(data_range: float | None, a: Any, b: Any, names: tuple[str, str] = ("a", "b")) -> float:
    """The value range to score in; a non-finite or non-positive range is refused, and when it came
    from non-finite data the message names that input rather than the range."""
    rng = float(data_range) if data_range is not None else _default_range(a)
    if rng > 0 and np.isfinite(rng):
        return rng
    for x, name in zip((a, b), names):
        n = _nonfinite(x)
        if n:
            raise InputError(f"{name} holds {n} non-finite values (NaN or inf) of {x.size if isinstance(x, np.ndarray) else x.numel()}, "
                             f"so no value range can be taken from it (data_range={rng}): the model that made it "
                             f"produced non-finite output (check its weights and precision)")
    raise InputError(f"data_range must be positive and finite, got {data_range}")


def _pair(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as float64 tensors of one shape, on a's device (element-wise measures)."""
    _check_kind(a, "a")
    _check_kind(b, "b")
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        raise InputError("compare like with like: a and b must both be numpy arrays or both torch tensors "
                         "(numpy is channel-last, torch channel-first)")
    if tuple(a.shape) != tuple(b.shape):
        raise InputError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must have the same shape")
    ta = torch.from_numpy(np.asarray(a)) if isinstance(a, np.ndarray) else a
    tb = torch.from_numpy(np.asarray(b)) if isinstance(b, np.ndarray) else b
    return ta.detach().to(torch.float64), tb.detach().to(device=ta.device, dtype=torch.float64)


def _nchw(x: Any, name: str) -> torch.Tensor:
    """An image or batch as a float64 NCHW tensor in its native range (device kept)."""
    _check_kind(x, name)
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(x))
        if t.dim() == 2:
            t = t[None, None]
        elif t.dim() == 3:
            t = t.permute(2, 0, 1)[None]
        elif t.dim() == 4:
            t = t.permute(0, 3, 1, 2)
        else:
            raise InputError(f"{name}: numpy images must be (H,W), (H,W,C) or (N,H,W,C), got {x.shape}")
    else:
        t = x.detach()
        if t.dim() == 2:
            t = t[None, None]
        elif t.dim() == 3:
            t = t[None]
        elif t.dim() != 4:
            raise InputError(f"{name}: torch images must be (H,W), (C,H,W) or (N,C,H,W), got {tuple(x.shape)}")
    if t.shape[1] not in (1, 3, 4):
        raise InputError(f"{name}: {t.shape[1]} channels; expected 1, 3 or 4 (numpy is channel-last, "
                         f"torch channel-first: check the layout)")
    return t.to(torch.float64)


def _nhwc(x: Any, name: str) -> np.ndarray:
    """An image or batch as a float64 NHWC numpy array in its native range."""
    return _nchw(x, name).permute(0, 2, 3, 1).cpu().numpy()


def _rgb01(x: Any, name: str) -> np.ndarray:
    """RGB batch in [0, 1], NHWC float64 (the range colour-space conversions expect)."""
    arr = _nhwc(x, name)
    if arr.shape[-1] == 4:
        arr = arr[..., :3]  # alpha does not take part in colour
    if arr.shape[-1] != 3:
        raise InputError(f"{name}: colour measures need RGB images, got {arr.shape[-1]} channel(s)")
    return np.clip(arr / _default_range(x), 0.0, 1.0)


def _check_roi(roi: Any, name: str = "roi") -> Roi | None:
    if roi is None:
        return None
    if not (isinstance(roi, tuple) and len(roi) == 2 and all(isinstance(s, slice) for s in roi)):
        raise InputError(f"{name} must be a (row slice, column slice) pair, e.g. mouth_roi(256, 256); got {roi!r}")
    return roi


# ----------------------------------------------------------------------------- fidelity

def mae(a: Any, b: Any) -> float:
    """Mean absolute difference, in the inputs' units (0..255 for uint8)."""
    ta, tb = _pair(a, b)
    return float((ta - tb).abs().mean())


def max_abs(a: Any, b: Any) -> float:
    """Largest absolute difference, in the inputs' units."""
    ta, tb = _pair(a, b)
    return float((ta - tb).abs().max())


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of the flattened inputs, in [-1, 1].

    Two all-zero inputs count as identical (1.0); one all-zero input against a non-zero one as
    unrelated (0.0), so the measure never returns NaN.
    """
    ta, tb = _pair(a, b)
    ta, tb = ta.flatten(), tb.flatten()
    na, nb = float(ta.norm()), float(tb.norm())
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(ta, tb) / (na * nb))


def psnr(a: Any, b: Any, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio in dB over all elements: 10·log10(range² / MSE).

    data_range defaults to 255 for uint8 and 1.0 for floats; identical inputs give inf. An input
    holding NaN or inf gives NaN (never inf: broken output must not read as a perfect match).
    """
    ta, tb = _pair(a, b)
    rng = _range_or_raise(data_range, a, b)
    if _nonfinite(ta) or _nonfinite(tb):
        return float("nan")
    mse = float(((ta - tb) ** 2).mean())
    if mse == 0:
        return float("inf")
    return float(10 * np.log10(rng**2 / mse))


def ssim(a: Any, b: Any, data_range: float | None = None, crop_border: bool = True) -> float:
    """Structural similarity, mean over the batch, via torchmetrics (Gaussian 11×11 window,
    σ = 1.5, K1 = 0.01, K2 = 0.03: Wang et al. 2004). 1.0 for identical images.

    crop_border: average the SSIM map only where the window lies inside the image (5 px in from
    each edge), as Wang et al.'s reference code and scikit-image do; False keeps torchmetrics'
    own mean, which includes a border computed on reflect-padded pixels (differs by ~0.01).
    Images must be at least 11 pixels on each side. data_range defaults to 255 for uint8,
    1.0 for floats.
    """
    from torchmetrics.functional.image import structural_similarity_index_measure

    ta, tb = _nchw(a, "a"), _nchw(b, "b")
    if ta.shape != tb.shape:
        raise InputError(f"a {tuple(ta.shape)} and b {tuple(tb.shape)} must be the same size (after layout)")
    if min(ta.shape[-2:]) < 11:
        raise InputError(f"SSIM needs images of at least 11×11 pixels, got {tuple(ta.shape[-2:])}")
    rng = _range_or_raise(data_range, a, b)
    if _nonfinite(ta) or _nonfinite(tb):
        return float("nan")  # never a score for broken output
    # float32 on [0, range/range]: the 11×11 depthwise convolution is ~4× slower in float64 on CPU,
    # and SSIM moves by ~1e-5
    ta, tb = (ta / rng).float(), (tb.to(ta.device) / rng).float()
    mean, full = structural_similarity_index_measure(ta, tb, data_range=1.0, gaussian_kernel=True,
                                                     sigma=1.5, kernel_size=11, reduction="elementwise_mean",
                                                     return_full_image=True)
    if not crop_border:
        return float(mean)
    pad = 5  # (11 - 1) // 2
    return float(full[..., pad:-pad, pad:-pad].mean())


# ----------------------------------------------------------------------------- LPIPS

# lpips' trunk → the torchvision weights it loads (file names come from torchvision itself)
_LPIPS_TRUNKS = {"alex": ("alexnet", "AlexNet_Weights"), "vgg": ("vgg16", "VGG16_Weights"),
                 "squeeze": ("squeezenet1_1", "SqueezeNet1_1_Weights")}
_HASH_OK: dict[tuple[str, int, int], bool] = {}


def _sha256_prefix_ok(path: Path) -> bool:
    """torch.hub names checkpoints '<name>-<sha256 prefix>.pth'; check the file against it."""
    stem = path.name.rsplit(".", 1)[0]
    prefix = stem.rsplit("-", 1)[-1] if "-" in stem else ""
    if len(prefix) < 6:
        return True  # no hash in the name: nothing to check against
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASH_OK:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _HASH_OK[key] = h.hexdigest().startswith(prefix.lower())
    return _HASH_OK[key]


def _lpips_paths(net: str) -> tuple[Path, Path]:
    """(trunk checkpoint in the torch hub cache, lpips linear-layer file); raises if unknown."""
    if net not in _LPIPS_TRUNKS:
        raise InputError(f"net must be one of {sorted(_LPIPS_TRUNKS)}, got {net!r}")
    import lpips
    import torchvision.models as tvm

    arch, enum = _LPIPS_TRUNKS[net]
    url = getattr(tvm, enum).IMAGENET1K_V1.url
    trunk = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    lin = Path(lpips.__file__).resolve().parent / "weights" / "v0.1" / f"{net}.pth"
    return trunk, lin


def lpips_available(net: str = "alex") -> tuple[bool, str]:
    """Whether LPIPS can run with real weights here, without any download, and why not.

    Needs torchvision's ImageNet weights for the trunk in the torch hub cache (checked against
    the sha256 prefix in the file name) and lpips' linear-layer weights shipped in the package.
    """
    try:
        trunk, lin = _lpips_paths(net)
    except ImportError as e:
        return False, f"LPIPS needs the lpips and torchvision packages ({e})"
    arch = _LPIPS_TRUNKS[net][0]
    if not lin.is_file():
        return False, f"LPIPS needs lpips' linear-layer weights at {lin}; not present (reinstall lpips)"
    if not trunk.is_file():
        return False, (f"LPIPS needs torchvision's pretrained {arch} weights at {trunk}; not present "
                       f"(nothing is downloaded here: fetch the file where there is network and copy it there)")
    if not _sha256_prefix_ok(trunk):
        return False, f"LPIPS trunk weights at {trunk} fail their sha256 check (corrupt or not the real {arch} weights)"
    return True, f"trunk {trunk}; linear layers {lin}"


@lru_cache(maxsize=3)
def _build_lpips(net: str, trunk_path: str) -> torch.nn.Module:
    """LPIPS with its trunk loaded from a local checkpoint: `pnet_rand=True` stops lpips from
    asking torchvision to download, then the real weights are copied in by layer index."""
    import warnings

    import lpips

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torchvision's `pretrained=` deprecation notice
            model = lpips.LPIPS(net=net, pretrained=True, pnet_rand=True, verbose=False)
    except TypeError as e:  # a torchvision that dropped `pretrained=` breaks lpips 0.1.x itself
        raise BackendUnavailable(f"lpips cannot build its {net} trunk with this torchvision ({e})") from None
    state = torch.load(trunk_path, map_location="cpu", weights_only=True)
    # lpips splits torchvision's `features` into slices but keeps each layer's index as its name
    new = {}
    for name, _ in list(model.net.named_parameters()) + list(model.net.named_buffers()):
        _, idx, rest = name.split(".", 2)
        key = f"features.{idx}.{rest}"
        if key not in state:
            raise BackendUnavailable(f"LPIPS trunk checkpoint {trunk_path} lacks {key}: not {net}'s torchvision weights")
        new[name] = state[key]
    model.net.load_state_dict(new, strict=True)
    return model.eval()


def _lpips_input(x: Any, name: str) -> torch.Tensor:
    t = _nchw(x, name)
    if t.shape[1] == 4:
        t = t[:, :3]
    if t.shape[1] != 3:
        raise InputError(f"{name}: LPIPS needs RGB images, got {t.shape[1]} channel(s)")
    return (t / _default_range(x)).clamp(0, 1).float() * 2 - 1  # lpips expects [-1, 1]


def lpips_distance(a: Any, b: Any, net: str = "alex") -> float:
    """LPIPS perceptual distance (Zhang et al. 2018), mean over the batch; 0 = identical.

    Runs only with the real pretrained weights present locally (see `lpips_available`);
    otherwise raises BackendUnavailable with the reason. It never downloads and never computes
    with a random trunk. Images: uint8 or floats in [0, 1] (mapped to lpips' [-1, 1]).
    """
    ok, reason = lpips_available(net)
    if not ok:
        raise BackendUnavailable(reason)
    trunk, _ = _lpips_paths(net)
    return _lpips_score(_build_lpips(net, str(trunk)), a, b)


def _lpips_score(model: torch.nn.Module, a: Any, b: Any) -> float:
    ta, tb = _lpips_input(a, "a"), _lpips_input(b, "b")
    if ta.shape != tb.shape:
        raise InputError(f"a {tuple(ta.shape)} and b {tuple(tb.shape)} must be the same size (after layout)")
    model = model.to(ta.device)
    with torch.no_grad():
        return float(model(ta, tb.to(ta.device)).mean())


# ----------------------------------------------------------------------------- colour drift

@dataclass
class ColorDrift:
    """How the test image's colour moved from the reference's (test minus reference)."""

    sat_ref: float   # mean HSV saturation of the reference, 0..1
    sat_test: float  # mean HSV saturation of the test image, 0..1
    d_sat: float     # sat_test - sat_ref (> 0: oversaturated, TAESD's "neon" look)
    dL: float        # mean CIELAB lightness shift, L in 0..100
    da: float        # mean a* shift (> 0: towards magenta/red)
    db: float        # mean b* shift (> 0: towards yellow)
    delta_e: float   # mean per-pixel CIE76 ΔE (≈ 2.3 is a just-noticeable difference)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def color_drift(ref: Any, test: Any, roi: Roi | None = None) -> ColorDrift:
    """Saturation and CIELAB shifts between two RGB images (or batches) of the same size.

    Inputs: uint8 RGB or floats in [0, 1] (clipped). roi: optional (rows, cols) slices.
    Conversions by scikit-image (rgb2hsv, rgb2lab, D65).
    """
    from skimage.color import deltaE_cie76, rgb2hsv, rgb2lab

    r, t = _rgb01(ref, "ref"), _rgb01(test, "test")
    if r.shape != t.shape:
        raise InputError(f"ref {r.shape} and test {t.shape} must be the same size (NHWC after layout)")
    roi = _check_roi(roi)
    if roi is not None:
        r, t = r[:, roi[0], roi[1]], t[:, roi[0], roi[1]]
        if r.size == 0:
            raise InputError(f"roi {roi!r} selects no pixels of a {r.shape[1:3]} image")
    sr, st = rgb2hsv(r)[..., 1].mean(), rgb2hsv(t)[..., 1].mean()
    lr, lt = rgb2lab(r), rgb2lab(t)
    shift = (lt - lr).reshape(-1, 3).mean(axis=0)
    de = deltaE_cie76(lr, lt).mean()
    return ColorDrift(float(sr), float(st), float(st - sr), float(shift[0]), float(shift[1]), float(shift[2]),
                      float(de))


# ----------------------------------------------------------------------------- blend seams

def _grey(arr: np.ndarray) -> np.ndarray:
    """NHWC → NHW luminance-ish (channel mean): a seam shows in any channel's brightness."""
    return arr[..., :3].mean(axis=-1) if arr.shape[-1] >= 3 else arr[..., 0]


def seam_energy(image: Any, mask: int | np.ndarray | None = None, band: int = 4, ring: int = 3) -> float:
    """Gradient energy along a paste boundary relative to the same measure just beside it.

    MuseTalk regenerates the lower half of a face crop and pastes it under the reference upper
    half; a colour or brightness mismatch leaves a line. Here: the squared Sobel gradient of the
    grey (channel-mean) image across the boundary (projected on the boundary's normal), averaged
    over pixels within `band` px of the boundary, divided by the same average over the pixels
    `band` < distance ≤ `ring`·`band` px away on both sides (similar content, no boundary).
    ≈1: seamless; ≫1: a visible seam. Natural edges running along the line move it too (0.5-1.5
    on real faces), so compare methods on the same crop rather than reading absolute values.

    mask: None → the boundary is row H//2 (MuseTalk's lower half); an int r → rows ≥ r are the
    generated part; or a boolean (H, W) array, True on the generated part.
    image: one image or a batch (energies pooled over it), any range.
    """
    from scipy import ndimage

    grey = _grey(_nhwc(image, "image"))
    _, h, w = grey.shape
    if isinstance(band, bool) or not isinstance(band, (int, np.integer)) or band < 1:
        raise InputError(f"band must be an integer >= 1 (pixels), got {band!r}")
    if not ring > 1:
        raise InputError(f"ring must be > 1 (outer radius in bands), got {ring!r}")
    if mask is None:
        mask = h // 2
    if isinstance(mask, (int, np.integer)) and not isinstance(mask, bool):
        if not 0 < mask < h:
            raise InputError(f"boundary row must be in 1..{h - 1} for an image {h} rows high, got {mask}")
        m = np.zeros((h, w), dtype=bool)
        m[int(mask):] = True
    else:
        m = np.asarray(mask)
        if m.shape != (h, w) or m.dtype != np.bool_:
            raise InputError(f"mask must be a boundary row (int) or a boolean array of shape {(h, w)}, "
                             f"got {getattr(m, 'dtype', type(mask))} {getattr(m, 'shape', '')}")
        if m.all() or not m.any():
            raise InputError("mask has no boundary: it must mark some pixels True (generated) and some False")
    # distance of every pixel to the nearest pixel on the other side of the boundary
    d_in, d_out = ndimage.distance_transform_edt(m), ndimage.distance_transform_edt(~m)
    dist = np.where(m, d_in, d_out)
    near = dist <= band
    beside = (dist > band) & (dist <= ring * band)
    if not beside.any():
        raise InputError(f"no pixels lie {band}..{ring * band} px from the boundary; use a smaller band")
    # only the gradient across the boundary counts: a seam is a step in that direction, while
    # texture has gradients both ways (this doubles the sensitivity over the full magnitude)
    ny, nx = np.gradient(d_in - d_out)
    norm = np.hypot(ny, nx)
    norm[norm == 0] = 1.0
    ny, nx = ny / norm, nx / norm
    energy = np.stack([(ndimage.sobel(g, axis=0) * ny + ndimage.sobel(g, axis=1) * nx) ** 2 for g in grey])
    e_near, e_beside = energy[:, near].mean(), energy[:, beside].mean()
    if not (np.isfinite(e_near) and np.isfinite(e_beside)):
        return float("nan")  # non-finite pixels: no score (never inf)
    if e_beside == 0:
        return 1.0 if e_near == 0 else float("inf")
    return float(e_near / e_beside)


# ----------------------------------------------------------------------------- temporal flicker

def mouth_roi(h: int = 256, w: int = 256) -> Roi:
    """(rows, cols) of the mouth in an aligned face crop: rows 62-92 %, columns 25-75 %.

    In MuseTalk's 256² crops the mouth sits in the lower-middle; this box contains lips and
    teeth across open and closed visemes and leaves out the jaw line and the blend seam at 50 %.
    """
    if min(h, w) < 4:
        raise InputError(f"face crop must be at least 4×4 pixels, got {h}×{w}")
    return slice(int(0.62 * h), int(0.92 * h)), slice(int(0.25 * w), int(0.75 * w))


def _frames(frames: Any) -> np.ndarray:
    """A clip as (T, H, W, C) float64, in its native units."""
    _check_kind(frames, "frames")
    if isinstance(frames, np.ndarray):
        x = frames.astype(np.float64)
        if x.ndim == 3:
            x = x[..., None]  # (T, H, W) grey
        elif x.ndim != 4:
            raise InputError(f"frames must be (T,H,W) or (T,H,W,C) numpy, got {frames.shape}")
    else:
        t = frames.detach().to(torch.float64)
        if t.dim() == 3:
            t = t[:, None]
        elif t.dim() != 4:
            raise InputError(f"frames must be (T,H,W) or (T,C,H,W) torch, got {tuple(frames.shape)}")
        x = t.permute(0, 2, 3, 1).cpu().numpy()
    return x


def flicker(frames: Any, roi: Roi | None = None) -> float:
    """Temporal flicker: mean |x[t+1] - 2·x[t] + x[t-1]| over the clip, in the inputs' units.

    The second difference is a temporal high-pass: zero for a static clip and for motion at
    constant speed (a mouth opening steadily), large for frame-to-frame jitter (teeth shimmer).
    An alternating ±e wobble scores 4e; independent per-frame noise of std σ scores ≈ 1.95σ.
    frames: numpy (T, H, W[, C]) or torch (T, [C,] H, W); T ≥ 3. roi: (rows, cols) slices,
    e.g. `mouth_roi(h, w)`.
    """
    x = _frames(frames)
    if x.shape[0] < 3:
        raise InputError(f"flicker needs at least 3 frames, got {x.shape[0]}")
    roi = _check_roi(roi)
    if roi is not None:
        x = x[:, roi[0], roi[1]]
        if x.size == 0:
            raise InputError(f"roi {roi!r} selects no pixels")
    d2 = x[2:] - 2 * x[1:-1] + x[:-2]
    return float(np.abs(d2).mean())


def drift(ref: torch.Tensor, out: torch.Tensor, data_range: float | None = None) -> dict[str, float]:
    """Output drift against the reference: MAE, max abs, PSNR (dB), cosine similarity.

    data_range: 1.0 for [0, 1] images; None for latents → the reference's own range (max − min).
    A reference holding NaN or inf is refused by name; a non-finite `out` scores NaN, never inf."""
    if data_range is None and _nonfinite(ref):
        _range_or_raise(float("nan"), ref, out, names=("ref (the reference output)", "out"))
    rng = data_range if data_range is not None else (float(ref.max() - ref.min()) or 1.0)
    return {"mae": mae(out, ref), "max_abs": max_abs(out, ref),
            "psnr_db": psnr(out, ref, data_range=rng), "cosine": cosine(out, ref)}
