# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The couplings to upstream the tree declares in pyproject.toml (check.py).

``[tool.vllm-overlay.env-choices]`` and ``known-issues`` name constants of
the tree as ``"path:NAME"``; an entry that names no declared file is refused
with the entry's name.
"""

import pytest
from synthetic import ADDED

from tools import check
from tools.pins import Pins


@pytest.mark.parametrize(
    ("pins", "expected"),
    [
        (
            {"env_choices": {"VLLM_X": "vllm/gone.py:CHOICES"}},
            (
                "[tool.vllm-overlay.env-choices]: VLLM_X = 'vllm/gone.py:CHOICES' must "
                "name a constant in a declared file"
            ),
        ),
        (
            {"env_choices": {"not-a-var": f"{ADDED}:CHOICES"}},
            "'not-a-var' is not an environment variable name",
        ),
        (
            {"known_issues": {"in": f"{ADDED}:KNOWN"}},
            "must have exactly the keys in and package",
        ),
        (
            {"known_issues": {"in": ADDED, "package": "flashinfer-python"}},
            f"[tool.vllm-overlay.known-issues]: in = '{ADDED}' must name a constant",
        ),
    ],
)
def test_bad_coupling_declarations_are_named(pins: dict, expected: str) -> None:
    declared = Pins("0.33.0", "hisparse1", {}, adds=(ADDED,), **pins)
    problems = check.declared_name_problems(declared)
    assert len(problems) == 1 and expected in problems[0]
