"""Streaming output: H.264 delivered packet by packet, over a WebSocket, to a page that decodes
with WebCodecs.

Write-up 001 pipes NVENC's raw NAL units to a browser's `VideoDecoder` instead of writing MP4
files. Without NVENC (the H200 has none) the encoder is libx264 on the CPU; the point that
survives is *when* the first bytes can leave: an MP4 file is readable once it is closed (its
index comes last), an Annex B stream after the first frame.

- `AnnexBEncoder`: in-process libx264 (PyAV) with zero-latency tuning; every packet is an
  Annex B access unit, key frames carry SPS/PPS in band (a decoder can join at any key frame).
- `make_app`: a Starlette ASGI app (serve it with uvicorn). `GET /` is the page in
  `lab/static/stream.html`; `WS /ws/{name}` streams a registered source. Two modes:
  "full" sends whole composited frames; "patch" sends the background once (PNG), the feathered
  mask once (PNG) and the paste box, then an H.264 stream of the face patch only, and the page
  composites out = m·patch + (1 − m)·background itself.
- Every session is tracked in `Registry`: frames encoded and sent, why it ended, and whether its
  encoder was closed. A client that disconnects mid-stream stops the encoding for it at the next
  frame and its encoder is closed.
- `browser_run`: the page in headless Chromium (the system's) driven by Playwright;
  BackendUnavailable with the reason when either is missing.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import struct
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lab.errors import BackendUnavailable, InputError
from lab.progress import step

STATIC = Path(__file__).resolve().parent.parent / "static"
PAGE = STATIC / "stream.html"
HEADER = struct.Struct("<IB3x")          # frame index, key flag, padding: 8 bytes before each packet
MODES = ("full", "patch")
# BT.601 limited range, the matrix the RGB→YUV conversion uses; written into the stream's VUI so
# the browser converts back with the same one
VUI = "colorprim=bt470bg:transfer=smpte170m:colormatrix=smpte170m:fullrange=off"


def _av():
    try:
        import av
    except ImportError as e:
        raise BackendUnavailable(f"PyAV is not installed ({e}); pip install av") from None
    if "libx264" not in av.codecs_available:
        raise BackendUnavailable("PyAV's FFmpeg build has no libx264 encoder")
    return av


class AnnexBEncoder:
    """RGB uint8 frames in, Annex B packets out: `encode(frame) → [(bytes, is_key, index)]`."""

    def __init__(self, width: int, height: int, fps: float = 25.0, preset: str = "ultrafast", crf: int = 20,
                 keyint: int = 50):
        av = _av()
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise InputError(f"stream size {width}×{height}: H.264 with yuv420p needs positive even width and height")
        self._av = av
        self.width, self.height = int(width), int(height)
        self.ctx = av.CodecContext.create("libx264", "w")
        self.ctx.width, self.ctx.height = self.width, self.height
        self.ctx.pix_fmt = "yuv420p"
        self.ctx.framerate = Fraction(fps).limit_denominator(1000)
        self.ctx.time_base = 1 / self.ctx.framerate
        self.ctx.options = {"preset": preset, "tune": "zerolatency", "crf": str(crf),
                            "x264-params": f"keyint={keyint}:repeat-headers=1:{VUI}"}
        self.n_in = 0
        self.n_out = 0
        self.closed = False
        self.encode_s = 0.0

    def encode(self, frame: np.ndarray) -> list[tuple[bytes, bool, int]]:
        if self.closed:
            raise RuntimeError("encoder is closed")
        a = np.asarray(frame)
        if a.shape != (self.height, self.width, 3) or a.dtype != np.uint8:
            raise InputError(f"frame of shape {a.shape} {a.dtype}; the stream expects RGB uint8 ({self.height}, {self.width}, 3)")
        t0 = time.perf_counter()
        vf = self._av.VideoFrame.from_ndarray(np.ascontiguousarray(a), format="rgb24").reformat(format="yuv420p")
        vf.pts = self.n_in
        self.n_in += 1
        out = self._packets(self.ctx.encode(vf))
        self.encode_s += time.perf_counter() - t0
        return out

    def flush(self) -> list[tuple[bytes, bool, int]]:
        if self.closed:
            return []
        return self._packets(self.ctx.encode(None))

    def _packets(self, pkts: Any) -> list[tuple[bytes, bool, int]]:
        out = [(bytes(p), bool(p.is_keyframe), int(p.pts if p.pts is not None else self.n_out)) for p in pkts]
        self.n_out += len(out)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.ctx.close()
            except Exception:  # noqa: BLE001 - closing a context PyAV already released
                pass


def codec_string(packet: bytes) -> str:
    """WebCodecs codec string 'avc1.PPCCLL' from the SPS in a key frame's Annex B bytes."""
    i = 0
    while True:
        i = packet.find(b"\x00\x00\x01", i)
        if i < 0 or i + 6 > len(packet):
            raise InputError("no SPS (NAL type 7) in this packet: pass a key frame with in-band headers")
        if packet[i + 3] & 0x1F == 7:
            p, c, lv = packet[i + 4], packet[i + 5], packet[i + 6]
            return f"avc1.{p:02X}{c:02X}{lv:02X}"
        i += 3


