"""Parity on the GPU host (pytest -m gpu): every check at full size on CUDA (fp32, TF32 off), and the Ditto
renderer's variants against upstream's code. With LAB_PARITY_OUT set, the runs are written there as JSON."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

from lab.parity import FAMILIES, run_checks, table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OUT = os.environ.get("LAB_PARITY_OUT")


def test_every_check_on_the_gpu():
    from lab.parity.page import run_record, to_json

    t0 = time.perf_counter()
    rows = run_checks(FAMILIES, "cuda", full=True, progress=lambda m: print(m, flush=True))
    if OUT:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        (Path(OUT) / "parity_cuda.json").write_text(to_json(run_record(rows, "cuda", True, time.perf_counter() - t0)))
    print(table(rows))
    bad = [r for r in rows if r.verdict == "DIFFERS"]
    assert not bad, "\n" + table(bad)


def test_ditto_renderer_variants_agree_with_upstream_code():
    from lab.experiments.ditto import AGREEMENT_VARIANTS, VARIANTS
    from lab.parity.ditto import renderer_agreement
    from lab.parity.page import agreement_record

    torch.backends.cudnn.benchmark = True
    sel = {v: VARIANTS[v] for v in AGREEMENT_VARIANTS}
    rows = renderer_agreement(sel, "cuda", 16, "parity") + renderer_agreement(sel, "cuda", 16, "seeded")
    if OUT:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        (Path(OUT) / "renderer_agreement.json").write_text(json.dumps(agreement_record(rows, "cuda"), indent=1, default=str))
    by = {(r["weights"], r["variant"]): r for r in rows}
    assert by[("parity", "fp32 eager")]["psnr_vs_upstream_code_db"] > 80   # the certified function, fp32 on the GPU
    for w in ("parity", "seeded"):
        for v in AGREEMENT_VARIANTS[1:]:   # every fp16 variant within reach of upstream's own fp16 runtime
            assert by[(w, v)]["psnr_vs_fp32_db"] > by[(w, "upstream")]["psnr_vs_fp32_db"] - 10, (w, v)
