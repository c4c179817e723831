# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test run exercises this tree's files, and the install is this build."""

import importlib
import os
from importlib.metadata import version
from pathlib import Path

import overlay_finder
import pytest
import tree_imports

from tools.pins import load_pins


def test_replaced_modules_come_from_the_selected_source(overlay_modules):
    assert overlay_modules, "the tree replaces at least one vLLM module"
    for name, path in overlay_modules.items():
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve() == path.resolve()
        assert "site-packages" not in Path(module.__file__).parts


def test_tree_is_the_default_source(overlay_modules):
    if os.environ[tree_imports.SOURCE_ENV] != "tree":
        return
    name = "vllm.distributed.device_communicators.flashinfer_all_reduce"
    expected = tree_imports.REPO_ROOT / "vllm/distributed/device_communicators"
    assert overlay_modules[name] == expected / "flashinfer_all_reduce.py"


def test_installed_vllm_carries_the_local_label():
    assert version("vllm") == load_pins().version


def test_the_finder_loads_only_dotted_names_inside_its_root(tmp_path: Path) -> None:
    (tmp_path / "tree" / "vllm").mkdir(parents=True)
    outside = tmp_path / "outside.py"
    outside.write_text("raise AssertionError('ran a file outside the tree')\n")
    (tmp_path / "tree" / "vllm" / "escape.py").symlink_to(outside)
    finder = overlay_finder.OverlayFinder(tmp_path / "tree", (), "")
    assert finder.find_spec(f"vllm.{outside.with_suffix('')}") is None
    with pytest.raises(ImportError, match=f"resolves to {outside}, outside"):
        finder.find_spec("vllm.escape")
