"""What ``diloco bench claims`` runs for each paper claim, and how each is judged.

A claim (C1..C9, docs/claims.md) is a set of runs (``Spec``: a contender of
benchmarks/contenders.py on a recipe, or C3's elastic scenario pair) and the tests
(``Check``) that turn their seeds' figures into a verdict by the rule of
``benchmarks.claims_verdict``. The same ``Spec`` in two claims is one run: C1's
M = 2 pair is C2's non-i.i.d. pair.

Two profiles (``PROFILES``): ``full`` (the reference model of benchmarks/recipe.py,
600 inner steps unless a claim needs a longer horizon, 3 seeds: a few hours on two
cores, docs/claims.md gives the budget) and ``quick`` (a 16-wide model, a few steps,
one seed: it checks that every claim's runs start, finish and give a verdict).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.claims_verdict import NOT_RUN, Outcome, combine, decide
from benchmarks.contenders import Contender
from benchmarks.recipe import REFERENCE_MODEL

CLAIMS = ("C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9")

#: the outer step of every contender but C8's: lr 1.0, no momentum, the best point of
#: the quality benchmark's sweep at 600 steps in every mode (docs/results.md)
OUTER = (1.0, 0.0)
NESTEROV = (0.7, 0.9)  # the DiLoCo paper's
#: One contiguous range of the corpus per data slot (``data.slot_blocks`` = 1): the split
#: every claim run read before that key existed (on Shakespeare, each DiLoCo worker of
#: M = 2 its own half of the plays).
CONTIGUOUS = "data.slot_blocks=1"
TOL = 0.01  # "matches", "costs little": within 1% of the reference's eval loss
#: C9's middle size: 4 blocks of width 192 (1.8M parameters), between the reference
#: model and tiny (small, 21M, at equal tokens per parameter is beyond two cores:
#: docs/claims.md)
MID_MODEL = "{d_model: 192, n_layers: 4, n_heads: 4, max_seq_len: 128}"


@dataclass(frozen=True)
class Profile:
    """Sizes of one profile. ``model`` is ``model.overrides`` of the tiny preset."""

    name: str
    model: str
    steps: int
    sync_every: int
    seq_len: int
    batch_size: int
    eval_batches: int
    seeds: tuple[int, ...]
    workers: tuple[int, ...]  # C1's M
    taus: tuple[int, ...]  # C5
    long_steps: int  # C7: the longest horizon that fits
    rounds_h: int  # C8: H of the 12- and 100-round runs
    rounds: tuple[int, int]  # C8
    sizes: tuple[tuple[str, str, str], ...]  # C9: (label, preset, overrides)
    size_steps: int  # C9: steps of the first size; the others at equal tokens per parameter
    elastic: tuple[str, ...] = ()  # C3: bench_elastic options


PROFILES: dict[str, Profile] = {
    "quick": Profile(
        "quick", "{d_model: 16, n_layers: 4, n_heads: 2, max_seq_len: 32}", steps=24,
        sync_every=24, seq_len=16, batch_size=2, eval_batches=2, seeds=(0,),
        workers=(2, 4), taus=(0, 1, 10), long_steps=24, rounds_h=4, rounds=(1, 2), size_steps=24,
        sizes=(("16 wide", "tiny", "{d_model: 16, n_layers: 4, n_heads: 2, max_seq_len: 32}"),
               ("32 wide", "tiny", "{d_model: 32, n_layers: 4, n_heads: 2, max_seq_len: 32}")),
        elastic=("--steps", "12", "--sync-every", "4", "--step-s", "0", "--batch-size", "2",
                 "--model", "{d_model: 16, n_layers: 2, n_heads: 2, max_seq_len: 64}")),
    "full": Profile(
        "full", REFERENCE_MODEL, steps=600, sync_every=40, seq_len=64, batch_size=16,
        eval_batches=32, seeds=(0, 1, 2), workers=(2, 4, 8), taus=(0, 1, 2, 5, 10),
        long_steps=1200, rounds_h=30, rounds=(12, 100),
        sizes=(("0.9M", "tiny", REFERENCE_MODEL), ("1.8M", "tiny", MID_MODEL),
               ("tiny 3.3M", "tiny", "{}")), size_steps=320,
        elastic=("--steps", "120", "--sync-every", "10")),
}


@dataclass(frozen=True)
class Spec:
    """One run of a claim, less its seed. ``kind`` train: ``contender`` trained for
    ``steps`` on ``data`` (``reference``: byte-level Shakespeare in the corpus's order,
    each worker's slot a run of consecutive plays; ``shuffled``: the same train
    text with its lines shuffled, so every slot is the same mix); ``model`` and
    ``preset`` replace the profile's model (C9). ``kind`` elastic: C3's pair of
    bench_elastic scenarios (fault-free, then a worker dropping at a third and one
    joining at a half)."""

    contender: Contender
    steps: int
    data: str = "reference"
    model: str | None = None
    preset: str = "tiny"
    kind: str = "train"

    @property
    def name(self) -> str:
        if self.kind == "elastic":
            return "elastic: w3 drops at 1/3, w4 joins at 1/2, against fault-free"
        extra = [f"{self.steps} steps", *self.contender.extra]
        if self.data != "reference":
            extra.append(f"{self.data} data")
        if self.model is not None:
            extra.append(f"model {self.preset} {self.model}")
        return f"{self.contender.name}, {', '.join(extra)}"

    def overrides(self, profile: Profile, seed: int) -> list[str]:
        """The recipe (benchmarks/recipe.py's reference, at the profile's sizes) and
        the seed: model init and data order (``train.seed``). ``data.slots`` = M: each
        DiLoCo worker reads half the corpus at M = 2, as a data-parallel rank does;
        `CONTIGUOUS`: one range per slot, as every claim run before ``data.slot_blocks``
        existed read, so that all claims are measured on the same split."""
        model = self.model if self.model is not None else profile.model
        return [f"model.preset={self.preset}", f"model.overrides={model}",
                f"data.seq_len={profile.seq_len}", f"data.batch_size={profile.batch_size}",
                "optim.lr=3e-3", "optim.warmup_steps=30", f"train.steps={self.steps}",
                "train.eval_every=0", f"train.eval_batches={profile.eval_batches}",
                "train.checkpoint_every=0", "train.log_every=10", "train.threads=1",
                f"train.seed={seed}", "sync.membership.quorum=1.0",
                f"data.slots={self.contender.workers}", CONTIGUOUS]

    def key(self, profile: Profile, seed: int) -> str:
        """What makes two runs the same: the whole config they train with."""
        said = [o for o in self.overrides(profile, seed) if o != CONTIGUOUS]  # what the
        # runs before the key existed trained with, and their keys in claims.jsonl say
        what = [self.kind, self.data, self.contender.overrides(), said,
                list(profile.elastic) if self.kind == "elastic" else []]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


# -- the figures a check reads ----------------------------------------------------------

Lookup = Callable[["Spec"], list[dict[str, Any]]]  # a spec's rows, one per seed, by seed


@dataclass(frozen=True)
class Series:
    """Per-seed figures: ``field`` of a spec's rows (``eval_loss`` by default), or
    with ``over``, the relative gap ``a / over - 1`` paired by seed; with ``ratio``,
    ``field`` of ``over`` divided by ``field`` of ``spec`` (peak bandwidth cut)."""

    spec: Spec
    over: Spec | None = None
    field: str = "eval_loss"
    ratio: bool = False

    def values(self, lookup: Lookup) -> list[float]:
        rows = lookup(self.spec)
        if self.over is None:
            return [r[self.field] for r in rows]
        other = {r["seed"]: r[self.field] for r in lookup(self.over)}
        if self.ratio:
            return [other[r["seed"]] / r[self.field] for r in rows if r["seed"] in other]
        return [r[self.field] / other[r["seed"]] - 1 for r in rows if r["seed"] in other]


@dataclass(frozen=True)
class Check:
    """One test of a claim: ``a`` against ``b`` (or 0) by ``kind``. ``tol`` is
    relative: for losses it is multiplied by mean(b); gaps and ratios are already
    in its unit."""

    label: str
    kind: str
    a: Series
    b: Series | None = None
    tol: float = 0.0

    def evaluate(self, lookup: Lookup) -> dict[str, Any]:
        a = self.a.values(lookup)
        b = self.b.values(lookup) if self.b is not None else None
        tol = self.tol
        if self.kind == "within" and b and self.a.over is None and self.a.field == "eval_loss":
            tol = self.tol * statistics.fmean(b)
        out: Outcome = decide(self.kind, a, b, tol)
        return {"label": self.label, "kind": self.kind, "n": len(a), "tol": tol,
                **out.to_dict()}


@dataclass(frozen=True)
class Claim:
    """A paper's claim: its sentence, source, the paper's figure, and its tests."""

    id: str
    sentence: str
    source: str
    paper: str
    specs: tuple[Spec, ...]
    checks: tuple[Check, ...]
    note: str = ""
    shows: tuple[tuple[str, Series], ...] = field(default_factory=tuple)

    def judge(self, lookup: Lookup) -> dict[str, Any]:
        """Every check's outcome and the claim's verdict; any check with a spec
        missing a row is not yet run."""
        checks = []
        for c in self.checks:
            try:
                checks.append(c.evaluate(lookup))
            except (KeyError, ZeroDivisionError):
                checks.append({"label": c.label, "kind": c.kind, "verdict": NOT_RUN})
        return {"claim": self.id, "verdict": combine([c["verdict"] for c in checks]),
                "checks": checks}


# -- the claims -------------------------------------------------------------------------


def _c(mode: str, codec: str = "fp32", m: int = 2, h: int = 40, *, p: int | None = None,
       outer: tuple[float, float] = OUTER, extra: Sequence[str] = ()) -> Contender:
    return Contender(mode, codec, m, h, fragments=p, outer_lr=outer[0],
                     outer_momentum=outer[1], extra=tuple(extra))


def _dp(m: int = 2) -> Contender:
    return Contender("data-parallel", workers=m)


def claims(profile: Profile) -> dict[str, Claim]:
    """Every claim's runs and tests at ``profile``'s sizes."""
    pr, steps, h = profile, profile.steps, profile.sync_every

    def run(c: Contender, n: int = steps, **kw: Any) -> Spec:
        return Spec(c, n, **kw)

    def loss(s: Spec) -> Series:
        return Series(s)

    out: list[Claim] = []

    # C1: DiLoCo at M = 2, 4, 8 against data-parallel at the same M and tokens
    c1 = [(m, run(_dp(m)), run(_c("diloco", m=m, h=h))) for m in pr.workers]
    out.append(Claim(
        "C1", "DiLoCo with 8 workers matches fully synchronous training while "
        "communicating about 500x less", "DiLoCo, arXiv 2311.08105",
        "8 workers, H = 500: 500x fewer exchanges than data-parallel, perplexity as low as "
        "the synchronous baseline's",
        tuple(s for _, a, b in c1 for s in (a, b)),
        tuple(x for m, a, b in c1 for x in (
            Check(f"M = {m}: DiLoCo (H = {h}) within {TOL:.0%} of data-parallel", "within",
                  loss(b), loss(a), TOL),
            Check(f"M = {m}: times less upload per worker-step than data-parallel", "report",
                  Series(b, field="up_less_than_dp"))))))

    # C2: i.i.d. against non-i.i.d. slots: DiLoCo's gap to data-parallel on each
    non = (run(_dp()), run(_c("diloco", h=h)))
    iid = (run(_dp(), data="shuffled"), run(_c("diloco", h=h), data="shuffled"))
    out.append(Claim(
        "C2", "DiLoCo is robust to how data is spread over workers: non-i.i.d. shards "
        "cost little", "DiLoCo, arXiv 2311.08105",
        "non-i.i.d. shards converge a little slower early and reach about the same "
        "final perplexity as i.i.d. ones",
        (*non, *iid),
        (Check(f"DiLoCo's gap to data-parallel with non-i.i.d. slots within {TOL:.0%} "
               "(absolute) of its gap with i.i.d. slots", "within",
               Series(non[1], non[0]), Series(iid[1], iid[0]), TOL),),
        note="Non-i.i.d.: each worker's slot is a run of consecutive plays (the "
        "corpus's order); i.i.d.: the same train lines shuffled. Both are scored on "
        "the same validation batches (the corpus's order)."))

    # C3: a worker dropping at a third and one joining at a half
    el = Spec(_c("streaming", "int4", m=4, h=10), 0, kind="elastic")
    out.append(Claim(
        "C3", "DiLoCo is robust to workers becoming unavailable, and uses workers that "
        "join", "DiLoCo, arXiv 2311.08105",
        "compute that comes and goes costs little against a constant fleet at equal "
        "compute", (el,),
        (Check(f"eval loss within {TOL:.0%} of fault-free at equal applied tokens",
               "within", Series(el, field="eval_gap"), None, TOL),),
        note="bench_elastic's recipe (4 workers, 2 x 32 model, streaming P = 2, int4 up "
        "/ int8 down, H = 10); the fault-free run's canonical checkpoints interpolated "
        "at the faulty run's applied tokens."))

    # C4: P = 1, 2, 4 at the same H
    # P = 2 is the streaming mode's own (no override), so that the run is C5's tau 1
    # and C6's float32 too
    c4 = {p: run(_c("streaming", h=h, p=None if p == 2 else p)) for p in (1, 2, 4)}
    out.append(Claim(
        "C4", "Streaming fragments cut peak bandwidth by about P without hurting quality",
        "Streaming DiLoCo, arXiv 2501.18512",
        "peak bandwidth divided by the number of fragments at equal loss",
        tuple(c4.values()),
        tuple(x for p in (2, 4) for x in (
            Check(f"P = {p} within {TOL:.0%} of P = 1", "within", loss(c4[p]), loss(c4[1]),
                  TOL),
            Check(f"peak upload per sync cut >= 0.75 x {p}", "at_least",
                  Series(c4[p], c4[1], "peak_up", ratio=True), None, 0.75 * p))),
        note="streaming, float32, tau = 1, alpha = 0.5; fragment 0 also holds the "
        "embedding and the final norm, so its payload is larger than 1/P."))

    # C5: tau = 0, 1, 2, 5, 10
    c5 = {t: run(_c("streaming", h=h, extra=[f"sync.schedule.overlap={t}"] if t != 1 else []))
          for t in pr.taus}
    t0 = c5[pr.taus[0]]
    out.append(Claim(
        "C5", "Overlapping communication for up to about 5 inner steps costs no "
        "significant quality", "Streaming DiLoCo, arXiv 2501.18512",
        "tau up to 5 inner steps: no significant loss increase; more costs quality",
        tuple(c5.values()),
        tuple(Check(f"tau = {t} within {TOL:.0%} of tau = 0", "within", loss(s), loss(t0),
                    TOL) if t <= 5 else
              Check(f"tau = {t} against tau = 0 (beyond the claim)", "report",
                    Series(s, t0)) for t, s in c5.items() if t != pr.taus[0]),
        note="streaming P = 2, float32, alpha = 0.5 at every tau."))

    # C6: fp32, int8, int4, fp4 up, with and without error feedback
    def up(codec: str, feedback: bool | None = None) -> Spec:
        ex = [f"sync.codec.up={codec}", "sync.codec.down=none"]
        if feedback is not None:
            ex.append(f"sync.codec.feedback_up={str(feedback).lower()}")
        return run(_c("streaming", h=h, extra=ex))

    fp32 = run(_c("streaming", h=h))
    c6 = {"int8": up("int8"), "int4": up("int4"), "int4 without error feedback":
          up("int4", False), "fp4-e3m0": up("fp4-e3m0"),
          "fp4-e3m0 without error feedback": up("fp4-e3m0", False)}
    out.append(Claim(
        "C6", "4-bit outer gradients barely change quality", "Streaming DiLoCo, arXiv "
        "2501.18512", "1B, Dolma, H = 100, fp4 outer gradients, tau = 1: 2.66 against "
        "data-parallel's 2.67 (441 TB exchanged against 1.10 TB)",
        (fp32, *c6.values()),
        tuple(Check(f"{name} within {TOL:.0%} of float32", "within", loss(s), loss(fp32),
                    TOL) if "without" not in name else
              Check(f"{name} against float32", "report", Series(s, fp32))
              for name, s in c6.items()),
        note="streaming P = 2, tau = 1; up codec varied, the mean comes down in "
        "float32; error feedback at the product's default (on for 4-bit) unless said."))

    # C7: blocking, naive delayed (at the outer lr and at a quarter of it), the
    # paper's eager rule and ours, at the longest horizon that fits
    n7 = pr.long_steps
    blocking = run(_c("diloco", h=h), n7)
    naive = run(_c("naive-eager", h=h), n7)
    naive_quarter = run(_c("naive-eager", h=h, outer=(OUTER[0] / 4, OUTER[1])), n7)
    pure = run(_c("pure-eager", h=h), n7)
    adaptive = run(_c("eager", h=h), n7)
    out.append(Claim(
        "C7", "Naive delayed outer updates hurt; lowering the outer learning rate 4x "
        "recovers only a little; eager updates come close to standard DiLoCo",
        "Eager updates, arXiv 2502.12996",
        "500M, C4: data-parallel 2.67, eager 2.69, naive delayed 3.01",
        (blocking, naive, naive_quarter, pure, adaptive),
        (Check("naive delayed is worse than blocking DiLoCo", "worse",
               loss(naive), loss(blocking)),
         Check("naive delayed at outer lr / 4 is still worse than blocking", "worse",
               loss(naive_quarter), loss(blocking)),
         Check("naive delayed: outer lr / 4 against outer lr", "report",
               Series(naive_quarter, naive)),
         Check(f"eager (the paper's rule) within {TOL:.0%} of blocking DiLoCo", "within",
               loss(pure), loss(blocking), TOL),
         Check("adaptive eager (tau 1) against blocking", "report", Series(adaptive, blocking))),
        note="P = 2 for the eager rules (sync.schedule.eager_rule naive, pure, adaptive), "
        "P = 1 for blocking; naive delayed applies only the previous round's mean and "
        "restarts each round from it; M = 2, float32."))

    # C8: outer Nesterov against plain averaging at 12 and 100 rounds
    hh = pr.rounds_h
    c8 = [(r, run(_c("diloco", h=hh, outer=NESTEROV), r * hh), run(_c("diloco", h=hh), r * hh))
          for r in pr.rounds]
    out.append(Claim(
        "C8", "Outer Nesterov momentum beats plain averaging (outer SGD lr 1, no "
        "momentum) at enough rounds", "DiLoCo, arXiv 2311.08105",
        "outer Nesterov (lr 0.7, momentum 0.9) gave the lowest perplexity of the outer "
        "optimizers tried; plain averaging was worse",
        tuple(s for _, a, b in c8 for s in (a, b)),
        (Check(f"{c8[0][0]} rounds: Nesterov against averaging", "report",
               Series(c8[0][1], c8[0][2])),
         Check(f"{c8[-1][0]} rounds: Nesterov (0.7, 0.9) beats averaging (1.0, 0)", "better",
               loss(c8[-1][1]), loss(c8[-1][2]))),
        note=f"blocking DiLoCo, float32, M = 2, H = {hh}."))

    # C9: data-parallel against streaming int4 at three sizes, equal tokens per parameter
    c9 = []
    params = [parameters(preset, model) for _, preset, model in pr.sizes]
    for (label, preset, model), n_params in zip(pr.sizes, params, strict=True):
        n = max(h, round(pr.size_steps * n_params / params[0] / h) * h)
        c9.append((label, run(_dp(), n, model=model, preset=preset),
                   run(_c("streaming", "int4", h=h), n, model=model, preset=preset)))
    gaps = [Series(s, d) for _, d, s in c9]
    out.append(Claim(
        "C9", "The gap to data-parallel shrinks as the model grows",
        "DiLoCo scaling studies (arXiv 2503.09799)",
        "the loss gap of DiLoCo to data-parallel falls with model size (35M to 2.4B)",
        tuple(s for _, a, b in c9 for s in (a, b)),
        (Check(f"gap at {c9[-1][0]} smaller than at {c9[0][0]}", "better", gaps[-1],
               gaps[0]),),
        note="streaming int4 (P = 2, tau = 1) against data-parallel, M = 2; steps scaled "
        "with the parameters (about equal tokens per parameter).",
        shows=tuple((f"gap at {label}", g) for (label, _, _), g in zip(c9, gaps, strict=True))))

    return {c.id: c for c in out}


def parameters(preset: str, model: str) -> int:
    """The parameter count of a model of the tiny recipe (its config only)."""
    from workers.config import load_config  # noqa: PLC0415

    cfg = load_config("tiny", [f"model.preset={preset}", f"model.overrides={model}",
                              "data.seq_len=16"])
    return cfg.model_config_resolved.num_parameters()


def unique_specs(chosen: Sequence[Claim], profile: Profile) -> list[Spec]:
    """The runs of ``chosen``, each once (two specs with the same config are one
    run), in the claims' order."""
    seen: dict[str, Spec] = {}
    for c in chosen:
        for s in c.specs:
            seen.setdefault(s.key(profile, 0), s)
    return list(seen.values())
