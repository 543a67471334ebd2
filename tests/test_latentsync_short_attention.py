"""The short-sequence attention kernel (lab.techniques.short_attention) against SDPA, run by Triton's
interpreter on the CPU (a subprocess: the interpreter is chosen when the kernel is defined), and its
place among the UNet's attention kernels."""
import textwrap

import pytest
import torch

from lab.errors import InputError

CHECK = textwrap.dedent("""
    import torch
    from lab.techniques import short_attention as sa
    from lab.models.latentsync import attention
    torch.manual_seed(0)
    worst = 0.0
    for n, L, h, d, dt in [(6, 16, 2, 40, torch.float32), (3, 16, 8, 80, torch.float32), (2, 10, 2, 24, torch.float32),
                           (2, 16, 1, 160, torch.float32), (4, 16, 2, 40, torch.float16)]:
        q, k, v = torch.randn(n, L, 3 * h * d).to(dt).chunk(3, -1)   # views of a fused projection
        out, ref = sa._launch(q, k, v, h).float(), attention(q.float(), k.float(), v.float(), h)
        err = ((out - ref).norm() / ref.norm()).item()
        worst = max(worst, err if dt == torch.float32 else err / 100)
    print(worst)
""")


def test_short_attention_matches_sdpa_under_the_interpreter(triton_interpreter):
    assert float(triton_interpreter(CHECK).split()[-1]) < 1e-5   # fp32 to round-off; fp16 within 1e-3


def test_short_attention_is_offered_for_the_temporal_attention_only():
    pytest.importorskip("triton")
    from lab.techniques import short_attention as sa
    from lab.models import latentsync as ls

    sa.register()
    m = ls.load_latentsync_unet("random", "tiny", seed=0).model
    ls.set_attention_kernels(m, temporal="triton", latent=8)
    assert {mod.backend for label, mod in ls.attention_sites(m, 8) if label.startswith("temporal")} == {"triton"}
    with pytest.raises(InputError, match="serves"):
        ls.set_attention_kernels(m, spatial="triton", latent=8)
    with pytest.raises(InputError, match="taken"):
        ls.register_attention_kernel("flash", sa.short_attention)
    ls.set_attention_kernels(m)
    if not torch.cuda.is_available():
        from lab.errors import BackendUnavailable

        q = torch.randn(2, 16, 32)
        with pytest.raises(BackendUnavailable, match="CUDA"):
            sa.short_attention(q, q, q, 2)
    with pytest.raises(InputError, match="64 tokens"):
        sa.short_attention(*(torch.randn(1, 65, 32),) * 3, 2)


def test_short_attention_is_one_opaque_op_in_a_traced_graph(monkeypatch):
    """Traced as a user-defined Triton kernel, the PDL form (inline-assembly griddepcontrol) makes inductor copy the
    kernel's inputs; behind a custom op the graph holds one call that inductor does not analyse."""
    pytest.importorskip("triton")
    from torch.fx.experimental.proxy_tensor import make_fx

    from lab.techniques import short_attention as sa

    monkeypatch.setattr(sa, "available", lambda device=None: (True, ""))   # tracing only: nothing is launched
    q, k, v = torch.randn(4, 16, 3 * 32).chunk(3, -1)
    gm = make_fx(lambda q, k, v: sa.short_attention(q, k, v, 2), tracing_mode="fake")(q, k, v)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.lab.short_attention.default in calls
    assert not [t for t in calls if "triton_kernel" in str(t)]
