import numpy as np
import pytest
import torch

from lab.data import default_avatar
from lab.errors import InputError, WeightsError
from lab.models import face
from lab.models.face import (detect_face_or_raise, detect_faces, load_sfd, lower_face_mask, prepare_avatar,
                             sfd_batch_sweep, sfd_detect_batch, square_box)


@pytest.fixture(scope="module")
def astronaut():
    return default_avatar()


def test_cascade_finds_the_astronaut(astronaut):
    boxes = detect_faces(astronaut)
    assert boxes
    x0, y0, x1, y1 = boxes[0]
    # her face sits around x 180–270, y 70–165 in the 512×512 image
    assert 150 < (x0 + x1) / 2 < 290 and 60 < (y0 + y1) / 2 < 180
    assert 60 < x1 - x0 < 160


def test_no_face_raises_with_file_name():
    grey = np.full((256, 256, 3), 128, np.uint8)
    with pytest.raises(InputError, match="no face found in grey.png"):
        detect_face_or_raise(grey, "grey.png")
    from skimage import data

    sky = np.stack([data.camera()[:150, :250]] * 3, -1)  # the sky above the cameraman
    with pytest.raises(InputError, match="sky.jpg"):
        detect_face_or_raise(sky, "sky.jpg")


def test_square_box_stays_inside():
    assert square_box((10, 10, 50, 40), (100, 200), expand=1.0) == (10, 5, 50, 45)
    b = square_box((0, 0, 40, 40), (100, 100), expand=1.5)  # would overhang top-left: shifted in
    assert b == (0, 0, 60, 60)
    b = square_box((80, 80, 100, 100), (100, 100), expand=10)  # bigger than the image: clipped
    assert b == (0, 0, 100, 100)


def test_lower_face_mask():
    m = lower_face_mask(256)
    assert m.shape == (256, 256) and m.dtype == np.float32
    assert m.min() >= 0 and m.max() <= 1
    assert m[:100].max() < 1e-3                       # upper face untouched
    assert m[200, 128] > 0.999                        # mouth region fully generated
    assert m[-1].max() < 0.05 and m[:, 0].max() < 0.05  # feathered to ~0 at the crop border
    assert 0.2 < m[128, 128] < 0.8                    # soft transition at the mid line


def test_prepare_avatar_and_cache_reuse(astronaut, tmp_path, monkeypatch):
    calls = []
    real = face.detect_face_or_raise
    monkeypatch.setattr(face, "detect_face_or_raise", lambda img, name: calls.append(name) or real(img, name))
    frames = np.stack([astronaut, astronaut[:, ::-1].copy(), astronaut])
    av = prepare_avatar(frames, "astronaut.png", cache_dir=tmp_path)
    assert len(calls) == 1  # detect once, reuse the box (static avatar)
    assert av.boxes.shape == (3, 4) and av.crops.shape == (3, 256, 256, 3) and av.crops.dtype == np.uint8
    assert av.masks.shape == (3, 256, 256) and av.latents is None and not av.from_cache
    x0, y0, x1, y1 = av.boxes[0]
    assert x1 - x0 == y1 - y0 and 0 <= x0 and x1 <= 512
    assert len(list(tmp_path.glob("avatar-*.npz"))) == 1

    again = prepare_avatar(frames, "astronaut.png", cache_dir=tmp_path)
    assert len(calls) == 1  # no detection on the second call
    assert again.from_cache and again.cache_key == av.cache_key
    assert np.array_equal(again.crops, av.crops) and np.array_equal(again.boxes, av.boxes)

    per = prepare_avatar(frames, "astronaut.png", cache_dir=tmp_path, per_frame=True)
    assert len(calls) == 4 and per.cache_key != av.cache_key
    assert per.boxes[1, 0] != per.boxes[0, 0]  # the mirrored frame's face moved


def test_prepare_avatar_without_face_names_the_file():
    with pytest.raises(InputError, match="no face found in flat.mp4"):
        prepare_avatar(np.full((2, 128, 128, 3), 90, np.uint8), "flat.mp4", per_frame=False)
    with pytest.raises(InputError, match="flat.mp4"):
        prepare_avatar(np.zeros((2, 128, 128), np.uint8), "flat.mp4")


def test_sfd_random_weights_batched():
    net, source = load_sfd("random", seed=0)
    assert source == "random (seed 0)"
    frames = np.random.default_rng(0).integers(0, 255, (3, 32, 32, 3), dtype=np.uint8)
    dets = sfd_detect_batch(net, frames, batch_size=2)
    assert len(dets) == 3 and all(d.ndim == 2 and d.shape[1] == 5 for d in dets)
    # batching must not change the result: each frame is processed independently
    single = sfd_detect_batch(net, frames[2:], batch_size=1)
    assert np.allclose(dets[2], single[0], atol=1e-3)
    rows = sfd_batch_sweep(net, frames, batch_sizes=(1, 2), device="cpu", repeats=1, warmup=0)
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["fps"] > 0 and r["ms_per_frame"] > 0 for r in rows)


def test_sfd_weights_errors(tmp_path):
    with pytest.raises(WeightsError, match="s3fd.pth"):
        load_sfd(str(tmp_path / "s3fd.pth"))
    torch.save({"conv1_1.weight": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(WeightsError, match=r"bad\.pth.*not match"):
        load_sfd(str(tmp_path / "bad.pth"))


def test_detector_minimum_is_the_loaders_and_errors_name_the_source():
    """A 16-px image must not pass one and then fail in the other with a nameless message."""
    from lab import data

    assert face.MIN_IMAGE_SIDE == data.MIN_IMAGE_SIDE == 24
    tiny = np.full((16, 16, 3), 90, np.uint8)
    with pytest.raises(InputError, match=r"tiny\.png: 16×16 pixels is too small; at least 24×24"):
        detect_face_or_raise(tiny, "tiny.png")
    with pytest.raises(InputError, match=r"tiny\.png: 16×16 pixels is too small"):
        prepare_avatar(tiny, "tiny.png")
    with pytest.raises(InputError, match=r"clip\.mp4: 40×20 pixels is too small"):
        prepare_avatar(np.zeros((3, 20, 40, 3), np.uint8), "clip.mp4")
    with pytest.raises(InputError, match=r"^image: image of shape \(4, 4, 4, 3\)"):
        detect_faces(np.zeros((4, 4, 4, 3), np.uint8))
    assert detect_faces(np.full((24, 24, 3), 90, np.uint8)) == []  # the smallest the loader passes
