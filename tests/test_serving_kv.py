"""Streaming attention stack and its caches: exactness vs the causal reference, INT8 error, the
fused kernel (Triton interpreter on CPU), memory bound, HuBERT hosting."""
import pytest
import torch

from lab.serving import kv_cache as kv
from lab.errors import InputError, WeightsError

pytestmark = pytest.mark.usefixtures("one_thread")


def _stack():
    return kv.streaming_stack(kv.TINY, seed=0)


def test_streaming_with_full_cache_equals_causal_forward():
    stack = _stack()
    x = torch.randn(2, 20, 64)
    caches = stack.new_caches("full", batch=2)
    for c in caches:                      # force one capacity doubling on the way
        c.__init__(2, 4, 16, "cpu", torch.float32, capacity=8)
    steps = torch.stack([stack.step(x[:, t], caches) for t in range(20)], 1)
    with torch.no_grad():
        ref = stack(x)
    assert torch.allclose(steps, ref, atol=1e-5), (steps - ref).abs().max()


def test_window_cache_without_eviction_equals_full_and_stays_bounded():
    stack = _stack()
    x = torch.randn(1, 30, 64)
    full, win = stack.new_caches("full"), stack.new_caches("window", window=40, int8=False)
    a = torch.stack([stack.step(x[:, t], full) for t in range(30)])
    b = torch.stack([stack.step(x[:, t], win) for t in range(30)])
    assert torch.allclose(a, b, atol=1e-5)
    small = stack.new_caches("window", window=5, int8=True)
    size0 = kv.cache_bytes(small)
    for t in range(30):
        stack.step(x[:, t], small)
    assert kv.cache_bytes(small) == size0 and small[0].n_evicted == 25


def test_summary_is_the_mean_of_evicted_tokens():
    c = kv.WindowCache(1, 1, 4, "cpu", torch.float32, window=2, int8=False)
    ks = [torch.full((1, 1, 4), float(i)) for i in range(5)]
    for k in ks:
        c.append(k, -k)
    assert c.n_evicted == 3 and torch.allclose(c.sk[0, 0, 0], torch.full((4,), 1.0))     # mean of 0, 1, 2
    assert torch.allclose(c.sv[0, 0, 0], torch.full((4,), -1.0))


def test_int8_quantization_error_is_small():
    x = torch.randn(3, 4, 64)
    q, s = kv.quantize_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (3, 4)
    err = (kv.dequantize(q, s, torch.float32) - x).abs().max(-1).values
    assert (err <= s / 2 + 1e-6).all()                                  # half a step per element
    assert torch.equal(kv.quantize_per_token(torch.zeros(2, 8))[0], torch.zeros(2, 8, dtype=torch.int8))


FUSED_CHECK = """
import torch
from lab.serving import kv_cache as kv
torch.manual_seed(0)
b, h, w, d = 1, 2, 16, 16
for n_valid, summary in [(5, False), (12, True), (16, True)]:
    q = torch.randn(b, h, 1, d)
    kq, ksc = kv.quantize_per_token(torch.randn(b, h, w, d))
    vq, vsc = kv.quantize_per_token(torch.randn(b, h, w, d))
    sk, sv = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d)
    k = kv.dequantize(kq[:, :, :n_valid], ksc[:, :, :n_valid], torch.float32)
    v = kv.dequantize(vq[:, :, :n_valid], vsc[:, :, :n_valid], torch.float32)
    if summary:
        k, v = torch.cat([sk, k], 2), torch.cat([sv, v], 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = kv.int8_window_attention(q, kq, vq, ksc, vsc, sk, sv, n_valid, summary)
    assert torch.allclose(out, ref, atol=1e-5), (n_valid, summary, (out - ref).abs().max())
    assert torch.allclose(kv._int8_attention_torch(q, kq, vq, ksc, vsc, sk, sv, n_valid, summary), ref, atol=1e-5)
stack = kv.streaming_stack(kv.TINY, seed=0)
x = torch.randn(1, 7, 64)
a, b = stack.new_caches("window", window=3, mode="dequant"), stack.new_caches("window", window=3, mode="fused")
for t in range(7):
    ya, yb = stack.step(x[:, t], a), stack.step(x[:, t], b)
    assert torch.allclose(ya, yb, atol=1e-4), (t, (ya - yb).abs().max())
assert torch.equal(a[0].k, b[0].k) and torch.allclose(a[0].sk, b[0].sk, atol=1e-6)
print("ok")
"""


