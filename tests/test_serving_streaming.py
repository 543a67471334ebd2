"""Streaming output: Annex B packets, the WebSocket server (full run, client that leaves mid-stream,
unknown stream), and the WebCodecs page in headless Chromium."""
import json

import numpy as np
import pytest

from lab.serving import streaming as sm
from lab.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


def _frames(n=8, h=64, w=96):
    y, x = np.mgrid[0:h, 0:w]
    return [np.stack([(x + 3 * i) % 256, (y * 2) % 256, np.full_like(x, 120)], -1).astype(np.uint8) for i in range(n)]


def test_annexb_packets_carry_headers_and_decode_back():
    import av

    frames = _frames()
    enc = sm.AnnexBEncoder(96, 64)
    pk = []
    for f in frames:
        pk += enc.encode(f)
    pk += enc.flush()
    enc.close()
    assert len(pk) == len(frames) and pk[0][1]
    assert {7, 8, 5} <= set(sm.nal_types(pk[0][0]))             # SPS, PPS, IDR in the first packet
    assert sm.codec_string(pk[0][0]).startswith("avc1.")
    dec = av.CodecContext.create("h264", "r")
    out = [f.to_ndarray(format="rgb24") for d, _, _ in pk for f in dec.decode(av.Packet(d))]
    assert len(out) == len(frames)
    mse = ((out[-1].astype(float) - frames[-1]) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 35
    with pytest.raises(RuntimeError, match="closed"):
        enc.encode(frames[0])


def test_encoder_and_source_bad_inputs():
    with pytest.raises(InputError, match="even"):
        sm.AnnexBEncoder(95, 64)
    with pytest.raises(InputError, match="RGB uint8"):
        sm.AnnexBEncoder(96, 64).encode(np.zeros((64, 96), np.uint8))
    with pytest.raises(InputError, match="at least one frame"):
        sm.Source("full", 0, lambda i: None)                      # a zero-length stream
    with pytest.raises(InputError, match="mode"):
        sm.Source("tiles", 4, lambda i: None)
    with pytest.raises(InputError, match="background, mask and box"):
        sm.Source("patch", 4, lambda i: None)
    with pytest.raises(InputError, match="SPS"):
        sm.codec_string(b"\x00\x00\x01\x41abc")


def _server(n):
    frames = _frames(8)
    reg = sm.Registry()
    # "long" outlasts the client that leaves after three packets by thousands of frames
    app = sm.make_app({"full": lambda: sm.Source("full", n, lambda i: frames[i % 8]),
                       "long": lambda: sm.Source("full", 5000, lambda i: frames[i % 8])}, reg)
    return reg, sm.Server(app)


def test_websocket_full_stream_and_a_client_that_leaves():
    from websockets.sync.client import connect

    pytest.importorskip("uvicorn")
    n = 30
    reg, srv = _server(n)
    with srv:
        ws_url = srv.url.replace("http", "ws") + "/ws/full"
        with connect(ws_url) as ws:                               # a short complete session
            head = json.loads(ws.recv())
            assert head["mode"] == "full" and head["n_frames"] == n
            got = 0
            while True:
                m = ws.recv()
                if isinstance(m, str):
                    assert json.loads(m)["type"] == "end"
                    break
                idx, key = sm.HEADER.unpack(m[:8])
                assert idx == got
                got += 1
            assert got == n
        done = reg.wait_ended(1)[0]
        assert done.ended == "complete" and done.encoder_closed
        with connect(ws_url.replace("/full", "/long")) as ws:     # leaves after three packets
            ws.recv()
            for _ in range(3):
                ws.recv()
        s = reg.wait_ended(2)[-1]
        assert s.ended == "client disconnected", s.ended
        assert s.encoder_closed and s.frames_encoded < 5000 and reg.active == 0
        from websockets.exceptions import InvalidStatus

        with pytest.raises(InvalidStatus, match="403"):          # refused before the handshake completes
            connect(srv.url.replace("http", "ws") + "/ws/nothing")


def test_webcodecs_page_decodes_every_frame_and_composites():
    ok, why = sm.browser_available()
    if not ok:
        pytest.skip(why)
    from lab.video import blend_numpy

    rng = np.random.default_rng(0)
    bg = np.clip(rng.normal(120, 10, (96, 64, 3)), 0, 255).astype(np.uint8)
    box = (16, 24, 48, 56)
    patches = [f[:32, :32] for f in _frames(6)]
    mask = np.linspace(0, 1, 32, dtype=np.float32)[None].repeat(32, 0)
    app = sm.make_app({"patch": lambda: sm.Source("patch", 6, lambda i: patches[i], background=bg, mask=mask, box=box)})
    with sm.Server(app) as srv:
        r = sm.browser_run(srv.url, "patch", timeout=60)
    assert r["frames_decoded"] == r["frames_sent"] == 6 and not r["errors"]
    cap = sm.capture_to_rgb(r["capture"]).astype(float)
    ref = blend_numpy(bg, patches[-1], mask, box)[24:56, 16:48]
    assert 10 * np.log10(255**2 / ((cap - ref) ** 2).mean()) > 30
