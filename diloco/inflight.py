"""One worker's rounds in flight: encode, upload, and the wait for each round's mean.

A send hands the outer gradient to three background stages, so training goes on
while the bytes travel: one encoder thread (in round order, because error feedback
carries each round's residual into the next), two upload threads, and a poller per
round that fetches the mean as soon as the aggregator commits it.

The synchroniser asks this class what it needs and does the arithmetic itself
(`diloco.rules`): a worker's own decoded contribution, which means have arrived,
and, when a rule needs a mean that has not, a timed wait for it. The wait gives up
(`MergeAbandoned`) once the caller asks to stop and the patience runs out. Rounds
whose contributions are all applied are forgotten; the others are what a
checkpoint records and a resume picks up again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import torch

from diloco import rules
from diloco.config import SyncConfig
from diloco.overlap import AutoOverlap, FixedOverlap
from storage.errors import BAD_CONTRIBUTION
from storage.exchange import Exchange, Prepared, Published
from storage.retry import outlast

log = logging.getLogger(__name__)


class MergeAbandoned(RuntimeError):
    """A merge stopped waiting for a round's mean because the caller asked to stop.

    The replica is then between an inner step and that step's merge, a state no
    checkpoint can describe: the worker should end without saving and resume from
    its last checkpoint, as after a crash."""

    def __init__(self, worker: str, fragment: int, round: int, waited: float):
        super().__init__(
            f"worker {worker}: stopped while waiting {waited:.0f} s for the mean of "
            f"fragment {fragment} round {round}"
        )
        self.fragment, self.round, self.waited = fragment, round, waited


@dataclass(eq=False)
class Round:
    """One round this worker sent: its futures and what became of its contributions.

    ``own_applied``: this worker's own part was applied to its outer state;
    ``correction_applied``: so was the others' part (the mean); ``own_weight``: the
    ``w`` the own part was applied with, which the correction must use again."""

    fragment: int
    round: int
    encoded: Future  # -> Prepared
    uploaded: Future  # -> Published
    mean: Future  # -> (np.ndarray, commit)
    own_applied: bool = False
    correction_applied: bool = False
    own_weight: float = 0.0
    released: bool = False

    @property
    def arrived(self) -> bool:
        """The mean is here (a merge can use it without waiting)."""
        return self.mean.done()

    @property
    def settled(self) -> bool:
        """Both parts are applied and the contribution is committed: no rule reads
        the round's values again."""
        return self.own_applied and self.correction_applied and self.uploaded.done()

    def release(self) -> None:
        """Let go of a settled round's values (its decoded contribution, its payload's
        bytes and the mean: two fragment-sized float32 arrays and more) and keep its
        commits, which the tau agreement, `InFlight.drain` and a checkpoint's record
        still read. A worker held them for the newest settled round of every
        fragment: twice the model's float32 size."""
        if self.released or not self.settled or not self.arrived or self.mean.exception():
            return
        published: Published = self.uploaded.result()
        self.encoded = self.uploaded = _settled(Published(_GONE, published.commit,
                                                          published.created))
        self.mean = _settled((_GONE, self.mean.result()[1]))
        self.released = True


#: what a released round holds instead of its values (an empty float32 vector)
_GONE = np.empty(0, dtype=np.float32)


def _settled(value: object) -> Future:
    """A future that is done with ``value``."""
    done: Future = Future()
    done.set_result(value)
    return done


def _check_held(sent: Round, worker: str) -> None:
    """Refuse to read the values of a released round (a bug, not a state to go on in)."""
    if sent.released:
        raise RuntimeError(f"worker {worker}: fragment {sent.fragment} round {sent.round} "
                           "is settled and its values are released")


