"""The trainer side's Prometheus gauge: `pinned_eval_spool_depth{run}`, the requests written to the
spool and not delivered yet (a growing depth: the orchestrator is unreachable or refusing).

Off unless the trainer calls `register_spool_depth(client)`; prometheus_client is imported then
only (the `prometheus` extra), so `import trainer_integration` needs neither it nor Prefect. The
gauge goes on the registry the trainer already serves (the default one unless given); `port`
also serves that registry at `http://host:port/metrics`, host 127.0.0.1 unless given. The value
is read at each scrape (the spool's entry files counted, none read); the label is the run name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

from trainer_integration.spool import Spool

EXTRA_HINT = "pip install 'pinned-eval[prometheus]'"


class _HasSpool(Protocol):
    run: str
    spool: Spool


class SpoolDepthCollector:
    """`pinned_eval_spool_depth{run}` of every spool added (one collector per registry)."""

    def __init__(self) -> None:
        self._spools: dict[str, Spool] = {}
        self._lock = threading.Lock()

    def add(self, run: str, spool: Spool) -> None:
        with self._lock:
            self._spools[run] = spool

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily("pinned_eval_spool_depth", "Spooled requests not delivered yet, by run.",
                                  labels=["run"])
        with self._lock:
            spools = sorted(self._spools.items())
        for run, spool in spools:
            gauge.add_metric([run], spool.depth())
        yield gauge


_collectors: dict[int, SpoolDepthCollector] = {}
_collectors_lock = threading.Lock()


def register_spool_depth(
    client: _HasSpool, *, registry: Any = None, port: int | None = None, host: str = "127.0.0.1"
) -> str | None:
    """Add `client`'s spool (an `EvalClient`) to the `pinned_eval_spool_depth` gauge of `registry`
    (default: prometheus_client's). With `port`: serve that registry there too (0: any free port);
    returns the URL, else None. Raises ImportError naming the `prometheus` extra without
    prometheus_client."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(f"register_spool_depth: needs prometheus_client: {EXTRA_HINT}") from exc
    registry = registry if registry is not None else prometheus_client.REGISTRY
    with _collectors_lock:
        collector = _collectors.get(id(registry))
        if collector is None:
            collector = _collectors[id(registry)] = SpoolDepthCollector()
            registry.register(collector)
    collector.add(client.run, client.spool)
    if port is None:
        return None
    server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    return f"http://{bound_host}:{bound_port}/metrics"
