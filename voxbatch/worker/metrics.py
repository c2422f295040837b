"""Prometheus metrics of a worker process, and the small load exporter the autoscaler reads.

Two things live here, both dependency-light (prometheus_client, and redis for the exporter):

* `Metrics`: what one worker process (one GPU, or one LLM+flow GPU pair) reports. The pipeline calls
  a handful of methods (`batch_done`, `segment_stored`, `segment_failed`); everything else, queue
  depths included (`track_queues`), is read at scrape time. Labels are only `worker` and `gpu`, fixed
  per process, so the number of time series does not grow with jobs or segments. prometheus_client's metric objects are
  thread-safe, so engine, upload and Celery threads may call in at once.

* The load exporter (`python -m voxbatch.worker.metrics`): serves `voxbatch_segments_outstanding`, read from
  the Redis key `vb:load` at every scrape, as Prometheus text on `/metrics` and as JSON on
  `/load` (what KEDA's `metrics-api` scaler reads). It runs as its own tiny CPU deployment, so it
  answers while the worker fleet is scaled to zero.

Why a counter key rather than the queue length: a Celery task that a worker has prefetched or is
running is no longer in the broker list (kombu keeps it in its `unacked` hash), so `LLEN render`
reads 0 while every GPU is busy, and an autoscaler driven by it scales the busy fleet down.
`vb:load` counts segments enqueued and not yet finished (done or failed for good), across all
jobs: queued + reserved + running.

The key (owned by voxbatch/jobstate.py, which documents it; read-only here):

    vb:load   integer   segments enqueued and not yet finished, across jobs:
                        INCRBY total when a job is created (before its render tasks are sent),
                        DECR 1 in the same Lua script that first records a segment done or failed,
                        DECRBY the unfinished remainder when a job is cancelled,
                        INCRBY the re-opened count when failed segments are retried.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

# The Redis key the autoscaler's load comes from (see the module docstring for who maintains it).
LOAD_KEY = "vb:load"

# Batch sizes are powers of two up to the engine's largest batch.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Real-time factor (synthesis wall seconds per audio second): < 1 is faster than real time.
RTF_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0)
# Encode + PUT of one segment object, in seconds.
UPLOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_LABELS = ("worker", "gpu")


class _GpuMemoryCollector(Collector):
    """Reports `torch.cuda.memory_allocated` per device, only where torch is already in use.

    It never imports torch and never initializes CUDA: a producer or assembler process has no torch,
    and a scrape from the HTTP thread must not create a CUDA context in a process that may fork.
    """

    def __init__(self, worker: str, gpu: str):
        self._labels = (worker, gpu)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "voxbatch_gpu_memory_allocated_bytes",
            "Bytes held by tensors on each CUDA device this process uses (torch.cuda.memory_allocated).",
            labels=[*_LABELS, "device"],
        )
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_available() and cuda.is_initialized():
            for index in range(cuda.device_count()):
                family.add_metric([*self._labels, f"cuda:{index}"], float(cuda.memory_allocated(index)))
        yield family


class Metrics:
    """The metrics of one worker process, in its own registry (none of it is process-global).

    `registry=None` makes a fresh `CollectorRegistry`, so two instances in one process (tests, the
    embedded renderer) never collide; pass a registry to share one.
    """

    def __init__(self, registry: CollectorRegistry | None = None, worker: str = "", gpu: str = ""):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"worker": worker, "gpu": gpu}

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, _LABELS, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, _LABELS, registry=self.registry).labels(**labels)

        self.segments_rendered = counter(
            "voxbatch_segments_rendered", "Segments synthesized and stored (one per segment object written).")
        self.audio_seconds_rendered = counter(
            "voxbatch_audio_seconds_rendered", "Seconds of audio in the segments stored.")
        self.segment_failures = counter(
            "voxbatch_segment_failures", "Segment attempts that failed (synthesis or upload).")
        self.synthesis_seconds = counter(
            "voxbatch_synthesis_seconds",
            "Wall seconds the engine spent synthesizing batches; its rate is the GPU's busy fraction.")
        self.batch_size = histogram(
            "voxbatch_batch_size", "Segments per engine batch.", BATCH_SIZE_BUCKETS)
        self.real_time_factor = histogram(
            "voxbatch_batch_real_time_factor",
            "Synthesis wall seconds per second of audio produced, per batch (lower is faster).", RTF_BUCKETS)
        self.upload_seconds = histogram(
            "voxbatch_upload_seconds", "Encode + store latency of one segment object.", UPLOAD_BUCKETS)
        self.intake_queue_depth = gauge(
            "voxbatch_intake_queue_depth", "Segments waiting for the engine in this process.")
        self.output_queue_depth = gauge(
            "voxbatch_output_queue_depth",
            "Finished audio waiting for the upload threads (the double buffer); full means storage is the bottleneck.")
        self.registry.register(_GpuMemoryCollector(worker, gpu))

    # -- what the pipeline calls ---------------------------------------------------------------

    def batch_done(self, size: int, audio_s: float, wall_s: float) -> None:
        """One engine batch finished: `size` segments, `audio_s` seconds of audio in `wall_s` seconds."""
        self.batch_size.observe(size)
        self.synthesis_seconds.inc(max(wall_s, 0.0))
        if audio_s > 0:
            self.real_time_factor.observe(wall_s / audio_s)

    def segment_stored(self, audio_s: float, upload_s: float) -> None:
        """One segment object was written to storage."""
        self.segments_rendered.inc()
        self.audio_seconds_rendered.inc(max(audio_s, 0.0))
        self.upload_seconds.observe(max(upload_s, 0.0))

    def segment_failed(self) -> None:
        self.segment_failures.inc()

    def track_queues(self, intake: Any, output: Any) -> None:
        """Read both depths from `queue.Queue`-like objects (`qsize()`) at every scrape instead."""
        self.intake_queue_depth.set_function(intake.qsize)
        self.output_queue_depth.set_function(output.qsize)

    def serve(self, port: int, addr: str = "0.0.0.0") -> ThreadingWSGIServer:
        """Serve this registry on `http://addr:port/metrics` from a daemon thread; returns the server
        (call `.shutdown()` to stop it; `.server_port` is the bound port when `port` is 0)."""
        return serve(make_wsgi_app(self.registry), port, addr)

    start_http_server = serve


# -- the load exporter --------------------------------------------------------------------------


class LoadCollector(Collector):
    """Reads the outstanding-segment counter and the render queue length from Redis at each scrape."""

    def __init__(self, redis_client: Any, render_queue: str = "render", load_key: str = LOAD_KEY):
        self._redis = redis_client
        self._render_queue = render_queue
        self._load_key = load_key

    def read(self) -> dict[str, int]:
        raw_load, queued = self._redis.pipeline(transaction=False).get(self._load_key).llen(
            self._render_queue).execute()
        # Clamp at 0: a counter that drifted negative (a state key expired mid-job) must not read as
        # negative demand.
        return {"segments_outstanding": max(int(raw_load or 0), 0), "render_queue_length": int(queued)}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            values = self.read()
        except Exception:  # noqa: BLE001 - a scrape must answer (up=0) even while Redis is unreachable
            yield GaugeMetricFamily("voxbatch_load_up", "1 when Redis answered this scrape.", value=0)
            return
        yield GaugeMetricFamily("voxbatch_load_up", "1 when Redis answered this scrape.", value=1)
        yield GaugeMetricFamily(
            "voxbatch_segments_outstanding",
            f"Segments enqueued and not yet finished, across jobs (Redis {self._load_key}): queued + reserved + running.",
            value=values["segments_outstanding"])
        yield GaugeMetricFamily(
            "voxbatch_render_queue_length",
            "Render tasks still in the broker list (excludes tasks reserved or running on workers).",
            value=values["render_queue_length"])


def load_app(collector: LoadCollector) -> Callable:
    """WSGI app: `/load` answers JSON for KEDA's metrics-api scaler (503 while Redis is unreachable),
    `/healthz` answers 200 while the process serves, anything else is Prometheus text."""
    registry = CollectorRegistry()
    registry.register(collector)
    prometheus = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "3")])
            return [b"ok\n"]
        if environ.get("PATH_INFO") == "/load":
            try:
                body = json.dumps(collector.read()).encode()
                status = "200 OK"
            except Exception as exc:  # noqa: BLE001 - any Redis failure is a 503 for the scaler
                body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                status = "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return prometheus(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Scrapes every few seconds would flood the log."""


def serve(app: Callable, port: int, addr: str = "0.0.0.0") -> ThreadingWSGIServer:
    """Run a WSGI app on a threading server in a daemon thread."""
    httpd = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name=f"metrics-http-{port}", daemon=True).start()
    return httpd


def main(argv: list[str] | None = None) -> None:
    """`python -m voxbatch.worker.metrics --port 9400`: the load exporter, with broker URL and queue from Settings."""
    import redis

    from voxbatch.settings import load_settings

    parser = argparse.ArgumentParser(prog="python -m voxbatch.worker.metrics", description=main.__doc__)
    parser.add_argument("--port", type=int, default=9400)
    parser.add_argument("--addr", default="0.0.0.0")
    args = parser.parse_args(argv)
    settings = load_settings()
    collector = LoadCollector(redis.Redis.from_url(settings.broker_url), settings.render_queue)
    httpd = make_server(args.addr, args.port, load_app(collector), ThreadingWSGIServer, handler_class=_QuietHandler)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
