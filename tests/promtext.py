"""The Prometheus text kvcd writes, read back with prometheus_client's own parser (the tests'
one reader of it: the unit tests of the text, and the real daemon's textfile)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def goals(got: Samples) -> list[str]:
    """The goal label of each kvcd_instance_info sample (one per instance)."""
    return [dict(labels)["goal"] for name, labels in got if name == "kvcd_instance_info"]
