"""A small, bounded fault campaign on real multi-process runs.

Every trial runs the aggregator and two workers as processes on one micro config
(2 workers, P = 2, H = 4, tau = 1, 16 steps: 5 rounds per fragment, int4 up and
int8 down with error feedback both ways) and injects faults:

- kill (SIGKILL) a worker or the aggregator at a publish boundary, restart it
  normally, and require the canonical state of an uninterrupted run of the same
  config, bit for bit, with every round applied exactly once (one run with a
  kill at each boundary, each at a round of its own);
- plant a bad contribution (flipped byte, NaN, wrong shape, a replayed record, a
  1e30 value sent through the public API) in the slot of the worker that is then
  killed and restarted (it must re-read its own delta), or in the other worker's
  slot: the run must finish with the rejection recorded and a finite, sane model
  (a run per kind, its two cases at rounds of their own);
- put a proxy failing 30% of the requests (503, connection resets) between the
  jobs and the S3 test server: same canonical state as without it;
- SIGKILL ``diloco run`` during start-up, then ``diloco resume``: same state.

Faults are injected by tests/fault_job.py (launched instead of ``python -m
workers``), never by changing product code. Every trial has a hard deadline:
past it, everything is killed and the trial fails with "hung" and the end of
each job's log. Helpers are in tests/faults.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_runs import alive, clean_env
from faults import (
    FaultProxy,
    Jobs,
    applied_once,
    canonical_eval,
    differences,
    env_for,
    fired,
    job_argv,
    round_arrays,
    snapshot,
)

from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run

WORKERS = ("region-a", "region-b")
#: seconds a trial may take before it is called hung (a plain run takes ~7 s)
TRIAL_TIMEOUT = 90.0

# The micro model of tests/test_flows.py, 16 steps. Quorum 1.0: the aggregator
# waits for every member holding its lease (a killed one is back within a few
# seconds, well inside it, so kills never change who is in a round); a rejected
# contribution counts as arrived, so it never makes a round wait.
MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=4", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=2", "train.log_every=1", "train.threads=1",
    "train.steps=16", "train.checkpoint_every=4", "train.keep_checkpoints=0",
    "sync.schedule.sync_every=4", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
    "sync.codec.up=int4", "sync.codec.down=int8", "sync.codec.feedback_up=true",
    "sync.codec.feedback_down=true",
    "sync.membership.deadline_s=30", "sync.membership.absent_deadline_s=30", "sync.liveness.poll_max_s=0.1",
    "sync.membership.quorum=1.0",
]
#: for runs whose workers are never killed (the reference): a
#: worker's periodic checkpoint (a torch distributed checkpoint every 4 steps, most of
#: its CPU) is read only by a worker started again, and leaves the run's numbers as
#: they are: a worker killed in a run with them must still give the reference, bit for bit
NO_WORKER_CHECKPOINTS = "train.checkpoint_every=0"


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    """A 200 kB slice of the installed corpus, prepared once (jobs read it by path)."""
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare/tragedies/*"], url, max_bytes=200_000)
    return url


def overrides(data_url: str, extra: list[str] | None = None) -> list[str]:
    return [*MICRO, f"data.dataset={data_url}", *(extra or [])]


def run_jobs(run_url: str, logs: Path, faults: dict[str, list[dict]] | None = None,
             *, env: dict[str, str] | None = None, timeout: float = TRIAL_TIMEOUT
             ) -> list[str]:
    """Run the aggregator and the workers of ``run_url`` to the end under the
    trial deadline. A process with faults runs tests/fault_job.py; when a fault
    kills it, it is started again: as plain ``python -m workers`` after its last
    kill when it has only kills, else through tests/fault_job.py with the same
    faults (one that fired never fires again: ``DILOCO_FAULT_FIRED``). Returns
    the lines of the faults that fired."""
    faults = faults or {}
    fault_log = logs / "faults.log"
    restart = {}
    with Jobs(logs, timeout) as jobs:
        for name in ("aggregator", *WORKERS):
            plain = env_for(**(env or {}))
            mine = faults.get(name)
            if mine:
                faulty = {**plain, "DILOCO_FAULTS": json.dumps(mine),
                          "DILOCO_FAULT_LOG": str(fault_log),
                          "DILOCO_FAULT_FIRED": str(logs / f"{name}.fired")}
                argv = job_argv(run_url, name, faulty=True)
                jobs.start(name, argv, faulty)
                kills = sum(f["action"] == "kill" for f in mine)
                restart[name] = [(argv, faulty)] * kills
                if kills == len(mine):  # nothing left after its last kill: plain
                    restart[name][-1] = (job_argv(run_url, name, faulty=False), plain)
            else:
                jobs.start(name, job_argv(run_url, name, faulty=False), plain)
        jobs.wait(restart)
    return fired(fault_log)


def new_run(data_url: str, url: str, storage_options: dict | None = None,
            extra: list[str] | None = None) -> str:
    create_run(load_config("tiny", overrides(data_url, extra)), url,
               storage_options=storage_options)
    return url


@pytest.fixture(scope="module")
def reference(data_url, tmp_path_factory):
    """The uninterrupted run on a local directory: its snapshot and eval loss."""
    tmp = tmp_path_factory.mktemp("reference")
    url = new_run(data_url, str(tmp / "run"), extra=[NO_WORKER_CHECKPOINTS])
    run_jobs(url, tmp / "logs")
    return snapshot(url), canonical_eval(url)


def problems_against(reference_snapshot, url: str,
                     storage_options: dict | None = None) -> list[str]:
    """How the run at ``url`` differs from the reference, bit for bit, and where a
    round was not applied exactly once; [] when it is the reference."""
    got = snapshot(url, storage_options)
    problems = differences(got, reference_snapshot) + applied_once(got)
    if got.rejected:
        problems.append(f"rejections in a run without bad payloads: {got.rejected}")
    return problems


def assert_same_as(reference_snapshot, url: str, storage_options: dict | None = None) -> None:
    problems = problems_against(reference_snapshot, url, storage_options)
    assert not problems, "\n".join(problems)


# -- kills at every publish boundary ---------------------------------------------------

#: (who, boundary, fragment, round), all in one run (`kill_run`), each at a round of
#: its own: every kill is followed by a restart that must give the reference, so one
#: kill handled wrongly (a round applied twice or skipped, a state lost) makes the
#: run differ from it, whatever the others did
KILLS = [
    ("aggregator", "before-mean-commit", 0, 1),  # mean payload written, no mean.json
    ("region-a", "before-commit", 1, 1),     # delta uploaded, its record not created
    ("aggregator", "published", 0, 2),       # mean.json committed, not stepped
    ("region-b", "after-commit", 1, 2),      # record created, nothing after it
    ("aggregator", "stepped", 0, 3),         # stepped, no canonical checkpoint
    ("aggregator", "checkpointed", 1, 3),    # checkpoint committed, round not counted
]


@pytest.fixture(scope="module")
def kill_run(data_url, reference, tmp_path_factory):
    """The run with every kill of `KILLS` (worker checkpoints on: a killed worker
    resumes from one), each killed job restarted: the lines of the faults that fired
    and how the run differs from the reference."""
    tmp = tmp_path_factory.mktemp("kills")
    url = new_run(data_url, str(tmp / "run"))
    faults: dict[str, list[dict]] = {}
    for who, boundary, fragment, rnd in KILLS:
        faults.setdefault(who, []).append(
            {"action": "kill", "at": boundary, "fragment": fragment, "round": rnd})
    lines = run_jobs(url, tmp / "logs", faults, timeout=2 * TRIAL_TIMEOUT)
    return lines, problems_against(reference[0], url)


@pytest.mark.parametrize("who, boundary, fragment, rnd", KILLS,
                         ids=[f"{'worker' if w in WORKERS else w}-{b}" for w, b, _, _ in KILLS])
def test_kill_at_boundary(who, boundary, fragment, rnd, kill_run):
    """SIGKILL at the boundary, a plain restart: the canonical state of the
    uninterrupted run, bit for bit, each round applied once."""
    lines, problems = kill_run
    assert any(f"{who} killed at {boundary} {fragment} {rnd}" in line for line in lines), lines
    assert not problems, "\n".join(problems)


# -- bad payloads ----------------------------------------------------------------------

PLANTS = ["flip", "nan", "shape", "replay", "huge"]

#: (kind, slot) -> (the worker killed after its send, fragment, round). ``own``: the
#: kind is planted in the killed worker's slot, ``other``: in the other worker's,
#: ``both``: in both slots, which leaves a round with no usable contribution. The two
#: cases of a kind share a run (`payload_runs`), each at a round of its own and with a
#: worker of its own killed: a case's checks read only its round, and the run's
#: (finite, sane, each round applied once) would fail for either case that broke
#: them. One kill per worker and run: a worker killed again and again, its rounds
#: planted, is never waited for and falls behind until the run ends without it (its
#: restart exits 2, RunFinished: seen). Nothing at round (1, 3), the last but one, for
#: the same reason. A replay copies round r-1's record to round r; a huge value needs
#: the norm guard's history (sync.guard.warmup = 2 rounds).
PAYLOADS = {
    **{(kind, "own"): ("region-a", 1, 1 if kind == "replay" else 2) for kind in PLANTS},
    **{(kind, "other"): ("region-b", 0, 3) for kind in PLANTS},
    ("nan", "both"): ("region-a", 1, 2),
}
CASES = list(PAYLOADS)
SLOW_RESTARTS = ["sync.membership.deadline_s=120", "sync.membership.absent_deadline_s=120"]


def victims(kind: str, slot: str) -> list[str]:
    """The workers whose slot holds the bad contribution of case (kind, slot)."""
    killed = PAYLOADS[(kind, slot)][0]
    return {"own": [killed], "other": [w for w in WORKERS if w != killed],
            "both": list(WORKERS)}[slot]


def run_of(kind: str, slot: str) -> str:
    return "nan-both" if slot == "both" else kind


@pytest.fixture(scope="module")
def payload_runs(data_url, tmp_path_factory):
    """``run(name)``: the run of the cases of `run_of` ``name`` in `PAYLOADS`, made
    on first use: its url, the lines of the faults that fired, its snapshot and its
    canonical eval loss (or the error it ended with, raised again)."""
    made: dict[str, tuple | BaseException] = {}

    def run(name: str) -> tuple:
        if name not in made:
            tmp = tmp_path_factory.mktemp(f"payloads-{name}")
            faults: dict[str, list[dict]] = {}
            for (kind, slot), (killed, fragment, rnd) in PAYLOADS.items():
                if run_of(kind, slot) != name:
                    continue
                where = {"fragment": fragment, "round": rnd}
                for victim in victims(kind, slot):
                    faults.setdefault(victim, []).append(
                        {"action": "plant", "kind": kind, **where})
                faults.setdefault(killed, []).append(
                    {"action": "kill", "at": "after-publish", **where})
            try:
                # both workers are killed once in a run: on a loaded machine (a whole
                # suite, load 10) a restart and its replay outlasted the 30 s deadline,
                # the round went without the victim and its plant was never judged
                url = new_run(data_url, str(tmp / "run"), extra=SLOW_RESTARTS)
                lines = run_jobs(url, tmp / "logs", faults, timeout=2 * TRIAL_TIMEOUT)
                made[name] = (url, lines, snapshot(url), canonical_eval(url))
            except BaseException as exc:  # every case of the run fails with it
                made[name] = exc
        if isinstance(made[name], BaseException):
            raise made[name]
        return made[name]

    return run


@pytest.mark.parametrize("kind, slot", CASES, ids=[f"{k}-{slot}" for k, slot in CASES])
def test_bad_payload(kind, slot, payload_runs, reference):
    """A bad contribution in the slot of the worker then killed and restarted
    (``own``: it must re-read it), in the other worker's (``other``: the killed
    one must not care), or in both (the round has no usable contribution and must
    not be a step): rejected and recorded, the run finishes (every job exits 0),
    the canonical model is finite and sane."""
    url, lines, got, loss = payload_runs(run_of(kind, slot))
    killed, fragment, rnd = PAYLOADS[(kind, slot)]
    key = (fragment, rnd)
    where = f"{key[0]} {key[1]}"
    assert any(f"{killed} killed at after-publish {where}" in line for line in lines), lines
    for victim in victims(kind, slot):
        assert any(f"{victim} planted {kind} {where}" in line for line in lines), lines
        assert victim in got.rejected.get(key, {}), (
            f"no rejection of {victim} recorded under frag/{key[0]}/r{key[1]:06d}/rejected/;"
            f" rejections: {got.rejected}")
        assert victim not in got.weights[key], f"a bad contribution was used: {got.weights[key]}"
    assert not applied_once(got), applied_once(got)
    if slot == "both":
        before, after = round_arrays(url, key[0], key[1] - 1), round_arrays(url, *key)
        for name in ("params", "momentum"):
            assert after[name].tobytes() == before[name].tobytes(), (
                f"round {key[1]} had no usable contribution but the canonical {name} moved")
    for p, arrays in got.final.items():
        for name, value in arrays.items():
            assert value.size and bool((abs(value) < 1e3).all()), (
                f"fragment {p} {name}: not finite or exploded (max |x| = {abs(value).max()})")
    ref_loss = reference[1]
    assert math.isfinite(loss) and loss < ref_loss + 0.5, (
        f"canonical eval loss {loss:.3f}, the reference reaches {ref_loss:.3f}")


# -- a flaky network in front of S3 -----------------------------------------------------


#: the S3 runs are shorter (8 steps, no periodic worker checkpoints, fewer status
#: writes): through the proxy every request may fail, and each retry waits. The
#: aggregator waits up to 80 s for a late worker (not 30): on a loaded machine one
#: worker can fall 30 s behind the other behind this proxy, and a round reduced
#: without it is correct but not the reference's.
S3_RUN = ["train.steps=8", "train.checkpoint_every=0", "train.log_every=4",
          "sync.liveness.poll_max_s=0.2", "sync.membership.deadline_s=80", "sync.membership.absent_deadline_s=80"]


@pytest.fixture(scope="module")
def s3_reference(data_url, s3_endpoint, s3_bucket, s3_env, tmp_path_factory):
    """The uninterrupted run on the S3 test server, no proxy. It runs in a thread
    while the trial runs (both mostly wait on the network): call it for the
    snapshot."""
    _endpoint, options = s3_endpoint
    url = new_run(data_url, f"s3://{s3_bucket}/faults-ref-{uuid.uuid4().hex[:8]}", options,
                  S3_RUN)
    logs = tmp_path_factory.mktemp("s3-reference")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: (run_jobs(url, logs, env=s3_env),
                                      snapshot(url, options))[1])
        yield lambda: future.result(timeout=TRIAL_TIMEOUT + 30)


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # our retries against a proxy's faults, not the server's
def test_flaky_s3(data_url, s3_endpoint, s3_bucket, s3_env, s3_reference, tmp_path):
    """30% of the jobs' requests fail (503 SlowDown, resets before and after the
    server acted), and once mid-run every request fails for 8 s (longer than one
    operation's retries): the run finishes with the state of the run without
    faults."""
    endpoint, options = s3_endpoint
    url = new_run(data_url, f"s3://{s3_bucket}/faults-{uuid.uuid4().hex[:8]}", options,
                  S3_RUN)
    with FaultProxy(endpoint, rate=0.3, seed=7, outage_after=300, outage_s=8.0) as proxy:
        run_jobs(url, tmp_path / "logs", env={**s3_env, "AWS_ENDPOINT_URL_S3": proxy.url})
    failed = sum(n for k, n in proxy.counts.items() if k != "forward")
    assert failed > 50 and proxy.counts["outage"] > 10, dict(proxy.counts)
    assert_same_as(s3_reference(), url, options)


# -- the launcher killed during start-up -------------------------------------------------

DILOCO = str(Path(sys.executable).parent / "diloco")


def test_launcher_killed_at_startup(data_url, reference, tmp_path):
    """``diloco run`` is SIGKILLed once it has launched its jobs (they stop by
    themselves: their launcher is gone); ``diloco resume`` finishes the run with
    the canonical state of the uninterrupted one."""
    url = str(tmp_path / "run")
    # the Prefect server this test process keeps (tests/cli_runs.py), not a temporary
    # one per command: the launcher's jobs watch its pid, not its Prefect server
    env = clean_env(tmp_path, shared_prefect=True, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                    DILOCO_TRACKING="off")
    sets = [a for o in overrides(data_url) for a in ("--set", o)]
    log = tmp_path / "diloco.log"
    deadline = time.monotonic() + 2 * TRIAL_TIMEOUT
    orphans: list[int] = []

    def report(what: str) -> str:
        """``what``, then the end of the command's output and of each job's log."""
        parts = [what]
        for path in [log, *sorted((Path(url) / "logs").glob("*.log"))]:
            lines = path.read_text(errors="replace").splitlines()[-10:]
            parts.append(f"  {path}:\n" + "\n".join("    " + line[:300] for line in lines))
        return "\n".join(parts)

    record = Path(url) / "members" / "launcher.json"
    launched: list[subprocess.Popen] = []

    def diloco(*args: str) -> subprocess.Popen:
        with open(log, "ab") as out:
            out.write(f"--- diloco {' '.join(args[:2])}\n".encode())
            out.flush()
            proc = subprocess.Popen([DILOCO, *args], cwd=tmp_path, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        launched.append(proc)
        return proc

    def jobs() -> list[int]:
        try:
            return [job["pid"] for job in json.loads(record.read_text())["jobs"].values()]
        except (OSError, ValueError, KeyError):
            return []

    try:
        run = diloco("run", "--run-url", url, "--no-eval", *sets)
        while not record.exists():
            assert run.poll() is None, report(f"diloco run exited {run.returncode} early")
            assert time.monotonic() < deadline, report("hung: diloco run launched no jobs")
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGKILL)  # the launcher (and all it started in its group)
        run.wait(10)
        orphans = jobs()
        while any(alive(pid) for pid in orphans):
            assert time.monotonic() < deadline, report(
                f"hung: orphaned jobs {orphans} never stopped")
            time.sleep(0.2)
        resumed = diloco("resume", url)
        while resumed.poll() is None:
            assert time.monotonic() < deadline, report("hung: diloco resume")
            time.sleep(0.2)
        assert resumed.returncode == 0, report(f"diloco resume exited {resumed.returncode}")
    finally:  # everything this trial started, by pid: the commands and their jobs
        for proc in launched:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for pid in set(orphans + jobs()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert_same_as(reference[0], url)
