"""deploy/: the Grafana dashboard and the Prometheus alert rules load, and every
metric they use is one Recall exports (or one of the pinned tallies the
transition layer will export), with labels it has. With promtool installed
(.ci/run installs it), the rules pass `promtool check` and their unit tests, and
every dashboard query parses."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from recall_site.metrics import render
from tests.support.factories import make_batch

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "recall-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "recall-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "recall-alerts.test.yml"

# Added by Prometheus to every scraped series.
TARGET_LABELS = {"job", "instance"}
SELECTOR = re.compile(r"\b(recall_[a-z_]+)\b(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*"')


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    return [
        rule for g in yaml.safe_load(RULES.read_text())["groups"] for rule in g["rules"]
    ]


def exported(scrape: bytes) -> dict[str, set[str]]:
    """Every series name a scrape can hold, with its labels."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(scrape.decode()):
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_count", "_sum"],
        }.get(family.type, [""])
        labels = {label for s in family.samples for label in s.labels} - {"le"}
        for suffix in suffixes:
            names[family.name + suffix] = labels | (
                {"le"} if suffix == "_bucket" else set()
            )
    return names


@pytest.mark.django_db
def test_every_metric_used_is_exported_with_its_labels(api):
    make_batch(1)
    assert api.claim().status_code == 200  # so the request counter has a series
    known = exported(render())
    queries = dashboard_queries() + [rule["expr"] for rule in alert_rules()]

    used = set()
    for query in queries:
        for name, selector in SELECTOR.findall(query):
            assert name in known, f"{name} is not a Recall metric ({query})"
            labels = set(MATCHER.findall(selector))
            assert labels <= known[name] | TARGET_LABELS, (name, labels, query)
            used.add(name)
        for grouping in re.findall(r"\bby \(([^)]*)\)", query):
            labels = {label.strip() for label in grouping.split(",")}
            series = {n for n, _ in SELECTOR.findall(query)}
            assert any(labels <= known[n] | TARGET_LABELS for n in series), query

    # The dashboard shows every family Recall exports (a process serving alone
    # also exports *_created, which multiprocess mode does not).
    shown = {n for n in known if not n.endswith(("_count", "_sum", "_created"))}
    assert shown <= used


SERIES = re.compile(r"^(recall_[a-z_]+)(?:\{(.*)\})?$")


@pytest.mark.django_db
def test_the_rule_tests_feed_series_a_scrape_can_hold():
    """The promtool tests' input series are ones /metrics has, label values
    included (a ``kind`` of repairs no scrape holds would test nothing real).
    Request statuses are any HTTP status; every other value is listed by a
    scrape from the start (issue 27, item 9)."""
    values: dict[str, set[tuple[str, str]]] = {}
    for family in text_string_to_metric_families(render().decode()):
        for sample in family.samples:
            values.setdefault(sample.name, set()).update(sample.labels.items())
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for series in test["input_series"]:
            match = SERIES.match(series["series"])
            assert match, series
            name, labels = match[1], match[2] or ""
            assert name in values, f"{name} is not in a scrape"
            pairs = set(re.findall(r'(\w+)="([^"]*)"', labels))
            pairs = {(k, v) for k, v in pairs if k not in TARGET_LABELS}
            if name == "recall_api_requests_total":
                assert {k for k, _ in pairs} == {"endpoint", "status"}, series
                endpoints = {v for k, v in values[name] if k == "endpoint"}
                assert dict(pairs)["endpoint"] in endpoints, series
                assert re.fullmatch(r"[1-5]\d\d", dict(pairs)["status"]), series
            else:
                assert pairs <= values[name], (series, sorted(values[name]))


def test_the_dashboard_is_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())

    assert dashboard["uid"] == "recall-overview"
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert 'job="$job"' in target["expr"], target["expr"]
            assert target["datasource"] == {
                "type": "prometheus",
                "uid": "${datasource}",
            }


def test_the_alert_rules_cover_what_operators_must_hear_about():
    rules = {rule["alert"]: rule for rule in alert_rules()}

    assert "recall_leases_expired_total" in rules["RecallLeasesExpiring"]["expr"]
    assert "recall_oldest_queued_seconds" in rules["RecallOldestQueuedTooOld"]["expr"]
    assert "recall_last_sweep_age_seconds" in rules["RecallSweeperStale"]["expr"]
    assert "recall_reconcile_repairs_total" in rules["RecallRepairs"]["expr"]
    for rule in rules.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert tested == set(rules)  # every rule has a unit test that makes it fire


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None, reason="needs promtool (apt-get install prometheus)"
)
def test_promtool_checks_and_tests_the_rules_and_parses_the_dashboard(tmp_path):
    def promtool(*args: str, cwd: Path = ROOT) -> None:
        result = subprocess.run(
            [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stdout + result.stderr

    promtool("check", "rules", str(RULES))
    promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    # Every dashboard query, as a recording rule, so promtool parses it.
    queries = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:query_{i}",
                        "expr": q.replace("$job", "recall"),
                    }
                    for i, q in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    parsed = tmp_path / "dashboard-queries.yml"
    parsed.write_text(yaml.safe_dump(queries))
    promtool("check", "rules", str(parsed))


def test_a_scrape_holds_every_family(db):
    """A scrape parses with the official parser (what Prometheus reads)."""
    families = list(text_string_to_metric_families(render().decode()))
    assert {f.name for f in families} >= {
        "recall_jobs",
        "recall_batches",
        "recall_oldest_queued_seconds",
        "recall_workers",
        "recall_last_sweep_age_seconds",
        "recall_api_requests",
        "recall_claim_seconds",
    }
