"""Unit tests of polyserve.settings: one declaration per setting, parsed from the env."""

import dataclasses
import os
import subprocess
import sys

import pytest

from polyserve import settings
from polyserve.settings import docs, variables
from tests.helpers import REPO


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
    declared.remove("deploy_token")  # read into deploy_token_sha256: no plaintext field
    declared.remove("database_url_file")  # read into database_url
    assert declared == [f.name for f in dataclasses.fields(settings.Settings)]


def test_the_settings_page_table_is_generated_from_the_declarations():
    readme = (REPO / "docs" / "settings.md").read_text()
    assert docs.markdown_table() in readme, "run: python -m polyserve.settings"


def test_the_unpacked_cap_follows_the_upload_cap_unless_set():
    assert settings.load({"POLYSERVE_MAX_UPLOAD_MB": "10"}).max_unpacked_mb == 40
    both = {"POLYSERVE_MAX_UPLOAD_MB": "10", "POLYSERVE_MAX_UNPACKED_MB": "15"}
    assert settings.load(both).max_unpacked_mb == 15


TOKEN = "plaintext-admin-token-7f3a9c"
TOKEN_SHA256 = settings.token_sha256(TOKEN)


@pytest.fixture
def token_env(monkeypatch):
    """os.environ without either token variable; both are restored after the test, even
    when load() has swapped one for the other."""
    for name in settings.SECRETS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_the_admin_token_is_kept_only_as_its_digest():
    s = settings.load({"POLYSERVE_DEPLOY_TOKEN": TOKEN})
    assert s.deploy_token_sha256 == TOKEN_SHA256
    assert TOKEN not in repr(s)
    assert settings.load({}).deploy_token_sha256 == ""


def test_the_admin_token_may_be_given_by_its_hash_alone():
    s = settings.load({"POLYSERVE_DEPLOY_TOKEN_SHA256": TOKEN_SHA256.upper()})
    assert s.deploy_token_sha256 == TOKEN_SHA256


@pytest.mark.parametrize("bad", ["abc", "g" * 64, TOKEN_SHA256 + "0", TOKEN_SHA256[:-1] + " "])
def test_a_bad_hash_names_its_variable_and_does_not_echo_it(bad):
    with pytest.raises(ValueError, match=r"POLYSERVE_DEPLOY_TOKEN_SHA256=<not shown>: .*64") as e:
        settings.load({"POLYSERVE_DEPLOY_TOKEN_SHA256": bad})
    assert bad.strip() not in str(e.value)


def test_both_token_variables_are_refused():
    both = {"POLYSERVE_DEPLOY_TOKEN": TOKEN, "POLYSERVE_DEPLOY_TOKEN_SHA256": TOKEN_SHA256}
    with pytest.raises(ValueError, match="both set") as e:
        settings.load(both)
    assert TOKEN not in str(e.value)


def test_loading_the_environment_swaps_the_plaintext_for_its_hash(token_env):
    token_env.setenv("POLYSERVE_DEPLOY_TOKEN", TOKEN)
    given = {"POLYSERVE_DEPLOY_TOKEN": TOKEN}
    settings.load(given)  # another mapping: neither it nor os.environ is changed
    assert given == {"POLYSERVE_DEPLOY_TOKEN": TOKEN}
    assert os.environ["POLYSERVE_DEPLOY_TOKEN"] == TOKEN
    # The gunicorn config, on_starting and every worker's app each load: same digest.
    loads = [settings.load() for _ in range(3)]
    assert {s.deploy_token_sha256 for s in loads} == {TOKEN_SHA256}
    assert "POLYSERVE_DEPLOY_TOKEN" not in os.environ
    assert os.environ["POLYSERVE_DEPLOY_TOKEN_SHA256"] == TOKEN_SHA256
    # Unset in the C environment too: a child process does not inherit it.
    child = child_environ()
    assert TOKEN not in child and "'POLYSERVE_DEPLOY_TOKEN'" not in child
    assert TOKEN_SHA256 in child


def child_environ() -> str:
    """The environment a child process of this one gets, as text."""
    return subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.environ.items()))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_forget_token_rewrites_any_mapping():
    env = {"POLYSERVE_DEPLOY_TOKEN": TOKEN, "PATH": "/bin"}
    settings.forget_token(env)
    assert env == {"POLYSERVE_DEPLOY_TOKEN_SHA256": TOKEN_SHA256, "PATH": "/bin"}
    empty = {"POLYSERVE_DEPLOY_TOKEN": ""}
    settings.forget_token(empty)
    assert empty == {}


def test_the_scrubbed_environment_has_no_token_variables(token_env):
    token_env.setenv("POLYSERVE_DEPLOY_TOKEN_SHA256", TOKEN_SHA256)
    token_env.setenv("POLYSERVE_IDLE_TTL", "5")
    scrubbed = settings.scrubbed_environ()
    assert "POLYSERVE_DEPLOY_TOKEN_SHA256" not in scrubbed
    assert scrubbed["POLYSERVE_IDLE_TTL"] == "5" and "PATH" in scrubbed
    given = {"POLYSERVE_DEPLOY_TOKEN": TOKEN, "HOME": "/h"}
    assert settings.scrubbed_environ(given) == {"HOME": "/h"}


