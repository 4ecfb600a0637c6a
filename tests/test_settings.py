"""Unit tests of polyserve.settings: one declaration per setting, parsed from the env."""

import dataclasses
import os

import pytest

from polyserve import settings
from tests.conftest import REPO


def test_defaults_match_the_documented_ones():
    s = settings.load({})
    assert s.bind == "127.0.0.1:8441"
    assert s.workers == (os.cpu_count() or 1)
    assert s.data_dir == "./polyserve-data"
    assert s.idle_ttl == 900


def test_env_values_are_parsed_to_their_types():
    s = settings.load({"POLYSERVE_WORKERS": "3", "POLYSERVE_IDLE_TTL": "0.5"})
    assert s.workers == 3
    assert s.idle_ttl == 0.5


def test_a_bad_value_names_its_variable():
    with pytest.raises(ValueError, match="POLYSERVE_WORKERS='0'"):
        settings.load({"POLYSERVE_WORKERS": "0"})


def test_every_declaration_is_a_settings_field_and_back():
    declared = [s.name for s in settings.SETTINGS]
    assert declared == [f.name for f in dataclasses.fields(settings.Settings)]


def test_readme_settings_table_is_generated_from_the_declarations():
    readme = (REPO / "README.md").read_text()
    assert settings.markdown_table() in readme, "run: python -m polyserve.settings"


def test_the_unpacked_cap_follows_the_upload_cap_unless_set():
    assert settings.load({"POLYSERVE_MAX_UPLOAD_MB": "10"}).max_unpacked_mb == 40
    both = {"POLYSERVE_MAX_UPLOAD_MB": "10", "POLYSERVE_MAX_UNPACKED_MB": "15"}
    assert settings.load(both).max_unpacked_mb == 15
