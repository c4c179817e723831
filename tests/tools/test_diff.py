# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m tools diff``: the patch against upstream's source, checked first.

On a scratch project (synthetic.py) over tiny synthetic base wheels.
"""

import subprocess
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    ADDED,
    ORIGINAL,
    OURS,
    PATCHED,
    UPSTREAM_FIX,
    make_project,
    release,
    sha,
)

from tools.pins import LOCATION_ENV


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
    proc = tree_imports.run_tool(project, "diff")
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
    proc = tree_imports.run_tool(project, "diff")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert f"error: the files under vllm/ do not fit {old[0].name}" in proc.stderr
