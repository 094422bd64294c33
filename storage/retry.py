"""Which store errors are worth another attempt, and how patiently to retry them.

Object stores fail transiently all the time: a 503 SlowDown under load, a 500
InternalError, a connection reset in the middle of a body. `is_transient` is our
verdict on one exception (it knows what s3fs and botocore make of S3's answers),
and the one verdict every retry of a store error asks.

Every retry loop of the storage path is a tenacity ``Retrying`` (or
``AsyncRetrying`` in coroutines) made by one of two named policies, so that one
vocabulary says how often and how long:

- `RetryPolicy`: one request. A bounded number of attempts, exponential backoff
  with jitter between them, and a `TransientStoreError` naming the operation when
  the attempts are used up. `ObjectStore` runs it for every operation, and
  storage/multipart.py for every part of a large object; both count each attempt
  and log each retry (`log_retry`).
- `OutagePolicy`: an outage of the store or the link, which lasts minutes where one
  request's retries last seconds. It retries until a deadline counted from the
  first failure and then re-raises the last error. `outlast` applies it to whole
  store operations (which already ran out their `RetryPolicy`); the token shard
  reader (workers/data/lazy.py) to its raw block reads.
"""

from __future__ import annotations

import errno
import http.client
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import ClientError, EndpointConnectionError, HTTPClientError
from botocore.parsers import ResponseParserError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random_exponential,
)
from tenacity.wait import wait_base

from storage.errors import TransientStoreError

_T = TypeVar("_T")

try:  # aiobotocore speaks aiohttp; its payload/connection errors are transient
    from aiohttp import ClientConnectionError, ClientPayloadError

    _AIOHTTP_TRANSIENT: tuple[type[BaseException], ...] = (
        ClientConnectionError,
        ClientPayloadError,
    )
except ImportError:  # pragma: no cover - aiohttp comes with aiobotocore
    _AIOHTTP_TRANSIENT = ()

#: S3 error codes worth another attempt. SlowDown/ServiceUnavailable are 503s,
#: InternalError a 500, the two 409s are documented by AWS as "retry the upload".
TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)

#: errno values that mean "the network or the server hiccupped". EBUSY and
#: EREMOTEIO are what s3fs.errors.translate_boto_error turns SlowDown/503 and
#: InternalError/500 into when it drops the botocore cause.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.ECONNREFUSED,
        errno.EAGAIN,
        errno.EBUSY,
        getattr(errno, "EREMOTEIO", errno.EIO + 1000),
    }
)

# Decisive exception types. OSError subclasses first: they are what s3fs makes of
# 404/403/412, and what a retry can never fix.
_NEVER_TRANSIENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
)
# ConnectionError covers ConnectionResetError/RefusedError/AbortedError and
# BrokenPipeError; TimeoutError is asyncio.TimeoutError and fsspec's FSTimeoutError;
# HTTPClientError covers botocore's EndpointConnectionError, ConnectionClosedError,
# ReadTimeoutError and ConnectTimeoutError, which s3fs lets through untranslated.
# ResponseParserError: throttling responses sometimes carry broken XML (s3fs #484).
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    HTTPClientError,
    ResponseParserError,
    http.client.IncompleteRead,
    *_AIOHTTP_TRANSIENT,
)


