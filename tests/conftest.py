# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import pytest
import tree_imports


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stock-vllm",
        action="store_true",
        help=(
            "Run against the pinned base wheel's original files "
            "instead of this tree's, to show which tests our change makes pass."
        ),
    )
    parser.addoption(
        "--vllm-tree",
        metavar="PATH",
        help="Run against another checkout's vllm/ files, such as an earlier commit's.",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module imports vLLM, so the replaced modules resolve to
    # this tree (or to the stock base release); child processes inherit the choice.
    source = config.getoption("--vllm-tree") or "tree"
    if config.getoption("--stock-vllm"):
        source = "stock"
    config.stash[overlay_key] = tree_imports.install(source)


overlay_key = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def overlay_modules(pytestconfig: pytest.Config) -> dict:
    """Module name -> the file the test run imports it from."""
    return pytestconfig.stash[overlay_key]
