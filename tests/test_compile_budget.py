"""torch.compile in the lab: a spent recompile budget is an error (never a variant run eager under a compiled
label), every compile site goes through it, and a compile runner called with inference-mode tensors does not compile
the network a second time."""
import ast
from pathlib import Path

import pytest
import torch
import torch._dynamo.config as dc

from lab.runtime import compile_budget

ROOT = Path(__file__).resolve().parents[1]


class _Scaled(torch.nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k   # an int attribute: dynamo specializes on it, so each k is one more entry of the same forward

    def forward(self, x):
        return x * self.k


@pytest.fixture
def small_budget(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(compile_budget, "LIMIT", 2)
    # torch's default once the limit is hit: the function runs eager, without a word
    with dc.patch(recompile_limit=2, fail_on_recompile_limit_hit=False):
        yield
    torch._dynamo.reset()


def test_a_variant_past_the_budget_fails_instead_of_running_eager(small_budget):
    x = torch.ones(3)
    for k in (1, 2):
        assert torch.equal(compile_budget.compiled(_Scaled(k), backend="eager")(x), x * k)
    with pytest.raises(Exception) as err:
        compile_budget.compiled(_Scaled(3), backend="eager")(x)
    assert compile_budget.spent(err.value)
    assert compile_budget.reason(err.value).startswith("dynamo's recompile budget spent (not timed eager)")


def test_the_budget_is_widened_never_narrowed():
    with dc.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        compile_budget.widen()
        assert dc.recompile_limit == compile_budget.LIMIT and dc.fail_on_recompile_limit_hit
    with dc.patch(recompile_limit=1000):
        compile_budget.widen()
        assert dc.recompile_limit == 1000


def test_spent_sees_through_wrapping_and_reason_names_other_errors_plainly():
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        try:
            raise FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")
        except FailOnRecompileLimitHit as inner:
            raise RuntimeError("while capturing") from inner
    except RuntimeError as outer:
        assert compile_budget.spent(outer)
        assert "not timed eager" in compile_budget.reason(outer) and "while capturing" in compile_budget.reason(outer)
    other = ValueError("x" * 500)
    assert not compile_budget.spent(other) and not compile_budget.spent(None)
    assert compile_budget.reason(other, 10) == "ValueError: " + "x" * 10


def test_every_compile_in_the_lab_goes_through_the_budget():
    bare = []
    for path in (ROOT / "lab").rglob("*.py"):
        if path.name == "compile_budget.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and f.attr == "compile" \
                    and isinstance(f.value, ast.Name) and f.value.id == "torch":
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, f"torch.compile outside lab.runtime.compile_budget.compiled: {bare}"


def test_a_compile_runner_takes_inference_tensors_without_compiling_again():
    from lab.runtime.backends import accelerate

    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    r = accelerate(m, "compile", (torch.randn(2, 8),), precision="fp32", compile_backend="eager")
    with dc.patch(error_on_recompile=True), torch.inference_mode():
        x = torch.randn(2, 8)
        assert x.is_inference()
        y = r(x)      # a loop that runs under inference_mode hands its runner such tensors
        ref = m(x)
    with dc.patch(error_on_recompile=True), torch.no_grad():
        assert torch.allclose(y, ref) and torch.allclose(r(x.clone()), ref)   # and plain ones, as before
    torch._dynamo.reset()


def test_notebook_06_records_a_spent_budget_as_a_failed_row(tmp_path, monkeypatch):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from lab.experiments import ditto as X

    ctx = X.setup("cpu", True, 0, str(tmp_path / "run"))
    real = X.P.stage_fn

    def stage_fn(engine, kind, batch):
        if "fold_spectral_norm" in engine.cfg.techniques:
            raise FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")
        return real(engine, kind, batch)

    monkeypatch.setattr(X.P, "stage_fn", stage_fn)
    rows = X.renderer_table(ctx, ["upstream", "fp16+fold-nchw"])
    failed = [r for r in rows if r["variant"] == "fp16+fold-nchw"]
    assert failed and all(r["status"] == "failed" and "fps" not in r for r in failed)
    assert all("recompile budget spent (not timed eager)" in r["reason"] for r in failed)
    assert any(r["variant"] == "upstream" and r["status"] == "ok" for r in rows)
