# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Buildkite pipeline names only files that exist, and its CPU step runs
what the README and .ci/run run."""

import re
import shlex

import pytest
import tree_imports
import yaml

ROOT = tree_imports.REPO_ROOT
PIPELINES = sorted((ROOT / ".buildkite").rglob("*.yaml"))
REPO_PATH = re.compile(r"^(vllm|tests|benchmarks|tools|requirements|\.buildkite)/")


def _steps() -> list[dict]:
    steps = []
    for pipeline in PIPELINES:
        steps += yaml.safe_load(pipeline.read_text())["steps"]
    return steps


def _readme_install_and_test() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install and test", 1)[1]
    line = section.split("```bash\n", 1)[1].split("\n", 1)[0]
    return [command.strip() for command in line.split("&&")]


def _named_paths(command: str) -> list[str]:
    return [word for word in shlex.split(command) if REPO_PATH.match(word)]


def test_there_is_a_pipeline():
    assert PIPELINES
    assert {"cpu-small"} <= {step.get("device") for step in _steps()}


@pytest.mark.parametrize("step", _steps(), ids=lambda step: step["key"])
def test_step_names_only_existing_files(step):
    assert step["label"] and step["commands"]
    for dependency in step.get("source_file_dependencies", []):
        assert (ROOT / dependency.removeprefix("!")).exists(), dependency
    for command in step["commands"]:
        for path in _named_paths(command):
            assert (ROOT / path).exists(), f"{step['key']}: {path} does not exist"


def test_cpu_step_runs_the_readme_commands():
    [cpu] = [step for step in _steps() if step.get("device") == "cpu-small"]
    readme = _readme_install_and_test()
    assert cpu["commands"] == readme
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert all(command in ci for command in readme)


def test_gpu_steps_are_optional_and_sized():
    gpu_steps = [step for step in _steps() if "num_devices" in step]
    assert gpu_steps
    for step in gpu_steps:
        assert step["optional"] is True
        assert step["num_devices"] >= 2
