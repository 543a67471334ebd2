import sys

import numpy as np
import pytest
import soundfile as sf

from lab import data
from lab.errors import InputError


def test_default_audio_is_10s_24k_mono():
    x, sr = data.default_audio()
    assert sr == 24000 and x.ndim == 1 and x.dtype == np.float32
    assert 9.0 < len(x) / sr < 12.0
    assert np.abs(x).max() > 0.05


def test_default_avatar():
    img = data.default_avatar()
    assert img.shape == (512, 512, 3) and img.dtype == np.uint8


def test_resample_44k_stereo_to_16k_mono(tmp_path):
    sr = 44100
    t = np.arange(int(0.5 * sr)) / sr
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    right = 0.25 * np.sin(2 * np.pi * 440 * t)
    sf.write(tmp_path / "st.wav", np.stack([left, right], 1), sr)
    x, out_sr = data.load_audio(tmp_path / "st.wav", sr=16000)
    assert out_sr == 16000 and x.ndim == 1 and x.dtype == np.float32
    assert abs(len(x) - 8000) <= 1
    ref = 0.375 * np.sin(2 * np.pi * 440 * np.arange(len(x)) / 16000)
    mid = slice(200, -200)  # filter edges
    assert np.max(np.abs(x[mid] - ref[mid])) < 1e-2


@pytest.fixture
def wav(tmp_path):
    p = tmp_path / "ok.wav"
    sf.write(p, (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32), 16000)
    return p


def test_empty_file(tmp_path):
    p = tmp_path / "empty.wav"
    p.write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.wav.*empty"):
        data.load_audio(p)


def test_not_audio(tmp_path):
    p = tmp_path / "notes.wav"
    p.write_text("this is not audio at all " * 50)
    with pytest.raises(InputError, match=r"notes\.wav.*not readable as audio"):
        data.load_audio(p)


def test_truncated(tmp_path, wav):
    p = tmp_path / "cut.wav"
    p.write_bytes(wav.read_bytes()[:20000])
    with pytest.raises(InputError, match=r"cut\.wav.*truncated"):
        data.load_audio(p)


def test_nan_and_inf(tmp_path):
    x = np.zeros(8000, np.float32)
    x[100] = np.nan
    x[200] = np.inf
    p = tmp_path / "nan.wav"
    sf.write(p, x, 16000, subtype="FLOAT")
    with pytest.raises(InputError, match=r"nan\.wav.*2 samples are NaN or infinite"):
        data.load_audio(p)


def test_too_short(tmp_path):
    p = tmp_path / "short.wav"
    sf.write(p, np.zeros(800, np.float32), 16000)  # 50 ms
    with pytest.raises(InputError, match=r"short\.wav.*50\.0 ms.*100 ms"):
        data.load_audio(p)


def test_missing(tmp_path):
    with pytest.raises(InputError, match="nope.wav.*not found"):
        data.load_audio(tmp_path / "nope.wav")


def test_load_image_errors(tmp_path):
    p = tmp_path / "x.png"
    p.write_text("not an image")
    with pytest.raises(InputError, match=r"x\.png.*not readable as an image"):
        data.load_image(p)
    with pytest.raises(InputError, match=r"none\.png: image file not found"):
        data.load_image(tmp_path / "none.png")


def test_load_image_grey_to_rgb(tmp_path):
    import imageio.v3 as iio

    iio.imwrite(tmp_path / "g.png", np.full((32, 40), 7, np.uint8))
    img = data.load_image(tmp_path / "g.png")
    assert img.shape == (32, 40, 3) and (img == 7).all()


# ---------------------------------------------------------------- images: every mode Pillow opens

H, W = 30, 40  # above the minimum side, small enough to be fast


