"""The fleet's database, one object per process: its change log, uploads, hosts, ledger, reports.

Each part is one job over the one connection (polyserve.fleet.connection): the change
log (changes.py), the versions' bytes (uploads.py), the hosts (hosts.py), the usage
ledger (ledger.py), what hosts report (reports.py), the spaces' secrets (secrets.py) and
their rollouts (rollouts.py).
"""

from __future__ import annotations

from polyserve.fleet.changes import ChangeLog
from polyserve.fleet.hosts import Hosts
from polyserve.fleet.ledger import UsageLedger
from polyserve.fleet.reports import Reports
from polyserve.fleet.rollouts import RolloutRows
from polyserve.fleet.secrets import SecretRows
from polyserve.fleet.uploads import Uploads


class FleetDB(ChangeLog, Uploads, Hosts, UsageLedger, Reports, SecretRows, RolloutRows):
    """One process's connection to the fleet's database, with every part's calls."""
