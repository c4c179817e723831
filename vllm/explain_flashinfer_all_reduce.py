# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  distributed/device_communicators/flashinfer_all_reduce.py. Goes away with
#  that file.
"""The command that explains vLLM's FlashInfer all-reduce choice.

    python -m vllm.explain_flashinfer_all_reduce --help

The explanation lives in
`vllm.distributed.device_communicators.flashinfer_all_reduce_report`; this
module starts it from where importing loads nothing of torch or vLLM.
Running a module inside `vllm.distributed` imports that package first, and
the import logs torch's notices before any code of the module runs.
"""

import logging
import sys
from types import TracebackType

# The loggers whose records are held: the root logger (vLLM's and
# FlashInfer's records reach it while vLLM has not configured logging),
# and vLLM's and torch's own.
HELD_LOGGERS = ("", "vllm", "torch")
# How a held error is written to stderr once explain ends.
HELD_RECORD_FORMAT = "%(levelname)s %(name)s: %(message)s"


class ErrorsOnly(logging.Handler):
    """While explain runs, keep torch's and vLLM's logs to their errors.

    explain answers for a deployment, not for the machine it runs on. What
    torch and vLLM log while they load here (deprecations of this torch,
    kernels this machine lacks) would bury a one-line usage error or the
    answer, so records below ERROR are dropped. Errors are held and written
    to stderr when explain ends, in order: not through vLLM's handler, which
    writes to stdout, where the answer (with --json, one JSON document) is.
    """

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self._saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "ErrorsOnly":
        for name in HELD_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.handlers, logger.propagate))
            logger.handlers, logger.propagate = [self], False
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for logger, handlers, propagate in reversed(self._saved):
            logger.handlers, logger.propagate = handlers, propagate
        self._saved.clear()
        to_stderr = logging.StreamHandler(sys.stderr)
        to_stderr.setFormatter(logging.Formatter(HELD_RECORD_FORMAT))
        for record in self.records:
            to_stderr.handle(record)
        self.records.clear()


def main(argv: list[str] | None = None) -> int:
    """Run explain with torch's and vLLM's logs kept to their errors."""
    with ErrorsOnly():
        from vllm.distributed.device_communicators import (
            flashinfer_all_reduce_report as report,
        )

        return report.main(argv)


if __name__ == "__main__":
    sys.exit(main())
