# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the overlay's declarations, and the diff and rebase commands.

Each test builds a scratch project (pyproject.toml, tools/, vllm/) on tiny
synthetic base wheels: release 0.33.0 is what the pins describe, 0.34.0 is
upstream's next one. pip only sees a local folder of wheels (PIP_NO_INDEX,
PIP_FIND_LINKS), so nothing touches the network.
"""

import hashlib
import shutil
import subprocess
import zipfile
from collections.abc import Mapping
from pathlib import Path

import overlay
import pytest
from test_precompiled_overlay import (
    PATCHED,
    copy_tools,
    make_wheel,
    read_member,
)

from tools import check, fetch, pack, rebase, util
from tools.pins import LOCATION_ENV, load_pins

ADDED = "vllm/distributed/device_communicators/added_helper.py"
# Upstream's file, far enough apart that a change near the top and one near
# the bottom merge cleanly.
ORIGINAL = "".join(f"line_{i} = {i}\n" for i in range(12))
OURS = "# Base: vllm==0.33.0\n" + ORIGINAL.replace("line_2 = 2", "line_2 = 'ours'")
UPSTREAM_FIX = ORIGINAL.replace("line_9 = 9", "line_9 = 'upstream'")
UPSTREAM_CLASH = ORIGINAL.replace("line_2 = 2", "line_2 = 'upstream'")
NEW_VERSION = "0.34.0"


def sha(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def release(
    tmp_path: Path, index: Path, version: str, files: Mapping[str, str]
) -> list[Path]:
    """One upstream release: an x86_64 and an aarch64 wheel, both in the index."""
    wheels = []
    for arch in ("x86_64", "aarch64"):
        built = make_wheel(
            tmp_path / f"release-{version}-{arch}",
            version=version,
            wheel_tag=f"cp38-abi3-linux_{arch}",
            file_tags=f"cp38-abi3-manylinux_2_28_{arch}",
            files=files,
        )
        wheels.append(Path(shutil.copy(built, index)))
    return wheels


def pyproject_text(
    wheels: list[Path], replaces: Mapping[str, str], adds: tuple[str, ...] = ()
) -> str:
    """The repo's pin tables, trusting ``wheels``."""
    version = wheels[0].name.split("-")[1]
    listed = ", ".join(f'"{path}"' for path in adds)
    return (
        "[build-system]\n"
        "requires = ['wheel>=0.48.0', 'packaging>=24.0']\n"
        "build-backend = 'tools.buildapi'\n"
        "backend-path = ['.']\n\n"
        "[tool.vllm-overlay]\n"
        f'base-version = "{version}"\n'
        'local-label = "hisparse1"\n'
        "# New modules.\n"
        f"adds = [{listed}]\n\n"
        "[tool.vllm-overlay.sha256]\n"
        + "".join(f'"{w.name}" = "{util.sha256_of(w)}"\n' for w in wheels)
        + "\n[tool.vllm-overlay.replaces]\n"
        "# Replaced files, pinned to their upstream originals.\n"
        + "".join(f'"{path}" = "{pin}"\n' for path, pin in replaces.items())
    )


def make_project(
    tmp_path: Path,
    wheels: list[Path],
    files: Mapping[str, str],
    adds: tuple[str, ...] = (),
    replaces: Mapping[str, str] | None = None,
) -> Path:
    """A git checkout of the repo's layout: pins, the build tool, a tree."""
    project = tmp_path / "project"
    copy_tools(project)
    for rel, text in files.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    if replaces is None:
        replaces = {PATCHED.as_posix(): sha(ORIGINAL)}
    (project / "pyproject.toml").write_text(pyproject_text(wheels, replaces, adds))
    commit(project, "the overlay")
    return project


def commit(project: Path, message: str) -> None:
    """Commit everything in ``project``, making it a git checkout if needed."""
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", message]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=project,
            check=True,
            capture_output=True,
            timeout=60,
        )


