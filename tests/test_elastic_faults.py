"""Elastic membership under faults, with real processes (``python -m workers``).

- a joiner or a leaver SIGKILLed at every publish boundary of join and leave, then
  started again plain (a joined member restarts without ``--join``);
- two joiners racing for one name, and a lease that lapses while its holder is only
  slow (SIGSTOP, then SIGCONT): one run for both, the race at its start, the lapse in
  its middle (fixture ``race_and_lapse``; each test checks its part);
- the aggregator SIGKILLed and started again while a join is half done.

Each ends with the run finished, the joiner admitted once, and `diloco.audit.audit`
clean: no lost, no double, nothing pending. Boundaries are hit deterministically by
tests/fault_job.py's key kills (``before-put`` / ``after-put`` / ``after-get`` of a
store key), never by timing. The local directory store for every case, and S3 (the
moto server) for one join-and-leave kill case, the race, the lapsed lease and both
aggregator restarts, where create-only writes are conditional PUTs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from faults import Jobs, env_for, fired, forkable, job_argv, zygote

from diloco.audit import audit
from diloco.membership import read_json, request_leave
from diloco.run import open_run
from storage import layout
from storage.objectstore import ObjectStore
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run

FAULT_JOB = str(Path(__file__).resolve().parent / "fault_job.py")
JOINER = "region-c"
TRIAL_TIMEOUT = 180.0  # a hang guard only: an S3 trial on a loaded machine takes up to ~120 s

# tests/test_elastic.py's micro model: 64 steps (~8 s quiet, ~100 s on a loaded machine
# on S3: a killed job, or a joiner that enters at step ~10, is back in time), H = 4,
# 2 fragments (16 rounds each);
# a lease of 3 s renewed every 0.75 s; a short grace window.
MICRO = [
    "model.overrides={d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=16", "data.batch_size=4", "optim.warmup_steps=2", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "train.threads=1",
    "train.steps=64", "train.checkpoint_every=4", "sync.schedule.sync_every=4",
    "sync.schedule.fragments=2", "sync.schedule.overlap=1", "sync.liveness.poll_max_s=0.05",
    "sync.membership.grace_min_s=0.05", "sync.membership.grace_max_s=2",
    "sync.liveness.lease_s=3",
]
#: for trials that kill no worker: a worker's periodic checkpoint (every 4 steps, ~170
#: objects each) is most of a run's requests on S3, and only a killed worker reads one
NO_CHECKPOINTS = "train.checkpoint_every=0"


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare"], url, max_bytes=120_000)
    return url


class Where:
    """A run's URL, the storage options of this process, and the jobs' env."""

    def __init__(self, url: str, options: dict | None, env: dict[str, str]):
        self.url, self.options, self.env = url, options, env

    def store(self) -> ObjectStore:
        return ObjectStore(self.url, storage_options=self.options)


def where_for(request, kind: str, tmp_path: Path) -> Where:
    """A fresh run's place: on the local directory store under ``tmp_path``, or on S3
    on the first local server (moto)."""
    if kind == "file":
        return Where(str(tmp_path / "run"), None, env_for())
    _endpoint, options = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    env = request.getfixturevalue("s3_env")
    return Where(f"s3://{bucket}/elastic-{uuid.uuid4().hex[:10]}", options, env_for(**env))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def where(request, tmp_path) -> Where:
    """The local directory store, and S3 on the first local server (moto)."""
    return where_for(request, request.param, tmp_path)


#: on S3 each poll is a request (a listing or a GET) the S3 server and the job's client
#: both pay for, and 0.05 s between them was most of an S3 trial's CPU; a lease of 2-3 s
#: and a grace window of up to 2 s are still many polls long
S3_POLL = "sync.liveness.poll_max_s=0.25"


def new_run(where: Where, data_url: str, *extra: str) -> None:
    s3 = [S3_POLL] if where.url.startswith("s3://") else []
    create_run(load_config("tiny", [*MICRO, f"data.dataset={data_url}", *s3, *extra]),
               where.url, storage_options=where.options)


def worker_argv(url: str, name: str, *, join: bool = False, faulty: bool = False,
                claim: str | None = None, level: str = "INFO") -> list[str]:
    argv = job_argv(url, name, faulty=faulty)
    argv[argv.index("INFO")] = level
    if join:
        argv += ["--join"] + (["--claim", claim] if claim else [])
    return argv


def until(what: str, check, jobs: Jobs, timeout: float = 60.0,
          restart: dict[str, tuple[list[str], dict[str, str]]] | None = None) -> None:
    """Poll ``check()`` until true; a job that exits meanwhile fails the trial, but
    one in ``restart`` that dies of SIGKILL (its planned fault), which is started
    again at once, as `Jobs.wait` does (a run may wait for it)."""
    end = time.monotonic() + timeout
    while not check():
        for job in jobs.jobs.values():
            code = job.proc.poll() if job.proc is not None else None
            if code == -signal.SIGKILL and job.name in (restart or {}):
                job.exits.append(code)
                job.start(*restart.pop(job.name))
            elif code not in (None, -signal.SIGKILL):
                jobs.fail(f"{job.name} exited with {code} before {what}")
        if time.monotonic() > end:
            jobs.fail(f"hung: never {what}")
        time.sleep(0.05)


def step_of(store: ObjectStore, name: str) -> int:
    status = read_json(store, layout.member_status(name)) or {}
    return int(status.get("step") or 0)


def check_clean(where: Where, logs: Path, joiner: str | None = JOINER,
                admitted_events: int = 1) -> dict:
    """The run finished, every contribution has one outcome, the joiner was
    admitted once (one admission, one ``admitted`` event across aggregators)."""
    ex = open_run(where.url, where.options)
    for p, n in enumerate(ex.manifest.rounds):
        assert ex.mean_commit(p, n - 1) is not None, f"fragment {p} never finished"
    report = audit(ex)
    assert report["lost"] == [] and report["double"] == [], report
    assert report["pending"] == 0, report
    if joiner is not None:
        admission = read_json(ex.store, layout.admission(joiner))
        # slot 2, or 1 when region-b left before the join (the lowest free slot)
        assert admission is not None and admission.get("slot") in (1, 2), admission
        text = (logs / "aggregator.log").read_text()
        assert text.count(f"member {joiner}: admitted") == admitted_events, (
            "admitted twice (or never)")
        took_part = [(p, r) for p, n in enumerate(ex.manifest.rounds) for r in range(n)
                     if any(k.split("@")[0] == joiner
                            for k in (ex.mean_commit(p, r) or {}).get("weights", {}))]
        assert took_part, f"{joiner}'s contributions were never applied"
    return report


def run_trial(where: Where, tmp_path: Path, faults: dict[str, list[dict]], *,
              join: bool = True, leave: str | None = None) -> list[str]:
    """The aggregator and the two workers; once round 0 of fragment 0 is reduced,
    the joiner (``--join``; started with them through tests/fault_job.py, which
    holds it, imports done, until that mean is committed); a leave request for
    ``leave`` once it reached step 10. A job with faults runs through
    tests/fault_job.py and, killed, is started again as plain ``python -m workers
    --worker NAME`` (no ``--join``)."""
    logs = tmp_path / "logs"
    fault_log = tmp_path / "faults.log"
    restart = {}

    def start(jobs: Jobs, name: str, mine: list[dict], **kw) -> None:
        if mine:
            env = {**where.env, "DILOCO_FAULTS": json.dumps(mine),
                   "DILOCO_FAULT_LOG": str(fault_log)}
            jobs.start(name, worker_argv(where.url, name, faulty=True, **kw), env)
            restart[name] = (worker_argv(where.url, name), where.env)
        else:
            jobs.start(name, worker_argv(where.url, name, **kw), where.env)

    store = where.store()
    with Jobs(logs, TRIAL_TIMEOUT) as jobs:
        for name in ("aggregator", "region-a", "region-b"):
            start(jobs, name, faults.get(name, []))
        if join:
            after_round_0 = {"action": "wait", "key": layout.mean_commit(0, 0)}
            start(jobs, JOINER, [after_round_0, *faults.get(JOINER, [])], join=True)
        if leave:
            until(f"{leave} reached step 10", lambda: step_of(store, leave) >= 10, jobs,
                  restart=restart)
            assert request_leave(store, leave)
        jobs.wait(restart)
    lines = fired(fault_log)
    if join:  # it joined a running run: round 0 was reduced before it began
        assert f"{JOINER} waited for {layout.mean_commit(0, 0)}" in lines, lines
    return lines


# -- 1. kill -9 at every publish boundary of join and leave ------------------------------

JOIN_KILLS = {
    # the membership record created, the admission not yet read
    "record": {"at": "after-put", "key": f"members/{JOINER}.json"},
    # the admission read, the canonical bootstrap (frontier) not yet started
    "admission": {"at": "after-get", "key": f"members/{JOINER}/admission.json"},
    # its first contribution committed, nothing after it
    "first-contribution": {"at": "after-put", "key": f"frag/*/commits/{JOINER}.json"},
}
LEAVE_KILLS = {
    "before-left": "before-put",  # asked to leave, its rounds drained, no left.json yet
    "after-left": "after-put",  # left.json created, its status not yet "left"
}
#: (joiner's boundary, leaver's boundary or None) per trial: every boundary once, two
#: faults per run where they do not interfere (the joiner dies right after joining,
#: region-b is asked to leave at step 10)
CASES = [("record", "before-left"), ("admission", "after-left"),
         ("first-contribution", None)]
S3_CASES = [("admission", "before-left")]  # every create-only record of join and leave


def join_and_leave_trial(where: Where, data_url: str, tmp_path: Path, join_at: str,
                         leave_at: str | None) -> None:
    # 96 steps on the directory store, not 64: a joiner killed at its first
    # contribution must be back before the others finish (at 64 steps a loaded machine
    # once left it 4 s, and it found the run finished). On S3 (steps ~5x slower) 64:
    # the joiner takes part from step ~6, region-b's left record is there by region-a's
    # step ~20, and the rest of the run is only margin (a third of the trial's CPU)
    steps = 64 if where.url.startswith("s3://") else 96
    new_run(where, data_url, f"train.steps={steps}")
    faults = {JOINER: [{"action": "kill", **JOIN_KILLS[join_at]}]}
    if leave_at:
        faults["region-b"] = [{"action": "kill", "at": LEAVE_KILLS[leave_at],
                               "key": "members/*/left.json"}]
    lines = run_trial(where, tmp_path, faults, leave="region-b" if leave_at else None)
    for who, f in ((w, fs[0]) for w, fs in faults.items()):
        assert any(f"{who} killed at {f['at']}" in line for line in lines), lines
    check_clean(where, tmp_path / "logs")
    store = where.store()
    status = read_json(store, layout.member_status(JOINER)) or {}
    assert status.get("state") == "finished", status
    if not leave_at:
        return
    left = read_json(store, layout.left("region-b"))
    assert left is not None and "last_rounds" in left, left
    assert (read_json(store, layout.member_status("region-b")) or {}).get("state") == "left"
    ex = open_run(where.url, where.options)
    after = [(p, r) for p, last in enumerate(left["last_rounds"])
             for r in range(last + 1, ex.manifest.rounds[p])
             if "region-b" in (ex.mean_commit(p, r) or {}).get("weights", {})]
    assert not after, f"region-b's rounds after it left were applied: {after}"


@pytest.mark.parametrize("join_at, leave_at", CASES,
                         ids=[f"join-{j}-leave-{x or 'none'}" for j, x in CASES])
def test_join_and_leave_killed_at_boundaries(join_at, leave_at, data_url, tmp_path):
    """The joiner SIGKILLed after its record / after reading its admission / after
    its first contribution, region-b after its leave request before / after its
    left record; each restarted plain (the joiner without --join)."""
    join_and_leave_trial(Where(str(tmp_path / "run"), None, env_for()), data_url,
                         tmp_path, join_at, leave_at)


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # conditional PUTs are the S3 side; one server is enough
@pytest.mark.parametrize("join_at, leave_at", S3_CASES,
                         ids=[f"join-{j}-leave-{x}" for j, x in S3_CASES])
def test_join_and_leave_killed_at_boundaries_on_s3(join_at, leave_at, data_url, tmp_path,
                                                    s3_endpoint, s3_bucket, s3_env):
    where = Where(f"s3://{s3_bucket}/elastic-{uuid.uuid4().hex[:10]}", s3_endpoint[1],
                  env_for(**s3_env))
    join_and_leave_trial(where, data_url, tmp_path, join_at, leave_at)


# -- 2. two joiners racing for one name, 3. a lease that lapses while its holder is only
# slow: one run for both (each alone paid a whole run's start and rounds: on S3 ~10 s of
# CPU), the race at its start, the lapse in its middle; each test checks its own part

class RaceAndLapse:
    """What the shared run of the race and the lapsed lease left: its store, logs,
    the racers' exit codes and outputs, and region-a's steps around the stop."""

    def __init__(self, where: Where, logs: Path, codes: dict[str, int | None],
                 outs: dict[str, tuple[str, str]], stopped_at: int, woke_at: int):
        self.where, self.logs, self.codes, self.outs = where, logs, codes, outs
        self.stopped_at, self.woke_at = stopped_at, woke_at


@pytest.fixture(scope="module", params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def race_and_lapse(request, tmp_path_factory, data_url) -> RaceAndLapse:
    """Two racers for one name start together with the aggregator; the run's workers
    start once the name is claimed, so the winner trains the whole run with them.
    Once region-b reached step 10 it is SIGSTOPped until region-a has gone 16 steps
    (4 rounds of each fragment) further, then SIGCONT. 64 steps: the run goes on
    after region-b wakes (at region-a's step ~30; one that wakes after the end exits
    2, RunFinished). A lease of 2 s; a late send 2 rounds behind still applies."""
    tmp_path = tmp_path_factory.mktemp(f"race-and-lapse-{request.param}")
    where = where_for(request, request.param, tmp_path)
    new_run(where, data_url, "sync.membership.max_staleness=2", "sync.liveness.lease_s=2",
            NO_CHECKPOINTS)
    store = where.store()
    with Jobs(tmp_path / "logs", TRIAL_TIMEOUT) as jobs:
        jobs.start("aggregator", worker_argv(where.url, "aggregator"), where.env)
        racers, outs = {}, {}
        # forks of the zygote (tests/faults.py), each in a session of its own, stdout
        # and stderr apart: a new interpreter each would import torch for nothing
        for claim in ("claim-one", "claim-two"):  # started together, no wait between
            streams = (tmp_path / f"{claim}.out", tmp_path / f"{claim}.err")
            racers[claim] = (zygote().start(
                worker_argv(where.url, JOINER, join=True, claim=claim, level="WARNING"),
                where.env, *streams), streams)
        try:
            until("the name was claimed", lambda: store.exists(layout.member(JOINER)), jobs)
            for name in ("region-a", "region-b"):
                jobs.start(name, worker_argv(where.url, name), where.env)
            until("region-b reached step 10", lambda: step_of(store, "region-b") >= 10,
                  jobs)
            victim = jobs.jobs["region-b"].proc
            os.killpg(victim.pid, signal.SIGSTOP)
            # from where the further of the two was: under load region-b may have been
            # rounds ahead of region-a, whose next steps then needed nothing from it
            stopped_at = max(step_of(store, "region-a"), step_of(store, "region-b"))
            until("region-a went 16 steps on without region-b",
                  lambda: step_of(store, "region-a") >= stopped_at + 16, jobs, timeout=90.0)
            woke_at = step_of(store, "region-a")
            os.killpg(victim.pid, signal.SIGCONT)
            for c, (p, streams) in racers.items():
                p.wait(timeout=TRIAL_TIMEOUT)
                outs[c] = tuple(path.read_text() for path in streams)
        finally:
            for p, _ in racers.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        jobs.wait()
    codes = {c: p.returncode for c, (p, _) in racers.items()}
    return RaceAndLapse(where, tmp_path / "logs", codes, outs, stopped_at, woke_at)


def test_two_joiners_race_for_one_name(race_and_lapse):
    """One racer wins the name and trains to the end; the other exits 2 with one
    line ("taken") and writes nothing; the winner is admitted once and takes part."""
    run = race_and_lapse
    codes, outs = run.codes, run.outs
    assert sorted(codes.values()) == [0, 2], (codes, outs)
    winner = next(c for c, code in codes.items() if code == 0)
    loser = next(c for c, code in codes.items() if code == 2)
    err = outs[loser][1].strip().splitlines()
    assert len(err) == 1 and "taken" in err[0], outs[loser]
    assert outs[loser][0].strip() == "", outs[loser]
    store = run.where.store()
    record = read_json(store, layout.member(JOINER)) or {}
    assert record.get("claim") == winner, record
    assert json.loads(outs[winner][0].strip().splitlines()[-1])["state"] == "finished"
    assert not any(loser in store.get(k).decode(errors="replace")
                   for k in store.list("members/")), "the loser wrote a record"
    check_clean(run.where, run.logs)


def test_a_lease_lapses_while_its_holder_is_stopped(race_and_lapse):
    """region-b, SIGSTOPped mid-run: the rounds reduce without it meanwhile, once its
    lease lapses (at most one lease after its last progress, the first round that
    misses it waits for it: it was coming); what it sends when it wakes is applied
    late once, dropped, or never sent (it heals); nothing is applied twice. Counted
    in steps, not seconds: a region-a that waited for region-b never gets 16 steps
    further (the run fails as hung). On S3 the lease is read from status objects and
    the late send is a conditional PUT."""
    run = race_and_lapse
    assert run.woke_at > run.stopped_at + 4, "region-a waited for region-b"
    report = check_clean(run.where, run.logs, joiner=None)
    ex = open_run(run.where.url, run.where.options)
    without = [(p, r) for p, n in enumerate(ex.manifest.rounds) for r in range(n)
               if "region-b" not in (ex.mean_commit(p, r) or {}).get("weights", {})]
    assert without, "no round was reduced without the stopped worker"
    assert report["contributions"] == sum(report[k] for k in (
        "applied", "applied_late", "dropped_stale", "rejected")), report


# -- 4. the aggregator restarted while a join is half done -------------------------------

AGGREGATOR_KILLS = {
    # the joiner's record is there, the admission not written yet
    "before-admission": "before-put",
    # the admission written, the joiner bootstrapping (or about to)
    "after-admission": "after-put",
}


@pytest.mark.parametrize("boundary", list(AGGREGATOR_KILLS))
def test_aggregator_restarted_during_a_join(boundary, where, data_url, tmp_path):
    """The aggregator SIGKILLed just before / just after it writes the joiner's
    admission, and started again: the joiner is admitted once and finishes. On S3
    the admission is a conditional PUT the new aggregator may race with: moto only
    (``where``), seaweedfs would double the time and test the same requests."""
    # 64 steps, a checkpoint every 4 on the directory store: the workers go on while
    # the joiner bootstraps, and must not finish first; on S3 (steps ~5x slower) 32
    # steps and no checkpoints (most of a run's requests): the kill, the restart, the
    # admission and the joiner's first contribution are over by step ~6, and each
    # round after that costs ~0.6 s of CPU (the jobs' requests and moto's)
    s3 = ["train.steps=32", NO_CHECKPOINTS] if where.url.startswith("s3://") else []
    new_run(where, data_url, *s3)
    fault = {"action": "kill", "at": AGGREGATOR_KILLS[boundary],
             "key": f"members/{JOINER}/admission.json"}
    lines = run_trial(where, tmp_path, {"aggregator": [fault]})
    assert any(f"aggregator killed at {fault['at']}" in line for line in lines), lines
    # before-admission: the restarted aggregator admits it (one "admitted" event);
    # after-admission: the killed one wrote it and died before its event; the new
    # one takes that admission (no event): one admission object either way
    check_clean(where, tmp_path / "logs",
                admitted_events=1 if boundary == "before-admission" else 0)
    ex = open_run(where.url, where.options)
    status = read_json(ex.store, layout.member_status(JOINER)) or {}
    assert status.get("state") == "finished", status


def test_fault_job_without_faults_is_the_plain_entry_point(tmp_path):
    """tests/fault_job.py with no faults is the plain entry point (a usage error). Run
    as the trials run it: a fork of the zygote, which runs the script as ``__main__``
    (a new interpreter would import torch again for nothing)."""
    argv = [sys.executable, FAULT_JOB, "--", "--run", "/nonexistent/x", "--worker", "a"]
    assert forkable(argv)
    log = tmp_path / "job.log"
    code = zygote().start(argv, env_for(), log).wait(timeout=60)
    out = log.read_text()
    assert code == 2 and out.strip().startswith("error:"), (code, out)
