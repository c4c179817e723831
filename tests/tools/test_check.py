# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 2 (tools/check.py): the tree's declarations, and whether it fits.

Each test builds a scratch project (synthetic.py) on tiny synthetic base
wheels; pip only sees a local folder of wheels, so nothing touches the
network.
"""

from pathlib import Path

import pytest
from synthetic import (
    NEW_VERSION,
    ORIGINAL,
    OURS,
    PATCHED,
    UPSTREAM_FIX,
    bump_pins_by_hand,
    make_project,
    no_unpacking,
    refused,
    release,
    sha,
)

from tools.pins import load_pins


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
    )
    no_unpacking(monkeypatch)
    message = refused(project, wheels[0], tmp_path)
    # All problems at once, each with what to do.
    assert f'"{shipped}" = "{sha(upstream_text)}"' in message
    assert "vllm/brand_new.py: not declared" in message and "adds" in message
    assert f"{PATCHED}:" not in message

    (project / "pyproject.toml").write_text(
        (project / "pyproject.toml")
        .read_text()
        .replace("adds = []", 'adds = ["vllm/gone.py"]')
    )
    message = refused(project, wheels[0], tmp_path)
    assert "vllm/gone.py: declared in pyproject.toml, but not in the tree" in message


def test_pins_bumped_by_hand_are_refused(tmp_path: Path, index: Path) -> None:
    old = release(tmp_path, index, "0.33.0", {PATCHED.as_posix(): ORIGINAL})
    new = release(tmp_path, index, NEW_VERSION, {PATCHED.as_posix(): UPSTREAM_FIX})
    project = make_project(tmp_path, old, {PATCHED.as_posix(): OURS})
    bump_pins_by_hand(project, new)
    message = refused(project, new[0], tmp_path)
    assert f"{PATCHED}: {new[0].name} holds another original" in message
    assert "would revert upstream's change" in message
    assert "git checkout pyproject.toml tools/base_wheel_METADATA" in message
