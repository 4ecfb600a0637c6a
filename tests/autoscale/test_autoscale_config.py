"""The autoscaler's settings: declared like the host's, checked at start."""

from __future__ import annotations

import pytest

from polyserve.autoscale import config
from polyserve.settings.docs import markdown_table
from tests.helpers import REPO

DB = {"POLYSERVE_DATABASE_URL": "postgresql://example.invalid/fleet"}


def test_docs_settings_table_is_generated_from_the_declarations():
    page = (REPO / "docs" / "autoscale.md").read_text()
    assert markdown_table(config.declared()) in page, "run: make settings-table"


def test_defaults_are_the_documented_ones():
    c = config.load(DB)
    cpu, gpu = c.pools
    assert (cpu.name, cpu.provider, cpu.min_workers, cpu.max_workers) == ("cpu", "local", 1, 4)
    assert (gpu.name, gpu.provider, gpu.min_workers, gpu.max_workers) == ("gpu", "none", 0, 2)
    assert (c.scale_up_window_s, c.scale_down_window_s) == (30, 600)


def test_the_fleet_database_is_required():
    with pytest.raises(ValueError, match="POLYSERVE_DATABASE_URL is empty"):
        config.load({})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"POLYSERVE_CPU_PROVIDER": "aws"}, "POLYSERVE_CPU_PROVIDER='aws': must be one of"),
        ({"POLYSERVE_GPU_MAX_WORKERS": "-1"}, "POLYSERVE_GPU_MAX_WORKERS='-1'"),
        ({"POLYSERVE_TARGET_BUSY_RATIO": "1.5"}, "must be a fraction"),
        (
            {"POLYSERVE_CPU_MIN_WORKERS": "5", "POLYSERVE_CPU_MAX_WORKERS": "2"},
            "POLYSERVE_CPU_MIN_WORKERS=5 is above POLYSERVE_CPU_MAX_WORKERS=2",
        ),
    ],
)
def test_a_bad_value_names_its_variable(env, message):
    with pytest.raises(ValueError, match=message):
        config.load(DB | env)


def test_the_database_url_is_never_echoed():
    with pytest.raises(ValueError) as caught:
        config.load(
            {
                "POLYSERVE_DATABASE_URL": "postgresql://u:s3cret@db/x",
                "POLYSERVE_CPU_MAX_WORKERS": "x",
            }
        )
    assert "s3cret" not in str(caught.value)
