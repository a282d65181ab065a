"""Server metrics in the Prometheus text exposition format: counters, gauges and histograms, nothing more.

The engine thread writes them and the /metrics handler reads them; a torn read of a float is not possible under the
GIL, and each value is a single attribute.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

PREFIX = "gpt2_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {self.n}"]


@dataclass
class Metrics:
    """What /metrics reports. Gauges are read from the engine when asked (`gauges`)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    requests_rejected: dict[str, int] = field(default_factory=dict)  # queue_full, queue_timeout
    time_to_first_token: Histogram = field(default_factory=Histogram)
    time_per_output_token: Histogram = field(default_factory=Histogram)

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """The exposition text; gauges: name -> (value, help)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, body: list[str]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}", *body])

        for name, (value, help_) in gauges.items():
            metric(name, "gauge", help_, [f"{PREFIX}{name} {value}"])
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [f"{PREFIX}prompt_tokens_total {self.prompt_tokens}"])
        metric("generation_tokens_total", "counter", "Tokens generated.",
               [f"{PREFIX}generation_tokens_total {self.generation_tokens}"])
        metric("requests_finished_total", "counter", "Sequences finished, by reason.",
               [f'{PREFIX}requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.requests_finished.items())])
        metric("requests_rejected_total", "counter", "Requests refused by back-pressure, by reason.",
               [f'{PREFIX}requests_rejected_total{{reason="{k}"}} {v}' for k, v in sorted(self.requests_rejected.items())])
        metric("time_to_first_token_seconds", "histogram", "From arrival to the first generated token.",
               self.time_to_first_token.lines(f"{PREFIX}time_to_first_token_seconds"))
        metric("time_per_output_token_seconds", "histogram", "Between consecutive tokens of a sequence.",
               self.time_per_output_token.lines(f"{PREFIX}time_per_output_token_seconds"))
        return "\n".join(lines) + "\n"

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


def parse(text: str) -> dict[str, float]:
    """Sample lines of an exposition text as {name{labels}: value} (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out