def nal_types(packet: bytes) -> list[int]:
    """NAL unit types in an Annex B packet (start codes 00 00 01 / 00 00 00 01)."""
    out, i = [], 0
    while (i := packet.find(b"\x00\x00\x01", i)) >= 0 and i + 3 < len(packet):
        out.append(packet[i + 3] & 0x1F)
        i += 3
    return out


def time_to_first_chunk(frames: np.ndarray, fps: float = 25.0) -> dict[str, float]:
    """Annex B: seconds until the first packet exists, and until all packets exist."""
    n, h, w, _ = frames.shape
    enc = AnnexBEncoder(w, h, fps)
    t0 = time.perf_counter()
    first = None
    n_bytes = 0
    for f in frames:
        pk = enc.encode(f)
        if pk and first is None:
            first = time.perf_counter() - t0
        n_bytes += sum(len(p[0]) for p in pk)
    pk = enc.flush()
    n_bytes += sum(len(p[0]) for p in pk)
    if first is None and pk:
        first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    enc.close()
    return {"first_chunk_s": first, "all_chunks_s": total, "bytes": n_bytes, "encode_fps": n / total}


# ----------------------------------------------------------------------------- sources and sessions

@dataclass
class Source:
    """What a WebSocket session streams. mode 'full': frame(i) is the whole frame. mode 'patch':
    frame(i) is the face patch at box size; background, mask (box size, [0, 1]) and box go first.
    In 'full' mode `box` only names the region the page captures for comparison."""

    mode: str
    n_frames: int
    frame: Callable[[int], np.ndarray]
    fps: float = 25.0
    background: np.ndarray | None = None
    mask: np.ndarray | None = None
    box: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"stream mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.n_frames, bool) or not isinstance(self.n_frames, int) or self.n_frames < 1:
            raise InputError(f"a stream needs at least one frame, got n_frames={self.n_frames!r}")
        if self.mode == "patch":
            if self.background is None or self.mask is None or self.box is None:
                raise InputError("a 'patch' stream needs background, mask and box")
            x0, y0, x1, y1 = self.box
            H, W = self.background.shape[:2]
            if not (0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H) or (x1 - x0) % 2 or (y1 - y0) % 2:
                raise InputError(f"box {self.box} must lie inside the {W}×{H} background with even width and height")
            if self.mask.shape != (y1 - y0, x1 - x0):
                raise InputError(f"mask of shape {self.mask.shape}; expected the box size {(y1 - y0, x1 - x0)}")


@dataclass
class Session:
    name: str
    mode: str
    n_frames: int
    frames_encoded: int = 0
    frames_sent: int = 0
    bytes_sent: int = 0
    encode_s: float = 0.0
    ended: str = ""                  # "complete" | "client disconnected" | "error: …"
    encoder_closed: bool = False
    t_open: float = field(default_factory=time.perf_counter)
    t_first_sent: float | None = None
    t_end: float | None = None