def build(project: Path, wheel: Path, tmp_path: Path, out: Path | None = None) -> Path:
    """Build the project's overlay on ``wheel``, as pip install . would."""
    out = out or fresh_dir(tmp_path)
    name = pack.build(
        out,
        pins=load_pins(project / "pyproject.toml"),
        overlay_root=project / "vllm",
        location=str(wheel),
    )
    return out / name


def fresh_dir(tmp_path: Path) -> Path:
    """A fresh, empty wheel_directory for each build."""
    for i in range(100):
        folder = tmp_path / f"out{i}"
        if not folder.exists():
            folder.mkdir()
            return folder
    raise AssertionError("too many builds in one test")


def refused(project: Path, wheel: Path, tmp_path: Path) -> str:
    """The build's error message; the build must leave no wheel."""
    out = fresh_dir(tmp_path)
    with pytest.raises(util.OverlayError) as excinfo:
        build(project, wheel, tmp_path, out)
    assert list(out.iterdir()) == []
    return str(excinfo.value)


def bump_pins_by_hand(project: Path, wheels: list[Path]) -> None:
    """What the issue warns about: new base wheels, file pins left as they were."""
    pins = load_pins(project / "pyproject.toml")
    (project / "pyproject.toml").write_text(
        pyproject_text(wheels, pins.replaces, pins.adds)
    )


