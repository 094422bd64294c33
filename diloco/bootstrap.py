"""The canonical state at the newest clean point of a run, for joiners and healers.

A worker that joins mid-run, returns after its lease lapsed, or has fallen too far
behind does not replay the rounds it missed: it takes the canonical state where the
others are. Merge points are numbered k = 1, 2, ... in schedule order (fragment
``(k - 1) % P``, round ``(k - 1) // P``, after step ``k * H / P``). Let K be the
newest committed merge point; the state after step ``S = K * H / P`` is, for every
fragment, the canonical outer parameters and momentum after its last round merged at
or before K. It is built exactly as the aggregator resumes: the fragment's newest
canonical checkpoint, then the committed means after it replayed with the outer step.
Merge points before K that are not committed yet are waited for (the others have
passed them, so they are being reduced). Right after a merge nothing of this worker is
in flight (tau < H/P), so S is a clean place to start: the live weights are the outer
ones, and the first round it sends is that of merge point K + 1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diloco.config import SyncConfig
from diloco.outer import OuterState
from diloco.run import latest_global, load_initial
from diloco.schedule import Schedule
from storage import layout
from storage.checkpoints import committed_keys, read_checkpoint
from storage.errors import ObjectMissing, PartialObject
from storage.exchange import Exchange

log = logging.getLogger(__name__)


@dataclass
class Frontier:
    """Where a worker (re)starts: after step ``step``, with ``rounds[p]`` rounds of
    fragment p applied and ``outer[p]`` their canonical outer state."""

    merge_point: int
    step: int
    rounds: list[int]
    outer: list[OuterState]


def merge_point(fragments: int, p: int, r: int) -> int:
    """k of (fragment p, round r): the order in which merges happen."""
    return r * fragments + p + 1


def newest_committed(exchange: Exchange, p: int) -> int:
    """The newest round of fragment ``p`` whose mean is committed (-1: none),
    probing forward from its newest canonical checkpoint."""
    latest = latest_global(exchange, p)
    r = -1 if latest is None else latest[0]
    last = exchange.manifest.rounds[p] - 1
    while r < last and exchange.mean_commit(p, r + 1) is not None:
        r += 1
    return r


def rounds_behind(exchange: Exchange, p: int, next_round: int) -> int:
    """How many rounds of fragment ``p`` at or after ``next_round`` are already
    reduced (0: the worker is in time for its next round)."""
    return max(0, newest_committed(exchange, p) - next_round + 1)


def frontier(exchange: Exchange, config: SyncConfig, *, poll_s: float = 0.1,
             timeout_s: float = 600.0, stop: Callable[[], bool] = lambda: False) -> Frontier:
    """The canonical state at the newest committed merge point (see the module)."""
    n = len(exchange.manifest.fragments)
    deadline = time.monotonic() + timeout_s
    while True:
        committed = [newest_committed(exchange, p) for p in range(n)]
        k = max([merge_point(n, p, c) for p, c in enumerate(committed) if c >= 0], default=0)
        need = [(k - p - 1) // n if k >= p + 1 else -1 for p in range(n)]
        need = [min(r, exchange.manifest.rounds[p] - 1) for p, r in enumerate(need)]
        if all(exchange.mean_commit(p, r) is not None for p, r in enumerate(need) if r >= 0):
            try:
                outer = [_state_at(exchange, config, p, r) for p, r in enumerate(need)]
            except _Moved as exc:
                if stop() or time.monotonic() > deadline:
                    raise TimeoutError(f"bootstrap: {exc}, still after {timeout_s:.0f} s"
                                       ) from exc
                log.info("bootstrap: %s; looking again", exc)
                time.sleep(poll_s)
                continue
            step = k * Schedule.of(config.schedule).stride
            step = min(step, exchange.manifest.total_steps)
            return Frontier(k, step, [r + 1 for r in need], outer)
        if stop() or time.monotonic() > deadline:
            raise TimeoutError(f"bootstrap: merge points up to {k} are not all committed "
                               f"after {timeout_s:.0f} s")
        time.sleep(poll_s)


class Unavailable(Exception):
    """What a canonical state is built from is not (or no longer) in the store."""


class _Moved(Unavailable):
    """The aggregator pruned what we were reading: look for the frontier again."""


def _state_at(exchange: Exchange, config: SyncConfig, p: int, r: int) -> OuterState:
    """Fragment ``p``'s canonical outer state after round ``r`` (-1: initial), from its
    newest checkpoint (`_Moved` if that is past ``r``: the frontier moved on)."""
    latest = latest_global(exchange, p) if r >= 0 else None
    if latest is not None and latest[0] > r:
        raise _Moved(f"fragment {p}: the newest checkpoint is round {latest[0]} > {r}")
    try:
        return state_after(exchange, config, p, r)
    except Unavailable as exc:
        raise _Moved(str(exc)) from exc


def state_after(exchange: Exchange, config: SyncConfig, p: int, r: int) -> OuterState:
    """Fragment ``p``'s canonical outer state after its round ``r`` (-1: the initial
    parameters): its newest canonical checkpoint at or before ``r`` (else the initial
    parameters), then the committed means after it replayed through the outer step, as
    the aggregator resumes. Raises `Unavailable` if a checkpoint or mean it needs is
    missing."""
    checkpoints = []
    for key in committed_keys(exchange.store, layout.global_states(p)):
        k = layout.parse_round(key.rsplit("/", 1)[-1][: -len(".json")])
        if k is not None and k <= r:
            checkpoints.append((k, key))
    if not checkpoints:
        state, start = OuterState(load_initial(exchange, p + 1)[p], config.outer.lr, config.outer.momentum), 0
    else:
        k, key = max(checkpoints)
        try:
            arrays, _ = read_checkpoint(exchange.store, key)
        except (ObjectMissing, PartialObject) as exc:  # pruned before or while we read
            raise Unavailable(f"fragment {p}: checkpoint round {k} was pruned") from exc
        momentum = arrays.get("momentum")
        state = OuterState(torch.from_numpy(arrays["params"].copy()), config.outer.lr, config.outer.momentum)
        state.load(torch.from_numpy(arrays["params"].copy()),
                   None if momentum is None else torch.from_numpy(momentum.copy()))
        start = k + 1
    for k in range(start, r + 1):  # the committed means after it, as the aggregator replays
        got = exchange.fetch_mean(p, k)
        if got is None:
            raise Unavailable(f"fragment {p}: the mean of round {k} is not readable")
        mean, commit = got
        if commit.get("weights"):
            state.step(torch.from_numpy(np.asarray(mean)))
    return state


def rounds_committed(exchange: Exchange) -> int:
    """How many rounds every fragment has committed (0: none yet)."""
    n = len(exchange.manifest.fragments)
    return min(newest_committed(exchange, p) for p in range(n)) + 1


def canonical_after(exchange: Exchange, config: SyncConfig,
                    rounds: int | None = None) -> tuple[int, list[torch.Tensor]]:
    """``(rounds, params)``: the canonical parameters (one flat float32 vector per
    fragment) after ``rounds`` rounds of every fragment; ``None``: the newest round
    every fragment has committed (0: the initial parameters). This is what a user
    exports or samples from: the model the aggregator holds at that round.

    Raises ValueError naming the rounds available if ``rounds`` is out of range."""
    done = rounds_committed(exchange)
    if rounds is None:
        rounds = done
    if not 0 <= rounds <= done:
        total = min(exchange.manifest.rounds)
        raise ValueError(
            f"round {rounds} is not available: every fragment has committed rounds "
            f"0..{done} of {total} (0: the initial parameters)")
    n = len(exchange.manifest.fragments)
    return rounds, [state_after(exchange, config, p, rounds - 1).params for p in range(n)]
