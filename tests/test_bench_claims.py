"""`diloco bench claims`: the verdict rule on hand-made numbers, every claim's runs as
valid configs, the plan through a stand-in runner (rows appended, resumed, a
verdict per claim), the i.i.d. dataset of C2, the command's errors, and one claim
of the quick profile run for real."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_claims, claims_elastic  # noqa: E402
from benchmarks.claims_data import _cut, shuffled_lines  # noqa: E402
from benchmarks.claims_plan import CLAIMS, PROFILES, claims, unique_specs  # noqa: E402
from benchmarks.claims_verdict import (  # noqa: E402
    FAILS,
    HOLDS,
    NOT_RUN,
    UNCLEAR,
    combine,
    decide,
    interval,
    t95,
)
from benchmarks.contenders import load  # noqa: E402

# -- the rule -----------------------------------------------------------------------------


def test_interval_is_the_pooled_two_sample_t_interval():
    """a = (2.0, 2.1, 2.2), b = (1.9, 2.0, 2.1): d = 0.1; both variances 0.01, so the
    pooled sd is 0.1 and se = 0.1 * sqrt(1/3 + 1/3) = 0.08165; t(4 df) = 2.776:
    half-width 0.22666."""
    d, lo, hi = interval([2.0, 2.1, 2.2], [1.9, 2.0, 2.1])
    assert d == pytest.approx(0.1)
    assert lo == pytest.approx(0.1 - 0.22666, abs=1e-4)
    assert hi == pytest.approx(0.1 + 0.22666, abs=1e-4)
    # one sample against 0: sd 0.01, se 0.01 / sqrt(3) = 0.005774, t(2 df) = 4.303
    d, lo, hi = interval([0.01, 0.02, 0.03])
    assert d == pytest.approx(0.02) and hi - d == pytest.approx(4.303 * 0.005774, rel=1e-3)
    assert t95(4) == 2.776 and t95(11) == 2.228 and t95(100) == 1.96
    assert interval([2.0], [1.9, 2.0]) == (pytest.approx(0.05), None, None)


def test_every_verdict_of_within():
    """tol 0.02 nats. Seeds spread by 0.001 (pooled sd 0.001, half-width 0.0023):
    d = 0.005 is inside the margin (holds), d = 0.05 is beyond it (does not hold);
    a spread of 0.03 makes d = 0.01 unclear (half-width 0.068)."""
    b = [2.000, 2.001, 2.002]
    assert decide("within", [2.005, 2.006, 2.007], b, 0.02).verdict == HOLDS
    assert decide("within", [2.050, 2.051, 2.052], b, 0.02).verdict == FAILS
    assert decide("within", [1.98, 2.01, 2.04], [1.97, 2.00, 2.03], 0.02).verdict == UNCLEAR
    # better is no failure of "within": 0.05 below the reference
    assert decide("within", [1.950, 1.951, 1.952], b, 0.02).verdict == HOLDS


def test_every_verdict_of_better_and_worse():
    lower, same, higher = [1.90, 1.91, 1.92], [1.99, 2.00, 2.01], [2.10, 2.11, 2.12]
    assert decide("better", lower, same).verdict == HOLDS
    assert decide("better", higher, same).verdict == FAILS
    assert decide("better", [1.98, 2.00, 2.03], same).verdict == UNCLEAR
    assert decide("worse", higher, same).verdict == HOLDS
    assert decide("worse", lower, same).verdict == FAILS
    assert decide("worse", [1.98, 2.00, 2.03], same).verdict == UNCLEAR


def test_one_seed_ratios_and_missing_runs():
    """One seed has no spread: not distinguishable however large d is. at_least needs
    no seeds (a byte count). No values: not yet run."""
    assert decide("within", [3.0], [2.0], 0.02).verdict == UNCLEAR
    assert decide("at_least", [1.97], None, 1.5).verdict == HOLDS
    assert decide("at_least", [1.2], None, 1.5).verdict == FAILS
    assert decide("within", [], [2.0], 0.02).verdict == NOT_RUN
    assert decide("report", [0.1, 0.2]).verdict == ""
    with pytest.raises(ValueError, match="allowed within"):
        decide("maybe", [1.0], [1.0])


def test_a_claims_verdict_combines_its_tests():
    assert combine([HOLDS, HOLDS, ""]) == HOLDS
    assert combine([HOLDS, UNCLEAR]) == UNCLEAR
    assert combine([HOLDS, FAILS, UNCLEAR]) == FAILS
    assert combine([HOLDS, NOT_RUN]) == NOT_RUN
    assert combine([FAILS, NOT_RUN]) == FAILS
    assert combine([""]) == NOT_RUN


# -- the plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_claims_runs_are_valid_configs(profile):
    """Every run of every claim loads as a RunConfig (mode, codec, tau, P, H, model
    and seed as the claim says), and the keys tell the runs and seeds apart."""
    pr = PROFILES[profile]
    plan = claims(pr)
    assert tuple(plan) == CLAIMS
    specs = unique_specs(list(plan.values()), pr)
    keys = {s.key(pr, seed) for s in specs for seed in (0, 1)}
    assert len(keys) == 2 * len(specs)
    for s in specs:
        if s.kind == "elastic":
            continue
        cfg = load(s.contender, [*s.overrides(pr, 7), "data.dataset=file:///tmp/x"])
        assert cfg.train.seed == 7 and cfg.train.steps == s.steps
        assert cfg.data.slot_count(len(cfg.workers)) == s.contender.workers
    c5 = plan["C5"]
    taus = [load(s.contender, s.overrides(pr, 0)).sync.schedule.overlap for s in c5.specs]
    assert taus == list(pr.taus)
    c4 = plan["C4"]
    assert [load(s.contender, s.overrides(pr, 0)).sync.schedule.fragments
            for s in c4.specs] == [1, 2, 4]
    assert c4.specs[1] in plan["C5"].specs and c4.specs[1] in plan["C6"].specs  # shared
    c1 = plan["C1"].specs[:2]
    assert c1[0] in plan["C2"].specs and c1[1] in plan["C2"].specs


def test_the_elastic_pair_runs_at_the_seed(monkeypatch):
    """C3's runs are bench_elastic's scenarios at the claim's seed: the recipe they
    create their run with says it, and bench_elastic's own runs stay at seed 0."""
    from benchmarks import bench_elastic  # noqa: PLC0415

    args = claims_elastic.options(list(PROFILES["full"].elastic))
    assert "train.seed=0" in bench_elastic.overrides(args, "file:///tmp/data")
    seen = {}
    monkeypatch.setattr(bench_elastic, "run_scenario", lambda name, a, data, wd: seen.update(
        name=name, over=bench_elastic.overrides(a, data)))
    claims_elastic.scenario("drop-join", args, "file:///tmp/data", None, 2)
    assert seen["name"] == "drop-join"
    assert "train.seed=2" in seen["over"] and "train.seed=0" not in seen["over"]
    assert args.seed == 0  # the options it was given are not changed


