"""lab.runtime.backends + lab.runtime.cache: every backend matches eager, unavailable ones say why,
the engine cache reuses good entries and rebuilds (with a warning) anything it must not trust.

CPU tests use tiny configs. `compile` runs with compile_backend="eager" on CPU (dynamo capture
and our wrapper; inductor's C++ build takes 30-80 s per graph on a 2-core CI box); the GPU tests
exercise inductor, CUDA graphs and the CUDA ONNX path.
"""
import json
import math
import signal
import sys
import time
import types
import warnings

import pytest
import torch

from lab.runtime import backends as B
from lab.runtime import cache as C
from lab.errors import BackendUnavailable, InputError
from lab.metrics import cosine, max_abs
from lab.models.musetalk import load_musetalk_unet
from lab.models.vae import load_vae

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core box (see conftest)
CUDA = torch.cuda.is_available()


def tiny(kind: str, device: str = "cpu", batch: int = 2):
    """(module, example inputs) for a tiny config of one of the lab's models."""
    g = torch.Generator().manual_seed(0)
    if kind == "unet":
        m = load_musetalk_unet(size="tiny", device=device).module()
        dim = m.unet.config.cross_attention_dim
        ex = (torch.randn(batch, 8, 8, 8, generator=g), torch.randn(batch, 50, dim, generator=g))
    else:
        m = load_vae(kind, size="tiny", device=device).decoder_module()
        ex = (torch.randn(batch, 4, 8, 8, generator=g),)
    return m, tuple(x.to(device) for x in ex)


def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 3, 3, padding=1)).eval()


def assert_close(y, ref, cos=0.9999, atol=1e-4):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert cosine(y, ref) > cos
    assert max_abs(y, ref) < atol


# ----------------------------------------------------------------------------- backends on CPU

@pytest.mark.parametrize("kind", ["taesd", "sd-vae", "unet"])
def test_eager_and_compile_match_module(kind):
    m, ex = tiny(kind)
    with torch.no_grad():
        ref = m(*ex)
    eager = B.accelerate(m, "eager", ex, precision="fp32", name=kind)
    assert eager.backend == "eager" and eager.artifact is None
    assert torch.equal(eager(*ex), ref)
    comp = B.accelerate(m, "compile", ex, precision="fp32", name=kind, compile_backend="eager")
    assert comp.backend == "compile" and comp.build_s > 0
    assert_close(comp(*ex), ref)


@pytest.mark.parametrize("kind", ["taesd", "sd-vae", "unet"])
def test_onnx_matches_module(kind):
    m, ex = tiny(kind, batch=1)
    with torch.no_grad():
        ref = m(*ex)
    r = B.accelerate(m, "onnx", ex, precision="fp32", name=kind)
    assert r.backend == "onnx" and r.build_s > 0
    assert_close(r(*ex), ref)
    with pytest.raises(InputError, match="exported for input shapes"):
        r(*(torch.cat([x, x]) for x in ex))


def test_precision_copy_leaves_callers_module_alone():
    m = small_net()
    x = torch.randn(1, 4, 8, 8)
    r = B.accelerate(m, "eager", (x,), precision="bf16")
    assert r(x).dtype == torch.bfloat16
    assert next(m.parameters()).dtype == torch.float32  # the caller's module was copied, not cast
    assert any("copy" in n for n in r.notes)


@pytest.mark.skipif(CUDA, reason="checks the CPU-only answer")
@pytest.mark.parametrize("backend", ["cudagraph", "compile+cudagraph", "cudnn", "tensorrt"])
def test_gpu_backends_unavailable_on_cpu(backend):
    m, ex = tiny("taesd")
    with pytest.raises(BackendUnavailable) as e:
        B.accelerate(m, backend, ex, precision="fp32")
    assert len(str(e.value)) > 20
    ok, why = B.available(backend, "cpu")
    assert not ok and why


def test_cudnn_backend_runs_fp16_only(monkeypatch):
    from lab.runtime import cudnn_graph

    monkeypatch.setattr(cudnn_graph, "require", lambda device, io: None)
    B._require_cudnn_graph(torch.device("cuda"), "fp16")
    with pytest.raises(BackendUnavailable, match="fp16 only"):
        B._require_cudnn_graph(torch.device("cuda"), "bf16")


def test_tensorrt_stub_package_is_reported(monkeypatch):
    """pip's placeholder 'tensorrt' (no Builder) must read as unavailable, not crash later."""
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    m, ex = tiny("taesd")
    with pytest.raises(BackendUnavailable, match="stub without Builder"):
        B.accelerate(m, "tensorrt", ex, precision="fp16")


def test_onnx_on_cuda_module_without_cuda_provider_is_unavailable(monkeypatch):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(BackendUnavailable, match="CUDA execution provider"):
        B._require_ort(torch.device("cuda"))


