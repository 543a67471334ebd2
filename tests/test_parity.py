"""Every network and per-frame transform against the fixture made by upstream's code (see lab.parity)."""
import json
import math

import pytest
import torch

from lab.parity import FAMILIES, load_checks, read_fixture, run_check, table
from lab.parity.core import agreement, fill_tensor, fingerprint, sample_index, seeded

CHECKS = load_checks(FAMILIES)
FAST = [k for k, c in CHECKS.items() if not c.slow]


@pytest.mark.parametrize("key", FAST, ids=["/".join(k) for k in FAST])
def test_matches_upstream(key):
    c = CHECKS[key]
    fx = read_fixture(*key)
    if "unavailable" in fx:
        pytest.skip(f"upstream's {key[1]} cannot run here: {fx['unavailable']}")
    torch.manual_seed(0)
    rows = run_check(c)
    assert rows, f"{key}: the fixture has no outputs"
    bad = [r for r in rows if r.verdict != "equal"]
    assert not bad, "\n" + table(bad)


def test_every_fixture_has_a_check_and_an_upstream_commit():
    from lab.parity.core import FIXTURES

    files = sorted(FIXTURES.glob("*/*.json"))
    assert files
    for f in files:
        key = (f.parent.name, f.stem)
        assert key in CHECKS, f"{f.name}: fixture without a registered check"
        fx = read_fixture(*key)
        assert len(fx["upstream"]["commit"]) == 40, f"{f}: upstream commit not recorded"
    for key in CHECKS:
        assert (FIXTURES / key[0] / f"{key[1]}.json").is_file(), f"{key}: check without a fixture"


def test_procedure_depends_only_on_key_and_shape():
    a = fill_tensor("decoder.G_middle_0.conv_0.weight_orig", (8, 4, 3, 3))
    assert torch.equal(a, fill_tensor("decoder.G_middle_0.conv_0.weight_orig", (8, 4, 3, 3)))
    assert not torch.equal(a, fill_tensor("decoder.G_middle_0.conv_1.weight_orig", (8, 4, 3, 3)))
    assert abs(float(a.std()) * math.sqrt(36) - 1) < 0.2           # 1/sqrt(fan_in)
    var = fill_tensor("x.norm.running_var", (64,))
    assert float(var.min()) >= 0.5 and float(var.max()) <= 1.5
    u = fill_tensor("conv.weight_u", (32,))
    assert abs(float(u.norm()) - 1) < 1e-6
    assert float(fill_tensor("x.norm.weight", (64,)).mean()) == pytest.approx(1, abs=0.05)
    assert torch.equal(seeded("kp", (2, 21, 3)), seeded("kp", (2, 21, 3)))


def test_agreement_sees_a_small_change_and_a_bad_shape():
    x = seeded("t", (4, 64, 32, 32))
    fp = fingerprint(x)
    assert len(fp["values"]) == 2048 and sample_index(x.numel()).max() < x.numel()
    assert agreement(x, fp).ok(1e-6)
    assert not agreement(x * 1.01, fp).ok(1e-3)                      # a 1 % gain
    assert not agreement(torch.where(x > 0, x, 0.01 * x), fp).ok(1e-3)   # an activation
    assert not agreement(x.reshape(4, 32, 64, 32), fp).ok(1)
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not agreement(nan, fp).ok(1)


def test_a_wrong_activation_is_caught(monkeypatch):
    # the bug the fixtures were made for: the warp block's LeakyReLU at the SPADE slope instead of upstream's
    from lab.models import ditto as D

    def wrong(self, x):
        return torch.nn.functional.leaky_relu(self.norm(self.conv(x)), 0.2 if self.lrelu else 0.0)

    monkeypatch.setattr(D.SameBlock2d, "forward", wrong)
    rows = {r.output: r for r in run_check(CHECKS[("ditto", "warp_network")])}
    assert rows["deformation"].verdict == "equal"          # the dense motion does not use the block
    assert rows["out"].verdict == "DIFFERS" and rows["out"].rel > 1e-2


def test_cli_builds_the_page_from_runs_and_refuses_a_bad_run(tmp_path, capsys):
    from lab.cli import main
    from lab.parity import Row
    from lab.parity.page import read_record, to_json

    rows = [Row("ditto", "stitch_network", "kp_driving", "4 pairs", [4, 21, 3], 1e-7, 2e-7, 150.0, 1.0, "equal",
                "e" * 40, 0.1), Row("ditto", "putback", "-", "blend", [], upstream_commit="e" * 40, note="no cv2")]
    run = tmp_path / "cpu.json"
    run.write_text(to_json({"machine": "test box", "device": "cpu", "full": False, "commit": "abc", "torch": "2",
                            "seconds": 1.0, "rows": rows}))
    assert read_record(run)["rows"][0] == rows[0]
    agree = tmp_path / "agreement.json"
    agree.write_text(json.dumps({"machine": "gpu box", "device": "cuda", "commit": "def", "torch": "2", "agreement": [
        {"variant": "upstream", "weights": "parity", "status": "ok", "psnr_vs_upstream_code_db": 50.3,
         "psnr_vs_fp32_db": 51.9, "psnr_vs_upstream_runtime_db": float("inf")}]}))
    page = tmp_path / "parity.md"
    assert main(["parity", "--page", str(page), "--from", str(run), str(agree)]) == 0
    text = page.read_text()
    assert "**1** · test box (cpu)" in text and "1 outputs equal, 0 differ, 1 not run" in text and "no cv2" in text
    assert "| ditto | putback | - | blend — no cv2 | skipped: no cv2 |" in text
    assert "gpu box (cuda), commit `def`" in text and "| parity | `upstream` | 50.3 | 51.9 | inf |" in text
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["parity", "--page", str(page), "--from", str(bad)]) == 2
    assert "not a parity run" in capsys.readouterr().err
    assert main(["parity", "--from", str(run)]) == 2          # --from without --page
    assert main(["parity", "--families", "nope"]) == 2
