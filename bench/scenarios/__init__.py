"""The scenarios of ``make bench``, one module each, by row number of
BENCHMARKS.md: ``--only N`` runs row N's scenario (2, 3 and 8 are measured
with 1, interleaved with it)."""

from __future__ import annotations

from bench.scenarios.claim_many import claim_many
from bench.scenarios.exports_vs_heartbeats import exports_vs_heartbeats
from bench.scenarios.fair_share import fair_share
from bench.scenarios.fleet_heartbeats import fleet_heartbeats
from bench.scenarios.hostile_clients import hostile_clients
from bench.scenarios.idle import idle
from bench.scenarios.idle_fleet import idle_fleet
from bench.scenarios.intake_export import intake_export
from bench.scenarios.long_poll import long_poll
from bench.scenarios.metrics_scrape import metrics_scrape
from bench.scenarios.peers import peers
from bench.scenarios.progress import progress
from bench.scenarios.purge_while_claiming import purge_while_claiming
from bench.scenarios.routing import routing
from bench.scenarios.search import search
from bench.scenarios.sustained import sustained
from bench.scenarios.sweep import sweep
from bench.scenarios.throughput import throughput

SCENARIOS = {
    "1": throughput,
    "4": peers,
    "5": idle,
    "6": sweep,
    "7": progress,
    "9": intake_export,
    "10": sustained,
    "11": fair_share,
    "12": exports_vs_heartbeats,
    "13": metrics_scrape,
    "14": idle_fleet,
    "15": long_poll,
    "17": purge_while_claiming,
    "18": hostile_clients,
    "19": routing,
    "20": fleet_heartbeats,
    "21": claim_many,
    "22": search,
}
# 2, 3 and 8 are measured with 1, interleaved with it.
ALIASES = {"2": "1", "3": "1", "8": "1"}
