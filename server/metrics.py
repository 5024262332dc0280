"""Request counters and latency histograms, rendered as Prometheus text by GET /metrics.

Counters live in the worker process that served the request: with several
workers, each scrape sees one worker's share (as with any pre-fork server
without a shared registry); store gauges are the same from every worker.
"""

from __future__ import annotations

import threading
from collections import defaultdict

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Thread-safe request counts by (method, route, status) and latency histograms by (method, route)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.buckets: dict[tuple[str, str], list[int]] = {}
        self.sums: dict[tuple[str, str], float] = defaultdict(float)
        self.counts: dict[tuple[str, str], int] = defaultdict(int)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(method, route, status)] += 1
            key = (method, route)
            b = self.buckets.setdefault(key, [0] * len(BUCKETS))
            for i, le in enumerate(BUCKETS):
                if seconds <= le:
                    b[i] += 1
            self.sums[key] += seconds
            self.counts[key] += 1

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text exposition format 0.0.4."""
        out = ["# HELP datastates_http_requests_total HTTP requests answered, by method, route and status.",
               "# TYPE datastates_http_requests_total counter"]
        with self._lock:
            for (m, r, s), n in sorted(self.requests.items()):
                out.append(f'datastates_http_requests_total{{method="{m}",route="{_esc(r)}",status="{s}"}} {n}')
            out += ["# HELP datastates_http_request_duration_seconds Time to answer (headers and body).",
                    "# TYPE datastates_http_request_duration_seconds histogram"]
            for (m, r), b in sorted(self.buckets.items()):
                labels = f'method="{m}",route="{_esc(r)}"'
                for le, n in zip(BUCKETS, b):
                    out.append(f'datastates_http_request_duration_seconds_bucket{{{labels},le="{le}"}} {n}')
                out.append(f'datastates_http_request_duration_seconds_bucket{{{labels},le="+Inf"}} '
                           f'{self.counts[(m, r)]}')
                out.append(f"datastates_http_request_duration_seconds_sum{{{labels}}} {self.sums[(m, r)]:.6f}")
                out.append(f"datastates_http_request_duration_seconds_count{{{labels}}} {self.counts[(m, r)]}")
        for name, (help_, value) in gauges.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        return "\n".join(out) + "\n"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