def fake_runner(spec, profile, seed, data, wd, mlflow):
    """Eval losses that differ by contender and seed, as a real runner's would."""
    loss = 2.0 + (int(spec.key(profile, 0), 16) % 1000) / 1e4 + seed * 0.003
    row = {"key": spec.key(profile, seed), "profile": profile.name, "spec": spec.name,
           "seed": seed, "eval_loss": loss, "wall_s": 0.0, "cpu_s": 1.0}
    if spec.kind == "elastic":
        row["eval_gap"] = 0.001 * (seed + 1)
    else:
        row["peak_up"] = 1000 / (spec.contender.fragments or 2)
    return row


def test_the_quick_plan_appends_resumes_and_gives_every_claim_a_verdict(tmp_path):
    """Every claim of the quick profile through a stand-in runner at two seeds: one
    JSONL row per (run, seed) as it ends, nothing run again on --resume, a verdict
    per claim from the rows, and the report's tables."""
    pr = PROFILES["quick"]
    chosen = list(claims(pr).values())
    results = tmp_path / "claims.jsonl"
    calls = []

    def runner(*a):
        calls.append(a[0])
        return fake_runner(*a)

    rows = bench_claims.execute(chosen, pr, [0, 1], results, resume=True, data={},
                                runner=runner)
    n = len(unique_specs(chosen, pr)) * 2
    assert len(rows) == len(calls) == n == len(results.read_text().splitlines())
    again = bench_claims.execute(chosen, pr, [0, 1], results, resume=True, data={},
                                 runner=runner)
    assert again == [] and len(calls) == n
    rep = bench_claims.report(chosen, pr, [0, 1], bench_claims.read_rows(results))
    verdicts = {c["claim"]: c["verdict"] for c in rep["claims"]}
    assert set(verdicts) == set(CLAIMS)
    assert all(v in (HOLDS, FAILS, UNCLEAR) for v in verdicts.values()), verdicts
    c4 = next(c for c in rep["claims"] if c["claim"] == "C4")
    ratios = [k for k in c4["checks"] if k["kind"] == "at_least"]
    assert [k["d"] for k in ratios] == [2.0, 4.0]  # peak 1000 / P against P = 1's 1000
    md = bench_claims.markdown(rep)
    assert "## C9:" in md and "+-" in md and "Verdict: **" in md
    # a seed that has not run: its claims are not yet run
    rep = bench_claims.report(chosen, pr, [0, 5], bench_claims.read_rows(results))
    assert all(c["verdict"] in (NOT_RUN, FAILS, UNCLEAR, HOLDS) for c in rep["claims"])


