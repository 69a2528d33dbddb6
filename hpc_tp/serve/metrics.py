"""``GET /metrics``: what ``hpc-tp serve`` has done so far, in Prometheus' text format, for the
monitoring an HPC center or a cloud runs beside its services (vLLM exposes the like).

Counted on rank 0 as requests finish (``Job.finish``, called by either batcher) and as the HTTP
server refuses them: requests by finish reason, refusals by status, prompt tokens (and of them those
found cached), generated tokens, preemptions (a request's KV blocks given to an older one, the request
prefilled again later); the requests decoding now and those waiting for a row; and
histograms of time to first token and of the whole request, from arrival.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "hpc_tp_"


class Histogram:
    def __init__(self):
        self.counts, self.sum, self.count = [0] * len(BUCKETS_S), 0.0, 0

    def observe(self, seconds: float):
        for i, bound in enumerate(BUCKETS_S):
            self.counts[i] += seconds <= bound
        self.sum += seconds
        self.count += 1

    def lines(self, name: str) -> list[str]:
        buckets = [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(BUCKETS_S, self.counts)]
        return buckets + [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.sum}",
            f"{name}_count {self.count}",
        ]


class ServerMetrics:
    """Thread-safe: handler threads refuse and read, the batcher's thread finishes jobs."""

    def __init__(self):
        self._lock = threading.Lock()
        self.finished, self.refused, self.tokens = Counter(), Counter(), Counter()
        self.started = 0  # jobs handed to the batcher
        self.preemptions = 0  # of the requests answered
        self.ttft, self.latency = Histogram(), Histogram()

    def admitted(self, jobs: int):
        with self._lock:
            self.started += jobs

    def refuse(self, status: int):
        with self._lock:
            self.refused[status] += 1

    def finish(self, job, completion, queued_s: float):
        with self._lock:
            self.finished[completion.finish_reason] += 1
            self.tokens.update(
                prompt=completion.prompt_tokens, cached=completion.cached_tokens, generated=len(completion.ids)
            )
            self.preemptions += completion.preemptions
            self.ttft.observe(queued_s + completion.ttft_s)
            self.latency.observe(time.perf_counter() - job.arrived)

    def embedded(self, job, tokens: int):
        """An embeddings request answered (``serve.embeddings``): counted under finish reason "embedding"."""
        with self._lock:
            self.finished["embedding"] += 1
            self.tokens.update(prompt=tokens)
            self.latency.observe(time.perf_counter() - job.arrived)

    def render(self, waiting: int) -> str:
        with self._lock:
            running = self.started - sum(self.finished.values())
            families = [
                (
                    "requests_total",
                    "counter",
                    "Requests answered, by finish reason.",
                    [f'{PREFIX}requests_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())],
                ),
                (
                    "requests_refused_total",
                    "counter",
                    "Requests refused, by HTTP status.",
                    [f'{PREFIX}requests_refused_total{{code="{c}"}} {n}' for c, n in sorted(self.refused.items())],
                ),
                (
                    "prompt_tokens_total",
                    "counter",
                    "Prompt tokens of the requests answered.",
                    [f"{PREFIX}prompt_tokens_total {self.tokens['prompt']}"],
                ),
                (
                    "prompt_tokens_cached_total",
                    "counter",
                    "Of those, found in the KV cache (prefix caching).",
                    [f"{PREFIX}prompt_tokens_cached_total {self.tokens['cached']}"],
                ),
                (
                    "generation_tokens_total",
                    "counter",
                    "Tokens generated.",
                    [f"{PREFIX}generation_tokens_total {self.tokens['generated']}"],
                ),
                (
                    "preemptions_total",
                    "counter",
                    "Times a request answered gave its KV blocks to an older one and was prefilled again.",
                    [f"{PREFIX}preemptions_total {self.preemptions}"],
                ),
                (
                    "requests_running",
                    "gauge",
                    "Requests handed to the batcher and not finished.",
                    [f"{PREFIX}requests_running {running}"],
                ),
                ("requests_waiting", "gauge", "Requests queued for a row.", [f"{PREFIX}requests_waiting {waiting}"]),
                (
                    "time_to_first_token_seconds",
                    "histogram",
                    "From arrival to the first token.",
                    self.ttft.lines(PREFIX + "time_to_first_token_seconds"),
                ),
                (
                    "request_latency_seconds",
                    "histogram",
                    "From arrival to the last token.",
                    self.latency.lines(PREFIX + "request_latency_seconds"),
                ),
            ]
        out = []
        for name, kind, help_text, lines in families:
            out += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", *lines]
        return "\n".join(out) + "\n"
