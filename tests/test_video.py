import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab.errors import InputError
from lab.video import (AsyncWriter, FFmpegWriter, PyAVWriter, blend_batch, blend_numpy, blend_torch,
                       read_video_info, resize_bilinear)

rng = np.random.default_rng(0)


def frames_(n, h=48, w=64):
    return rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def test_resize_matches_torch_interpolate():
    img = rng.random((37, 23, 3)).astype(np.float32) * 255
    for oh, ow in [(37, 23), (80, 50), (10, 9), (64, 64)]:
        ref = F.interpolate(torch.from_numpy(img).permute(2, 0, 1)[None], size=(oh, ow), mode="bilinear",
                            align_corners=False)[0].permute(1, 2, 0).numpy()
        assert np.abs(resize_bilinear(img, oh, ow) - ref).max() < 1e-3


def test_blend_mask_ones_pastes_face_exactly():
    frame = frames_(1, 300, 320)[0]
    face = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
    out = blend_numpy(frame, face, np.ones((256, 256), np.float32), (20, 30, 276, 286))
    assert np.array_equal(out[30:286, 20:276], face)
    outside = np.ones(frame.shape[:2], bool)
    outside[30:286, 20:276] = False
    assert np.array_equal(out[outside], frame[outside])
    # resized to a different box: the region is exactly the resized face
    out = blend_numpy(frame, face, np.ones((256, 256), np.float32), (10, 10, 110, 130))
    assert np.array_equal(out[10:130, 10:110], np.rint(resize_bilinear(face, 120, 100)).astype(np.uint8))


def test_blend_mask_zeros_leaves_frame_unchanged():
    frame = frames_(1, 100, 120)[0]
    face = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
    out = blend_numpy(frame, face, np.zeros((256, 256), np.float32), (10, 10, 90, 90))
    assert np.array_equal(out, frame) and out is not frame


def test_blend_box_overhanging_the_frame():
    frame = frames_(1, 64, 64)[0]
    face = np.full((32, 32, 3), 7, np.uint8)
    out = blend_numpy(frame, face, np.ones((32, 32), np.float32), (-8, 40, 24, 72))
    assert np.all(out[40:, :24] == 7) and np.array_equal(out[:40], frame[:40])


def test_numpy_and_torch_agree_within_one_lsb():
    from lab.models.face import lower_face_mask

    n = 5
    frames = frames_(n, 200, 240)
    faces = rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8)
    mask = lower_face_mask(256)
    boxes = np.array([[20, 10, 170, 160]] * 3 + [[0, 0, 100, 100], [100, 50, 240, 190]])
    ref = blend_batch(frames, faces, mask, boxes)
    got = blend_torch(torch.from_numpy(frames), torch.from_numpy(faces), torch.from_numpy(mask), boxes)
    assert got.dtype == torch.uint8 and got.shape == frames.shape
    diff = np.abs(got.numpy().astype(int) - ref.astype(int))
    assert diff.max() <= 1
    via_batch = blend_batch(torch.from_numpy(frames), torch.from_numpy(faces), torch.from_numpy(mask), boxes)
    assert torch.equal(via_batch, got)


def test_blend_torch_inplace_and_float_faces():
    frames = torch.from_numpy(frames_(2, 64, 64))
    faces = torch.rand(2, 3, 32, 32).permute(0, 2, 3, 1) * 255  # a VAE's [0, 1] output, rescaled
    out = blend_torch(frames.clone(), faces, torch.ones(2, 32, 32), [[0, 0, 32, 32]] * 2, inplace=False)
    assert torch.equal(out[:, :32, :32], faces.round().to(torch.uint8))
    target = frames.clone()
    blend_torch(target, faces, torch.ones(32, 32), [[0, 0, 32, 32]] * 2, inplace=True)
    assert torch.equal(target, out)


@pytest.mark.gpu
def test_blend_torch_on_cuda():
    frames = frames_(4, 128, 128)
    faces = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64), 0.5, np.float32)
    boxes = [[10, 10, 90, 90]] * 4
    ref = blend_batch(frames, faces, mask, boxes)
    got = blend_torch(torch.from_numpy(frames).cuda(), torch.from_numpy(faces).cuda(),
                      torch.from_numpy(mask).cuda(), boxes).cpu().numpy()
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1


WRITERS = [FFmpegWriter, PyAVWriter]


@pytest.mark.parametrize("cls", WRITERS)
def test_writer_frame_count_duration_audio(cls, tmp_path):
    path = tmp_path / "out.mp4"
    sr = 16000
    audio = (0.1 * np.sin(2 * np.pi * 440 * np.arange(sr) / sr)).astype(np.float32)  # 1 s, longer than the video
    with cls(path, fps=25, size=(64, 48), audio=(audio, sr)) as w:
        w.write(frames_(10))       # a batch
        for f in frames_(5):
            w.write(f)            # single frames
    info = read_video_info(path)
    assert info.n_frames == 15 and info.fps == 25
    assert abs(info.duration - 0.6) < 0.05 and info.has_audio
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]  # temp files cleaned up


