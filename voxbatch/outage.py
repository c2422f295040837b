"""What counts as a service outage, and the one jittered backoff every retry loop waits with.

An outage is an error that says Redis or storage is unreachable, restarting, overloaded or full for
now, not that the thing being written is wrong: a refused connection, a timeout, Redis loading its
AOF (`BusyLoadingError`) or refusing writes (`OOM`, read-only replica), an S3 5xx or `SlowDown`, a
full local disk. Work that meets one waits for the service and tries again; it never spends a
segment's render attempts and never fails a task (issue 12: a 30 s SeaweedFS stop once turned into
4,000 unrendered segments because these errors were counted as task failures).
"""

from __future__ import annotations

import errno
import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis.exceptions as redis_errors

T = TypeVar("T")

# S3 error codes that mean "the service, not the request": retry later.
_S3_TRANSIENT = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeTooSkewed",
                 "503", "500", "502", "504", "Throttling", "ThrottlingException"}
# Redis replies that mean the server is (re)starting, overloaded or not the primary right now.
_REDIS_TRANSIENT = ("LOADING", "OOM", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "BUSY ")
# Local-disk errors of the storage itself (a full or failing volume), not of one key.
_OS_TRANSIENT = {errno.ENOSPC, errno.EIO, errno.EROFS, errno.ESTALE, errno.EDQUOT, errno.ENETDOWN,
                 errno.ENETUNREACH, errno.EHOSTUNREACH}


def backoff_s(attempt: int, base_ms: float, max_ms: float) -> float:
    """Seconds to wait before try `attempt + 1`: exponential, capped, with full jitter.

    Full jitter (a uniform draw below the cap) spreads the retries of many workers that met the same
    outage at the same moment, so a service coming back is not hit by all of them at once.
    """
    return random.uniform(0, min(max_ms, base_ms * 2 ** max(attempt - 1, 0))) / 1000


def is_outage(exc: BaseException) -> bool:
    """True when `exc`, or an error it was raised from (kombu wraps connection errors in its
    `OperationalError`), says a service is unavailable for now (see the module docstring)."""
    seen = 0
    while exc is not None and seen < 8:
        if _is_outage_error(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@functools.cache
def _library_errors() -> tuple:
    """(kombu's OperationalError, botocore's BotoCoreError, ClientError, and the BotoCoreErrors that are
    outages), each () where its package is missing; imported once, not on every error checked (a worker
    checks one per segment it looks up and does not find)."""
    try:
        from kombu.exceptions import OperationalError  # the broker connection, as Celery's publish reports it
    except ImportError:  # pragma: no cover - kombu comes with celery
        OperationalError = ()  # type: ignore[assignment,misc]
    try:
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError as BotoConnectionError, HTTPClientError
    except ImportError:  # pragma: no cover - botocore is a dependency; stay usable without it
        return OperationalError, (), (), ()
    return OperationalError, BotoCoreError, ClientError, (BotoConnectionError, HTTPClientError)


def _is_outage_error(exc: BaseException) -> bool:
    if isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError)):
        return True  # BusyLoadingError is a ConnectionError
    if isinstance(exc, redis_errors.ResponseError):
        return str(exc).upper().startswith(_REDIS_TRANSIENT)
    if isinstance(exc, (ConnectionError, TimeoutError)):  # the builtins (sockets, urllib3)
        return True
    OperationalError, BotoCoreError, ClientError, boto_outages = _library_errors()
    if OperationalError and isinstance(exc, OperationalError):
        return True
    if BotoCoreError and isinstance(exc, BotoCoreError):
        # Connection, timeout and closed-connection errors; a bad parameter or missing credentials is not.
        return isinstance(exc, boto_outages)
    if ClientError and isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        return str(err.get("Code")) in _S3_TRANSIENT or status >= 500
    if isinstance(exc, OSError):
        return exc.errno in _OS_TRANSIENT
    return False


class OutageTooLong(Exception):
    """A service stayed unavailable longer than the caller's window; carries the last error."""

    def __init__(self, what: str, waited_s: float, error: BaseException):
        super().__init__(f"{what}: unavailable for {waited_s:.0f} s, last error {type(error).__name__}: {error}")
        self.error = error


class Stopped(Exception):
    """The wait for a service was ended by the caller's stop event (the process is shutting down)."""


def wait_for_service(fn: Callable[[], T], what: str, *, log: logging.Logger, base_ms: float = 200,
                     max_ms: float = 5000, window_s: float | None = None,
                     stop: threading.Event | None = None) -> T:
    """`fn()`, retried through outages with `backoff_s` until it returns.

    Non-outage errors propagate at once. The outage is logged once when it starts and once when it
    ends, not at every retry. With `window_s`, an outage longer than that raises `OutageTooLong`;
    a set `stop` event raises `Stopped` instead of waiting further.
    """
    started: float | None = None
    attempt = 0
    while True:
        try:
            value = fn()
        except Exception as e:
            if not is_outage(e):
                raise
            now = time.monotonic()
            if started is None:
                started = now
                log.warning("%s: service unavailable (%s: %s); waiting for it", what, type(e).__name__, e)
            if window_s is not None and now - started >= window_s:
                raise OutageTooLong(what, now - started, e) from e
            attempt += 1
            delay = backoff_s(attempt, base_ms, max_ms)
            if stop is not None:
                if stop.wait(delay):
                    raise Stopped(what) from e
            else:
                time.sleep(delay)
            continue
        if started is not None:
            log.warning("%s: service back after %.1f s", what, time.monotonic() - started)
        return value
