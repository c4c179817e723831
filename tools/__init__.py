# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The precompiled-overlay build tool: builds vLLM from its release wheel plus
the files under ``vllm/``."""