def _rgb():
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([x * 255 // (W - 1), y * 255 // (H - 1), (x + y) * 255 // (W + H - 2)], -1).astype(np.uint8)


def _grey():
    return _rgb()[..., 0]


def _alpha():
    a = np.linspace(0, 255, W)[None].repeat(H, 0)
    return np.rint(a).astype(np.uint8)


def _over_white(rgb, alpha):
    a = alpha.astype(np.float64)[..., None] / 255
    return np.rint(rgb * a + 255 * (1 - a)).astype(np.uint8)


def _stack(g):
    return np.repeat(g[..., None], 3, -1)


def _png16(path, arr, color_type):
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit RGB)."""
    import struct
    import zlib

    h, w = arr.shape[:2]
    raw = b"".join(b"\x00" + arr[r].astype(">u2").tobytes() for r in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _case(name, tmp):
    """(file, expected RGB, max abs error, Pillow's mode when opened) for one colour mode."""
    from PIL import Image
    import tifffile

    rgb, g, a = _rgb(), _grey(), _alpha()
    rng = np.random.default_rng(0)
    p = tmp / name
    if name == "rgb.png":
        Image.fromarray(rgb).save(p)
        return p, rgb, 0, "RGB"
    if name == "rgba.png":
        Image.fromarray(np.dstack([rgb, a])).save(p)
        return p, _over_white(rgb, a), 1, "RGBA"
    if name == "l.png":
        Image.fromarray(g).save(p)
        return p, _stack(g), 0, "L"
    if name == "la.png":
        Image.fromarray(np.dstack([g, a]), "LA").save(p)
        return p, _over_white(_stack(g), a), 1, "LA"
    if name == "1bit.png":
        b = g > 127
        Image.fromarray(b).save(p)
        return p, _stack(np.where(b, 255, 0).astype(np.uint8)), 0, "1"
    if name in ("p.png", "p.gif"):
        im = Image.fromarray(rgb).quantize(64)
        im.save(p)
        return p, np.asarray(im.convert("RGB")), 0, "P"
    if name == "p_transparent.png":
        im = Image.fromarray(rgb).quantize(64)
        im.info["transparency"] = 0
        im.save(p, transparency=0)
        idx = np.asarray(im)
        return p, np.where((idx == 0)[..., None], 255, np.asarray(im.convert("RGB"))), 0, "P"
    if name == "pa.tif":
        im = Image.fromarray(rgb).quantize(64)
        pa = im.convert("PA")
        pa.putalpha(Image.fromarray(a))
        pa.save(p)
        return p, _over_white(np.asarray(im.convert("RGB")), a), 1, "PA"
    if name in ("cmyk.jpg", "cmyk.tif"):
        Image.fromarray(rgb).convert("CMYK").save(p, quality=95)
        return p, rgb, 12 if p.suffix == ".jpg" else 0, "CMYK"
    if name == "ycbcr.tif":
        Image.fromarray(rgb).convert("YCbCr").save(p)
        return p, rgb, 3, "YCbCr"
    if name == "lab.tif":  # 8-bit L*a*b* itself loses up to ~35 levels on saturated greens
        lab = Image.fromarray(rgb).convert("LAB")
        lab.save(p)
        return p, np.asarray(lab.convert("RGB")), 1, "LAB"
    if name in ("i16.png", "i16b.tif"):
        v = g.astype(np.int64) * 257 + rng.integers(-128, 129, g.shape)
        v = np.clip(v, 0, 65535).astype(np.uint16)
        if p.suffix == ".tif":
            tifffile.imwrite(p, v.astype(">u2"))
        else:
            Image.fromarray(v).save(p)
        return p, _stack(np.rint(v / 257).astype(np.uint8)), 0, "I;16B" if p.suffix == ".tif" else "I;16"
    if name == "i32.tif":
        v = (g.astype(np.uint64) * 16843009).astype(np.uint32)  # 255 · 16843009 = 2^32 - 1
        tifffile.imwrite(p, v, photometric="minisblack")
        return p, _stack(g), 0, "I"
    if name == "i16_signed.tif":
        v = (g.astype(np.int32) * 257 - 32768).astype(np.int16)
        tifffile.imwrite(p, v, photometric="minisblack")
        return p, _stack(g), 0, "I"
    if name in ("f01.tif", "f255.tif"):
        v = g.astype(np.float32) / (255 if name == "f01.tif" else 1)
        Image.fromarray(v, "F").save(p)
        return p, _stack(g), 0, "F"
    if name == "rgb16.png":
        v = rgb.astype(np.uint16) * 257 + rng.integers(0, 257, rgb.shape).astype(np.uint16)
        _png16(p, v, 2)
        return p, (v >> 8).astype(np.uint8), 1, "RGB"
    if name == "rgba16.png":
        av = a.astype(np.uint16) * 257
        _png16(p, np.dstack([rgb.astype(np.uint16) * 257, av]), 6)
        return p, _over_white(rgb, a), 1, "RGBA"
    if name == "premultiplied.tif":
        pm = np.rint(rgb * (a[..., None] / 255.0)).astype(np.uint8)
        tifffile.imwrite(p, np.dstack([pm, a]), photometric="rgb", extrasamples=["assocalpha"])
        return p, _over_white(rgb, a), 2, "RGBA"  # Pillow unpremultiplies on open
    if name == "rgba.webp":
        Image.fromarray(np.dstack([rgb, a])).save(p, lossless=True)
        return p, _over_white(rgb, a), 1, "RGBA"
    if name == "rgb.bmp":
        Image.fromarray(rgb).save(p)
        return p, rgb, 0, "RGB"
    if name == "srgb_icc.png":
        from PIL import ImageCms

        icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
        Image.fromarray(rgb).save(p, icc_profile=icc)
        return p, rgb, 2, "RGB"
    raise KeyError(name)


MODES = ["rgb.png", "rgba.png", "l.png", "la.png", "1bit.png", "p.png", "p.gif", "p_transparent.png", "pa.tif",
         "cmyk.jpg", "cmyk.tif", "ycbcr.tif", "lab.tif", "i16.png", "i16b.tif", "i32.tif", "i16_signed.tif",
         "f01.tif", "f255.tif", "rgb16.png", "rgba16.png", "premultiplied.tif", "rgba.webp", "rgb.bmp",
         "srgb_icc.png"]


@pytest.mark.parametrize("name", MODES)
def test_load_image_every_mode_to_rgb8(tmp_path, name):
    from PIL import Image

    path, expected, tol, mode = _case(name, tmp_path)
    with Image.open(path) as im:
        assert im.mode == mode  # the file really is in the mode under test
    img = data.load_image(path)
    assert img.shape == (H, W, 3) and img.dtype == np.uint8 and img.flags.c_contiguous
    err = np.abs(img.astype(int) - expected.astype(int))
    assert err.max() <= tol, f"{name}: max error {err.max()}, mean {err.mean():.2f}"


def test_cmyk_jpeg_is_not_read_as_rgb(tmp_path):
    """The CMYK channels used to be read as R, G, B (+alpha): colours inverted."""
    path, rgb, _, _ = _case("cmyk.jpg", tmp_path)
    assert np.abs(data.load_image(path).astype(int) - rgb.astype(int)).mean() < 3


@pytest.mark.parametrize("orientation, turn", [(1, lambda a: a), (3, lambda a: np.rot90(a, 2)),
                                               (6, lambda a: np.rot90(a, -1)), (8, lambda a: np.rot90(a, 1)),
                                               (2, lambda a: a[:, ::-1])])
def test_load_image_applies_exif_orientation(tmp_path, orientation, turn):
    from PIL import Image

    rgb = _rgb()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(rgb).save(tmp_path / "o.png", exif=exif)
    img = data.load_image(tmp_path / "o.png")
    assert np.array_equal(img, turn(rgb))


def test_load_image_first_frame_of_an_animation(tmp_path):
    from PIL import Image

    frames = [Image.fromarray(np.full((H, W, 3), v, np.uint8)) for v in (40, 200)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    assert abs(int(data.load_image(tmp_path / "anim.gif").mean()) - 40) <= 1


def test_load_image_size_limit_is_the_detectors(tmp_path):
    import imageio.v3 as iio

    from lab.models import face

    for shape in [(16, 16), (23, 100), (100, 23)]:
        p = tmp_path / f"small_{shape[0]}x{shape[1]}.png"
        iio.imwrite(p, np.full(shape + (3,), 99, np.uint8))
        with pytest.raises(InputError, match=rf"{p.name}: {shape[1]}×{shape[0]} pixels is too small; at least 24×24"):
            data.load_image(p)
    iio.imwrite(tmp_path / "ok.png", np.full((24, 24, 3), 99, np.uint8))
    img = data.load_image(tmp_path / "ok.png")
    assert face.detect_faces(img, source_name="ok.png") == []  # the detector takes what the loader passes


def test_load_image_bad_files_name_the_file(tmp_path):
    p = tmp_path / "folder.png"
    p.mkdir()
    with pytest.raises(InputError, match=r"folder\.png: is a folder"):
        data.load_image(p)
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.png: file is empty"):
        data.load_image(tmp_path / "empty.png")
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "f.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "f.png").read_bytes()[:3000])
    with pytest.raises(InputError, match=r"cut\.png: not readable as an image"):
        data.load_image(tmp_path / "cut.png")
    nan = np.full((H, W), np.nan, np.float32)
    Image.fromarray(nan, "F").save(tmp_path / "nan.tif")
    with pytest.raises(InputError, match=r"nan\.tif: 1200 pixels are NaN"):
        data.load_image(tmp_path / "nan.tif")
    Image.fromarray(np.full((H, W), 1000.0, np.float32), "F").save(tmp_path / "hdr.tif")
    with pytest.raises(InputError, match=r"hdr\.tif: floating-point image with values in \[1e\+03"):
        data.load_image(tmp_path / "hdr.tif")
    import tifffile

    tifffile.imwrite(tmp_path / "float_rgb.tif", np.zeros((H, W, 3), np.float32), photometric="rgb")
    with pytest.raises(InputError, match=r"float_rgb\.tif: not readable as an image \(Pillow cannot identify"):
        data.load_image(tmp_path / "float_rgb.tif")


def test_load_video_names_the_file(tmp_path):
    from lab.video import FFmpegWriter

    with FFmpegWriter(tmp_path / "tiny.mp4", 25, (16, 16)) as w:
        w.write(np.zeros((3, 16, 16, 3), np.uint8))
    with pytest.raises(InputError, match=r"tiny\.mp4: 16×16 pixels is too small; at least 24×24"):
        data.load_video(tmp_path / "tiny.mp4")
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all")
    with pytest.raises(InputError, match=r"junk\.mp4: not readable as a video"):
        data.load_video(tmp_path / "junk.mp4")
    with pytest.raises(InputError, match=r"none\.mp4: video file not found"):
        data.load_video(tmp_path / "none.mp4")


def test_a_large_source_is_scaled_down_once_for_the_tiny_ditto_profile(tmp_path, capsys):
    from PIL import Image

    from lab import data
    from lab.experiments import ditto as dx

    big = np.random.default_rng(0).integers(0, 255, (1, 3000, 2001, 3), dtype=np.uint8)
    small = data.reduce_source(big, 1024)
    assert small.shape == (1, 1024, 682, 3) and small.dtype == np.uint8
    assert data.reduce_source(small, 1024) is small                       # within the bound: untouched
    Image.fromarray(big[0]).save(tmp_path / "huge.png")
    tiny = dx.profile(True, __import__("torch").device("cpu"))
    got = dx._source_for(tiny, str(tmp_path / "huge.png"))
    assert max(got.shape[1:3]) <= dx.TINY_SOURCE_SIDE and "2000×3000 scaled to" in capsys.readouterr().out
    full = dx.replace(tiny, size="full")
    assert dx._source_for(full, str(tmp_path / "huge.png")) == str(tmp_path / "huge.png")   # the full profile keeps it


def test_the_bundled_sentence_reads_the_same_without_soundfile(monkeypatch):
    a, sr = data.default_audio(16000)
    monkeypatch.setitem(sys.modules, "soundfile", None)   # `import soundfile` raises ImportError
    with pytest.raises(ImportError):
        data.load_audio(data.DEFAULT_AUDIO)
    b, sr2 = data.default_audio(16000)
    assert sr2 == sr == 16000 and np.array_equal(a, b)
    c, sr3 = data.default_audio()
    assert sr3 == 24000 and c.dtype == np.float32 and len(c) > 9 * sr3