def test_fused_kernel_matches_dequant_then_attend():
    """The Triton kernel under the interpreter (its own process: the variable must be set before
    triton is imported) and the torch fallback, against dequantize-then-SDPA."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", FUSED_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_bad_inputs():
    stack = _stack()
    with pytest.raises(InputError, match="window"):
        stack.new_caches("window", window=0)
    with pytest.raises(InputError, match="cache kind"):
        stack.new_caches("paged")
    with pytest.raises(InputError, match="one frame per stream"):
        stack.step(torch.randn(1, 3, 64), stack.new_caches())


def test_hosts_hubert_layers():
    from transformers import HubertConfig, HubertModel

    cfg = HubertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       feat_extract_norm="layer", do_stable_layer_norm=True, conv_dim=(32,) * 7,
                       num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    torch.manual_seed(1)
    hub = HubertModel(cfg).eval()
    stack = _stack()
    report = kv.load_hubert_layers(stack, hub.state_dict())
    assert report["missing"] == [] and report["unexpected"] == []
    x = torch.randn(1, 1, 64)            # one frame: causal == bidirectional
    with torch.no_grad():
        ref = hub.encoder.layers[0](x)[0]
    assert torch.allclose(stack.layers[0](x), ref, atol=1e-5)
    bad = {k: v for k, v in hub.state_dict().items() if "layers.1.attention.q_proj" not in k}
    with pytest.raises(WeightsError, match="missing"):
        kv.load_hubert_layers(stack, bad)


def test_cache_state_restores_and_capture_needs_fused_cuda():
    stack = _stack()
    caches = stack.new_caches("window", window=3)
    x = torch.randn(5, 64)
    saved = [c._state() for c in caches]
    for t in range(5):
        stack.step(x[t:t + 1], caches)
    assert caches[0].n == 5 and caches[0].n_evicted == 2
    for c, s in zip(caches, saved):
        c._restore(s)
    assert caches[0].n == 0 and caches[0].n_evicted == 0 and not caches[0].k.any()
    with pytest.raises(Exception, match="CUDA device with Triton"):
        kv.capture_step(stack, caches, x[:1])


@pytest.mark.gpu
def test_captured_step_matches_eager_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    stack = kv.streaming_stack(kv.TINY, "cuda", torch.float16, seed=0)
    x = torch.randn(40, 64, device="cuda", dtype=torch.float16)
    eager, graphed = stack.new_caches("window", window=8, mode="fused"), stack.new_caches("window", window=8, mode="fused")
    step = kv.capture_step(stack, graphed, x[:1])
    with pytest.raises(InputError, match="fused"):
        kv.capture_step(stack, stack.new_caches("window", window=8, mode="dequant"), x[:1])
    for t in range(40):
        a, b = stack.step(x[t:t + 1], eager), step(x[t:t + 1])
        assert torch.allclose(a.float(), b.float(), atol=2e-3), (t, (a - b).abs().max())
    assert graphed[0].n == 40 and graphed[0].n_evicted == 32 and int(graphed[0].pos) == 40


def _ptxas() -> bool:
    import os
    import shutil

    if not kv.HAVE_TRITON:
        return False
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")) \
        or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas(), reason="needs triton with its bundled ptxas")
@pytest.mark.parametrize("from_pos", [True, False])
def test_kv_kernels_compile_for_sm90(from_pos):
    """Ahead-of-time compile of both KV kernels for an H200 without a GPU, with the ring position
    read on the device and passed by the host: the interpreter test cannot catch code generation."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx(body, ptrs, consts):
        names = list(inspect.signature(body).parameters)
        sig = {n: ptrs.get(n, "constexpr" if n in consts else ("fp32" if n in ("count", "sm_scale") else "i32")) for n in names}
        src = ASTSource(fn=triton.jit(body), signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]

    f32 = {n: "*fp32" for n in ("ks_ptr", "vs_ptr", "sk_ptr", "sv_ptr")}
    app = ptx(kv._int8_append_body, {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": "*i8", "vc_ptr": "*i8", "pos_ptr": "*i32", **f32},
              dict(W=75, D=64, FROM_POS=from_pos))
    assert "st.global.b8" in app or "st.global.u8" in app         # the INT8 K and V written
    att = ptx(kv._int8_attn_body, {"q_ptr": "*fp16", "k_ptr": "*i8", "v_ptr": "*i8", "o_ptr": "*fp16", "pos_ptr": "*i32", **f32},
              dict(W=75, D=64, BLOCK_W=128, FROM_POS=from_pos))
    assert "ex2.approx" in att                                      # the softmax's exponentials
