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

from tools import util
from tools.pins import load_pins

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
