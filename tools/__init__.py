# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The overlay build tool: vLLM's release wheel plus ``vllm/``.

Imports run one way, down this list; no module imports one above it::

    buildapi   commands        PEP 517/660 hooks; ``python -m tools diff|rebase``
       |       rebase          the maintainer's move to a new release
       |       couplings       the upstream names the tree uses: in a release?
    sdist                      the sdist
    pack                       stage 4, and the whole build in stage order
    overlay                    stage 3: the tree's files into the wheel's members
    check                      stage 2: does the tree fit the base wheel? Does
                               the base pin the fixes of its known issues?
    fetch                      stage 1: the verified base wheel
    pins, util                 pyproject.toml's pins; errors, logging, files

``finder`` (the editable install's import hook) imports nothing from here: it
is copied into the editable wheel and runs in every Python start-up.
"""
