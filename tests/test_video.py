import os
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


def _decoded_frames(path):
    """(frames a decoder gets, video stream seconds, audio stream seconds or None)."""
    import av

    with av.open(str(path)) as c:
        v = c.streams.video[0]
        a = c.streams.audio[0] if c.streams.audio else None
        vdur = float(v.duration * v.time_base)
        adur = float(a.duration * a.time_base) if a is not None else None
        n = sum(1 for _ in c.decode(v))
    return n, vdur, adur


FPS = (24, 25, 30, 60)
NEAR = (1, 2, 3, 15, 16, 17, 23, 24, 25, 26, 29, 30, 31, 59, 60, 61, 99, 100, 101, 119, 120)  # around seconds
SR = 16000
_grid_frames = np.random.default_rng(3).integers(0, 256, (120, 16, 16, 3), dtype=np.uint8)
_grid_audio = (0.1 * np.random.default_rng(4).standard_normal(SR * 6)).astype(np.float32)  # longer than any video


def _audio(kind, fps, n):
    """'exact': cut to the video as the pipeline passes it; 'long': 6 s; an int: that many samples."""
    if kind is None:
        return None
    k = {"exact": int(n * SR // fps), "long": len(_grid_audio)}.get(kind, kind)
    return _grid_audio[:k], SR


def _check_counts(cls, folder, jobs, workers):
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        fps, n, kind = job
        path = folder / f"{fps}_{n}_{kind}.mp4"
        audio = _audio(kind, fps, n)
        with cls(path, fps, (16, 16), audio=audio, preset="ultrafast") as w:
            w.write(_grid_frames[:n])
        return job, audio, _decoded_frames(path)

    with ThreadPoolExecutor(workers) as ex:  # ffmpeg runs in child processes: threads overlap them
        rows = list(ex.map(one, jobs))
    wrong = [(fps, n, kind, got) for (fps, n, kind), _, (got, _, _) in rows if got != n]
    assert not wrong, f"(fps, frames given, audio, frames in file): {wrong[:10]}"
    for (fps, n, kind), audio, (_, vdur, adur) in rows:
        assert abs(vdur - n / fps) < 1e-3
        if audio is not None:
            # cut to the video (never longer, beyond one sample) and no shorter than it was given
            given = len(audio[0]) / SR
            tol = 1.5e-3  # the container stores the AAC stream's duration in milliseconds (PyAV)
            assert min(given, vdur) - tol <= adur <= vdur + tol, (fps, n, kind, adur, vdur)
    assert not [p for p in folder.iterdir() if ".part" in p.name]


# Every count at every rate is 960 encodes per writer; each ffmpeg start costs ~20 ms of CPU, so
# by default every count runs at 30 fps and the counts around whole seconds at the other rates.
# LAB_FULL_WRITER_GRID=1 runs 1–120 at all four rates for both writers.
FULL_GRID = os.environ.get("LAB_FULL_WRITER_GRID") == "1"


def _counts(fps):
    return range(1, 121) if FULL_GRID or fps == 30 else NEAR


def test_ffmpeg_writer_keeps_every_frame(tmp_path):
    """The file holds the frames written, 1–120 frames at 24/25/30/60 fps, without audio and with
    audio of the video's length, as the pipeline passes it (ffmpeg's -shortest used to drop the
    last frame at some counts: 16 at 30 fps gave 15, 100 gave 99)."""
    jobs = [(fps, n, kind) for fps in FPS for n in _counts(fps) for kind in (None, "exact")]
    _check_counts(FFmpegWriter, tmp_path, jobs, workers=4)


def test_pyav_writer_keeps_every_frame(tmp_path):
    """Same for PyAV (in-process; its audio is cut in Python, never by the muxer)."""
    jobs = [(fps, n, kind) for fps in FPS for n in (range(1, 121) if FULL_GRID else NEAR)
            for kind in (None, "exact")]
    _check_counts(PyAVWriter, tmp_path, jobs, workers=1)


@pytest.mark.parametrize("cls", WRITERS)
def test_writer_cuts_long_audio_and_keeps_frames_with_short_audio(cls, tmp_path):
    """Longer audio is cut to the video (counts around whole seconds); shorter audio, down to a
    few ms, ends early and never takes frames with it (it used to lose every frame past the
    audio's end, or all of them)."""
    jobs = [(30, n, "long") for n in NEAR] + [(24, n, "long") for n in (1, 16, 17, 100)]
    jobs += [(fps, n, k) for fps in (25, 60) for n in (1, 16, 100) for k in (100, 1000)]
    _check_counts(cls, tmp_path, jobs, workers=4 if cls is FFmpegWriter else 1)


def _parts(folder):
    return sorted(p.name for p in folder.iterdir() if ".part" in p.name)


def _wait_until(cond, timeout=30.0):
    import time

    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)  # waits for an orphaned ffmpeg to finish; not a timing assumption
    return cond()


def test_killed_process_leaves_nothing(tmp_path):
    """SIGKILL mid-encode: no file under any final name. ffmpeg outlives its parent and finishes
    its temp file, then removes it (and the temp WAV) itself; PyAV encodes in-process, so its
    temp file stays until the next writer in the folder removes it, leaving live writers' and
    other tools' temp files alone."""
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from lab.video import FFmpegWriter, PyAVWriter
        audio = (np.zeros(16000, np.float32), 16000)
        writers = [FFmpegWriter({str(tmp_path / "ff.mp4")!r}, 25, (64, 48)),
                   FFmpegWriter({str(tmp_path / "ffa.mp4")!r}, 25, (64, 48), audio=audio),
                   PyAVWriter({str(tmp_path / "av.mp4")!r}, 25, (64, 48))]
        for w in writers:
            w.write(np.zeros((30, 48, 64, 3), np.uint8))
        print(sorted(p for p in os.listdir({str(tmp_path)!r})), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    assert ".ffa.p" in r.stdout and ".part.wav" in r.stdout  # the temp files did exist
    assert _wait_until(lambda: len(_parts(tmp_path)) == 1), _parts(tmp_path)
    stale = _parts(tmp_path)
    assert stale[0].startswith(".av.p") and stale[0].endswith(".part.mp4")
    assert sorted(p.name for p in tmp_path.iterdir()) == stale  # nothing under a final name

    (tmp_path / ".old.p999999999-0123abcd.part.wav").write_bytes(b"x")  # no such pid
    (tmp_path / ".results.json.abc.part").write_bytes(b"x")  # not a writer's file
    mine = f".live.p{os.getpid()}-0123abcd.part.mp4"  # a live process's
    (tmp_path / mine).write_bytes(b"x")
    with PyAVWriter(tmp_path / "next.mp4", 25, (64, 48)) as w:  # the next writer sweeps on start
        w.write(frames_(2))
    assert _parts(tmp_path) == sorted([".results.json.abc.part", mine])
    assert read_video_info(tmp_path / "next.mp4").n_frames == 2


def test_remove_stale_parts(tmp_path):
    from lab.video import remove_stale_parts

    mine = tmp_path / f".a.p{os.getpid()}-00000000.part.mp4"
    dead = tmp_path / ".b.p999999999-ffffffff.part.mp4"
    for f in (mine, dead):
        f.write_bytes(b"x")
    assert remove_stale_parts(tmp_path) == [dead]
    assert mine.exists() and remove_stale_parts(tmp_path / "missing") == []


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


def test_composite_yuv420p_is_the_whole_frame_conversion_bit_for_bit():
    """Only the face boxes (widened to whole chroma blocks) are recomputed, yet every byte equals
    rgb_to_yuv420p(blend_torch(...)): odd box corners, boxes overhanging the frame, several boxes
    in one batch, backgrounds picked from a set by index."""
    from lab.video import composite_yuv420p, rgb_to_yuv420p

    src = torch.from_numpy(frames_(5, 48, 64))
    index = torch.tensor([3, 0, 3, 1, 4, 2])
    faces = torch.from_numpy(rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    mask = torch.from_numpy(rng.random((16, 16)).astype(np.float32))
    boxes = [[5, 7, 30, 26], [5, 7, 30, 26], [-6, 33, 13, 55], [51, -3, 70, 12], [5, 7, 30, 26], [0, 0, 64, 48]]
    want = rgb_to_yuv420p(blend_torch(src[index], faces, mask, boxes))
    got = composite_yuv420p(rgb_to_yuv420p(src)[index], src, faces, mask, boxes, index=index)
    assert torch.equal(got, want)
    per_item = torch.from_numpy(rng.random((6, 16, 16)).astype(np.float32))  # one mask per frame
    got = composite_yuv420p(rgb_to_yuv420p(src[index]), src[index], faces, per_item, boxes)
    assert torch.equal(got, rgb_to_yuv420p(blend_torch(src[index], faces, per_item, boxes)))
    with pytest.raises(InputError, match="planes of shape"):
        composite_yuv420p(torch.zeros(5, 10, dtype=torch.uint8), src, faces[:5], mask, boxes[:5])


@pytest.mark.parametrize("zero_copy", [False, True])
def test_writer_transport_options_keep_the_file_identical(tmp_path, zero_copy):
    """A larger pipe and zero-copy writes (vmsplice) change how the bytes travel, not the file:
    one reused buffer rewritten after every write must still give the same H.264 bytes."""
    from lab.video import rgb_to_yuv420p

    yuv = rgb_to_yuv420p(torch.from_numpy(frames_(12, 48, 64))).numpy()
    with FFmpegWriter(tmp_path / "ref.mp4", 30, (64, 48), preset="ultrafast", pix_fmt="yuv420p") as w:
        w.write(yuv)
    buf = np.empty((3, yuv.shape[1]), np.uint8)
    with FFmpegWriter(tmp_path / "t.mp4", 30, (64, 48), preset="ultrafast", pix_fmt="yuv420p", pipe_buffer=8192,
                      zero_copy=zero_copy, x264_args=["-threads", "2"]) as w:
        assert w.pipe_size == (8192 if sys.platform == "linux" else 0)
        for s in range(0, 12, 3):
            buf[:] = yuv[s:s + 3]
            w.write(buf)
    assert read_video_info(tmp_path / "t.mp4").n_frames == 12
    if not zero_copy:
        return
    with FFmpegWriter(tmp_path / "zc.mp4", 30, (64, 48), preset="ultrafast", pix_fmt="yuv420p", pipe_buffer=8192,
                      zero_copy=True) as w:
        for s in range(0, 12, 3):
            buf[:] = yuv[s:s + 3]
            w.write(buf)
            buf[:] = 0  # must not reach the file
    assert (tmp_path / "zc.mp4").read_bytes() == (tmp_path / "ref.mp4").read_bytes()


def test_zero_copy_falls_back_to_copying_when_the_kernel_refuses_the_pages(tmp_path, monkeypatch):
    """Memory vmsplice cannot take (a driver mapping) is written by copy from then on, and the
    writer says so; the file is the same."""
    import errno

    from lab import video
    from lab.video import rgb_to_yuv420p

    yuv = rgb_to_yuv420p(torch.from_numpy(frames_(6, 48, 64))).numpy()
    with FFmpegWriter(tmp_path / "ref.mp4", 30, (64, 48), preset="ultrafast", pix_fmt="yuv420p") as w:
        w.write(yuv)

    def refuse(fd, a, proc):
        raise video._NotSpliceable(0, errno.EFAULT)

    monkeypatch.setattr(video, "_splice_all", refuse)
    with FFmpegWriter(tmp_path / "fb.mp4", 30, (64, 48), preset="ultrafast", pix_fmt="yuv420p", zero_copy=True) as w:
        w.write(yuv[:3])
        w.write(yuv[3:])
        assert not w.zero_copy and "vmsplice" in w.zero_copy_note
    assert (tmp_path / "fb.mp4").read_bytes() == (tmp_path / "ref.mp4").read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failed_registration_falls_back_to_pinned_and_leaves_no_cuda_error(monkeypatch):
    import lab.video as V

    real = torch.cuda.cudart()

    class Failing:  # the real call with flags CUDA refuses: it fails and sets the thread's last error, as a clash would
        def cudaHostRegister(self, ptr, n, flags):
            return real.cudaHostRegister(ptr, n, 0xFFFF)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Failing())
    t, how = V.host_buffer((2, 64, 64), torch.uint8, True, True)
    assert how == "pinned" and t.is_pinned()
    monkeypatch.undo()
    x = torch.randn(2, 3, 16, 16, device="cuda")      # torch checks the last error after this launch
    torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3, device="cuda"))
    torch.cuda.synchronize()
    assert V._loaded_cudart() is not None             # the runtime torch loaded was found (no launch fallback)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a finalizer that raises fails the test
def test_registered_host_buffers_come_and_go_cleanly():
    import gc

    from lab.video import host_buffer

    # buffers dropped while registered used to leave their pages locked: a later buffer mapped at the same address
    # failed to register, and CUDA's error surfaced at the next kernel launch (in a conv of another test)
    for _ in range(20):
        t, how = host_buffer((4, 1920, 1080), torch.uint8, True, True)
        assert how == "registered"
        t.copy_(torch.ones(4, 1920, 1080, dtype=torch.uint8, device="cuda"), non_blocking=True)
        torch.cuda.synchronize()
        assert int(t[0, 0, 0]) == 1
        del t
        gc.collect()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3, device="cuda"))
    torch.cuda.synchronize()
