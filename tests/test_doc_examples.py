# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every explain example in README.md and docs/ runs as written.

The examples are read out of the Markdown, whatever it holds today:

- a `console` block with a `$ ` line that runs the explain command is run
  one command at a time in one bash session; each command must print what
  the block shows under it (stdout and stderr, as a terminal shows them;
  `...` stands for any text) and exit 0, unless the next command is
  `echo $?`, whose shown output is then the status;
- a `bash` block that runs the explain command must exit 0.

They run on a machine without a GPU, with this tree's modules (a
sitecustomize that installs tests/tree_imports.py's finder) and none of
the switches explain reads from the environment set. Their `python` is the
interpreter running the tests, whatever is first on PATH, so the suite
passes with its venv activated or not.
"""

import doctest
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tree_imports

# The explain command.
EXPLAIN = re.compile(r"explain_flashinfer_all_reduce")
# The variables explain reads; an example that needs one sets it itself.
EXPLAIN_ENV = (
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND",
    "VLLM_ALLREDUCE_USE_FLASHINFER",
    "VLLM_BATCH_INVARIANT",
)
_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)
# Printed after each command of a console block, with its exit status.
_END = "@@example-command-end %d@@"
_END_LINE = re.compile(r"^@@example-command-end (\d+)@@\n", re.MULTILINE)
_CHECKER = doctest.OutputChecker()
TIMEOUT_S = 600


@dataclass
class Command:
    text: str
    output: str


@dataclass
class Example:
    where: str
    language: str
    body: str

    def commands(self) -> list[Command]:
        """The `$ ` commands of a console block, each with its shown output."""
        commands: list[Command] = []
        lines = self.body.splitlines(keepends=True)
        while lines:
            line = lines.pop(0)
            if not line.startswith("$ "):
                if commands:
                    commands[-1].output += line
                continue
            text = line[2:]
            while text.rstrip("\n").endswith("\\") and lines:
                text += lines.pop(0)
            commands.append(Command(text.rstrip("\n"), ""))
        return commands


def doc_files() -> list[Path]:
    root = tree_imports.REPO_ROOT
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def explain_examples() -> list[Example]:
    """The console and bash blocks of the docs that run the explain command."""
    examples = []
    for path in doc_files():
        text = path.read_text()
        for match in _FENCE.finditer(text):
            indent, language, body = match.groups()
            body = re.sub(rf"^{indent}", "", body, flags=re.MULTILINE)
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(tree_imports.REPO_ROOT)}:{line}"
            if (
                language == "console"
                and any(
                    EXPLAIN.search(c.text)
                    for c in Example(where, language, body).commands()
                )
                or language == "bash"
                and EXPLAIN.search(body)
            ):
                examples.append(Example(where, language, body))
    return examples


def python_first_on_path(folder: Path) -> str:
    """A PATH whose `python` and `python3` are this test's own interpreter.

    They exec sys.executable by its own path, so a venv's interpreter keeps
    its venv even when the venv is not activated.
    """
    folder.mkdir()
    for name in ("python", "python3"):
        (folder / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (folder / name).chmod(0o755)
    return os.pathsep.join([str(folder), os.environ.get("PATH", "")])


@pytest.fixture(scope="module")
def example_env(tmp_path_factory) -> dict[str, str]:
    """A shell environment whose Python imports this tree's vLLM modules."""
    hook = tmp_path_factory.mktemp("tree-hook")
    (hook / "sitecustomize.py").write_text(
        "import tree_imports\n\ntree_imports.install()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in EXPLAIN_ENV}
    paths = [str(hook), str(tree_imports.REPO_ROOT / "tests")]
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PATH=python_first_on_path(hook / "bin"),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(paths + [env.get("PYTHONPATH", "")]),
    )
    return env


def _bash(script: str, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """Run `script`; its own session, so a hung run dies with its children."""
    proc = tree_imports.run_in_session(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stderr=subprocess.STDOUT,
        timeout=TIMEOUT_S,
    )
    return proc.returncode, proc.stdout


def test_the_examples_run_this_interpreter(example_env, tmp_path):
    """Not whatever `python` the caller's PATH has first (an unactivated
    venv's tests would otherwise run the examples without vLLM)."""
    script = "python -c 'import sys; print(sys.executable)'"
    status, out = _bash(script, example_env, tmp_path)
    assert (status, out.strip()) == (0, sys.executable)


def test_the_docs_have_explain_examples():
    """The examples below are found at all (a renamed fence would hide them)."""
    assert any(e.where.startswith("docs/") for e in explain_examples())


@pytest.mark.parametrize("example", explain_examples(), ids=lambda e: e.where)
def test_explain_example_runs_as_written(example, example_env, tmp_path):
    if example.language == "bash":
        status, out = _bash(f"set -e\n{example.body}", example_env, tmp_path)
        assert status == 0, f"{example.where} exits {status}:\n{out}"
        return
    assert example.body.startswith("$ "), f"{example.where}: output before `$ `"
    commands = example.commands()
    # After each command's output, a line with its status, which the next
    # command's $? still sees.
    script = "".join(
        f"{c.text}\n__status=$?\nprintf '{_END}\\n' \"$__status\"\n(exit $__status)\n"
        for c in commands
    )
    status, out = _bash(script, example_env, tmp_path)
    pieces = _END_LINE.split(out)
    outputs, statuses = pieces[0:-1:2], [int(s) for s in pieces[1::2]]
    assert len(statuses) == len(commands), f"{example.where}:\n{out}"
    for i, (command, output, code) in enumerate(
        zip(commands, outputs, statuses, strict=True)
    ):
        checked_by_next = i + 1 < len(commands) and (
            commands[i + 1].text.strip() == "echo $?"
        )
        assert checked_by_next or code == 0, (
            f"{example.where}: `{command.text}` exits {code}:\n{output}"
        )
        assert _CHECKER.check_output(command.output, output, doctest.ELLIPSIS), (
            f"{example.where}: `{command.text}` printed\n{output}\n"
            f"where the docs show\n{command.output}"
        )
