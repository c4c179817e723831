# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m tools diff|rebase``, run from the repository's root."""

from .commands import main

raise SystemExit(main())
