"""A small, bounded fault campaign on real multi-process runs.

Every trial runs the aggregator and two workers as processes on one micro config
(2 workers, P = 2, H = 4, tau = 1, 16 steps: 5 rounds per fragment, int4 up and
int8 down with error feedback both ways) and injects one fault:

- kill (SIGKILL) a worker or the aggregator at a publish boundary, restart it
  normally, and require the canonical state of an uninterrupted run of the same
  config, bit for bit, with every round applied exactly once;
- plant a bad contribution (flipped byte, NaN, wrong shape, a replayed record, a
  1e30 value sent through the public API) in the slot of the worker that is then
  killed and restarted (it must re-read its own delta), or in the other worker's
  slot: the run must finish with the rejection recorded and a finite, sane model;
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
#: for runs whose workers are never killed (the reference, the aggregator's kills): a
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
             *, env: dict[str, str] | None = None) -> list[str]:
    """Run the aggregator and the workers of ``run_url`` to the end under the
    trial deadline. A process with faults runs tests/fault_job.py; when a fault
    kills it, it is started again as plain ``python -m workers``. Returns the
    lines of the faults that fired."""
    faults = faults or {}
    fault_log = logs / "faults.log"
    restart = {}
    with Jobs(logs, TRIAL_TIMEOUT) as jobs:
        for name in ("aggregator", *WORKERS):
            plain = env_for(**(env or {}))
            mine = faults.get(name)
            if mine:
                faulty = {**plain, "DILOCO_FAULTS": json.dumps(mine),
                          "DILOCO_FAULT_LOG": str(fault_log)}
                jobs.start(name, job_argv(run_url, name, faulty=True), faulty)
                restart[name] = (job_argv(run_url, name, faulty=False), plain)
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


def assert_same_as(reference_snapshot, url: str, storage_options: dict | None = None) -> None:
    got = snapshot(url, storage_options)
    problems = differences(got, reference_snapshot) + applied_once(got)
    if got.rejected:
        problems.append(f"rejections in a run without bad payloads: {got.rejected}")
    assert not problems, "\n".join(problems)


# -- kills at every publish boundary ---------------------------------------------------

KILLS = [
    # (who, boundary, fragment, round)
    ("region-a", "before-commit", 1, 1),     # delta uploaded, its record not created
    ("region-a", "after-commit", 1, 1),      # record created, nothing after it
    ("aggregator", "before-mean-commit", 0, 2),  # mean payload written, no mean.json
    ("aggregator", "published", 0, 2),       # mean.json committed, not stepped
    ("aggregator", "stepped", 0, 2),         # stepped, no canonical checkpoint
    ("aggregator", "checkpointed", 0, 2),    # checkpoint committed, round not counted
]


@pytest.mark.parametrize("who, boundary, fragment, rnd", KILLS,
                         ids=[f"{'worker' if w in WORKERS else w}-{b}" for w, b, _, _ in KILLS])
def test_kill_at_boundary(who, boundary, fragment, rnd, data_url, reference, tmp_path):
    """SIGKILL at the boundary, a plain restart: the canonical state of the
    uninterrupted run, bit for bit, each round applied once."""
    url = new_run(data_url, str(tmp_path / "run"),
                  extra=None if who in WORKERS else [NO_WORKER_CHECKPOINTS])
    fault = {"action": "kill", "at": boundary, "fragment": fragment, "round": rnd}
    lines = run_jobs(url, tmp_path / "logs", {who: [fault]})
    assert any(f"killed at {boundary} {fragment} {rnd}" in line for line in lines), lines
    assert_same_as(reference[0], url)


# -- bad payloads ----------------------------------------------------------------------

PLANTS = ["flip", "nan", "shape", "replay", "huge"]
#: the round each kind is planted in: a replay copies round 0's record to round 1;
#: a huge value needs the norm guard's history (sync.guard.warmup = 2 rounds)
PLANT_ROUND = {"replay": 1}
PLANT_FRAGMENT = 1


#: every kind in region-a's own slot and in the other worker's; one kind in both
#: slots, which leaves a round with no usable contribution
CASES = [(k, slot) for k in PLANTS for slot in ("own", "other")] + [("nan", "both")]
VICTIMS = {"own": ["region-a"], "other": ["region-b"], "both": list(WORKERS)}


@pytest.mark.parametrize("kind, slot", CASES, ids=[f"{k}-{slot}" for k, slot in CASES])
def test_bad_payload(kind, slot, data_url, reference, tmp_path):
    """A bad contribution in region-a's slot (``own``: region-a is then killed
    and restarted, and must re-read it), in region-b's (``other``: region-a is
    killed all the same and must not care), or in both (the round has no usable
    contribution and must not be a step): rejected and recorded, the run
    finishes (every job exits 0), the canonical model is finite and sane."""
    rnd = PLANT_ROUND.get(kind, 2)
    where = {"fragment": PLANT_FRAGMENT, "round": rnd}
    faults = {"region-a": [{"action": "kill", "at": "after-publish", **where}]}
    for victim in VICTIMS[slot]:
        faults.setdefault(victim, []).insert(0, {"action": "plant", "kind": kind, **where})
    url = new_run(data_url, str(tmp_path / "run"))
    lines = run_jobs(url, tmp_path / "logs", faults)
    assert any("region-a killed at after-publish" in line for line in lines), lines

    got = snapshot(url)
    key = (PLANT_FRAGMENT, rnd)
    for victim in VICTIMS[slot]:
        assert any(f"{victim} planted {kind}" in line for line in lines), lines
        assert victim in got.rejected.get(key, {}), (
            f"no rejection of {victim} recorded under frag/{key[0]}/r{key[1]:06d}/rejected/;"
            f" rejections: {got.rejected}")
        assert victim not in got.weights[key], f"a bad contribution was used: {got.weights[key]}"
    assert not applied_once(got), applied_once(got)
    if slot == "both":
        before, after = round_arrays(url, PLANT_FRAGMENT, rnd - 1), round_arrays(url, *key)
        for name in ("params", "momentum"):
            assert after[name].tobytes() == before[name].tobytes(), (
                f"round {rnd} had no usable contribution but the canonical {name} moved")
    for p, arrays in got.final.items():
        for name, value in arrays.items():
            assert value.size and bool((abs(value) < 1e3).all()), (
                f"fragment {p} {name}: not finite or exploded (max |x| = {abs(value).max()})")
    loss = canonical_eval(url)
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