class Registry:
    """Sessions by id; `wait_ended` blocks until a session has ended (tests, experiments)."""

    def __init__(self):
        self.sessions: list[Session] = []
        self._cv = threading.Condition()

    def open(self, s: Session) -> Session:
        with self._cv:
            self.sessions.append(s)
        return s

    def end(self, s: Session, reason: str) -> None:
        with self._cv:
            s.ended = s.ended or reason
            s.t_end = time.perf_counter()
            self._cv.notify_all()

    @property
    def active(self) -> int:
        return sum(not s.ended for s in self.sessions)

    def wait_ended(self, n: int = 1, timeout: float = 30.0) -> list[Session]:
        with self._cv:
            ok = self._cv.wait_for(lambda: sum(bool(s.ended) for s in self.sessions) >= n, timeout)
        if not ok:
            raise TimeoutError(f"fewer than {n} sessions ended within {timeout} s")
        return [s for s in self.sessions if s.ended]


def _png(img: np.ndarray) -> bytes:
    import cv2

    a = np.asarray(img)
    ok, buf = cv2.imencode(".png", a if a.ndim == 2 else a[..., ::-1])
    if not ok:
        raise InputError("could not PNG-encode the image")
    return buf.tobytes()


def make_app(sources: dict[str, Callable[[], Source]], registry: Registry | None = None) -> Any:
    """The ASGI app: `/` the page, `/ws/{name}` one session of sources[name]()."""
    try:
        from starlette.applications import Starlette
        from starlette.responses import HTMLResponse
        from starlette.routing import Route, WebSocketRoute
        from starlette.websockets import WebSocket, WebSocketDisconnect
    except ImportError as e:
        raise BackendUnavailable(f"starlette is not installed ({e}); pip install starlette uvicorn websockets") from None
    reg = registry or Registry()

    async def page(request: Any) -> Any:
        return HTMLResponse(PAGE.read_text())

    async def stream(ws: WebSocket) -> None:
        name = ws.path_params["name"]
        if name not in sources:
            await ws.close(code=4404, reason=f"no stream named {name!r}")
            return
        await ws.accept()
        src = sources[name]()
        s = reg.open(Session(name, src.mode, src.n_frames))
        gone = asyncio.Event()

        async def listen() -> None:
            # the disconnect arrives on the receive side of the socket; the sender checks the flag
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    gone.set()
                    return

        listener = asyncio.create_task(listen())
        enc = None
        try:
            first = np.asarray(src.frame(0))
            h, w = first.shape[:2]
            enc = AnnexBEncoder(w, h, src.fps)
            pk0 = enc.encode(first)
            head = {"type": "header", "mode": src.mode, "width": w, "height": h, "fps": src.fps, "n_frames": src.n_frames,
                    "codec": codec_string(pk0[0][0]) if pk0 else "avc1.42E01E"}
            if src.mode == "patch":
                H, W = src.background.shape[:2]
                head.update(box=list(src.box), frame_width=W, frame_height=H)
            else:
                head.update(frame_width=w, frame_height=h, capture_box=list(src.box) if src.box else None)
            await ws.send_text(json.dumps(head))
            if src.mode == "patch":
                await ws.send_bytes(_png(src.background))
                await ws.send_bytes(_png(np.clip(np.rint(src.mask * 255), 0, 255).astype(np.uint8)))
            pending = pk0
            s.frames_encoded = 1
            for i in range(src.n_frames + 1):
                for data, key, idx in pending:
                    if gone.is_set():
                        raise ConnectionError
                    await ws.send_bytes(HEADER.pack(idx, key) + data)
                    s.frames_sent += 1
                    s.bytes_sent += len(data)
                    if s.t_first_sent is None:
                        s.t_first_sent = time.perf_counter()
                if gone.is_set():
                    raise ConnectionError
                if i + 1 < src.n_frames:
                    pending = await asyncio.to_thread(enc.encode, np.asarray(src.frame(i + 1)))
                    s.frames_encoded += 1
                elif i + 1 == src.n_frames:
                    pending = enc.flush()
                else:
                    pending = []
            await ws.send_text(json.dumps({"type": "end", "frames": s.frames_sent}))
            reg_reason = "complete"
        except Exception as e:  # noqa: BLE001 - a session's failure is recorded, the server goes on
            # a send can meet the closed socket before the listener has seen the disconnect message
            left = gone.is_set() or isinstance(e, (ConnectionError, WebSocketDisconnect))
            reg_reason = "client disconnected" if left else f"error: {type(e).__name__}: {e}"
        finally:
            if enc is not None:
                s.encode_s = enc.encode_s
                enc.close()
                s.encoder_closed = enc.closed
            listener.cancel()
        reg.end(s, reg_reason)
        if reg_reason == "complete":
            try:
                await asyncio.wait_for(gone.wait(), timeout=30)   # let the page close the socket
            except asyncio.TimeoutError:
                pass

    app = Starlette(routes=[Route("/", page), WebSocketRoute("/ws/{name}", stream)])
    app.state.registry = reg
    return app


