"""Quality measures: known values, agreement with scikit-image, and the LPIPS weights gate."""
import math

import numpy as np
import pytest
import torch
from skimage import data as skdata
from skimage.color import lab2rgb
from skimage.metrics import structural_similarity

from lab import metrics as M
from lab.errors import BackendUnavailable, InputError


@pytest.fixture(scope="module")
def face():
    return skdata.astronaut()[:256, 128:384].copy()  # 256² RGB uint8 with a face in it


def _chw(img):
    return torch.from_numpy(img).permute(2, 0, 1).float() / 255


# ----------------------------------------------------------------------------- fidelity

def test_identical_images(face):
    assert M.psnr(face, face) == math.inf
    assert M.ssim(face, face) == pytest.approx(1.0, abs=1e-6)
    assert M.mae(face, face) == 0 and M.max_abs(face, face) == 0
    assert M.cosine(face, face) == pytest.approx(1.0)
    t = _chw(face)
    assert M.ssim(t, t) == pytest.approx(1.0, abs=1e-6)


def test_psnr_of_a_known_constant_shift():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 246, size=(2, 32, 32, 3), dtype=np.uint8)
    b = a + np.uint8(10)  # no wrap-around: a ≤ 245
    assert M.psnr(a, b) == pytest.approx(10 * math.log10(255**2 / 100))
    assert M.mae(a, b) == 10 and M.max_abs(a, b) == 10
    assert M.mae(b, a) == 10  # uint8 differences do not wrap
    x = torch.rand(1, 3, 16, 16)
    assert M.psnr(x, x + 0.1) == pytest.approx(20.0, abs=1e-4)
    assert M.psnr(x * 2 - 1, x * 2 - 1 + 0.2, data_range=2.0) == pytest.approx(20.0, abs=1e-4)


@pytest.mark.parametrize("pair", ["noisy", "two photos"])
def test_ssim_agrees_with_scikit_image(face, pair):
    if pair == "noisy":
        rng = np.random.default_rng(0)
        other = np.clip(face + rng.normal(0, 20, face.shape), 0, 255).astype(np.uint8)
    else:
        other = skdata.chelsea()[:256, :256].copy()
    ref = structural_similarity(face, other, channel_axis=-1, gaussian_weights=True, sigma=1.5,
                                use_sample_covariance=False, data_range=255)
    assert M.ssim(face, other) == pytest.approx(ref, abs=1e-4)
    # the same pair as float NCHW tensors in [0, 1]
    assert M.ssim(_chw(face), _chw(other)) == pytest.approx(ref, abs=1e-4)


def test_cosine_edge_cases():
    z = torch.zeros(4, 8)
    v = torch.randn(4, 8)
    assert M.cosine(z, z) == 1.0
    assert M.cosine(z, v) == 0.0
    assert M.cosine(v, -v) == pytest.approx(-1.0)


def test_input_errors(face):
    with pytest.raises(InputError, match="same shape"):
        M.psnr(face, face[:128])
    with pytest.raises(InputError, match="like with like"):
        M.mae(face, torch.from_numpy(face))
    with pytest.raises(InputError, match="data_range"):
        M.psnr(face.astype(np.int64), face.astype(np.int64) + 1)
    assert M.psnr(face.astype(np.int64), face.astype(np.int64) + 1, data_range=255) == pytest.approx(48.13, abs=0.01)
    with pytest.raises(InputError, match="11"):
        M.ssim(face[:8, :8], face[:8, :8])
    with pytest.raises(InputError, match="channels"):
        M.ssim(np.zeros((2, 16, 16, 7)), np.zeros((2, 16, 16, 7)))


# ----------------------------------------------------------------------------- LPIPS gate

def test_lpips_unavailable_without_weights(tmp_path, monkeypatch, face):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    ok, reason = M.lpips_available()
    assert not ok and "alexnet" in reason and "not present" in reason
    with pytest.raises(BackendUnavailable, match="LPIPS needs"):
        M.lpips_distance(face, face)
    assert not list(tmp_path.rglob("*.pth"))  # nothing was downloaded