def _client_error_verdict(exc: BaseException) -> bool | None:
    response = getattr(exc, "response", None)
    if not isinstance(exc, ClientError) or not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in TRANSIENT_S3_CODES or code in ("500", "502", "503", "504"):
        return True
    # 501 NotImplemented is a server that lacks a feature: retrying cannot help.
    return status == 429 or (status >= 500 and status != 501)


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is a fault worth retrying (5xx, throttling, a dropped
    connection), False for anything a retry cannot fix (missing key, access
    denied, precondition failed, bad request).

    Walks the exception and its causes in order; the first one that says
    something decides. That matters for s3fs, which re-raises botocore's
    ``ClientError`` as an ``OSError`` whose ``__cause__`` is the original.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        if isinstance(current, _NEVER_TRANSIENT):
            return False
        verdict = _client_error_verdict(current)
        if verdict is not None:
            return verdict
        if isinstance(current, _TRANSIENT_TYPES):
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry transient store errors.

    Attempt ``i`` (counting from 0) that fails waits about
    ``min(max_delay, base_delay * 2**i)`` seconds, scaled by a random factor in
    [0.5, 1] so that workers that failed together do not retry together.
    ``attempts`` counts every try, the first one included.
    """

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must be >= 0")

    def wait(self) -> wait_base:
        """The backoff as a tenacity wait: ``c/2 + uniform(0, c/2)`` with
        ``c = min(max_delay, base_delay * 2**(n - 1))`` after the n-th failed
        attempt, which is ``c`` times a factor uniform in [0.5, 1] ("equal jitter":
        never less than half the backoff, unlike tenacity's full-jitter
        ``wait_random_exponential`` alone)."""
        half, half_max = self.base_delay / 2, self.max_delay / 2
        return wait_exponential(multiplier=half, max=half_max) + wait_random_exponential(
            multiplier=half, max=half_max
        )

    def retrying(
        self,
        *,
        describe: Callable[[BaseException], str],
        before_sleep: Callable[[RetryCallState], None],
        retry_on: Callable[[BaseException], bool] = is_transient,
        chain: bool = True,
    ) -> Retrying:
        """A tenacity ``Retrying`` for one store operation.

        It retries the exceptions ``retry_on`` calls transient, calling
        ``before_sleep`` before each wait (count and log there); any other
        exception propagates unchanged at once. When the attempts are used up it
        raises `TransientStoreError` ``"<describe(last error)> failed after N
        attempts; last error: <type>: <message>"``, from the last error, or with
        no exception chain if not ``chain``: `is_transient` follows causes, and an
        outer retry of the same request (the store's, around a part's) must not
        start over what an inner one gave up on.
        """

        def give_up(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            assert exc is not None  # tenacity gives up only after a failed attempt
            error = TransientStoreError(
                f"{describe(exc)} failed after {self.attempts} attempts; last error: "
                f"{type(exc).__name__}: {exc}"
            )
            if chain:
                raise error from exc
            raise error from None

        return Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=self.wait(),
            retry=retry_if_exception(retry_on),
            before_sleep=before_sleep,
            retry_error_callback=give_up,
        )

    def async_retrying(self, **options: Any) -> AsyncRetrying:
        """`retrying` (the same keyword arguments) for coroutines: the same attempts,
        backoff and giving up, with the waits as ``asyncio.sleep`` so that the other
        requests of the event loop go on meanwhile."""
        sync = self.retrying(**options)
        return AsyncRetrying(stop=sync.stop, wait=sync.wait, retry=sync.retry,
                             before_sleep=sync.before_sleep,
                             retry_error_callback=sync.retry_error_callback)


def log_retry(
    log: logging.Logger, store: str, what: str, attempts: int, state: RetryCallState
) -> None:
    """Log one retry of a `RetryPolicy` (its ``before_sleep``) as one warning line:
    the store's name, what failed, the attempt, the error and the wait. ``what``
    names the URL, never the storage options (they hold the credentials)."""
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "store %s: %s failed (attempt %d of %d): %s: %s; retrying in %.2fs",
        store or "-",
        what,
        state.attempt_number,
        attempts,
        type(exc).__name__,
        exc,
        state.next_action.sleep if state.next_action else 0.0,
    )


@dataclass(frozen=True)
class OutagePolicy:
    """How long to ride out an outage, and how often to look whether it is over.

    The deadline, ``patience_s``, counts from the first failure, not from the
    first attempt: an operation that ran for minutes before it failed (a
    checkpoint's write) still gets the whole patience. The pause after the n-th
    failure is ``min(max_pause_s, pause_s * 2**(n - 1))``; without
    ``max_pause_s`` every pause is ``pause_s``. The first ``quiet_retries``
    retries are not logged (a brief hiccup is no news).
    """

    patience_s: float
    pause_s: float = 5.0
    max_pause_s: float | None = None
    quiet_retries: int = 0

    def __post_init__(self) -> None:
        if self.patience_s < 0 or self.pause_s < 0 or (self.max_pause_s or 0) < 0:
            raise ValueError("OutagePolicy times must be >= 0")

    def wait(self) -> wait_base:
        """The pauses as a tenacity wait (no jitter: the deadline, not the pace of
        the retries, is what the other workers must agree on)."""
        cap = self.pause_s if self.max_pause_s is None else self.max_pause_s
        return wait_exponential(multiplier=self.pause_s, max=cap)

    def retrying(
        self,
        *,
        retry_on: Callable[[BaseException], bool],
        what: str,
        log: logging.Logger,
        stop: Callable[[], bool] = lambda: False,
    ) -> Retrying:
        """A tenacity ``Retrying`` that calls its function again while it fails
        with an error ``retry_on`` accepts, until ``patience_s`` have passed since
        the first failure or ``stop()`` says to give up; then the last error is
        re-raised as it was. Any other error propagates at once. Each retry is
        logged as ``"<what> (<s> s of at most <patience> s): <error>"``.

        Make one per operation: it remembers when that operation first failed.
        """
        first_failure: list[float] = []

        def outage_s(state: RetryCallState) -> float:
            now = state.outcome_timestamp or time.monotonic()
            if state.attempt_number == 1 or not first_failure:
                first_failure[:] = [now]
            return now - first_failure[0]

        def over(state: RetryCallState) -> bool:
            return outage_s(state) >= self.patience_s or stop()

        def warn(state: RetryCallState) -> None:
            if state.attempt_number > self.quiet_retries:
                exc = state.outcome.exception() if state.outcome else None
                log.warning("%s (%.0f s of at most %.0f s): %s", what, outage_s(state),
                            self.patience_s, exc)

        return Retrying(
            stop=over,
            wait=self.wait(),
            retry=retry_if_exception(retry_on),
            before_sleep=warn,
            reraise=True,
        )


def outlast(
    operation: Callable[[], _T],
    *,
    patience_s: float,
    what: str,
    log: logging.Logger,
    stop: Callable[[], bool] = lambda: False,
    pause_s: float = 5.0,
) -> _T:
    """Run ``operation`` until it gets through an outage of up to ``patience_s``.

    One store operation retries for a few seconds (`RetryPolicy`); an outage of
    the store or the link lasts minutes. The waits that must survive one (a
    worker's upload and its wait for a mean, the aggregator's loop) call their
    operation again after each `TransientStoreError`, pausing ``pause_s``, until
    ``patience_s`` seconds have passed since the first failure (then the last
    error propagates) or ``stop()`` says to give up (an `OutagePolicy`). Only
    `TransientStoreError` is retried: the store raises it once `is_transient`
    has called every error of the operation's attempts transient, so the one
    verdict decides here too. The operation must be safe to repeat: ours are
    reads and create-only commits.
    """
    policy = OutagePolicy(patience_s=patience_s, pause_s=pause_s)
    retrying = policy.retrying(
        retry_on=lambda exc: isinstance(exc, TransientStoreError),
        what=f"{what}: the store keeps failing",
        log=log,
        stop=stop,
    )
    return retrying(operation)


def never_connected(exc: BaseException) -> bool:
    """The store never accepted a connection (a refused port, an endpoint that does
    not resolve): at start-up a wrong URL far likelier than an outage."""
    return isinstance(exc, (EndpointConnectionError, ConnectionRefusedError))
