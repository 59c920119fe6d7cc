"""The server's metric updates from engine outputs, without a server: a composite's free drafts."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from verispec.engine.request import RequestOutput
from verispec.metrics import SpecStats
from verispec.server.metrics import MetricsRecorder, ServerMetrics


def value(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_free_drafts_are_counted_apart_and_in_the_totals() -> None:
    metrics = ServerMetrics("m", target="target", draft="draft", drafter="composite")
    recorder = MetricsRecorder(metrics)
    recorder.added("r", 0.0, 5)
    stats = SpecStats()
    for drafted, accepted, free in ((6, 6, True), (3, 1, False), (4, 2, True)):
        stats.observe(drafted, accepted, free)
        out = RequestOutput("r", [1], "x", [1], "x", False, None, stats.merge(SpecStats()), {}, True)
        recorder.output(out, 1.0)
    text = metrics.render().decode()
    assert value(text, "verispec:spec_decode_num_drafts_total") == 3
    assert value(text, "verispec:spec_decode_num_free_drafts_total") == 2
    assert value(text, "verispec:spec_decode_num_free_draft_tokens_total") == 10
    assert value(text, "verispec:spec_decode_num_free_accepted_tokens_total") == 8