def test_bad_inputs_name_the_fix():
    m, ex = tiny("taesd")
    with pytest.raises(InputError) as e:
        B.accelerate(m, "tvm", ex)
    for b in B.BACKENDS:
        assert b in str(e.value)
    with pytest.raises(InputError, match="precision"):
        B.accelerate(m, "eager", ex, precision="int4")
    with pytest.raises(InputError, match="unknown option"):
        B.accelerate(m, "eager", ex, precision="fp32", mode="default")
    with pytest.raises(InputError, match="max-autotune"):
        B.accelerate(m, "compile", ex, precision="fp32", mode="max-autotune")


def test_module_sha256_follows_weights():
    a, b = small_net(), small_net()
    assert B.module_sha256(a) == B.module_sha256(b)
    with torch.no_grad():
        b[0].weight[0, 0, 0, 0] += 1e-3
    assert B.module_sha256(a) != B.module_sha256(b)


# ----------------------------------------------------------------------------- engine cache

def build(tmp_path, net=None):
    net = net or small_net()
    x = torch.randn(1, 4, 8, 8)
    return B.accelerate(net, "onnx", (x,), precision="fp32", cache_dir=tmp_path, name="net"), net, x


def no_cache_warnings():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", C.CacheWarning)
    return ctx


def test_cache_build_then_reuse(tmp_path):
    r1, net, x = build(tmp_path)
    assert r1.cache_hit is False and r1.artifact.is_file()
    assert r1.artifact.name.startswith("net_cpu_fp32_b1_") and r1.artifact.name.endswith(".ort.onnx")
    mtime = r1.artifact.stat().st_mtime_ns
    ctx = no_cache_warnings()
    try:
        r2, _, _ = build(tmp_path, net)
    finally:
        ctx.__exit__(None, None, None)
    assert r2.cache_hit is True and r2.artifact == r1.artifact
    assert r2.artifact.stat().st_mtime_ns == mtime  # not rewritten
    assert torch.equal(r1(x), r2(x))
    rows = C.listing(tmp_path)
    assert {r["arch"] for r in rows} == {"any", "cpu"} and all(r["valid"] for r in rows)


def test_cache_other_arch_rebuilds_with_warning(tmp_path, monkeypatch):
    r1, net, x = build(tmp_path)
    monkeypatch.setattr(C, "target_arch", lambda device: "sm_86")
    with pytest.warns(C.CacheWarning, match=r"arch=cpu \(this run: sm_86\)"):
        r2, _, _ = build(tmp_path, net)
    assert r2.cache_hit is False and "_sm_86_" in r2.artifact.name
    assert r1.artifact.is_file()  # the other GPU's entry stays for that GPU
    assert_close(r2(x), r1(x))


def test_cache_other_version_rebuilds_with_warning(tmp_path, monkeypatch):
    r1, net, x = build(tmp_path)
    real = B.backend_version
    monkeypatch.setattr(B, "backend_version", lambda b: "onnxruntime 0.0.1" if b == "onnx" else real(b))
    with pytest.warns(C.CacheWarning, match="backend_version"):
        r2, _, _ = build(tmp_path, net)
    assert r2.cache_hit is False and r2.artifact != r1.artifact