def no_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the build gets as far as unpacking the base wheel."""

    def unpack(base_wheel: Path, *args: object) -> Path:
        raise AssertionError(f"the base wheel {base_wheel} was unpacked")

    monkeypatch.setattr(pack, "repack", unpack)


# --- declarations -------------------------------------------------------------


REPLACES = "[tool.vllm-overlay.replaces]\n"


@pytest.mark.parametrize(
    ("tables", "expected"),
    [
        (REPLACES + '"vllm/a.py" = "ABC"\n', "64 lowercase hex"),
        (REPLACES + '"tools/a.py" = "{pin}"\n', "not a path under"),
        (REPLACES + '"vllm/../a.py" = "{pin}"\n', "not a path under"),
        (
            'adds = ["vllm/a.py"]\n' + REPLACES + '"vllm/a.py" = "{pin}"\n',
            "both in [tool.vllm-overlay.replaces] and in adds",
        ),
        ('adds = ["vllm/a.py", "vllm/a.py"]\n', "listed twice"),
        ('adds = "vllm/a.py"\n', "must be a list of paths"),
    ],
)
def test_bad_declarations_name_pyproject(
    tmp_path: Path, tables: str, expected: str
) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[tool.vllm-overlay]\nbase-version = '0.33.0'\nlocal-label = 'x1'\n"
        + tables.format(pin="a" * 64)
        + f"[tool.vllm-overlay.sha256]\n'vllm-0.33.0-py3-none-any.whl' = '{'a' * 64}'\n"
    )
    with pytest.raises(util.OverlayError) as excinfo:
        load_pins(pyproject)
    assert expected in str(excinfo.value)
    assert str(pyproject) in str(excinfo.value)


def test_repo_pins_declare_the_replaced_file() -> None:
    pins = load_pins()
    assert PATCHED.as_posix() in pins.replaces
    assert not set(pins.replaces) & set(pins.adds)


def test_undeclared_files_are_refused_before_unpacking(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped, upstream_text = "vllm/distributed/parallel_state.py", "upstream = 1\n"
    wheels = release(
        tmp_path,
        index,
        "0.33.0",
        {PATCHED.as_posix(): ORIGINAL, shipped: upstream_text},
    )
    project = make_project(
        tmp_path,
        wheels,
        {PATCHED.as_posix(): OURS, shipped: "ours = 1\n", "vllm/brand_new.py": ""},
        adds=("vllm/gone.py",),
    )
    no_unpacking(monkeypatch)
    message = refused(project, wheels[0], tmp_path)
    # All problems at once, each with what to do.
    assert f'"{shipped}" = "{sha(upstream_text)}"' in message
    assert "vllm/brand_new.py: not declared" in message and "adds" in message
    assert "vllm/gone.py: declared in pyproject.toml but not in the tree" in message
    assert f"{PATCHED}:" not in message


# --- the build against a new upstream release --------------------------------


def test_identical_base_builds_and_keeps_its_originals(
    tmp_path: Path, index: Path
) -> None:
    wheels = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    project = make_project(tmp_path, wheels, {PATCHED.as_posix(): OURS})
    built = build(project, wheels[0], tmp_path)
    assert read_member(built, PATCHED.as_posix()) == OURS
    assert (
        check.originals_dir(fetch.default_cache_dir()) / sha(ORIGINAL)
    ).read_text() == ORIGINAL

    # Rebasing onto the same release changes nothing, byte for byte.
    before = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    proc = overlay.run_tool(project, "rebase", "--base-version", "0.33.0")
    assert proc.returncode == 0, proc.stderr
    assert {p: p.read_bytes() for p in project.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("pins_bumped", [False, True], ids=["clean", "bumped"])
def test_upstream_change_refused_then_rebased(
    tmp_path: Path, index: Path, pins_bumped: bool
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    new = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_FIX})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    build(project, old[0], tmp_path)  # caches the pinned original
    pyproject = (project / "pyproject.toml").read_text()

    # Bumping the base by hand would revert upstream's fix: refused, with
    # upstream's diff and the command that takes it in.
    bump_pins_by_hand(project, new)
    message = refused(project, new[0], tmp_path)
    assert f"{PATCHED}: upstream's file changed" in message
    assert "-line_9 = 9\n" in message and "+line_9 = 'upstream'\n" in message
    assert "line_2" not in message
    assert f"rebase --base-version {NEW_VERSION}" in message

    if not pins_bumped:
        (project / "pyproject.toml").write_text(pyproject)
        # The old originals then come from the pinned base wheel, through pip.
        shutil.rmtree(check.originals_dir(fetch.default_cache_dir()))
    else:
        commit(project, "bump the base by hand")  # a rebase needs a clean tree
    proc = overlay.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 0, proc.stderr

    merged = (project / PATCHED).read_text()
    assert merged == OURS.replace("0.33.0", NEW_VERSION).replace(
        "line_9 = 9", "line_9 = 'upstream'"
    )
    pins = load_pins(project / "pyproject.toml")
    assert pins.base_version == NEW_VERSION
    assert pins.sha256 == {w.name: util.sha256_of(w) for w in new}
    assert pins.replaces == {PATCHED.as_posix(): sha(UPSTREAM_FIX)}
    # Fetched by the build's path into the build's cache.
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

    proc = overlay.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 1
    assert f"CONFLICT: vllm=={NEW_VERSION}" in proc.stderr
    assert f"{PATCHED} (1 conflict(s))" in proc.stderr
    assert "--continue" in proc.stderr
    text = (project / PATCHED).read_text()
    assert "<<<<<<< ours\nline_2 = 'ours'\n" in text
    assert "||||||| vllm==0.33.0\nline_2 = 2\n" in text
    assert f"line_2 = 'upstream'\n>>>>>>> vllm=={NEW_VERSION}\n" in text
    assert (project / "pyproject.toml").read_bytes() == pyproject
    assert "a build refuses files with conflict markers" in proc.stderr
    message = refused(project, old[0], tmp_path)
    assert f"{PATCHED}: holds a conflict marker on line 4" in message

    # Running it again cannot stack markers on markers.
    again = overlay.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert again.returncode == 1 and "uncommitted changes" in again.stderr
    assert (project / PATCHED).read_text() == text
    assert (project / "pyproject.toml").read_bytes() == pyproject

    resolved = OURS.replace("line_2 = 'ours'", "line_2 = ('ours', 'upstream')")
    (project / PATCHED).write_text(resolved)
    proc = overlay.run_tool(
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
    proc = overlay.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 1
    assert f"{ADDED}: declared as added" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert {p: p.read_bytes() for p in project.rglob("*") if p.is_file()} == before

    bump_pins_by_hand(project, new)
    no_unpacking(monkeypatch)
    message = refused(project, new[0], tmp_path)
    assert f"{ADDED}: declared as added, but {new[0].name} ships its own" in message
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


def test_pin_mismatch_without_cached_original_says_how(
    tmp_path: Path, index: Path
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    new = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_FIX})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    bump_pins_by_hand(project, new)
    message = refused(project, new[0], tmp_path)
    assert "not cached here" in message
    assert "git stash push -- pyproject.toml" in message
    assert f"rebase --base-version {NEW_VERSION}" in message


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
    proc = overlay.run_tool(project, "rebase", "--base-version", NEW_VERSION)
    assert proc.returncode == 1
    assert f"{PATCHED}: the new wheels disagree on it" in proc.stderr
    assert (project / PATCHED).read_text() == OURS


# --- diff ---------------------------------------------------------------------


def test_diff_applies_to_upstream_byte_for_byte(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream = {PATCHED.as_posix(): ORIGINAL, "vllm/tail.py": "a = 1\nb = 2"}
    old = release(tmp_path, index, "0.33.0", upstream)
    ours = {
        PATCHED.as_posix(): OURS,
        "vllm/tail.py": "a = 1\nb = 3",  # neither side ends in a newline
        ADDED: "helper = 1\n\x0cpage = 2",  # a form feed is not a line break
        "vllm/empty_added.py": "",
    }
    project = make_project(
        tmp_path,
        old,
        ours,
        adds=(ADDED, "vllm/empty_added.py"),
        replaces={path: sha(text) for path, text in upstream.items()},
    )
    monkeypatch.setenv(LOCATION_ENV, str(old[0]))
    proc = overlay.run_tool(project, "diff")
    assert proc.returncode == 0, proc.stderr
    diff = proc.stdout
    assert (
        f"diff --git a/{PATCHED} b/{PATCHED}\n--- a/{PATCHED}\n+++ b/{PATCHED}\n"
        in (diff)
    )
    assert f"new file mode 100644\n--- /dev/null\n+++ b/{ADDED}\n" in diff

    tree = tmp_path / "vllm-source"
    for path, text in upstream.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    (tree / "patch.diff").write_text(diff)
    subprocess.run(["git", "apply", "patch.diff"], cwd=tree, check=True, timeout=60)
    for path, text in ours.items():
        assert (tree / path).read_bytes() == text.encode(), path


def test_diff_refuses_an_overlay_that_does_not_fit(
    tmp_path: Path, index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): UPSTREAM_FIX})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    monkeypatch.setenv(LOCATION_ENV, str(old[0]))
    proc = overlay.run_tool(project, "diff")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert f"error: the overlay does not fit the base wheel {old[0].name}" in (
        proc.stderr
    )


# --- pyproject.toml editing ---------------------------------------------------


def test_rebase_edits_only_the_pins_in_the_repo_pyproject() -> None:
    repo = overlay.REPO_ROOT / "pyproject.toml"
    pins = load_pins(repo)
    wheels = {
        name.replace(pins.base_version, "9.9.9"): "f" * 64 for name in pins.sha256
    }
    replaces = {path: "e" * 64 for path in pins.replaces}
    text = rebase._new_pyproject(repo, "9.9.9", wheels, replaces)
    before, after = repo.read_text().splitlines(), text.splitlines()
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert len(changed) == 1 + len(wheels) + len(replaces)
    assert changed[0] == (
        f'base-version = "{pins.base_version}"',
        'base-version = "9.9.9"',
    )
    assert all(
        new.endswith(('"' + "f" * 64 + '"', '"' + "e" * 64 + '"'))
        for _, new in changed[1:]
    )
