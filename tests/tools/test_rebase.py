# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m tools rebase``: onto a new release, or refused with the reason.

Each test builds a scratch git project (synthetic.py) on tiny synthetic base
wheels: release 0.33.0 is what the pins describe, 0.34.0 is upstream's next
one. pip only sees a local folder of wheels, so nothing touches the network.
"""

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    ADDED,
    NEW_VERSION,
    ORIGINAL,
    OURS,
    PATCHED,
    UPSTREAM_CLASH,
    UPSTREAM_FIX,
    build,
    bump_pins_by_hand,
    commit,
    make_project,
    make_wheel,
    metadata_of,
    no_unpacking,
    read_member,
    refused,
    release,
    sha,
)

from tools import fetch, util
from tools.pins import load_pins


def test_identical_base_builds_and_rebases_onto_itself_unchanged(
    tmp_path: Path, index: Path
) -> None:
    wheels = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    project = make_project(tmp_path, wheels, {PATCHED.as_posix(): OURS})
    built = build(project, wheels[0], tmp_path)
    assert read_member(built, PATCHED.as_posix()) == OURS

    # Rebasing onto the same release changes nothing, byte for byte.
    before = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    proc = tree_imports.run_tool(project, "rebase", "--base-version", "0.33.0")
    assert proc.returncode == 0, proc.stderr
    assert {p: p.read_bytes() for p in project.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("pins_bumped", [False, True], ids=["clean", "bumped"])
def test_upstream_change_is_merged_and_pinned(
    tmp_path: Path, index: Path, pins_bumped: bool
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    new = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_FIX})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    if pins_bumped:  # by hand: refused, with how to go on
        bump_pins_by_hand(project, new)
        commit(project, "bump the base by hand")
        proc = tree_imports.run_tool(project, "rebase", "--base-version", NEW_VERSION)
        assert proc.returncode == 1
        assert "holds another original" in proc.stderr
        assert "put the pins back (git checkout pyproject.toml" in proc.stderr
        git = ["git", "checkout", "HEAD~1", "--", "."]
        subprocess.run(git, cwd=project, check=True, capture_output=True, timeout=60)
        commit(project, "put the pins back")
    proc = tree_imports.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 0, proc.stderr

    merged = (project / PATCHED).read_text()
    assert merged == OURS.replace("0.33.0", NEW_VERSION).replace(
        "line_9 = 9", "line_9 = 'upstream'"
    )
    pins = load_pins(project / "pyproject.toml")
    assert pins.base_version == NEW_VERSION
    assert pins.sha256 == {w.name: util.sha256_of(w) for w in new}
    assert pins.replaces == {PATCHED.as_posix(): sha(UPSTREAM_FIX)}
    assert pins.base_metadata == metadata_of(new[0])  # the new release's METADATA
    assert b"Version: 0.34.0" in pins.base_metadata
    # Fetched into the build's cache.
    for wheel in new:
        assert (
            fetch.default_cache_dir() / wheel.name
        ).read_bytes() == wheel.read_bytes()
    assert read_member(build(project, new[0], tmp_path), PATCHED.as_posix()) == merged


def test_conflicting_upstream_change(tmp_path: Path, index: Path) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    new = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_CLASH})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    pyproject = (project / "pyproject.toml").read_bytes()

    proc = tree_imports.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 1
    assert f"CONFLICT: vllm=={NEW_VERSION}" in proc.stderr
    assert f"{PATCHED} (1 conflict(s))" in proc.stderr
    assert f"rebase --base-version {NEW_VERSION} --continue" in proc.stderr
    text = (project / PATCHED).read_text()
    assert "<<<<<<< ours\nline_2 = 'ours'\n" in text
    assert "||||||| vllm==0.33.0\nline_2 = 2\n" in text
    assert f"line_2 = 'upstream'\n>>>>>>> vllm=={NEW_VERSION}\n" in text
    assert (project / "pyproject.toml").read_bytes() == pyproject
    assert "a build refuses conflict markers" in proc.stderr
    message = refused(project, old[0], tmp_path)
    assert f"{PATCHED}: holds a conflict marker on line 4" in message

    # Running it again cannot stack markers on markers.
    again = tree_imports.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert again.returncode == 1 and "uncommitted changes" in again.stderr
    assert (project / PATCHED).read_text() == text
    assert (project / "pyproject.toml").read_bytes() == pyproject

    resolved = OURS.replace("line_2 = 'ours'", "line_2 = ('ours', 'upstream')")
    (project / PATCHED).write_text(resolved)
    proc = tree_imports.run_tool(
        project, "rebase", "--base-version", NEW_VERSION, "--continue"
    )
    assert proc.returncode == 0, proc.stderr
    pins = load_pins(project / "pyproject.toml")
    assert pins.base_version == NEW_VERSION
    assert pins.replaces == {PATCHED.as_posix(): sha(UPSTREAM_CLASH)}
    assert (project / PATCHED).read_text() == resolved.replace("0.33.0", NEW_VERSION)
    build(project, new[0], tmp_path)


def test_added_file_that_upstream_now_ships(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = "upstream_helper = 1\n"
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    new = release(
        tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): ORIGINAL, ADDED: theirs}
    )
    files = {PATCHED.as_posix(): OURS, ADDED: "our_helper = 1\n"}
    project = make_project(tmp_path, old, files, adds=(ADDED,))
    assert read_member(build(project, old[0], tmp_path), ADDED) == "our_helper = 1\n"

    before = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    proc = tree_imports.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 1
    assert f"{ADDED}: declared as added" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert {p: p.read_bytes() for p in project.rglob("*") if p.is_file()} == before

    bump_pins_by_hand(project, new)
    no_unpacking(monkeypatch)
    message = refused(project, new[0], tmp_path)
    assert f"{ADDED}: declared as added, but {new[0].name} ships {ADDED}" in message
    assert f'"{ADDED}" = "{sha(theirs)}"' in message


def test_replaced_file_upstream_dropped(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = release(tmp_path, index, "0.33.0", {"vllm/old_name.py": ORIGINAL})
    project = make_project(
        tmp_path,
        old,
        {PATCHED.as_posix(): OURS, "vllm/old_name.py": OURS},
        replaces={PATCHED.as_posix(): sha(ORIGINAL), "vllm/old_name.py": sha(ORIGINAL)},
    )
    gone = make_wheel(tmp_path / "gone", version=NEW_VERSION)
    with zipfile.ZipFile(gone) as zf:
        assert "vllm/old_name.py" not in zf.namelist()
    bump_pins_by_hand(project, [gone])
    no_unpacking(monkeypatch)
    message = refused(project, gone, tmp_path)
    assert "vllm/old_name.py: declared as replaced, but" in message
    assert "does not ship it" in message


def test_new_wheels_must_agree(tmp_path: Path, index: Path) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    new = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_FIX})
    arm = make_wheel(
        tmp_path / "arm",
        version=NEW_VERSION,
        wheel_tag="cp38-abi3-linux_aarch64",
        file_tags="cp38-abi3-manylinux_2_28_aarch64",
        files={PATCHED.as_posix(): UPSTREAM_CLASH},
    )
    shutil.copy(arm, new[1])
    proc = tree_imports.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 1
    assert f"{PATCHED}: the new release's wheels differ in it" in proc.stderr
    assert (project / PATCHED).read_text() == OURS