def test_cache_truncated_file_rebuilds_with_warning(tmp_path):
    r1, net, x = build(tmp_path)
    data = r1.artifact.read_bytes()
    r1.artifact.write_bytes(data[: len(data) // 2])
    with pytest.warns(C.CacheWarning, match="truncated"):
        r2, _, _ = build(tmp_path, net)
    assert r2.cache_hit is False and r2.artifact == r1.artifact
    assert r2.artifact.read_bytes() == data and C.validate(r2.artifact, C.read_sidecar(r2.artifact)["key"]) is None


def test_cache_same_size_corruption_and_bad_deserialize(tmp_path):
    r1, net, x = build(tmp_path)
    data = bytearray(r1.artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    r1.artifact.write_bytes(bytes(data))
    with pytest.warns(C.CacheWarning, match="sha256"):
        build(tmp_path, net)
    # a file whose sidecar was rewritten to match (say, by hand) still has to deserialize
    garbage = b"not an onnx model" * 100
    r1.artifact.write_bytes(garbage)
    side = C.read_sidecar(r1.artifact)
    side["files"][r1.artifact.name] = {"bytes": len(garbage), "sha256": C.sha256_file(r1.artifact)}
    (tmp_path / (r1.artifact.name + ".json")).write_text(json.dumps(side))
    with pytest.warns(C.CacheWarning, match="failed to deserialize"):
        r3, _, _ = build(tmp_path, net)
    assert r3.cache_hit is False
    assert_close(r3(x), net(x).detach())


def test_gpu_artifacts_are_keyed_by_arch_tag(monkeypatch):
    import lab.env

    monkeypatch.setattr(lab.env, "arch_tag", lambda: "sm_86")
    assert C.target_arch("cuda") == "sm_86"  # engines and CUDA-provider models: the GPU's arch
    assert C.target_arch("cpu") == "cpu"  # CPU artifacts do not depend on which GPU is present
    k86 = C.make_key("vae", C.target_arch("cuda"), "fp16", 16, [(16, 4, 32, 32)], "tensorrt", "tensorrt 10.0")
    monkeypatch.setattr(lab.env, "arch_tag", lambda: "sm_90")
    k90 = C.make_key("vae", C.target_arch("cuda"), "fp16", 16, [(16, 4, 32, 32)], "tensorrt", "tensorrt 10.0")
    assert C.entry_name(k86, "engine").startswith("vae_sm_86_fp16_b16_")
    assert C.entry_name(k86, "engine") != C.entry_name(k90, "engine")


def test_cache_lookup_store_primitives(tmp_path):
    key = C.make_key("m", "sm_90", "fp16", 4, [(4, 3)], "tensorrt", "tensorrt 10.0", graph_sha256="ab" * 32)
    assert C.lookup(tmp_path, key, "engine") == (None, None)
    path = C.store(tmp_path, key, "engine", b"\x01" * 100)
    assert path.name.startswith("m_sm_90_fp16_b4_") and path.suffix == ".engine"
    assert C.lookup(tmp_path, key, "engine", load=lambda p: p.read_bytes()) == (path, b"\x01" * 100)
    with pytest.warns(C.CacheWarning, match="nothing"):
        assert C.lookup(tmp_path, key, "engine", load=lambda p: None) == (None, None)
    (tmp_path / (path.name + ".json")).unlink()  # interrupted store: artifact without sidecar
    with pytest.warns(C.CacheWarning, match="sidecar"):
        assert C.lookup(tmp_path, key, "engine") == (None, None)
    assert C.lookup(None, key, "engine") == (None, None)


def test_external_data_export_is_cached_with_its_data_file(tmp_path, monkeypatch):
    """Graphs over the 2 GB protobuf limit go to external data; force that path on a small net."""
    monkeypatch.setattr(B, "EXTERNAL_DATA_BYTES", 0)
    r1, net, x = build(tmp_path)
    exports = [r for r in C.listing(tmp_path) if r["arch"] == "any"]
    assert len(exports) == 1
    data_files = list(tmp_path.glob("net_any_*.onnx.data"))
    assert len(data_files) == 1
    assert_close(r1(x), net(x).detach())
    data_files[0].write_bytes(data_files[0].read_bytes()[:10])
    with pytest.warns(C.CacheWarning, match="truncated"):
        r2, _, _ = build(tmp_path, net)
    assert_close(r2(x), net(x).detach())


# ----------------------------------------------------------------------------- GPU (run with -m gpu)

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["taesd", "unet"])
def test_cudagraph_matches_eager_and_rejects_new_shapes(kind):
    m, ex = tiny(kind, "cuda")
    with torch.no_grad():
        ref = m(*ex)
    r = B.accelerate(m, "cudagraph", ex, precision="fp32")
    assert_close(r(*ex), ref)
    other = tuple(torch.randn_like(x) for x in ex)
    with torch.no_grad():
        ref2 = m(*other)
    y2 = r(*other)
    assert_close(y2, ref2)  # inputs are copied into the staging buffers on every call
    with pytest.raises(InputError, match="captured for input shapes"):
        r(*(x[:1] for x in ex))
    raw = B.accelerate(m, "cudagraph", ex, precision="fp32", clone_output=False)
    a = raw(*ex)
    raw(*other)
    assert_close(a, ref2)  # the static buffer: overwritten by the next call, as documented


@pytest.mark.gpu
@pytest.mark.parametrize("via", ["capture", "reduce-overhead"])
def test_compile_cudagraph_matches_eager_fp16(via):
    m, ex = tiny("taesd", "cuda")
    with torch.no_grad():
        ref = m.half()(*(x.half() for x in ex)).float()
    comp = B.accelerate(m, "compile", ex, precision="fp16")
    assert comp.build_s > 0
    assert cosine(comp(*ex).float(), ref) > 0.999
    kw = {"compiled": comp} if via == "capture" else {"via": via}
    r = B.accelerate(m, "compile+cudagraph", ex, precision="fp16", **kw)
    y = r(*ex)
    assert y.dtype == torch.float16 and cosine(y.float(), ref) > 0.999
    r(*(torch.randn_like(x) for x in ex))
    assert cosine(y.float(), ref) > 0.999  # a returned output is a copy: the next replay does not touch it


@pytest.mark.gpu
def test_onnx_and_tensorrt_on_cuda_run_or_say_why(tmp_path):
    m, ex = tiny("taesd", "cuda", batch=1)
    with torch.no_grad():
        ref = m.half()(*(x.half() for x in ex)).float()
    for backend in ("onnx", "tensorrt"):
        try:
            r = B.accelerate(m, backend, ex, precision="fp16", cache_dir=tmp_path, name="taesd")
        except BackendUnavailable as e:
            assert str(e)
            continue
        assert cosine(r(*ex).float(), ref) > 0.999
        assert r.artifact is not None and r.artifact.is_file()


# ----------------------------------------------------------------------------- the notebook's experiment

def test_run_matrix_rows_and_failures_do_not_stop_the_run(monkeypatch):
    from lab.experiments import backends as BB

    def broken(c, **kw):
        raise RuntimeError("inductor exploded")

    monkeypatch.setitem(B._BUILDERS, "compile", broken)
    with pytest.warns(RuntimeWarning, match="inductor exploded"):
        out = BB.run_matrix(["taesd"], [1], ["compile", "compile+cudagraph", "onnx", "tensorrt"], "fp32",
                            torch.device("cpu"), size="tiny", iters=2, warmup=1, progress=False,
                            skip={"taesd": {"onnx": "not today"}})
    rows = {r["backend"]: r for r in out["rows"]}
    assert list(rows) == ["eager", "compile", "compile+cudagraph", "onnx", "tensorrt"]  # eager is always first
    assert rows["eager"]["status"] == "ok" and rows["eager"]["speedup"] == 1.0 and rows["eager"]["fps"] > 0
    assert rows["eager"]["baseline"] == "eager" and rows["eager"]["speedup_vs_eager_cl"] == 1.0
    assert "speedup" not in rows["onnx"] or rows["onnx"]["speedup"] is None
    assert rows["compile"]["status"] == "failed" and "inductor exploded" in rows["compile"]["reason"]
    assert rows["compile+cudagraph"]["status"] == "skipped" and "compile failed" in rows["compile+cudagraph"]["reason"]
    assert rows["onnx"] == {**rows["onnx"], "status": "skipped", "reason": "not today"}
    assert rows["tensorrt"]["status"] == "unavailable" and rows["tensorrt"]["reason"]
    best = BB.best_per_model(out["rows"])
    assert best[("taesd", 1)]["backend"] == "eager"
    assert out["models"]["taesd"]["clamped_pct"] >= 0 and out["weights"]["taesd"].startswith("random")


def test_run_matrix_scores_a_build_on_another_input_twice(monkeypatch):
    # a build exact on the example it was built with and off elsewhere, differently per call (a stale buffer, a
    # race): scoring the example alone would call it exact
    from lab.experiments import backends as BB

    real = BB._build

    def build(module, backend, ex, *a, **k):
        r = real(module, backend, ex, *a, **k)
        if backend != "compile":
            return r
        first, calls = ex[0].clone(), []

        class Off:
            def __getattr__(self, name):
                return getattr(r, name)

            def __call__(self, *xs):
                calls.append(1)
                y = r(*xs)
                return y if torch.equal(xs[0], first) else y + 0.05 * len(calls)
        return Off()

    monkeypatch.setattr(BB, "_build", build)
    out = BB.run_matrix(["taesd"], [1], ["compile"], "fp32", torch.device("cpu"), size="tiny", iters=2, warmup=1,
                        progress=False)
    rows = {r["backend"]: r for r in out["rows"]}
    eager, off = rows["eager"], rows["compile"]
    assert eager["repeat_max_abs"] == 0.0 and eager["psnr_vs_fp32"] > 100 and eager["psnr_vs_eager"] == float("inf")
    assert off["status"] == "ok" and off["psnr_vs_eager"] < 40 and off["psnr_vs_fp32"] < 40
    assert off["repeat_max_abs"] == pytest.approx(0.05, abs=1e-6)
    assert BB.best_per_model(out["rows"])[("taesd", 1)]["backend"] == "eager"


def _srow(model, batch, backend, fps, status="ok", **kw):
    return {"model": model, "batch": batch, "backend": backend, "status": status, "fps": fps,
            "ms_per_batch": 1e3 * batch / fps if fps else None, **kw}


def test_fill_speedups_uses_the_faster_eager_layout_as_the_baseline():
    from lab.experiments.backends import best_per_model, fill_speedups, speedup_text

    rows = [  # the H200's UNet and SD-VAE at batch 16: channels-last eager slower than NCHW eager
        _srow("unet", 16, "eager", 295.9, psnr_vs_eager=float("inf")),
        _srow("unet", 16, "compile+cudagraph", 1863.0, psnr_vs_eager=74.2, speedup_vs_nchw=3.16),
        _srow("unet", 16, "onnx", None, status="unavailable", reason="no CUDA provider"),
        _srow("unet", 16, "eager (NCHW)", 589.0),
        _srow("sd-vae", 16, "eager", 277.8, psnr_vs_eager="inf"),  # "inf": as a loaded results.json holds it
        _srow("sd-vae", 16, "compile+cudagraph", 660.8, psnr_vs_eager=66.8),
        _srow("sd-vae", 16, "eager (NCHW)", 308.8),
        _srow("taesd", 16, "eager", 400.0),  # channels-last eager the faster layout
        _srow("taesd", 16, "compile", 800.0, psnr_vs_eager=90.0),
        _srow("taesd", 16, "eager (NCHW)", 320.0),
        _srow("taesd", 1, "eager", 100.0),  # no NCHW row (CPU, or a run cut short): eager alone
        _srow("taesd", 1, "compile", 150.0, psnr_vs_eager=90.0),
        _srow("unet", 1, "eager", None, status="skipped", reason="time budget"),  # no eager baseline at all
        _srow("unet", 1, "cudagraph", 50.0, psnr_vs_eager=80.0),
    ]
    untouched = {id(r): dict(r) for r in rows if r["status"] != "ok"}
    assert fill_speedups(rows) is rows
    by = {(r["model"], r["batch"], r["backend"]): r for r in rows}

    cg = by[("unet", 16, "compile+cudagraph")]
    assert cg["baseline"] == "eager (NCHW)" and cg["speedup"] == pytest.approx(1863.0 / 589.0)  # 3.16×, not 6.30×
    assert cg["speedup_vs_eager_cl"] == pytest.approx(1863.0 / 295.9) and "speedup_vs_nchw" not in cg
    assert by[("unet", 16, "eager")]["speedup"] == pytest.approx(295.9 / 589.0)
    assert by[("unet", 16, "eager")]["speedup_vs_eager_cl"] == 1.0
    assert by[("unet", 16, "eager (NCHW)")]["speedup"] == 1.0
    assert by[("unet", 16, "eager (NCHW)")]["speedup_vs_eager_cl"] == pytest.approx(589.0 / 295.9)
    assert by[("sd-vae", 16, "compile+cudagraph")]["speedup"] == pytest.approx(660.8 / 308.8)
    tc = by[("taesd", 16, "compile")]
    assert tc["baseline"] == "eager" and tc["speedup"] == tc["speedup_vs_eager_cl"] == pytest.approx(2.0)
    assert by[("taesd", 16, "eager (NCHW)")]["speedup"] == pytest.approx(0.8)
    t1 = by[("taesd", 1, "compile")]
    assert t1["baseline"] == "eager" and t1["speedup"] == t1["speedup_vs_eager_cl"] == pytest.approx(1.5)
    u1 = by[("unet", 1, "cudagraph")]
    assert u1["speedup"] is None and u1["baseline"] is None and u1["speedup_vs_eager_cl"] is None
    for r in rows:  # rows that did not run are left exactly as they were
        if r["status"] != "ok":
            assert r == untouched[id(r)]
    snapshot = [dict(r) for r in rows]
    assert fill_speedups(rows) == snapshot  # idempotent (run_matrix calls it on every checkpoint)

    # only NCHW eager measured: it is the baseline, and there is no channels-last speed-up
    only = fill_speedups([_srow("m", 2, "eager (NCHW)", 10.0), _srow("m", 2, "compile", 30.0)])
    assert only[1]["baseline"] == "eager (NCHW)" and only[1]["speedup"] == 3.0
    assert only[1]["speedup_vs_eager_cl"] is None
    assert fill_speedups([]) == []

    best = best_per_model(rows)
    assert best[("unet", 16)] is cg and best[("sd-vae", 16)]["backend"] == "compile+cudagraph"
    assert speedup_text(cg, rows) == "3.16× over eager (NCHW) (1863.0 FPS; 6.30× over channels-last eager)"
    assert speedup_text(best[("sd-vae", 16)], rows) == (
        "2.14× over eager (NCHW) (660.8 FPS; 2.38× over channels-last eager)")
    assert speedup_text(tc, rows) == "2.00× over channels-last eager, the faster eager layout (800.0 FPS)"
    assert speedup_text(t1, rows) == "1.50× over eager (150.0 FPS)"
    assert "no eager baseline" in speedup_text(u1, rows)


def test_best_per_model_picks_nchw_eager_when_nothing_beats_it():
    from lab.experiments.backends import best_per_model, fill_speedups

    rows = fill_speedups([_srow("unet", 16, "eager", 300.0, psnr_vs_eager=float("inf")),
                          _srow("unet", 16, "compile", 500.0, psnr_vs_eager=70.0),
                          _srow("unet", 16, "cudagraph", 900.0, psnr_vs_eager=20.0),  # fast but wrong: never best
                          _srow("unet", 16, "eager (NCHW)", 600.0)])
    b = best_per_model(rows)[("unet", 16)]
    assert b["backend"] == "eager (NCHW)" and b["speedup"] == 1.0 and b["baseline"] == "eager (NCHW)"


# ----------------------------------------------------------------------------- the time budget (lab.budget, notebooks 03 and 04)

class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_budget_allows_what_fits_and_says_why_not():
    from lab.budget import Budget

    clock = FakeClock()
    b = Budget(100, reserve_s=10, clock=clock, verbose=False)
    assert b.left() == 90 and b.allows(90) and not b.allows(91)
    clock.t += 60
    assert b.left() == pytest.approx(30) and b.allows(30) and not b.allows(31)
    why = b.check("compile unet", 150)
    assert "compile unet needs ~150 s" in why and "30 s left" in why and "time_budget_s=100" in why
    assert "raise time_budget_s" in why
    assert b.check("eager", 5) == ""
    assert [(s["step"], s["status"], s["reason"]) for s in b.table()] == [("compile unet", "skipped", why)]
    clock.t += 1000  # past the end: nothing fits, and `left` never goes below zero in messages
    assert not b.allows(0) and "0 s left" in b.why_not("x", 1)
    unlimited = Budget(None, clock=clock, verbose=False)
    assert unlimited.allows(1e9) and unlimited.left() == math.inf and unlimited.check("anything", 1e9) == ""
    assert unlimited.summary()["time_budget_s"] is None


def test_budget_parameter_values():
    from lab.budget import DEFAULT_TIME_BUDGET_S, budget_seconds

    assert budget_seconds("auto") == DEFAULT_TIME_BUDGET_S == 420
    assert budget_seconds("auto", quick=True) is None  # CI smoke runs: no limit unless asked
    assert budget_seconds(None) is None and budget_seconds(1, quick=True) == 1.0 and budget_seconds(300.5) == 300.5
    for bad in ("soon", 0, -5, True, [420]):
        with pytest.raises(InputError, match="time_budget_s"):
            budget_seconds(bad)


def test_budget_run_ok_skipped_failed_and_strict(capsys):
    from lab.budget import Budget

    b = Budget(60)
    r = b.run("add", 1, lambda x, y: x + y, 2, 3)
    assert r.ok and r.value == 5 and r.status == "ok"
    r = b.run("too big", 1e6, lambda: pytest.fail("must not run"))
    assert r.status == "skipped" and r.value is None and "too big needs" in r.reason

    def boom():
        raise ValueError("bad shape\nmore")

    with pytest.warns(RuntimeWarning, match="boom failed: ValueError: bad shape"):
        r = b.run("boom", 1, boom)
    assert r.status == "failed" and r.reason == "ValueError: bad shape"
    with pytest.raises(ValueError):
        Budget(60, strict=True, verbose=False).run("boom", 1, boom)
    assert [s["status"] for s in b.table()] == ["ok", "skipped", "failed"]
    b.section("next part")
    out = capsys.readouterr().out
    assert "start add" in out and "skip too big" in out and "== next part" in out and "s of the 60 s budget left" in out
    assert out.splitlines()[0].startswith("[") and " s] " in out.splitlines()[0]  # seconds since the start
    assert b.summary()["steps_ok"] == 1 and b.summary()["steps_skipped"] == 1 and b.summary()["steps_failed"] == 1


def spin(limit_s: float = 20.0) -> str:
    """Busy Python work that only the budget's deadline stops (gives up after `limit_s`)."""
    t0 = time.perf_counter()
    x = 0
    while time.perf_counter() - t0 < limit_s:
        x += 1
    return "not stopped"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="the hard deadline uses SIGALRM")
def test_budget_deadline_aborts_a_step_that_overruns_and_restores_the_handler():
    from lab.budget import Budget, BudgetExceeded

    before = signal.getsignal(signal.SIGALRM)
    b = Budget(0.5, verbose=False)
    t0 = time.perf_counter()
    r = b.run("cold compile", 0, spin)  # estimated at 0 s, runs "forever"
    assert r.status == "aborted" and time.perf_counter() - t0 < 5
    assert "cold compile stopped after" in r.reason and "time_budget_s=0" in r.reason
    assert signal.getsignal(signal.SIGALRM) is before
    assert issubclass(BudgetExceeded, BaseException) and not issubclass(BudgetExceeded, Exception)
    assert b.run("after the end", 0, lambda: 1).status == "skipped"  # nothing starts once time is up


def test_plan_puts_the_headline_rows_first():
    from lab.experiments.backends import plan_tasks

    tasks = plan_tasks(["sd-vae", "unet"], [1, 16], list(B.BACKENDS), nchw_rows=True)
    assert tasks[:6] == [("sd-vae", 16, "eager"), ("sd-vae", 16, "compile"), ("sd-vae", 16, "compile+cudagraph"),
                         ("unet", 16, "eager"), ("unet", 16, "compile"), ("unet", 16, "compile+cudagraph")]
    assert tasks[6:12] == [("sd-vae", 1, "eager"), ("sd-vae", 1, "compile"), ("sd-vae", 1, "compile+cudagraph"),
                           ("unet", 1, "eager"), ("unet", 1, "compile"), ("unet", 1, "compile+cudagraph")]
    assert tasks[12:16] == [("sd-vae", 16, "cudagraph"), ("sd-vae", 16, "cudnn"), ("sd-vae", 16, "onnx"),
                            ("sd-vae", 16, "tensorrt")]
    assert tasks[-4:] == [("sd-vae", 16, "eager (NCHW)"), ("unet", 16, "eager (NCHW)"),
                          ("sd-vae", 1, "eager (NCHW)"), ("unet", 1, "eager (NCHW)")]
    assert len(tasks) == len(set(tasks)) == 2 * 2 * len(B.BACKENDS) + 4


def test_run_matrix_with_no_time_left_returns_every_row_with_its_reason():
    from lab.budget import Budget
    from lab.experiments.backends import plan_tasks, run_matrix

    backends = ["eager", "compile", "compile+cudagraph", "onnx", "tensorrt"]
    out = run_matrix(["taesd", "unet"], [1, 2], backends, "fp32", torch.device("cpu"), size="tiny", progress=False,
                     budget=Budget(1e-3, verbose=False))
    got = [(r["model"], r["batch"], r["backend"]) for r in out["rows"]]
    assert got == plan_tasks(["taesd", "unet"], [1, 2], backends)  # nothing loaded, nothing lost
    for r in out["rows"]:
        if r["backend"] == "tensorrt":
            assert r["status"] == "unavailable" and "TensorRT" in r["reason"]  # the real reason wins over the budget's
        else:
            assert r["status"] in ("skipped", "unavailable") and "time budget" in r["reason"], r
    assert out["models"] == {} and out["build_spent_s"] == 0


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="the hard deadline uses SIGALRM")
def test_run_matrix_skips_rows_that_do_not_fit_and_aborts_one_that_overruns(monkeypatch):
    from lab.budget import Budget
    from lab.experiments.backends import run_matrix

    tiny("taesd")  # imports done before the clock starts
    est = {"load": 0, "eager": 0, "compile": 0, "onnx": 1e6}
    monkeypatch.setitem(B._BUILDERS, "compile", lambda c, **kw: spin())
    parts = []
    out = run_matrix(["taesd"], [1, 2], ["eager", "compile", "onnx"], "fp32", torch.device("cpu"), size="tiny",
                     # 5 s: the eager row (model load included) must finish well inside it on a busy runner
                     iters=2, warmup=1, progress=False, budget=Budget(5.0, verbose=False), estimates=est,
                     checkpoint=lambda part: parts.append((len(part["rows"]), part["rows"][0].get("speedup"))))
    rows = {(r["batch"], r["backend"]): r for r in out["rows"]}
    assert list(rows) == [(2, "eager"), (2, "compile"), (1, "eager"), (1, "compile"), (2, "onnx"), (1, "onnx")]
    assert rows[(2, "eager")]["status"] == "ok" and rows[(2, "eager")]["fps"] > 0
    assert rows[(2, "compile")]["status"] == "aborted" and "stopped after" in rows[(2, "compile")]["reason"]
    for k in [(1, "eager"), (1, "compile"), (2, "onnx"), (1, "onnx")]:  # after the deadline nothing starts
        assert rows[k]["status"] == "skipped" and "time budget" in rows[k]["reason"], k
    assert parts == [(2, 1.0), (4, 1.0)]  # a checkpoint after each (model, batch) group, speed-ups filled