class InFlight:
    """The encode/upload/poll pipeline of one worker, and the rounds in it."""

    def __init__(
        self,
        exchange: Exchange,
        worker: str,
        fragments: int,
        config: SyncConfig,
        on_wait: Callable[[float], None],
        *,
        stop: threading.Event | None = None,
        stop_patience_s: float = 10.0,
        on_stall: Callable[[int, int, float], None] | None = None,
        tau: FixedOverlap | AutoOverlap | None = None,
    ):
        """``on_wait(seconds)`` is told every time a merge waited for a mean;
        ``on_stall(fragment, round, seconds)`` every ``stall_after_s`` while one
        waits; ``tau`` (a fixed tau by default) is told, when the mean of a round
        sent here reaches this worker, the time since its send and how much of it
        the last peer's send came after this worker's (``tau.arrived``:
        `diloco.overlap` sizes tau by it), and says the longest pause between polls
        for a mean (``tau.poll_max``);
        ``stop`` and ``stop_patience_s`` as for `diloco.synchronizer.Synchronizer`."""
        self.exchange = exchange
        self.worker = worker
        self.config = config
        self.feedback = config.codec.feedback_up
        #: error-feedback residual per fragment (None until a round left one)
        self.residual: list[torch.Tensor | None] = [None] * fragments
        #: (fragment, round) of the mean a merge is blocked on, else None
        self.waiting_for: tuple[int, int] | None = None
        self._rounds: dict[tuple[int, int], Round] = {}
        self._on_wait = on_wait
        self._abandon = stop
        self.stop_patience_s = stop_patience_s
        self.on_stall = on_stall
        self.tau = tau or FixedOverlap(config.schedule.send_offset)
        #: overlap auto: read the tau proposals of each mean's contributions
        self.agree = self.tau.agrees
        self._agreed: dict[tuple[int, int], int | None] = {}
        self._closed = threading.Event()
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix=f"enc-{worker}")
        self._uploader = ThreadPoolExecutor(2, thread_name_prefix=f"up-{worker}")
        self._poller = ThreadPoolExecutor(fragments + 2, thread_name_prefix=f"poll-{worker}")

    def __len__(self) -> int:
        return len(self._rounds)

    # -- sending -------------------------------------------------------------------
    def send(self, p: int, r: int, delta: torch.Tensor, *, tokens: int, final: bool,
             step: int, tau_next: int | None = None) -> None:
        """Encode (with the residual), upload and await the mean of round ``r`` of
        fragment ``p``, all in the background. ``tau_next``: this worker's proposal
        for the next merge point's tau (``overlap: auto``), kept in the commit."""
        previous = self._rounds.get((p, r - 1))
        extra: dict = {"final": final, "step": step}
        if tau_next is not None:
            extra["tau_next"] = int(tau_next)
        encoded = self._encoder.submit(self._encode, p, r, delta, previous)
        uploaded = self._uploader.submit(self._upload, encoded, tokens, extra)
        mean = self._poller.submit(self._poll_mean, p, r, time.monotonic())
        self._rounds[(p, r)] = Round(p, r, encoded, uploaded, mean)

    def _encode(self, p: int, r: int, delta: torch.Tensor, previous: Round | None) -> Prepared:
        """Encode ``delta`` plus the fragment's residual. The sum, and then the new
        residual, are written over the old residual (nothing else reads it while an
        encode runs: a checkpoint drains first), so a round allocates only what the
        codec returns; ``delta`` itself is left as it was."""
        if not self.feedback:
            return self.exchange.prepare_delta(p, r, self.worker, delta.numpy())
        if previous is not None:
            previous.encoded.result()  # its residual is set when it finishes
        residual = self.residual[p]
        x = rules.with_residual(delta, residual, self.config.codec.error_decay, out=residual)
        prepared = self.exchange.prepare_delta(p, r, self.worker, x.numpy())
        self.residual[p] = rules.residual_of(x, torch.from_numpy(prepared.decoded),
                                             out=residual)
        return prepared

    def _upload(self, encoded: Future, tokens: int, extra: dict) -> Published:
        prepared: Prepared = encoded.result()
        return outlast(  # a retried publish is safe: fresh payload, create-only commit
            lambda: self.exchange.publish_prepared(prepared, tokens=tokens, extra=extra),
            patience_s=self.config.liveness.outage_s, log=log, stop=self._closed.is_set,
            pause_s=self.config.liveness.poll_max_s, what=f"worker {self.worker}: send of fragment {prepared.fragment} round "
                 f"{prepared.round}",
        )

    def _poll_mean(self, p: int, r: int, sent_at: float | None = None
                   ) -> tuple[np.ndarray, dict]:
        """Poll until the mean of (p, r) is committed; ``tau.arrived`` is told the time
        since ``sent_at`` (and the lag behind the last peer's send) before the future
        is done, so a merge that waited on it finds the measurement in place."""
        delay = self.config.liveness.poll_interval_s
        what = f"worker {self.worker}: wait for the mean of fragment {p} round {r}"
        while not self._closed.is_set():
            got = outlast(lambda: self._fetch_mean(p, r), what=what, log=log,
                          patience_s=self.config.liveness.outage_s, stop=self._closed.is_set,
                          pause_s=self.config.liveness.poll_max_s)
            if got is not None:
                latency = None if sent_at is None else time.monotonic() - sent_at
                lag = 0.0
                if self.agree:
                    self._agreed[(p, r)], lag = self._proposals(p, r, got[1])
                if latency is not None:
                    self.tau.arrived(latency, lag)
                return got
            self._closed.wait(delay)
            delay = min(delay * 1.5, self._poll_max())
        raise RuntimeError(f"worker {self.worker}: stopped while waiting for fragment {p} round {r}")

    def _poll_max(self) -> float:
        """The longest pause between two polls for a mean (``overlap: auto``: one inner
        step, `diloco.overlap.AutoOverlap.poll_max`)."""
        return self.tau.poll_max(self.config.liveness.poll_interval_s, self.config.liveness.poll_max_s)

    def _proposals(self, p: int, r: int, commit: dict) -> tuple[int | None, float]:
        """The largest ``tau_next`` of the contributions the mean counted on time
        (weight keys without ``@``): the same for every worker, as the commits are;
        and how long after this worker's commit the last of them was created (0 when
        this worker's is not among them or a time is missing)."""
        found, created = [], {}
        for w in sorted(k for k in commit.get("weights", {}) if "@" not in k):
            got = outlast(lambda w=w: self.exchange.delta_commit(p, r, w), log=log,
                          what=f"worker {self.worker}: read the tau proposal of {w}",
                          patience_s=self.config.liveness.outage_s, stop=self._closed.is_set,
                          pause_s=self.config.liveness.poll_max_s)
            if got.get("tau_next") is not None:
                found.append(int(got["tau_next"]))
            if got.get("created"):
                created[w] = datetime.fromisoformat(got["created"])
        lag = 0.0
        if self.worker in created:
            lag = (max(created.values()) - created[self.worker]).total_seconds()
        return max(found, default=None), lag

    def agreed_tau(self, p: int, r: int) -> int | None:
        """The tau the workers agreed on after (p, r) (its mean must have arrived)."""
        return self._agreed.get((p, r))

    def _fetch_mean(self, p: int, r: int) -> tuple[np.ndarray, dict] | None:
        if self.exchange.from_peers:  # the others' contributions only: ours is here
            return self.exchange.fetch_mean(p, r, self._known(p, r))
        return self.exchange.fetch_mean(p, r)

    def _known(self, p: int, r: int) -> dict[str, np.ndarray]:
        """This worker's own committed contribution to (p, r), when it is held: a
        peers mean then reads only the others'."""
        sent = self._rounds.get((p, r))
        if sent is None or not sent.uploaded.done() or sent.uploaded.exception() is not None:
            return {}
        published = sent.uploaded.result()
        if published.commit.get("unusable"):
            return {}
        return {self.worker: np.asarray(published.decoded)}

    # -- what the rules read -------------------------------------------------------
    def get(self, p: int, r: int) -> Round:
        return self._rounds[(p, r)]

    def of(self, p: int, upto: int | None = None) -> list[Round]:
        """The rounds of fragment ``p`` still held (up to round ``upto``), in order."""
        return [s for (q, k), s in sorted(self._rounds.items())
                if q == p and (upto is None or k <= upto)]

    def owed(self, p: int, upto: int | None = None) -> list[Round]:
        """Rounds of ``p`` (up to ``upto``) whose others' part is not applied yet."""
        return [s for s in self.of(p, upto) if not s.correction_applied]

    def own(self, sent: Round) -> torch.Tensor:
        """This worker's decoded contribution as the aggregator sees it (the
        committed value once uploaded: a restarted worker's earlier commit wins)."""
        _check_held(sent, self.worker)
        if sent.uploaded.done():
            return torch.from_numpy(np.asarray(sent.uploaded.result().decoded))
        return torch.from_numpy(np.asarray(sent.encoded.result().decoded))

    def mean(self, sent: Round) -> torch.Tensor:
        """The round's mean ``delta^(k)``, which must have arrived (no wait here)."""
        if not sent.arrived:
            raise RuntimeError(f"worker {self.worker}: the mean of fragment "
                               f"{sent.fragment} round {sent.round} has not arrived")
        _check_held(sent, self.worker)
        return torch.from_numpy(np.asarray(sent.mean.result()[0]))

    def arrived(self, sent: Round) -> rules.Arrived:
        """The round's mean (which must have arrived) with this worker's part."""
        return rules.Arrived(self.mean(sent), self.own(sent), sent.own_weight)

    def wait_arrival(self, p: int, r: int, timeout: float | None = None) -> bool:
        """Whether the mean of fragment ``p`` round ``r`` has reached this worker,
        waiting up to ``timeout`` seconds for it; an observer's wait, not counted as
        a merge's. A round no longer held was fully applied, so its mean came."""
        sent = self._rounds.get((p, r))
        if sent is None:
            return True
        wait_futures([sent.mean], timeout=timeout)
        return sent.mean.done() and sent.mean.exception() is None

    def wait_mean(self, sent: Round) -> tuple[np.ndarray, dict]:
        """The mean of ``sent``'s round and its commit, waiting for it if need be
        (timed: ``on_wait``). Raises `MergeAbandoned` once ``stop`` is set and the
        mean has not come within ``stop_patience_s``."""
        future, p, r = sent.mean, sent.fragment, sent.round
        if future.done():
            return future.result()
        start = time.perf_counter()
        self.waiting_for = (p, r)
        stopped_at = None
        told = 0.0
        try:
            while True:
                try:
                    value = future.result(timeout=0.25)
                    break
                except TimeoutError:
                    waited = time.perf_counter() - start
                    if waited - told >= self.config.liveness.stall_after_s:
                        told = waited  # never wait silently: say so every stall_after_s
                        log.warning("worker %s: waiting %.0f s for the mean of fragment %d "
                                    "round %d (is the aggregator running? `diloco status` "
                                    "says who it waits for)", self.worker, waited, p, r)
                        if self.on_stall is not None:
                            self.on_stall(p, r, waited)
                    if self._abandon is None or not self._abandon.is_set():
                        continue
                    now = time.perf_counter()
                    stopped_at = stopped_at or now
                    if now - stopped_at >= self.stop_patience_s:
                        raise MergeAbandoned(self.worker, p, r, now - start) from None
        finally:
            self.waiting_for = None
        self._on_wait(time.perf_counter() - start)
        return value

    # -- housekeeping --------------------------------------------------------------
    def forget(self, p: int) -> None:
        """Drop rounds of ``p`` that are fully applied and no longer referenced."""
        done = [s for s in self.of(p) if s.settled]
        # keep the newest one (error feedback waits for its encode, overlap auto reads
        # its agreed tau, a checkpoint records it), without its values
        for s in done[:-1]:
            del self._rounds[(p, s.round)]
            self._agreed.pop((p, s.round), None)
        if done:
            done[-1].release()

    def drain(self) -> None:
        """Wait until every round sent so far is committed to the store."""
        for sent in self._rounds.values():
            sent.uploaded.result()

    def reset(self) -> None:
        """Forget every round (after :meth:`drain`) and the residuals: a rebase."""
        self._rounds.clear()
        self.residual[:] = [None] * len(self.residual)

    def close(self) -> None:
        """Stop background threads (without waiting for rounds in flight)."""
        self._closed.set()
        for pool in (self._encoder, self._uploader, self._poller):
            pool.shutdown(wait=True, cancel_futures=True)

    # -- checkpoint and resume -----------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict:
        """The residuals (``copy=False``: themselves) and the rounds held, once
        committed (:meth:`drain` first): their own values are read back from the
        store on resume, not kept here."""
        return {
            "residual": [r if r is None or not copy else r.clone() for r in self.residual],
            "sent": [
                {"fragment": s.fragment, "round": s.round, "own_weight": s.own_weight,
                 "own_applied": s.own_applied, "correction_applied": s.correction_applied}
                for s in self._rounds.values()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Take :meth:`state_dict` back: own values from the store, means awaited
        again."""
        self.residual[:] = [None if r is None else r.clone() for r in state["residual"]]
        for entry in state["sent"]:
            p, r = int(entry["fragment"]), int(entry["round"])
            try:
                value, commit = self.exchange.fetch_delta(p, r, self.worker)
            except BAD_CONTRIBUTION as exc:
                # The aggregator rejects it (the mean counts it with weight 0); the
                # value only served to take the own part back out of an eager
                # correction, so zero is the one left. Failing here would fail for
                # ever: a commit is never replaced.
                log.warning("worker %s: its own contribution to fragment %d round %d "
                            "is unusable (%s: %s); going on without it", self.worker, p, r,
                            type(exc).__name__, exc)
                value = np.zeros(self.exchange.manifest.numel(p), dtype=np.float32)
                commit = {"unusable": f"{type(exc).__name__}: {exc}"}
            done: Future = Future()
            done.set_result(Published(value, commit, False))
            mean = self._poller.submit(self._poll_mean, p, r)
            self._rounds[(p, r)] = Round(
                p, r, done, done, mean,
                own_applied=bool(entry["own_applied"]),
                correction_applied=bool(entry["correction_applied"]),
                own_weight=float(entry["own_weight"]),
            )