@pytest.mark.parametrize("cls", WRITERS)
def test_writer_without_audio(cls, tmp_path):
    path = tmp_path / "silent.mp4"
    w = cls(path, fps=30, size=(32, 32))
    w.write(frames_(7, 32, 32))
    assert not path.exists()  # only a hidden temp file while writing
    assert w.close() == path
    info = read_video_info(path)
    assert info.n_frames == 7 and not info.has_audio and abs(info.duration - 7 / 30) < 0.02


@pytest.mark.parametrize("cls", WRITERS)
def test_exception_mid_write_leaves_nothing(cls, tmp_path):
    path = tmp_path / "broken.mp4"
    with pytest.raises(RuntimeError, match="boom"):
        with cls(path, fps=25, size=(64, 48)) as w:
            w.write(frames_(3))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cls", WRITERS)
def test_writer_rejects_bad_input(cls, tmp_path):
    with pytest.raises(InputError, match="even"):
        cls(tmp_path / "odd.mp4", fps=25, size=(63, 48))
    with cls(tmp_path / "x.mp4", fps=25, size=(64, 48)) as w:
        with pytest.raises(InputError, match=r"\(48, 64, 3\)"):
            w.write(np.zeros((48, 62, 3), np.uint8))
        w.write(frames_(1))
    with pytest.raises(FileExistsError):
        cls(tmp_path / "x.mp4", fps=25, size=(64, 48))


def test_killed_process_leaves_nothing_under_final_name(tmp_path):
    path = tmp_path / "killed.mp4"
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from lab.video import FFmpegWriter
        w = FFmpegWriter({str(path)!r}, fps=25, size=(64, 48))
        w.write(np.zeros((5, 48, 64, 3), np.uint8))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert r.returncode == -9
    assert not path.exists()


def test_async_writer(tmp_path):
    path = tmp_path / "async.mp4"
    with AsyncWriter(FFmpegWriter(path, fps=25, size=(64, 48)), maxsize=2) as w:
        for f in frames_(12):
            w.write(torch.from_numpy(f))  # tensors are moved to the host in the thread
    assert w.n_frames == 12 and w.busy_s > 0
    assert read_video_info(path).n_frames == 12


def test_async_writer_reraises_and_discards(tmp_path):
    path = tmp_path / "bad.mp4"
    w = AsyncWriter(FFmpegWriter(path, fps=25, size=(64, 48)), maxsize=1)
    w.write(frames_(1))
    w.write(np.zeros((10, 10, 3), np.uint8))  # wrong size: fails in the thread
    with pytest.raises(InputError, match="expected RGB uint8"):
        for f in frames_(20):  # the producer is never deadlocked; the error surfaces
            w.write(f)
        w.close()
    assert not path.exists()


def test_read_video_info_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_video_info(tmp_path / "none.mp4")
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    with pytest.raises(InputError, match="junk.mp4"):
        read_video_info(tmp_path / "junk.mp4")


def test_yuv420p_pipe_matches_rgb_pipe(tmp_path):
    """Converting to I420 ourselves must give the same video as ffmpeg's own rgb24 → yuv420p."""
    import imageio.v3 as iio
    import torch

    from lab.video import FFmpegWriter, rgb_to_yuv420p

    rng = np.random.default_rng(0)
    base = np.kron(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8), np.ones((8, 8, 1), np.uint8))  # 48×64 blocks
    frames = np.stack([np.roll(base, i, axis=1) for i in range(6)])
    with FFmpegWriter(tmp_path / "rgb.mp4", 30, (64, 48), crf=0, preset="ultrafast") as w:
        w.write(frames)
    with FFmpegWriter(tmp_path / "yuv.mp4", 30, (64, 48), crf=0, preset="ultrafast", pix_fmt="yuv420p") as w:
        w.write(rgb_to_yuv420p(torch.from_numpy(frames)))
    a = np.stack(list(iio.imiter(tmp_path / "rgb.mp4"))).astype(float)
    b = np.stack(list(iio.imiter(tmp_path / "yuv.mp4"))).astype(float)
    assert a.shape == b.shape == frames.shape
    d = np.abs(a - b)
    assert np.median(d) <= 1 and d.mean() < 3.0  # chroma filters differ at block edges; colours must not
    assert np.abs(b - frames).mean() < 6.0


def test_yuv_writer_rejects_rgb_frames(tmp_path):
    from lab.video import FFmpegWriter

    w = FFmpegWriter(tmp_path / "x.mp4", 30, (64, 48), pix_fmt="yuv420p")
    with pytest.raises(InputError, match="yuv420p frames"):
        w.write(np.zeros((48, 64, 3), np.uint8))
    w.abort()
    assert not (tmp_path / "x.mp4").exists()