def test_cache_demo_is_skipped_when_it_does_not_fit(tmp_path):
    from lab.budget import Budget
    from lab.experiments.backends import cache_demo

    demo = cache_demo(tmp_path / "c", size="tiny", budget=Budget(1, verbose=False), est_s=30)
    assert demo["rows"] == [] and demo["listing"] == [] and "cache demo" in demo["skipped"]
    assert not (tmp_path / "c").exists()


def test_notebook_04_with_a_tiny_budget_still_saves_every_row_with_a_reason(tmp_path):
    from lab.results import Result
    from lab.runner import find_notebook, run_notebook

    entry = run_notebook(find_notebook("04"), tmp_path, {"quick": True, "device": "cpu", "time_budget_s": 1})
    assert entry.status == "ok", entry.error
    res = Result.load(tmp_path / "results.json")
    rows = res.tables["backends"]
    assert rows and all(r["status"] in ("skipped", "unavailable") and r["reason"] for r in rows)
    assert any("time budget" in r["reason"] for r in rows)
    steps = {s["step"]: s for s in res.tables["time_budget"]}
    assert steps["§ save"]["status"] == "section" and any(s["status"] == "skipped" for s in steps.values())
    assert res.params["time_budget_s"] == 1 and "time budget" in res.headline


# ----------------------------------------------------------------------------- notebook 04's parameters and profile