def test_lpips_rejects_a_file_that_is_not_the_real_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    trunk, _ = M._lpips_paths("alex")
    trunk.parent.mkdir(parents=True)
    trunk.write_bytes(b"not alexnet")
    ok, reason = M.lpips_available()
    assert not ok and "sha256" in reason


def test_lpips_plumbing_with_a_local_trunk_file(tmp_path, face):
    # Exercises the loader on a random trunk saved locally (never how lpips_distance runs:
    # that path demands the hash-checked real weights).
    import torchvision

    path = tmp_path / "trunk.pth"
    torch.save(torchvision.models.alexnet(weights=None).state_dict(), path)
    model = M._build_lpips("alex", str(path))
    assert M._lpips_score(model, face, face) == pytest.approx(0.0, abs=1e-7)
    assert M._lpips_score(model, face, 255 - face) > 0


def test_lpips_unknown_net():
    with pytest.raises(InputError, match="net must be"):
        M.lpips_available("resnet")


# ----------------------------------------------------------------------------- colour drift

def test_color_drift_of_a_known_lab_shift():
    rng = np.random.default_rng(0)
    lab = np.stack([rng.uniform(40, 60, (32, 32)), rng.uniform(-10, 10, (32, 32)),
                    rng.uniform(-10, 10, (32, 32))], axis=-1)  # well inside the sRGB gamut
    shifted = lab + np.array([5.0, 3.0, -2.0])
    ref, test = lab2rgb(lab), lab2rgb(shifted)
    d = M.color_drift(ref, test)
    assert (d.dL, d.da, d.db) == pytest.approx((5.0, 3.0, -2.0), abs=1e-3)
    assert d.delta_e == pytest.approx(math.sqrt(25 + 9 + 4), abs=1e-3)
    # torch NCHW input measures the same
    dt = M.color_drift(torch.from_numpy(ref).permute(2, 0, 1), torch.from_numpy(test).permute(2, 0, 1))
    assert dt.delta_e == pytest.approx(d.delta_e)


def test_color_drift_saturation():
    grey = np.full((8, 8, 3), 128, dtype=np.uint8)
    red = np.zeros((8, 8, 3), dtype=np.uint8)
    red[..., 0] = 200
    d = M.color_drift(grey, red)
    assert d.sat_ref == 0 and d.sat_test == pytest.approx(1.0) and d.d_sat == pytest.approx(1.0)
    assert d.da > 0  # towards red/magenta
    assert M.color_drift(grey, grey).delta_e == 0


def test_color_drift_roi(face):
    test = face.copy()
    test[:100] = 0  # damage outside the mouth box only
    assert M.color_drift(face, test, roi=M.mouth_roi()).delta_e == 0
    assert M.color_drift(face, test).delta_e > 1
    with pytest.raises(InputError, match="RGB"):
        M.color_drift(face[..., 0], face[..., 0])


# ----------------------------------------------------------------------------- seams

def test_seam_energy_higher_for_a_mismatched_paste(face):
    seamless = M.seam_energy(face)
    pasted = face.copy()
    pasted[128:] = np.clip(face[128:].astype(int) + 40, 0, 255).astype(np.uint8)  # brighter generated half
    mismatched = M.seam_energy(pasted)
    assert mismatched > 2 * seamless
    # a boolean mask of the same boundary gives the same number
    mask = np.zeros(face.shape[:2], dtype=bool)
    mask[128:] = True
    assert M.seam_energy(pasted, mask) == pytest.approx(mismatched)
    assert M.seam_energy(torch.from_numpy(pasted).permute(2, 0, 1), 128) == pytest.approx(mismatched)


