# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``[tool.vllm-overlay]`` and ``tools/base_wheel_METADATA``: read, checked,
and still right for the release they pin.

The last tests read the repository's own pins: they fail at the rebase that
makes the patch's workaround, its FlashInfer override or its label wrong.
"""

import sys
from pathlib import Path

import pytest
import tree_imports
from packaging.requirements import Requirement
from packaging.version import Version
from synthetic import make_wheel, scratch_project

from tools import pins as pins_module
from tools.pins import load_pins, parse_metadata


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ("local-label = 'hisparse-1'", "label 'hisparse-1' is not letters"),
        ("local-label = 'x1'\nsha256 = 1", "cannot read the pins"),
        (
            (
                "local-label = 'x1'\n[tool.vllm-overlay.sha256]\n"
                f"'vllm-0.32.0-py3-none-any.whl' = '{'a' * 64}'"
            ),
            "vllm-0.32.0-py3-none-any.whl is not a vllm==0.33.0 wheel",
        ),
        (
            "local-label = 'x1'\n[tool.vllm-overlay.variants.flashinfer]",
            "unknown key 'variants'",
        ),
        (
            "local-label = 'x1'\nrequires = ['flashinfer-python=0.7.4']",
            "cannot read the pins",
        ),
        (
            "local-label = 'x1'\nrequires = ['a==1; sys_platform == \"linux\"']",
            'requires: a==1; sys_platform == "linux" has a marker',
        ),
    ],
)
def test_bad_pins_are_one_message(tmp_path: Path, table: str, expected: str) -> None:
    project = scratch_project(tmp_path, make_wheel(tmp_path))
    pyproject = project / "pyproject.toml"
    pyproject.write_text(
        f"[tool.vllm-overlay]\nbase-version = '0.33.0'\n{table}\n"
        + ("" if "sha256" in table else "[tool.vllm-overlay.sha256]\n")
    )
    with pytest.raises(pins_module.OverlayError) as excinfo:
        load_pins(pyproject)
    assert expected in str(excinfo.value) and str(pyproject) in str(excinfo.value)


def test_python_310_gets_the_message_from_the_metadata_hook(tmp_path: Path) -> None:
    """As Python 3.10 has it: no tomllib, so no pins and no METADATA whose
    Requires-Python pip could refuse."""
    code = (
        "import sys; sys.modules['tomllib'] = None; "
        f"sys.path.insert(0, {str(tree_imports.REPO_ROOT)!r}); "
        "from tools import buildapi; "
        f"buildapi.prepare_metadata_for_build_wheel({str(tmp_path)!r})"
    )
    proc = tree_imports.run_in_session([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "error: this vLLM build needs Python 3.11 or newer" in proc.stderr
    assert "Fix: run pip with a newer Python" in proc.stderr


def base_requirements() -> list[Requirement]:
    metadata = parse_metadata(load_pins().base_metadata)
    return [Requirement(line) for line in metadata.get_all("Requires-Dist")]


def pinned_flashinfer() -> Version:
    """The flashinfer-python release the base wheel pins (``==``)."""
    [pin] = [r for r in base_requirements() if r.name == "flashinfer-python"]
    [spec] = pin.specifier
    assert spec.operator == "==", pin
    return Version(spec.version)


def test_the_base_still_needs_the_known_issue_workaround() -> None:
    """A base wheel that pins FlashInfer at or above every known issue's
    fixed_in retires the part of the patch that steers around them."""
    from vllm.distributed.device_communicators.flashinfer_all_reduce_backend import (
        FI_AR_KNOWN_ISSUES,
    )

    fixes = [issue.fixed_in for issue in FI_AR_KNOWN_ISSUES]
    assert fixes, "FI_AR_KNOWN_ISSUES lists the issues the patch steers around"
    retired = None not in fixes and pinned_flashinfer() >= max(map(Version, fixes))
    assert not retired, (
        f"the base wheel pins flashinfer-python=={pinned_flashinfer()}, at or above "
        f"every fixed_in of FI_AR_KNOWN_ISSUES ({fixes}): drop those entries and "
        "the part of the patch that steers around them (Drop-When in the DEP-3 "
        "header of the replaced file), and the flashinfer-python override"
    )


def test_each_override_moves_past_the_base_wheels_pin() -> None:
    for requirement in load_pins().requires:
        [spec] = requirement.specifier
        assert requirement.name == "flashinfer-python", requirement
        assert Version(spec.version) > pinned_flashinfer(), (
            f"requires {requirement}: the base wheel pins that release or a later "
            "one already; remove it from [tool.vllm-overlay] requires"
        )


def test_the_local_label_is_one_vllm_reads_as_a_label() -> None:
    """vllm/platforms picks the CPU platform when 'cpu' is in the version, and
    collect-env reads a last version part starting with 'g' as a git sha."""
    label = load_pins().local_label
    assert "cpu" not in label.lower() and not label.lower().startswith("g")