def _check04(**values):
    from lab import params
    from lab.experiments import backends as ex
    from lab.experiments.common import notebook_path

    return params.check({"quick": False, **values}, params.notebook_defaults(notebook_path(ex.NAME)), ex.RULES, where=ex.NAME)


@pytest.mark.parametrize("name,value,says", [
    ("backends", ["eager", "tensorRT"], "backends[1]='tensorRT'"), ("models", ["unet", "vae"], "models[1]='vae'"),
    ("batches", [16, 0], "batches[1]=0: must be > 0"), ("batches", 16, "batches=16: expected a non-empty list"),
    ("precision", "fp8", "precision='fp8'"), ("channels_last", 1, "channels_last=1: expected True or False"),
    ("build_budget_s", -1, "build_budget_s=-1"), ("time_budget_s", 0, "time_budget_s=0"),
    ("min_psnr_db", "high", "min_psnr_db='high'"), ("iters", 0, "iters=0"), ("cache_dir", 3, "cache_dir=3"),
    ("skip", {"unet": {"onx": "slow"}}, "skip={'unet'"), ("skip", {"unet": "onnx"}, "expected {model: {backend: reason}}"),
    ("weights", ["random"], "weights=['random']"), ("batch", 16, "did you mean 'batches'"),
])
def test_notebook_04_parameters_are_checked_by_name(name, value, says):
    with pytest.raises(InputError) as e:
        _check04(**{name: value})
    assert says in str(e.value)


