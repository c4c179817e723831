# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The overlay build tool: vLLM's release wheel plus ``vllm/``.

Imports run one way, down: ``buildapi`` and ``__main__`` (the PEP 517 hooks;
``python -m tools diff|rebase``), ``rebase``, ``sdist``, ``pack``, ``check``,
``fetch``, ``pins``, ``util``.
"""
