"""Unit tests of polyserve.state.store: names, safe staging, atomic publish, slots."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from polyserve.errors import ClientError
from polyserve.names import parse_space
from polyserve.state.history import rollback_target
from polyserve.state.slots import NO_SLOT
from polyserve.state.store import Store
from tests.helpers import make_tar

KEEP_VERSIONS = 3


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "data", max_spaces=4, keep_versions=KEEP_VERSIONS)


def stage(store: Store, content: bytes, filename: str = "space.tar"):
    return store.stage(io.BytesIO(content), filename, max_unpacked=1 << 20)


def publish(store: Store, space: str, files: dict[str, str]) -> tuple[int, int]:
    staged = stage(store, make_tar(files))
    with store.locked():
        published = store.publish(space, staged, {"kind": "handle", "import_ms": 1.0})
        store.prune(space, oldest_held=None)
        return published


@pytest.mark.parametrize("name", ["lee101/hello", "a/b", "A-1_x/y.z", "o/" + "n" * 64])
def test_valid_space_names(name):
    assert parse_space(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a",
        "a/b/c",
        "../x",
        "a/..",
        "/b",
        "a/",
        ".a/b",
        "a/.b",
        "a b/c",
        "a/b\n",
        "a/\x00",
        "o/" + "n" * 65,
        "x" * 300,
    ],
)
def test_invalid_space_names_say_the_rule(name):
    with pytest.raises(ClientError, match="owner/name") as err:
        parse_space(name)
    assert err.value.status == 422


def test_a_py_upload_keeps_its_name(store):
    staged = store.stage(io.BytesIO(b"def handle(r): return 'hi'\n"), "hello.py", 1 << 20)
    assert staged.entry == "hello.py"
    assert (staged.dir / "hello.py").read_text() == "def handle(r): return 'hi'\n"
    assert staged.size == 27 and len(staged.sha256) == 64


@pytest.mark.parametrize("filename", ["../../x.py", "__init__.py", "a.b.py", "x" * 70 + ".py"])
def test_a_py_upload_with_an_unusable_name_is_stored_as_main_py(store, filename):
    assert store.stage(io.BytesIO(b"x = 1\n"), filename, 1 << 20).entry == "main.py"


@pytest.mark.parametrize("content,problem", [(b"  \n", "empty"), (b"\xff\xfe x", "UTF-8")])
def test_an_empty_or_non_utf8_py_is_refused(store, content, problem):
    with pytest.raises(ClientError, match=problem):
        store.stage(io.BytesIO(content), "x.py", 1 << 20)
    assert list(store.staging_dir.iterdir()) == []


def test_tar_written_with_dot_prefix_is_accepted(store):
    staged = stage(store, make_tar({"./main.py": "app = 1\n", "./lib/util.py": "x = 1\n"}))
    assert staged.entry == "main.py"
    assert (staged.dir / "lib" / "util.py").is_file()


def test_gzip_tar_is_accepted_and_app_py_is_the_fallback_entry(store):
    staged = stage(store, make_tar({"app.py": "app = 1\n"}, gzip=True), "space.tar.gz")
    assert staged.entry == "app.py"


def test_manifest_names_the_entry(store):
    files = {"polyserve.toml": 'entry = "server.py"\n', "server.py": "", "main.py": ""}
    assert stage(store, make_tar(files)).entry == "server.py"


@pytest.mark.parametrize(
    "manifest", ['entry = "sub/x.py"', 'entry = "missing.py"', "entry = [", 'entry = "x.txt"']
)
def test_a_bad_manifest_is_refused(store, manifest):
    with pytest.raises(ClientError, match=r"polyserve\.toml"):
        stage(store, make_tar({"polyserve.toml": manifest, "x.txt": ""}))


def test_a_tar_without_entry_says_how_to_build_one(store):
    with pytest.raises(ClientError, match="-C yourdir") as err:
        stage(store, make_tar({"myspace/main.py": ""}))
    assert err.value.details["found"] == ["myspace/"]


def _tar_with(info: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("main.py"), io.BytesIO(b""))
        tar.addfile(info)
    return buf.getvalue()


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _special(kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo("dev")
    info.type = kind
    return info


@pytest.mark.parametrize(
    "content,problem",
    [
        (make_tar({"../evil.py": ""}), "'..'"),
        (make_tar({"a/../../evil.py": ""}), "'..'"),
        (make_tar({"/etc/evil.py": ""}), "absolute"),
        (_tar_with(_link("out", "/etc/passwd", tarfile.SYMTYPE)), "regular files"),
        (_tar_with(_link("in", "main.py", tarfile.SYMTYPE)), "regular files"),
        (_tar_with(_link("hard", "/etc/passwd", tarfile.LNKTYPE)), "regular files"),
        (_tar_with(_special(tarfile.CHRTYPE)), "regular files"),
        (_tar_with(_special(tarfile.FIFOTYPE)), "regular files"),
        (b"not a tar at all", "valid tar"),
        (make_tar({"main.py": "x" * 5000})[:1200], "valid tar"),
    ],
)
def test_unsafe_or_broken_tars_are_refused_and_leave_nothing(store, content, problem):
    with pytest.raises(ClientError, match=problem) as err:
        stage(store, content)
    assert err.value.status == 422
    assert list(store.staging_dir.iterdir()) == []


def test_unpacked_size_is_capped_before_extraction(store):
    big = make_tar({"main.py": "", "blob": b"\0" * 4096}, gzip=True)
    with pytest.raises(ClientError) as err:
        store.stage(io.BytesIO(big), "x.tar.gz", max_unpacked=1024)
    assert err.value.status == 413
    assert list(store.staging_dir.iterdir()) == []


def test_publish_flips_current_and_keeps_the_slot(store):
    slot1, v1 = publish(store, "o/s", {"main.py": "A = 1\n"})
    slot2, v2 = publish(store, "o/s", {"main.py": "A = 2\n"})
    assert (slot1, v1, slot2, v2) == (0, 1, 0, 2)
    current = store.current("o/s")
    assert current.number == 2 and (current.dir / "main.py").read_text() == "A = 2\n"
    assert os.readlink(store.space_dir("o/s") / "current") == "versions/2"
    assert store.spaces()["o/s"]["version"] == 2
    assert list(store.staging_dir.iterdir()) == []


def test_old_versions_are_pruned(store):
    for i in range(KEEP_VERSIONS + 2):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    kept = sorted(p.name for p in (store.space_dir("o/s") / "versions").iterdir())
    newest = KEEP_VERSIONS + 2
    expected = [str(n) for n in range(newest - KEEP_VERSIONS + 1, newest + 1)]
    assert kept == sorted(expected + [f"{n}.json" for n in expected])


def test_numbers_go_on_from_a_last_file_an_earlier_polyserve_wrote(store):
    publish(store, "o/s", {"main.py": ""})
    last = store.space_dir("o/s") / "last"
    assert last.is_symlink()
    last.unlink()
    last.write_text("7")  # a data directory from before `last` was a symlink
    assert publish(store, "o/s", {"main.py": ""}) == (0, 8)
    assert os.readlink(last) == "8"


def test_delete_unpublishes_but_the_slot_stays(store):
    publish(store, "o/s", {"main.py": ""})
    publish(store, "o/t", {"main.py": ""})
    with store.locked():
        assert store.delete("o/s") == 0
        assert store.delete("o/s") is None
    assert store.current("o/s") is None
    assert list(store.spaces()) == ["o/t"]
    slot, version = publish(store, "o/s", {"main.py": ""})
    assert (slot, version) == (0, 2), "numbers are never reused, so one names one upload"


def test_a_full_space_table_answers_507(store):
    for i in range(4):
        publish(store, f"o/s{i}", {"main.py": ""})
    with pytest.raises(ClientError) as err:
        publish(store, "o/one-too-many", {"main.py": ""})
    assert err.value.status == 507 and "POLYSERVE_MAX_SPACES" in err.value.error
    assert store.current("o/one-too-many") is None


def test_pruning_keeps_every_version_a_worker_still_holds(store):
    """A draining request or a slow load may read a version's files: older versions
    than the oldest one held stay until nobody holds them."""
    for i in range(KEEP_VERSIONS + 3):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    with store.locked():
        store.prune("o/s", oldest_held=1)  # v1 was pruned already: nothing comes back
    newest = KEEP_VERSIONS + 3
    staged = stage(store, make_tar({"main.py": "A = -1\n"}))
    with store.locked():
        store.publish("o/s", staged, {"kind": "handle", "import_ms": 1.0})
        # the oldest version kept so far is held by a draining worker
        store.prune("o/s", oldest_held=newest - KEEP_VERSIONS + 1)
    versions = store.space_dir("o/s") / "versions"
    kept = sorted(int(p.name) for p in versions.iterdir() if p.is_dir())
    assert kept == list(range(newest - KEEP_VERSIONS + 1, newest + 2))
    with store.locked():
        store.prune("o/s", oldest_held=None)  # the last holder let go
    kept = sorted(int(p.name) for p in versions.iterdir() if p.is_dir())
    assert kept == list(range(newest + 2 - KEEP_VERSIONS, newest + 2))


def test_delete_leaves_held_versions_until_they_are_let_go(store):
    """Deleting a space removes its versions, except those a worker still uses."""
    publish(store, "o/s", {"main.py": "A = 1\n"})
    publish(store, "o/s", {"main.py": "A = 2\n"})
    versions = store.space_dir("o/s") / "versions"
    with store.locked():
        store.delete("o/s")
        store.prune("o/s", oldest_held=2)
    assert sorted(p.name for p in versions.iterdir()) == ["2", "2.json"]
    assert (versions / "2" / "main.py").read_text() == "A = 2\n"
    with store.locked():
        store.prune("o/s", oldest_held=None)
    assert list(versions.iterdir()) == []


def test_a_full_table_hands_over_a_deleted_spaces_slot_once_it_is_quiet(store):
    """With every slot taken, a new space gets the slot of a deleted one that no worker
    uses any more; the old owner keeps its usage by name, the new one starts from 0."""
    for i in range(4):
        publish(store, f"o/s{i}", {"main.py": ""})
    with store.locked():
        store.delete("o/s1")
        store.delete("o/s2")
    asked: list[int] = []

    def reclaim(slot: int) -> tuple[int, ...] | None:
        asked.append(slot)
        return None if slot == 1 else (10, 1, 500, 7, 2, 30)  # s1 is still draining

    staged = stage(store, make_tar({"main.py": ""}))
    with store.locked():
        slot, version = store.publish("o/new", staged, {}, reclaim=reclaim)
    assert (slot, version, asked) == (2, 1, [1, 2])
    assert store.slots.slot("o/new") == 2 and store.slots.slot("o/s2") is None
    ledger = Store(store.root, max_spaces=4).slots.ledger()  # as a fresh process reads the log
    assert ledger.names == ["o/s0", "o/s1", "o/new", "o/s3"]
    assert ledger.offsets == {2: (-10, -1, -500, -7, -2, -30)}
    assert ledger.retired == {"o/s2": (10, 1, 500, 7, 2, 30)}
    with pytest.raises(ClientError) as err:  # s1 never became quiet: no slot is left
        publish(store, "o/another", {"main.py": ""})
    assert err.value.status == 507


def test_a_lazy_slots_store_moves_pointers_without_slots_and_hands_over_unheld_ones(
    tmp_path: Path,
):
    """A fleet host's store (lazy_slots): a publish or a pointer takes no slot (NO_SLOT),
    claim_slot takes one, and a full table hands over the slot of any space that is
    quiet, deployed or not, which counts on from its old totals when it claims again."""
    store = Store(tmp_path / "data", max_spaces=2, lazy_slots=True)
    for i in range(3):
        assert publish(store, f"o/s{i}", {"main.py": ""}) == (NO_SLOT, 1)
    assert store.slots.ledger().names == []
    quiet = {0: (4, 0, 0, 0, 0, 0), 1: None}  # the first slot's space no worker holds
    with store.locked():
        assert [store.claim_slot(f"o/s{i}", quiet.get) for i in range(2)] == [0, 1]
        assert store.claim_slot("o/s2", quiet.get) == 0  # o/s0 is deployed, and quiet
    assert store.slots.slot("o/s0") is None and store.current("o/s0") is not None
    quiet = {0: (4 + 3, 0, 0, 0, 0, 0), 1: (9, 0, 0, 0, 0, 0)}  # o/s2 had 3 requests
    with store.locked():
        assert store.claim_slot("o/s0", quiet.get) == 0
    ledger = Store(store.root, max_spaces=2).slots.ledger()
    assert ledger.names == ["o/s0", "o/s1"]
    assert ledger.retired == {"o/s2": (3, 0, 0, 0, 0, 0)}
    assert ledger.offsets[0][0] == 4 - 7  # raw 7 in the slot: o/s0's 4 from here on


# -- history, keeping and rollbacks ----------------------------------------------------


def on_disk(store: Store, space: str) -> list[int]:
    versions = store.space_dir(space) / "versions"
    return sorted(int(p.name) for p in versions.iterdir() if p.is_dir())


def roll_back(store: Store, space: str, asked: int | None = None) -> tuple[int, int]:
    with store.locked():
        _, number, previous, _ = store.reactivate(space, asked)
        store.prune(space, oldest_held=None)
    return number, previous


def test_the_history_records_deploys_rollbacks_releases_and_deletes_in_order(store):
    for i in range(3):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    assert roll_back(store, "o/s") == (2, 3)
    with store.locked():
        store.history.record("o/s", "release", 2, 2)
        store.delete("o/s")
    events = [(e["event"], e["version"], e["previous"]) for e in store.history.read("o/s", 100)]
    assert events == [
        ("deploy", 1, None),
        ("deploy", 2, 1),
        ("deploy", 3, 2),
        ("rollback", 2, 3),
        ("release", 2, 2),
        ("delete", None, 2),
    ]
    times = [e["at"] for e in store.history.read("o/s", 100)]
    assert times == sorted(times)
    assert [e["event"] for e in store.history.read("o/s", 2)] == ["release", "delete"]


def test_pruning_ranks_versions_from_the_newest_events_alone(store):
    """ranked() decodes the history from its newest event back only until it has as
    many as it was asked for: the same order as ranking the whole history."""
    store.space_dir("o/s").mkdir(parents=True)
    events = [("deploy", n) for n in range(1, 9)]
    events += [("rollback", 3), ("release", 3), ("rollback", 6), ("deploy", 9), ("rollback", 2)]
    for event, number in events:
        store.history.record("o/s", event, number, None)
    numbers = set(range(1, 10)) | {42}  # 42: a version the history does not name
    whole = [2, 9, 6, 3, 8, 7, 5, 4, 1, 42]
    for first in range(12):
        assert store.history.ranked("o/s", numbers, first) == whole[:first]
    assert store.history.ranked("o/s", {1, 6}, 1) == [6]


def test_each_version_remembers_what_it_replaced(store):
    publish(store, "o/s", {"main.py": ""})
    publish(store, "o/s", {"main.py": "A = 1\n"})
    versions = store.versions("o/s")
    assert [(v["version"], v["replaced"], v["current"]) for v in versions] == [
        (1, None, False),
        (2, 1, True),
    ]
    assert {"sha256", "size", "entry", "kind", "import_ms", "deployed_at"} <= set(versions[0])


def test_rollbacks_without_a_number_walk_back_through_the_deploys(store):
    """v3 -> v2 -> v1, not v3 -> v2 -> v3: each goes to what the current one replaced."""
    for i in range(3):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    assert roll_back(store, "o/s") == (2, 3)
    assert roll_back(store, "o/s") == (1, 2)
    with pytest.raises(ClientError) as err:
        roll_back(store, "o/s")
    assert err.value.status == 404 and "replaced no earlier version" in err.value.error
    assert err.value.details["kept"] == [1, 2, 3]
    assert store.current("o/s").number == 1


def test_a_rollback_to_a_pruned_or_unknown_version_lists_the_kept_ones(store):
    for i in range(KEEP_VERSIONS + 2):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    kept = on_disk(store, "o/s")
    assert kept == [3, 4, 5]
    for asked in (1, 99):
        with pytest.raises(ClientError) as err:
            roll_back(store, "o/s", asked)
        assert err.value.status == 404
        assert err.value.details == {"space": "o/s", "version": asked, "kept": kept}
    assert store.current("o/s").number == 5  # nothing moved


def test_a_rollback_of_a_deleted_space_is_refused(store):
    publish(store, "o/s", {"main.py": ""})
    publish(store, "o/s", {"main.py": "A = 1\n"})
    with store.locked():
        store.delete("o/s")
    with pytest.raises(ClientError, match="not deployed") as err:
        roll_back(store, "o/s", 1)
    assert err.value.status == 404


def test_pruning_keeps_the_versions_made_current_most_recently(store):
    """Keeping ranks by when a version was last made current, not by its number: after
    a rollback to v1, deploying v4 and v5 keeps v1 (rolled back to) over v2 and v3."""
    for i in range(3):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    roll_back(store, "o/s", 1)
    publish(store, "o/s", {"main.py": "A = 4\n"})
    publish(store, "o/s", {"main.py": "A = 5\n"})
    assert on_disk(store, "o/s") == [1, 4, 5]
    assert store.kept("o/s") == [1, 4, 5]
    assert roll_back(store, "o/s") == (4, 5)  # v5 replaced v4
    assert roll_back(store, "o/s") == (1, 4)  # and v4 replaced v1, the rollback's target


def test_a_data_directory_without_history_keeps_the_newest_numbers(store):
    for i in range(KEEP_VERSIONS):
        publish(store, "o/s", {"main.py": f"A = {i}\n"})
    (store.space_dir("o/s") / "history.jsonl").unlink()  # as written before histories
    publish(store, "o/s", {"main.py": "A = 9\n"})
    assert on_disk(store, "o/s") == [2, 3, 4]


def test_a_long_history_is_trimmed_and_a_torn_line_is_skipped(store, monkeypatch):
    import polyserve.state.history as history_mod

    monkeypatch.setattr(history_mod, "HISTORY_KEEP", 5)
    publish(store, "o/s", {"main.py": ""})
    with store.locked():
        for _ in range(200):
            store.history.record("o/s", "release", 1, 1)
    path = store.space_dir("o/s") / "history.jsonl"
    assert len(path.read_bytes().splitlines()) <= 2 * 5 * 200 // 50
    with path.open("ab") as f:
        f.write(b'{"event": "depl')  # a crash mid-append
    assert store.history.read("o/s", 3)[-1]["event"] == "release"


def test_rollback_target_without_replaced_falls_back_to_the_newest_lower_kept_one():
    assert rollback_target("o/s", 5, {}, [2, 3, 5], None) == 3
    with pytest.raises(ClientError):
        rollback_target("o/s", 2, {}, [2, 3, 5], None)
    assert rollback_target("o/s", 5, {"replaced": 2}, [2, 3, 5], None) == 2
    assert rollback_target("o/s", 5, {"replaced": None}, [2, 3, 5], 3) == 3


def test_a_history_that_cannot_be_written_does_not_fail_the_change(store, caplog):
    """The event is recorded after `current` moved: the change stands, a warning says so."""
    publish(store, "o/s", {"main.py": ""})
    path = store.space_dir("o/s") / "history.jsonl"
    path.unlink()
    path.mkdir()  # appending to it now fails, as a full disk would
    assert publish(store, "o/s", {"main.py": "A = 1\n"}) == (0, 2)
    assert store.current("o/s").number == 2
    assert "could not record the deploy" in caplog.text


def test_a_pinned_version_is_kept_by_every_prune_until_it_is_unpinned(store):
    publish(store, "o/s", {"main.py": "A = 1\n"})
    with store.locked():
        assert store.pin("o/s", 1) == [1]
    for i in range(KEEP_VERSIONS + 2):
        publish(store, "o/s", {"main.py": f"A = {i + 2}\n"})
    newest = KEEP_VERSIONS + 3
    assert store.kept("o/s") == [1, *range(newest - KEEP_VERSIONS + 1, newest + 1)]
    assert store.pins("o/s") == [1]
    with store.locked():
        assert store.unpin("o/s", 1) == []
        store.prune("o/s", oldest_held=None)
    assert store.kept("o/s") == list(range(newest - KEEP_VERSIONS + 1, newest + 1))


def test_only_a_kept_version_of_a_deployed_space_can_be_pinned(store):
    with store.locked(), pytest.raises(ClientError) as err:
        store.pin("o/s", 1)
    assert err.value.status == 404 and "not deployed" in err.value.error
    publish(store, "o/s", {"main.py": "A = 1\n"})
    with store.locked(), pytest.raises(ClientError) as err:
        store.pin("o/s", 2)
    assert err.value.status == 404 and err.value.details["kept"] == [1]


def test_a_delete_drops_the_pins_and_their_versions_go_once_unheld(store):
    publish(store, "o/s", {"main.py": "A = 1\n"})
    publish(store, "o/s", {"main.py": "A = 2\n"})
    with store.locked():
        store.pin("o/s", 1)
        store.delete("o/s")
        store.prune("o/s", oldest_held=None)
    assert store.pins("o/s") == [] and store.kept("o/s") == []
    publish(store, "o/s", {"main.py": "A = 3\n"})  # a redeployed space starts unpinned
    assert store.pins("o/s") == []


def test_a_version_kept_with_current_false_waits_for_its_rollout_through_any_prune(store):
    publish(store, "o/s", {"main.py": "A = 1\n"})
    staged = stage(store, make_tar({"main.py": "A = 2\n"}))
    with store.locked():
        assert store.publish("o/s", staged, {}, current=False)[1] == 2
    for i in range(KEEP_VERSIONS + 2):
        publish(store, "o/s", {"main.py": f"A = {i + 3}\n"})
    assert 2 in store.kept("o/s") and store.waiting("o/s") == 2
    # A later current=false deploy takes its place: the first one may go.
    staged = stage(store, make_tar({"main.py": "A = 9\n"}))
    with store.locked():
        later = store.publish("o/s", staged, {}, current=False)[1]
        store.prune("o/s", oldest_held=None)
    assert 2 not in store.kept("o/s") and store.waiting("o/s") == later
    # Its rollout's end lets it go, as a move of `current` to it does.
    with store.locked():
        store.unpin("o/s", later)
        store.prune("o/s", oldest_held=None)
    assert later not in store.kept("o/s") and store.waiting("o/s") is None


def test_a_waiting_version_made_current_waits_no_more(store):
    publish(store, "o/s", {"main.py": "A = 1\n"})
    staged = stage(store, make_tar({"main.py": "A = 2\n"}))
    with store.locked():
        store.publish("o/s", staged, {}, current=False)
        store.reactivate("o/s", 2)  # a rollback to it, as a completed rollout's is
        store.prune("o/s", oldest_held=None)
    assert store.waiting("o/s") is None
    for i in range(KEEP_VERSIONS):  # ranked by the history now: pruned as any version
        publish(store, "o/s", {"main.py": f"A = {i + 3}\n"})
    assert 2 not in store.kept("o/s")