class Server:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in a background thread; a context manager."""

    def __init__(self, app: Any):
        try:
            import uvicorn
        except ImportError as e:
            raise BackendUnavailable(f"uvicorn is not installed ({e}); pip install uvicorn websockets") from None
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="websockets-sansio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if not self.thread.is_alive() or time.perf_counter() - t0 > 20:
                raise BackendUnavailable("uvicorn did not start within 20 s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# ----------------------------------------------------------------------------- the browser

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def browser_available() -> tuple[bool, str]:
    """Headless Chromium (the system's) and Playwright present?"""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False, "playwright is not installed (pip install playwright; it drives the system Chromium)"
    if _chromium() is None:
        return False, "no Chromium on this machine (Debian: apt-get install chromium)"
    return True, ""


def _drive(url: str, streams: list[str], timeout: float) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page()
            for name in streams:
                page.goto(f"{url}/?stream={name}")
                try:
                    page.wait_for_function("() => window.__result != null", timeout=timeout * 1e3, polling=50)
                except Exception:  # noqa: BLE001 - Playwright's timeout: say what the page had reached
                    raise TimeoutError(f"the page did not finish stream {name!r} within {timeout} s: "
                                       f"{page.evaluate('() => window.__status || null')}") from None
                out[name] = page.evaluate("() => window.__result")
        finally:
            browser.close()
    return out


def browser_run(url: str, stream: str | list[str], timeout: float = 120.0) -> dict[str, Any]:
    """Open the page for `stream` in headless Chromium and return what it measured
    (window.__result: frames decoded, times, composite rate, the captured box region). A list of
    streams runs them one after another in one browser and returns {stream: result}. Playwright's
    synchronous API runs in a thread of its own, so this also works inside a notebook's event loop."""
    from concurrent.futures import ThreadPoolExecutor

    ok, why = browser_available()
    if not ok:
        raise BackendUnavailable(why)
    names = [stream] if isinstance(stream, str) else list(stream)
    step(f"headless Chromium: the {', '.join(names)} page{'s' if len(names) > 1 else ''} over a local WebSocket …")
    with ThreadPoolExecutor(1) as ex:
        out = ex.submit(_drive, url, names, timeout).result()
    step("headless Chromium: done")
    return out[stream] if isinstance(stream, str) else out


def capture_to_rgb(capture: dict[str, Any]) -> np.ndarray:
    """The page's captured region (base64 RGBA, width, height) → (h, w, 3) uint8."""
    import base64

    raw = np.frombuffer(base64.b64decode(capture["rgba"]), np.uint8)
    return raw.reshape(capture["height"], capture["width"], 4)[..., :3].copy()
