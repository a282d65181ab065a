"""The server's Prometheus metrics, through prometheus_client, in a registry of the engine's own (no global state).

The engine thread counts and observes; the /metrics handler renders. Gauges are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..runtime.prefix import PrefixCache

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """What /metrics reports: gpt2_requests_running|waiting, gpt2_slots_busy|total, gpt2_prompt_tokens_total,
    gpt2_generation_tokens_total, gpt2_requests_finished_total{reason}, gpt2_requests_rejected_total{reason}, and
    the histograms gpt2_time_to_first_token_seconds and gpt2_time_per_output_token_seconds; with --speculate,
    gpt2_speculative_draft_tokens_total, gpt2_speculative_accepted_tokens_total and
    gpt2_speculative_verify_passes_total (counted when a sequence finishes); with a prefix cache,
    gpt2_prefix_cache_queries_total and gpt2_prefix_cache_hits_total (prompt tokens looked up, and found: their ratio
    is the hit rate, as vLLM reports it), gpt2_prefix_cache_blocks and gpt2_prefix_cache_capacity_blocks."""

    def __init__(self, running: Callable[[], float], waiting: Callable[[], float], slots: int,
                 prefix: PrefixCache | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        Gauge("gpt2_requests_running", "Sequences in a slot.", registry=r).set_function(running)
        Gauge("gpt2_requests_waiting", "Sequences waiting for a slot.", registry=r).set_function(waiting)
        Gauge("gpt2_slots_busy", "KV-cache slots in use.", registry=r).set_function(running)
        Gauge("gpt2_slots_total", "KV-cache slots (--parallel).", registry=r).set(slots)
        if prefix is not None:
            r.register(PrefixCacheCollector(prefix))
        self.prompt_tokens = Counter("gpt2_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("gpt2_generation_tokens", "Tokens generated.", registry=r)
        self.requests_finished = Counter("gpt2_requests_finished", "Sequences finished, by reason.", ["reason"],
                                         registry=r)
        self.requests_rejected = Counter("gpt2_requests_rejected", "Requests refused by back-pressure, by reason.",
                                         ["reason"], registry=r)
        self.draft_tokens = Counter("gpt2_speculative_draft_tokens", "Tokens drafted for speculative decoding.",
                                    registry=r)
        self.accepted_tokens = Counter("gpt2_speculative_accepted_tokens", "Drafted tokens the model accepted.",
                                       registry=r)
        self.verify_passes = Counter("gpt2_speculative_verify_passes", "Passes that verified drafts.", registry=r)
        self.time_to_first_token = Histogram("gpt2_time_to_first_token_seconds",
                                             "From arrival to the first generated token.", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.time_per_output_token = Histogram("gpt2_time_per_output_token_seconds",
                                               "Between consecutive tokens of a sequence.", buckets=LATENCY_BUCKETS,
                                               registry=r)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class PrefixCacheCollector(Collector):
    """The prefix cache's counters, read when scraped (the engine thread alone writes them)."""

    def __init__(self, prefix: PrefixCache) -> None:
        self.prefix = prefix

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        p, c = self.prefix, self.prefix.counters
        yield CounterMetricFamily("gpt2_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=c.queried)
        yield CounterMetricFamily("gpt2_prefix_cache_hits", "Prompt tokens whose keys and values the prefix cache "
                                  "held.", value=c.hit)
        yield GaugeMetricFamily("gpt2_prefix_cache_blocks", f"Blocks of {p.block} tokens cached.", value=len(p))
        yield GaugeMetricFamily("gpt2_prefix_cache_capacity_blocks", "Blocks the prefix cache holds at most "
                                "(--prefix-cache-mb).", value=p.capacity)


def parse(text: str) -> dict[str, float]:
    """The samples of an exposition text as {name{labels}: value} (for tests and the benchmark)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
