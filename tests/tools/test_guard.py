# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The guard holds on every path a maintainer takes.

The promise: no build ships a replaced file with upstream's changes silently
dropped, and what the tests import is what users run. Each test drives the
documented commands (``python -m tools rebase``, the build) on tiny synthetic
releases served to pip from a local folder.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    NEW_VERSION,
    ORIGINAL,
    OURS,
    PATCHED,
    UPSTREAM_CLASH,
    build,
    commit,
    copy_tools,
    make_project,
    make_wheel,
    read_member,
    refused,
    release,
    sha,
)

from tools.pins import load_pins

TIMEOUT = 120
# Upstream's next release: one change that clashes with ours, one that does not.
UPSTREAM_BOTH = UPSTREAM_CLASH.replace("line_9 = 9", "line_9 = 'upstream'")
RESOLVED = OURS.replace("line_2 = 'ours'", "line_2 = ('ours', 'upstream')")
ADDED = "vllm/distributed/device_communicators/new_helper.py"


def rebase(project: Path, *flags: str) -> subprocess.CompletedProcess:
    return tree_imports.run_tool(
        project, "rebase", "--base-version", NEW_VERSION, *flags
    )


def conflicted(tmp_path: Path, index: Path, ours: str = OURS, new: str = UPSTREAM_BOTH):
    """A project whose rebase onto NEW_VERSION stopped on a conflict."""
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    wheels = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): new})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): ours})
    proc = rebase(project)
    assert proc.returncode == 1 and "CONFLICT" in proc.stderr, proc.stderr
    return project, old, wheels, proc


# --- 1. --continue after starting over ---------------------------------------


def test_continue_after_starting_over_keeps_upstreams_change(
    tmp_path: Path, index: Path
) -> None:
    project, old, new, _ = conflicted(tmp_path, index)
    pyproject = (project / "pyproject.toml").read_bytes()
    # Start over as git allows, then resolve only the conflicting line by hand:
    # upstream's other change (line_9) is lost.
    subprocess.run(["git", "checkout", "--", "vllm/"], cwd=project, check=True)
    (project / PATCHED).write_text(RESOLVED)

    proc = rebase(project, "--continue")
    assert proc.returncode == 1
    assert f"{PATCHED} lacks upstream's change(s)" in proc.stderr
    assert "+line_9 = 'upstream'" in proc.stderr
    assert (project / "pyproject.toml").read_bytes() == pyproject
    assert (project / PATCHED).read_text() == RESOLVED

    # Taken in, the same command records the rebase, and the build ships it.
    fixed = RESOLVED.replace("line_9 = 9", "line_9 = 'upstream'")
    (project / PATCHED).write_text(fixed)
    proc = rebase(project, "--continue")
    assert proc.returncode == 0, proc.stderr
    assert load_pins(project / "pyproject.toml").base_version == NEW_VERSION
    shipped = read_member(build(project, new[0], tmp_path), PATCHED.as_posix())
    assert shipped == fixed.replace("0.33.0", NEW_VERSION)


def test_continue_without_a_rebase_cannot_drop_upstreams_change(
    tmp_path: Path, index: Path
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_BOTH})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    proc = rebase(project, "--continue")
    assert proc.returncode == 1
    assert f"{PATCHED} lacks upstream's change(s)" in proc.stderr
    assert load_pins(project / "pyproject.toml").base_version == "0.33.0"


# --- 2. added modules that upstream shadows -----------------------------------


SHADOWS = [
    ADDED.removesuffix(".py") + "/__init__.py",
    ADDED.removesuffix(".py") + ".abi3.so",
    ADDED.removesuffix(".py") + ".cpython-311-x86_64-linux-gnu.so",
    ADDED.removesuffix(".py") + ".pyc",
]