def test_a_torn_line_is_skipped(tmp_path):
    results = tmp_path / "claims.jsonl"
    bench_claims.append_row(results, {"key": "a", "seed": 0, "eval_loss": 2.0})
    with results.open("a") as f:
        f.write('{"key": "b", "se')
    assert [r["key"] for r in bench_claims.read_rows(results)] == ["a"]


def test_the_iid_data_is_the_same_lines_shuffled():
    text = b"one\ntwo\nthree\nfour\nfive"
    got = shuffled_lines(text, seed=3)
    assert sorted(got.splitlines()) == sorted(text.splitlines()) and got != text + b"\n"
    assert len(got) == len(text) + 1  # the last line gets its newline
    # a cut never splits a character, and keeps prepare's rounding of the val part:
    # 10 val tokens at 1% need 950 <= train + 10 < 1050
    data = ("\u00e9" * 600).encode()  # 2 bytes a character
    end = _cut(data, 0, 995, 10, 0.01)
    assert end % 2 == 0 and int((end + 10) * 0.01 + 0.5) == 10


# -- the command ------------------------------------------------------------------------------


def test_bad_options_are_one_line_errors(capsys):
    for argv, words in ((["--claims", "C4,C10"], ["--claims", "C10", "C1, C2"]),
                        (["--profile", "fast"], ["--profile", "quick", "full"]),
                        (["--seeds", "0,x"], ["--seeds", "integers"]),
                        (["--seeds", "1,1"], ["--seeds", "distinct"])):
        assert bench_claims.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_diloco_bench_claims_is_wired(tmp_path):
    """The command refuses a bad claim or profile itself (exit 2, the allowed values),
    keeps its lists equal to the benchmark's, and `--plan` runs the module."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from cli import bench  # noqa: PLC0415
    from cli.app import app  # noqa: PLC0415

    assert bench.CLAIMS == CLAIMS and tuple(PROFILES) == bench.CLAIM_PROFILES
    runner = CliRunner()
    out = runner.invoke(app, ["bench", "claims", "--claims", "C4,C10"])
    assert out.exit_code == 2 and "unknown C10" in out.output and "C9" in out.output
    out = runner.invoke(app, ["bench", "claims", "--profile", "huge"])
    assert out.exit_code == 2 and "quick, full" in out.output
    out = runner.invoke(app, ["bench", "--claims", "C4"])
    assert out.exit_code == 2 and "diloco bench claims" in out.output
    argv = bench.claims_argv("c4,C5", None, "0,1", True, False, False, tmp_path)
    assert argv == ["--claims", "C4,C5", "--seeds", "0,1", "--resume", "--no-mlflow",
                    "--results-dir", str(tmp_path)]
    assert bench_claims.options(argv)[1][0].id == "C4"


def test_quick_profile_runs_a_claim_for_real(tmp_path):
    """C4 of the quick profile end to end (three streaming contenders of a 16-wide
    model, 24 steps, one seed): a row per run with an eval loss and the peak payload,
    the verdict computed and the report written. The other claims' runs are the same
    contenders with other options (checked as configs above); `diloco bench claims
    --profile quick` runs them all."""
    results = tmp_path / "claims.jsonl"
    code = bench_claims.main(["--profile", "quick", "--claims", "C4", "--results",
                              str(results), "--results-dir", str(tmp_path), "--no-mlflow"])
    assert code == 0
    rows = bench_claims.read_rows(results)
    assert len(rows) == 3 and all(math.isfinite(r["eval_loss"]) for r in rows)
    assert rows[0]["peak_up"] > 1.9 * rows[1]["peak_up"] > 0
    rep = json.loads((tmp_path / "claims-quick.json").read_text())
    assert rep["claims"][0]["verdict"] == UNCLEAR  # one seed: no spread
    assert "| C4 |" in (tmp_path / "claims-quick.md").read_text()
