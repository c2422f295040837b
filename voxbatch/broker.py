"""The Redis broker as voxbatch runs it: malformed messages are dropped, running tasks stay visible.

Two things kombu's Redis transport does not do for us:

- **Hostile list entries.** Anyone who can write to Redis can push anything onto the render list.
  kombu decodes each entry it pops as a JSON envelope; a non-JSON entry raised `JSONDecodeError` out
  of the worker's event loop, which Celery treats as unrecoverable (the worker exited, was restarted,
  and died again on the next entry). `Transport` here logs such an entry once and drops it (it is
  already off the list), and drops envelopes that lack what kombu needs to even acknowledge them.
  Inside a well-formed envelope, Celery refuses what it cannot run (a body that does not decode,
  a content type other than JSON, an unknown task name); `Consumer` makes each of those one log line
  (Celery's own logs a traceback and a dump of the body) and drops the message. The arguments of a
  render task are the task's to validate (worker/messages.py).

- **Dead workers' tasks, and only theirs.** A task a worker has taken sits in kombu's `unacked` hash, indexed by the
  time it was taken in the `unacked_index` sorted set; any worker restores one older than the
  visibility timeout to the queue. With a timeout above the longest task (the old setting: an hour),
  a SIGKILLed worker's tasks waited an hour. `TaskHeartbeat` lets the timeout be short instead: every
  `task_heartbeat_s` each worker moves the index entries of the tasks it is running to "now", so a
  live worker's task never looks old and a dead worker's comes back within the timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Empty

log = logging.getLogger(__name__)

# kombu's key for the unacked index (its default `unacked_index_key`, no global key prefix).
UNACKED_INDEX = "unacked_index"


def _envelope_problem(message: object) -> str | None:
    """Why a decoded list entry is not a kombu envelope this transport can deliver, or None."""
    if not isinstance(message, dict):
        return f"a JSON {type(message).__name__}, not an object"
    props = message.get("properties")
    if not isinstance(props, dict):
        return "no 'properties' object"
    if not isinstance(props.get("delivery_tag"), str):
        return "no string 'properties.delivery_tag'"
    info = props.get("delivery_info")
    if not isinstance(info, dict) or not isinstance(info.get("routing_key"), str) or "exchange" not in info:
        return "no 'properties.delivery_info' with exchange and routing_key"
    if props.get("body_encoding") not in (None, "base64"):
        return "unknown body_encoding"
    if not isinstance(message.get("body"), str):
        return "no string 'body'"
    if not isinstance(message.get("headers", {}), (dict, type(None))):
        return "'headers' is not an object"
    return None


class Channel(kombu_redis.Channel):
    # kombu hands every message this channel holds back to the queue when the channel closes, which
    # includes a lost connection (a Redis restart): the tasks still running here were then delivered
    # to another worker too and their segments rendered and written twice. Held messages stay where
    # they are instead: the worker finishes and acks them, the heartbeat keeps them fresh meanwhile,
    # and if the worker dies the visibility timeout brings them back. (Graceful shutdown does not
    # need the restore either: unfinished tasks are rejected with requeue, worker/main.py.)
    do_restore = False

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except (ValueError, TypeError, KeyError) as e:
            # The entry was popped (BRPOP) and could not be decoded into a message (JSON, UTF-8 or
            # base64 body), so nothing of it was recorded as unacked: dropping it is all there is to do.
            log.error("dropped an undecodable broker message: %s: %.200s", type(e).__name__, e)
            raise Empty() from None

    def _get(self, queue):
        try:
            return super()._get(queue)
        except (ValueError, TypeError) as e:
            log.error("dropped an undecodable broker message from %r: %s: %.200s", queue, type(e).__name__, e)
            raise Empty() from None


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the guards above; selected by `broker_transport` (celery_app.py)."""

    Channel = Channel

    def _deliver(self, message, queue):
        problem = _envelope_problem(message)
        if problem is not None:
            log.error("dropped a malformed broker message from %r: %s", queue, problem)
            return
        super()._deliver(message, queue)


class Consumer(CeleryConsumer):
    """Celery's consumer, with one-line reports of messages it cannot run (`worker_consumer`)."""

    def on_decode_error(self, message, exc):
        log.error("dropped a broker message whose body does not decode (content type %.60r): %s: %.200s",
                  message.content_type, type(exc).__name__, exc)
        message.ack()

    def on_unknown_task(self, body, message, exc):
        log.error("dropped a message for unknown task %.80r", (message.headers or {}).get("task"))
        message.reject_log_error(log, self.connection_errors)

    def on_invalid_task(self, body, message, exc):
        log.error("dropped an invalid task message: %s: %.200s", type(exc).__name__, exc)
        message.reject_log_error(log, self.connection_errors)


class TaskHeartbeat:
    """Keeps the tasks this process holds from looking abandoned (see the module docstring).

    A task counts from the moment the consumer receives it (Celery's `task_received`: its kombu
    delivery tag is known there) until it has run (`task_postrun`) or was revoked; `install` wires
    the signals. A daemon thread refreshes their `unacked_index` scores. Redis errors are logged and
    the next beat tries again: a missed beat costs nothing until the visibility timeout, which is
    several beats long.
    """

    def __init__(self, client: redis.Redis, interval_s: float):
        self.r, self.interval_s = client, interval_s
        self._tags: dict[str, str] = {}  # task id -> delivery tag
        self._lock = threading.Lock()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="task-heartbeat", daemon=True)

    def start(self) -> "TaskHeartbeat":
        self._thread.start()
        return self

    def holding(self, task_id: str, tag: str) -> None:
        with self._lock:
            self._tags[task_id] = tag

    def released(self, task_id: str) -> None:
        with self._lock:
            self._tags.pop(task_id, None)

    def beat(self) -> int:
        """Refresh every held task's index entry now; returns how many were refreshed."""
        with self._lock:
            tags = list(self._tags.values())
        if not tags:
            return 0
        now = time.time()
        # XX: only entries that still exist (an acked task's entry is gone and must stay gone).
        self.r.zadd(UNACKED_INDEX, {t: now for t in tags}, xx=True)
        return len(tags)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self.beat()
                if self._failing:
                    log.warning("task heartbeat: Redis answers again")
                self._failing = False
            except Exception as e:  # noqa: BLE001 - keep beating; the visibility timeout spans several beats
                if not self._failing:
                    log.warning("task heartbeat: %s: %s (retrying every %.0f s)", type(e).__name__, e, self.interval_s)
                self._failing = True


def install_heartbeat(broker_url: str, interval_s: float) -> TaskHeartbeat:
    """Start a heartbeat for the Celery tasks this process holds (render workers and the assembler)."""
    from celery import signals

    heartbeat = TaskHeartbeat(redis.Redis.from_url(broker_url, socket_timeout=10), interval_s).start()

    def on_received(request=None, **_) -> None:
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if isinstance(tag, str) and request.id:
            heartbeat.holding(request.id, tag)

    def on_done(task_id=None, request=None, **_) -> None:
        task_id = task_id or getattr(request, "id", None)
        if task_id:
            heartbeat.released(task_id)

    signals.task_received.connect(on_received, weak=False)
    signals.task_postrun.connect(on_done, weak=False)
    signals.task_revoked.connect(on_done, weak=False)
    return heartbeat
