# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The editable install's import hook (tools/finder.py), run as users run it.

Each test makes a tiny synthetic base wheel, installs a scratch project with
``pip install -e`` into a scratch venv, and probes it from fresh interpreters.
The hook runs in every process of that venv, so it must be safe and cheap.
"""

from pathlib import Path

from synthetic import (
    PATCHED,
    editable_install,
    make_wheel,
    pip_install,
    run_limited,
    scratch_project,
    scratch_venv,
    site_packages,
)

from tools import pack

# Added modules: one beside the replaced file, one in a folder upstream lacks.
ADDED = {
    "vllm/distributed/device_communicators/beside.py": "WHERE = 'beside'\n",
    "vllm/hisparse_new/policy.py": "WHERE = 'new folder'\n",
}
IMPORT_EACH = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        print(importlib.import_module(name).__file__)\n"
    "    except ImportError as e:\n"
    "        print('refused:', e)\n"
)


def _module(rel: str | Path) -> str:
    """The import name of the file ``rel`` (``vllm/a/b.py``)."""
    return ".".join(Path(rel).with_suffix("").parts)


def _import_each(python: Path, *names: str) -> list[str]:
    """Import ``names`` in a fresh interpreter: each one's file, or its error."""
    proc = run_limited([str(python), "-c", IMPORT_EACH, *names])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def test_declared_modules_are_the_same_from_wheel_and_editable(
    tmp_path: Path,
) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base, adds=ADDED)
    python = scratch_venv(tmp_path)
    declared = [PATCHED.as_posix(), *ADDED]
    names = [_module(rel) for rel in declared]

    pip_install(python, str(project), base=base)
    from_wheel = _import_each(python, *names)
    site = site_packages(python)
    assert from_wheel == [str(site / rel) for rel in declared]
    shipped = [Path(file).read_bytes() for file in from_wheel]

    pip_install(python, "-e", str(project), base=base)
    from_tree = _import_each(python, *names)
    assert from_tree == [str(project / rel) for rel in declared]
    assert [Path(file).read_bytes() for file in from_tree] == shipped


def test_only_dotted_names_inside_the_checkout_load(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    python = editable_install(tmp_path, project, base)
    outside = tmp_path / "outside.py"
    outside.write_text("print('ran a file outside the checkout')\n")
    escape = project / PATCHED.parent / "escape.py"
    escape.symlink_to(outside)

    shaped_like_a_path = f"vllm.{outside.with_suffix('')}"
    lines = _import_each(
        python, shaped_like_a_path, _module(escape.relative_to(project))
    )
    assert lines[0] == f"refused: No module named {shaped_like_a_path!r}"
    assert lines[1].startswith(f"refused: {escape} resolves to {outside}")
    assert len(lines) == 2, lines  # nothing printed by the file outside
    assert _import_each(python, _module(PATCHED)) == [str(project / PATCHED)]


def test_pth_adds_at_most_five_modules_to_startup(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    python = editable_install(tmp_path, scratch_project(tmp_path, base), base)
    pth = site_packages(python) / pack.EDITABLE_PTH

    def loaded() -> set[str]:
        proc = run_limited([str(python), "-c", "import sys; print(*sys.modules)"])
        assert proc.returncode == 0, proc.stderr
        return set(proc.stdout.split())

    with_hook = loaded()
    pth.rename(pth.with_suffix(".off"))
    added = sorted(with_hook - loaded())
    assert pack.EDITABLE_FINDER in added
    assert len(added) <= 5, added


def test_moved_checkout_is_named_when_an_overlaid_module_is_imported(
    tmp_path: Path,
) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base, adds=ADDED)
    python = editable_install(tmp_path, project, base)
    project.rename(tmp_path / "moved")

    for rel in [PATCHED, *ADDED]:
        proc = run_limited([str(python), "-c", f"import {_module(rel)}"])
        assert proc.returncode == 1
        last = proc.stderr.splitlines()[-1]
        assert f"{project}, which is gone" in last, proc.stderr
        assert "pip install -e ." in last and "pip install ." in last
    # What the wheel itself holds still imports.
    assert _import_each(python, "vllm._version")[0].startswith(str(tmp_path / "venv"))