def test_seam_energy_on_texture_is_about_one_without_a_seam():
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(0)
    noise = 128 + 10 * gaussian_filter(rng.normal(0, 1, (256, 256)), 1.5) / 0.19  # smooth texture, std ≈ 10
    assert M.seam_energy(noise) == pytest.approx(1.0, abs=0.2)
    pasted = noise.copy()
    pasted[128:] += 25
    assert M.seam_energy(pasted) > 2.5
    # any boundary shape: a pasted disc
    yy, xx = np.mgrid[:256, :256]
    disc = (yy - 128) ** 2 + (xx - 128) ** 2 < 60**2
    assert M.seam_energy(noise, disc) == pytest.approx(1.0, abs=0.2)
    assert M.seam_energy(np.where(disc, noise + 25, noise), disc) > 2.5


def test_seam_energy_flat_and_errors():
    flat = np.full((64, 64, 3), 100, dtype=np.uint8)
    assert M.seam_energy(flat) == 1.0
    step = flat.copy()
    step[32:] = 150
    assert M.seam_energy(step) == math.inf
    with pytest.raises(InputError, match="no boundary"):
        M.seam_energy(flat, np.ones((64, 64), dtype=bool))
    with pytest.raises(InputError, match="boundary row"):
        M.seam_energy(flat, 64)


# ----------------------------------------------------------------------------- flicker

def test_flicker_static_and_steady_motion_are_zero(face):
    clip = np.stack([face] * 6)
    assert M.flicker(clip) == 0.0
    assert M.flicker(clip, roi=M.mouth_roi(256, 256)) == 0.0
    ramp = torch.stack([torch.full((3, 16, 16), 0.1 * t) for t in range(6)])  # constant speed
    assert M.flicker(ramp) == pytest.approx(0.0, abs=1e-6)  # float32 rounding only


def test_flicker_alternating_wobble_and_roi(face):
    e = 3.0
    base = face.astype(np.float64)
    clip = np.stack([base + (e if t % 2 else -e) for t in range(8)])
    assert M.flicker(clip) == pytest.approx(4 * e)
    rows, cols = M.mouth_roi(256, 256)
    assert (rows.start, rows.stop, cols.start, cols.stop) == (158, 235, 64, 192)
    only_top = np.stack([base] * 8)
    only_top[1::2, :100] += 10  # jitter outside the mouth box
    assert M.flicker(only_top, roi=(rows, cols)) == 0.0
    assert M.flicker(only_top) > 0
    with pytest.raises(InputError, match="at least 3"):
        M.flicker(clip[:2])
    with pytest.raises(InputError, match="slice"):
        M.flicker(clip, roi=(0, 10))


def test_non_finite_inputs_never_score_perfect():
    """NaN output used to read as "inf" dB or fail on "data_range must be positive, got nan"."""
    ok = torch.rand(1, 3, 16, 16)
    bad = ok.clone()
    bad[0, 0, 0, 0] = float("nan")
    allnan = torch.full_like(ok, float("nan"))
    for a, b in ((bad, ok), (ok, bad), (allnan, allnan), (ok.clone().fill_(float("inf")), ok.clone().fill_(float("inf")))):
        assert math.isnan(M.psnr(a, b, data_range=1.0))
        assert math.isnan(M.ssim(a, b, data_range=1.0))
    assert math.isnan(M.seam_energy(bad)) and math.isnan(M.seam_energy(allnan))
    assert math.isinf(M.psnr(ok, ok.clone()))   # identical finite inputs still give inf
    # a range taken from non-finite data: the input is named, not the range
    with pytest.raises(InputError, match=r"b holds 1 non-finite values \(NaN or inf\) of 768"):
        M.psnr(ok, bad, data_range=float(bad.max() - bad.min()))
    with pytest.raises(InputError, match=r"ref \(the reference output\) holds 768 non-finite"):
        M.drift(allnan, ok)
    assert math.isnan(M.drift(ok, bad)["psnr_db"])
    with pytest.raises(InputError, match="positive and finite"):
        M.psnr(ok, ok, data_range=float("inf"))
    with pytest.raises(InputError, match="positive"):
        M.psnr(ok, ok, data_range=-1.0)