def test_notebook_04_profile_decides_sizes_from_quick_and_the_device():
    from lab.budget import DEFAULT_TIME_BUDGET_S
    from lab.experiments import backends as ex

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    q = ex.profile(_check04(quick=True, skip={"unet": {"onnx": "export too slow"}}), cpu)
    assert (q["size"], q["batches"], q["iters"], q["warmup"], q["precision"]) == ("tiny", [2], 5, 1, "fp32")
    assert q["compile_backend"] == "eager" and q["onnx_opts"] == {"dynamo": False} and q["time_budget_s"] is None
    assert q["skip"]["unet"]["onnx"] == "export too slow" and "quick profile" in q["skip"]["unet"]["compile"]
    assert len(q["notes"]) == 5 and any("fp32 on CPU" in n for n in q["notes"])
    c = ex.profile(_check04(), cpu)  # a CPU without quick: full configs, fp32, inductor
    assert (c["size"], c["batches"], c["precision"], c["compile_backend"]) == ("full", [1, 16], "fp32", "inductor")
    g = ex.profile(_check04(time_budget_s="auto"), gpu)
    assert (g["precision"], g["warmup"], g["onnx_opts"], g["skip"], g["notes"]) == ("fp16", 3, {}, {}, [])
    assert g["time_budget_s"] == DEFAULT_TIME_BUDGET_S