def test_the_worker_memory_cap_defaults_to_half_the_machine_split_among_the_workers():
    """MemTotal / 2 / POLYSERVE_WORKERS unless set; 0 means no cap; negative is refused."""
    total = variables.memory_limit_mb()
    assert total > 0  # Linux: /proc/meminfo
    assert settings.load({"POLYSERVE_WORKERS": "4"}).worker_memory_mb == total // 2 // 4
    assert settings.load({"POLYSERVE_WORKER_MEMORY_MB": "0"}).worker_memory_mb == 0
    for bad in ("-1", "lots"):
        with pytest.raises(ValueError, match=f"POLYSERVE_WORKER_MEMORY_MB='{bad}'"):
            settings.load({"POLYSERVE_WORKER_MEMORY_MB": bad})


def test_the_memory_the_default_cap_divides_is_the_cgroup_limit_when_it_is_smaller(tmp_path):
    """A cgroup v2 memory.max under MemTotal wins; "max", a bigger one or none leaves
    MemTotal."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8388608 kB\nMemFree:  1 kB\n")  # 8 GiB
    memory_max = tmp_path / "memory.max"

    def limit() -> int:
        return variables.memory_limit_mb(str(meminfo), str(memory_max))

    assert limit() == 8192  # no cgroup file
    memory_max.write_text("max\n")
    assert limit() == 8192
    memory_max.write_text(f"{2 << 30}\n")
    assert limit() == 2048
    memory_max.write_text(f"{16 << 30}\n")
    assert limit() == 8192


URL = "postgresql://polyserve:secret@db.internal/polyserve"


def test_the_fleets_url_may_come_from_a_file(tmp_path):
    path = tmp_path / "url"
    path.write_text(URL + "\n")
    assert settings.load({"POLYSERVE_DATABASE_URL_FILE": str(path)}).database_url == URL
    both = {"POLYSERVE_DATABASE_URL_FILE": str(path), "POLYSERVE_DATABASE_URL": URL}
    with pytest.raises(ValueError, match="both set") as e:
        settings.load(both)
    assert URL not in str(e.value)
    path.write_text("\n")
    with pytest.raises(ValueError, match="POLYSERVE_DATABASE_URL_FILE: the file is empty"):
        settings.load({"POLYSERVE_DATABASE_URL_FILE": str(path)})
    with pytest.raises(ValueError, match="POLYSERVE_DATABASE_URL_FILE: cannot read it"):
        settings.load({"POLYSERVE_DATABASE_URL_FILE": str(tmp_path / "missing")})


def test_the_master_withholds_the_fleets_url_from_its_environment(monkeypatch, tmp_path):
    """Out of os.environ (so no child process and no space's os.environ gets it), and
    still what load() says, in this process and in the workers it forks."""
    monkeypatch.setattr(settings, "_withheld", {})
    monkeypatch.setenv("POLYSERVE_DATABASE_URL", URL)
    settings.withhold(settings.load().database_url)
    assert "POLYSERVE_DATABASE_URL" not in os.environ
    assert settings.load().database_url == URL
    child = child_environ()
    assert URL not in child and "POLYSERVE_DATABASE_URL" not in child
    # Another mapping only loses the variables: the process's own URL is kept apart.
    given = {"POLYSERVE_DATABASE_URL_FILE": str(tmp_path / "url"), "HOME": "/h"}
    settings.withhold("", given)
    assert given == {"HOME": "/h"}
    assert settings.load({}).database_url == ""


def test_the_scrubbed_environment_has_no_database_url_variables():
    given = {"POLYSERVE_DATABASE_URL": URL, "POLYSERVE_DATABASE_URL_FILE": "/f", "HOME": "/h"}
    assert settings.scrubbed_environ(given) == {"HOME": "/h"}


def test_a_disk_budget_is_a_fleet_hosts_only():
    """POLYSERVE_DISK_BUDGET_MB removes files the fleet keeps a copy of: refused on a
    single host and beside POLYSERVE_FLEET_FILES=all, each with what to change."""
    assert settings.load({}).disk_budget_mb == 0
    fleet = {"POLYSERVE_DATABASE_URL": URL, "POLYSERVE_DISK_BUDGET_MB": "64"}
    assert settings.load(fleet).disk_budget_mb == 64
    with pytest.raises(ValueError, match="POLYSERVE_DISK_BUDGET_MB is for a fleet host"):
        settings.load({"POLYSERVE_DISK_BUDGET_MB": "64"})
    with pytest.raises(ValueError, match="keep one of them"):
        settings.load({**fleet, "POLYSERVE_FLEET_FILES": "all"})
    with pytest.raises(ValueError, match="POLYSERVE_DISK_BUDGET_MB="):
        settings.load({**fleet, "POLYSERVE_DISK_BUDGET_MB": "-1"})