@pytest.mark.parametrize("shadow", SHADOWS, ids=["package", "abi3", "cpython", "pyc"])
def test_added_module_that_upstream_shadows_is_refused(
    tmp_path: Path, index: Path, shadow: str
) -> None:
    files = {PATCHED.as_posix(): ORIGINAL, shadow: "upstream's own\n"}
    old = release(tmp_path, index, "0.33.0", files)
    project = make_project(
        tmp_path, old, {PATCHED.as_posix(): OURS, ADDED: "VALUE = 1\n"}, adds=(ADDED,)
    )
    message = refused(project, old[0], tmp_path)
    assert f"{ADDED}: declared as added, but {old[0].name} ships {shadow}" in message

    # A rebase onto a release that starts shipping it is refused the same way.
    clean = release(tmp_path / "clean", index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    project = make_project(
        tmp_path / "clean",
        clean,
        {PATCHED.as_posix(): OURS, ADDED: "VALUE = 1\n"},
        adds=(ADDED,),
    )
    release(tmp_path, index, NEW_VERSION, files)
    proc = rebase(project)
    assert proc.returncode == 1 and f"ships {shadow}" in proc.stderr
    assert "nothing was changed" in proc.stderr


# --- 3. keeping our side, or a backport ---------------------------------------


@pytest.mark.parametrize("backport", [False, True], ids=["ours", "backport"])
def test_continue_accepts_our_side_of_the_conflict(
    tmp_path: Path, index: Path, backport: bool
) -> None:
    # A backport: our file already carries upstream's non-conflicting change.
    ours = OURS.replace("line_9 = 9", "line_9 = 'upstream'") if backport else OURS
    new_text = UPSTREAM_BOTH if backport else UPSTREAM_CLASH
    project, _, new, _ = conflicted(tmp_path, index, ours=ours, new=new_text)
    (project / PATCHED).write_text(ours)  # byte for byte as before the rebase
    proc = rebase(project, "--continue")
    assert proc.returncode == 0, proc.stderr
    pins = load_pins(project / "pyproject.toml")
    assert pins.replaces == {PATCHED.as_posix(): sha(new_text)}
    assert read_member(build(project, new[0], tmp_path), PATCHED.as_posix()) == (
        ours.replace("0.33.0", NEW_VERSION)
    )


# --- 4. no advice destroys work -----------------------------------------------


def test_rebase_refuses_to_start_over_uncommitted_work(
    tmp_path: Path, index: Path
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_BOTH})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    edited = OURS + "work_in_progress = True\n"
    (project / PATCHED).write_text(edited)
    proc = rebase(project)
    assert proc.returncode == 1
    assert "uncommitted changes" in proc.stderr and str(PATCHED) in proc.stderr
    assert "git stash" in proc.stderr and "git checkout" not in proc.stderr
    assert (project / PATCHED).read_text() == edited

    # The advice on a conflict keeps the merge recoverable, too.
    commit(project, "work")
    proc = rebase(project)
    assert proc.returncode == 1 and "CONFLICT" in proc.stderr
    assert "git stash" in proc.stderr and "git checkout" not in proc.stderr


# --- 5. half-resolved conflicts -----------------------------------------------


MARKERS = ["<<<<<<< ours", "||||||| vllm==0.33.0", "=======", ">>>>>>> vllm==0.34.0"]


@pytest.mark.parametrize("marker", MARKERS, ids=["ours", "base", "sep", "theirs"])
def test_any_conflict_line_is_refused(tmp_path: Path, index: Path, marker: str) -> None:
    project, old, _, _ = conflicted(tmp_path, index)
    fixed = RESOLVED.replace("line_9 = 9", "line_9 = 'upstream'")
    half = fixed.replace("line_5 = 5\n", f"line_5 = 5\n{marker}\n")
    (project / PATCHED).write_text(half)
    proc = rebase(project, "--continue")
    assert proc.returncode == 1
    assert f"{PATCHED}: holds a conflict marker on line 8" in proc.stderr
    assert "holds a conflict marker" in refused(project, old[0], tmp_path)


def test_a_file_that_does_not_compile_is_refused(tmp_path: Path, index: Path) -> None:
    project, old, _, _ = conflicted(tmp_path, index)
    fixed = RESOLVED.replace("line_9 = 9", "line_9 = 'upstream'")
    (project / PATCHED).write_text(fixed.replace("line_5 = 5", "line_5 = ("))
    proc = rebase(project, "--continue")
    assert proc.returncode == 1 and f"{PATCHED}: does not compile" in proc.stderr
    assert f"{PATCHED}: does not compile" in refused(project, old[0], tmp_path)


# --- 6. symlinks under vllm/ ---------------------------------------------------


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_symlink_under_the_tree_is_refused(
    tmp_path: Path, index: Path, kind: str
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "linked.py").write_text("VALUE = 1\n")
    target = elsewhere if kind == "folder" else elsewhere / "linked.py"
    link = project / "vllm" / ("linked" if kind == "folder" else "linked.py")
    link.symlink_to(target)
    message = refused(project, old[0], tmp_path)
    assert str(link.relative_to(project)) in message and "symlink" in message


# --- 7. a local-label that makes an invalid wheel name -------------------------


@pytest.mark.parametrize("label", ["hisparse-1", "hi_sparse", "hi sparse", ""])
def test_bad_local_label_names_the_setting(tmp_path: Path, label: str) -> None:
    base = make_wheel(tmp_path)
    project = tmp_path / "project"
    copy_tools(project, base)
    (project / "pyproject.toml").write_text(
        "[build-system]\n"
        "requires = []\n"
        "build-backend = 'tools.buildapi'\n"
        "backend-path = ['.']\n\n"
        "[tool.vllm-overlay]\n"
        'base-version = "0.33.0"\n'
        f'local-label = "{label}"\n\n'
        "[tool.vllm-overlay.sha256]\n"
        f'"{base.name}" = "{sha(base.read_bytes())}"\n'
    )
    wheels = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels)]
    proc = subprocess.run(
        [*pip_wheel, "--no-build-isolation", str(project)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode != 0
    assert f"label {label!r} is not letters and digits" in proc.stderr + proc.stdout
    assert not (tmp_path / "wheels").exists() or not list(
        (tmp_path / "wheels").iterdir()
    )