def test_notebook_04_best_headline_and_comparisons_from_the_h200_reference_tables():
    """The H200 reference run's backend rows (speed-ups refilled over the faster eager layout) give
    the README's figures through the notebook's own table, headline and comparison code."""
    from pathlib import Path

    from lab.budget import Budget
    from lab.experiments import backends as ex
    from lab.experiments.common import Run
    from lab.results import ROOT, Result

    path = ROOT / "outputs" / "reference" / "h200" / "run_04" / "04_compile_backends" / "results.json"
    if not path.exists():
        pytest.skip("no reference run run_04")
    ref = Result.load(path)
    res = Result(name=ref.name, params=ref.params, tables={"backends": ex.fill_speedups(ref.tables["backends"])},
                 weights=ref.weights)
    run = Run(ref.name, dict(ref.params), torch.device("cuda"), Path("unused"), res, ref.provenance["machine"])
    run.budget = Budget(None, verbose=False)
    ex.best_table(run)
    hl = ex.headline(run)
    assert list(hl) == list(ref.headline)
    assert hl["sd-vae b16"].startswith("compile+cudagraph: 2.14× over eager (NCHW) (660.8 FPS; 2.38× over channels-last")
    assert hl["unet b16"].startswith("compile+cudagraph: 3.16× over eager (NCHW)") and "74.2 dB" in hl["unet b16"]
    ex.writeup_comparison(run)
    got = {c.claim: (c.our_value, c.verdict) for c in res.comparisons}
    assert got["TensorRT FP16 engine over PyTorch FP16 eager, SD-VAE decoder"] == ("unavailable", "not comparable")
    assert got["best backend speed-up over FP16 eager, SD-VAE decoder (theirs: TensorRT)"] == (2.14, "reproduced")


def test_inductor_options_reach_torch_compile_and_bad_combinations_are_refused(monkeypatch):
    m, ex = small_net(), (torch.randn(1, 4, 8, 8),)
    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda mod, **kw: seen.append(kw) or real(mod, backend="eager"))
    r = B.accelerate(m, "compile", ex, precision="fp32", inductor_options={"triton.enable_pdl": True})
    assert seen[-1]["options"] == {"triton.enable_pdl": True} and seen[-1]["mode"] is None
    assert "options=" in r.notes[0]
    with pytest.raises(InputError, match="cannot both be given"):
        B.accelerate(m, "compile", ex, precision="fp32", mode="reduce-overhead", inductor_options={"a": 1})
    with pytest.raises(InputError, match="need compile_backend='inductor'"):
        B.accelerate(m, "compile", ex, precision="fp32", compile_backend="eager", inductor_options={"a": 1})
    with pytest.raises(InputError, match="unknown option"):
        B.accelerate(m, "cudagraph", ex, precision="fp32", inductor_options={"a": 1})
