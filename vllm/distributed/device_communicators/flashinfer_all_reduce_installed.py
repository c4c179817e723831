# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""The FlashInfer packages installed here, read as FlashInfer's loader reads them.

Which kernels run is not only flashinfer-python's release: FlashInfer loads
prebuilt modules from `flashinfer/data/aot` and from the provider packages a
flashinfer-jit-cache shim lists (flashinfer/jit/env.py). This module reads
each of them without importing FlashInfer, so start-up and explain see the
same inputs; `kernel_release` in the policy module does the counting.
"""

import importlib
import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FLASHINFER_VERSION_CHECK_ENV,
    MNNVL_KERNEL_MODULE,
    FiJitCacheProvider,
)

# The module of FlashInfer's prebuilt kernels (the flashinfer-jit-cache shim).
FLASHINFER_JIT_CACHE_MODULE = "flashinfer_jit_cache"
# Where flashinfer-python itself may hold prebuilt modules, under its package
# (FLASHINFER_AOT_DIR in flashinfer/jit/env.py).
FLASHINFER_AOT_DIR = ("data", "aot")
# What stands for a provider's version that cannot be read: no release, so
# never taken for a fix.
UNREADABLE_VERSION = "unknown"


def installed_flashinfer_version() -> str | None:
    """The flashinfer-python release, whose kernels run unless prebuilt ones
    of another release stand in for them."""
    try:
        return version("flashinfer-python")
    except PackageNotFoundError:
        return None


def _jit_cache_shim() -> Any | None:
    """The importable `flashinfer_jit_cache` module, or None.

    Found as FlashInfer's loader finds it (`has_flashinfer_jit_cache` and
    `_get_aot_providers` in flashinfer/jit/env.py). One that fails to import
    fails FlashInfer's own import too, so none of its kernels run.
    """
    try:
        if importlib.util.find_spec(FLASHINFER_JIT_CACHE_MODULE) is None:
            return None
        return importlib.import_module(FLASHINFER_JIT_CACHE_MODULE)
    except Exception:
        return None


def installed_flashinfer_jit_cache_version() -> str | None:
    """The flashinfer-jit-cache shim's `__version__`, which FlashInfer
    checks against its own release; None without a readable shim."""
    shim = _jit_cache_shim()
    shim_version = getattr(shim, "__version__", None)
    return None if shim_version is None else str(shim_version)


def _frozen_strings(value: Any) -> frozenset[str] | None:
    """A provider's list of modules or CUDA targets; None where absent."""
    if value is None:
        return None
    try:
        return frozenset(str(item) for item in value)
    except TypeError:
        return None


def installed_flashinfer_jit_cache_providers() -> tuple[FiJitCacheProvider, ...]:
    """The kernel packages the shim lists (`get_jit_cache_providers()`),
    with the fields FlashInfer's loader reads from each.

    A provider whose version cannot be read counts as UNREADABLE_VERSION; a
    shim whose list cannot be read lists nothing here (FlashInfer's own
    import fails on it).
    """
    shim = _jit_cache_shim()
    if shim is None or getattr(shim, "__version__", None) is None:
        return ()
    try:
        listed = tuple(shim.get_jit_cache_providers())
    except Exception:
        return ()
    return tuple(
        FiJitCacheProvider(
            distribution=str(getattr(provider, "distribution", "a provider")),
            version=str(getattr(provider, "version", UNREADABLE_VERSION)),
            modules=_frozen_strings(getattr(provider, "modules", None)),
            cuda_architectures=_frozen_strings(
                getattr(provider, "cuda_architectures", None)
            ),
        )
        for provider in listed
    )


def installed_flashinfer_aot_module() -> bool:
    """Whether flashinfer-python holds a prebuilt MNNVL module of its own.

    `get_aot_artifacts` in flashinfer/jit/env.py loads
    `flashinfer/data/aot/<module>/<module>.so` before any provider's, with
    no version check. No released wheel ships one.
    """
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    for location in spec.submodule_search_locations:
        module = Path(location).joinpath(*FLASHINFER_AOT_DIR, MNNVL_KERNEL_MODULE)
        if (module / f"{MNNVL_KERNEL_MODULE}.so").exists():
            return True
    return False


def flashinfer_version_check() -> bool:
    """Whether FlashInfer refuses jit-cache packages of another release.

    FlashInfer's own variable, so read as FlashInfer reads it rather than
    through vllm.envs: `os.getenv`, where any non-empty value (also "0")
    turns the check off.
    """
    return not os.getenv(FLASHINFER_VERSION_CHECK_ENV)


def installed_kernel_inputs() -> dict[str, Any]:
    """The FlashInfer fields of `FiArBackendInputs`, as installed here."""
    return {
        "flashinfer_version": installed_flashinfer_version(),
        "flashinfer_jit_cache_version": installed_flashinfer_jit_cache_version(),
        "flashinfer_jit_cache_providers": installed_flashinfer_jit_cache_providers(),
        "flashinfer_aot_module": installed_flashinfer_aot_module(),
        "flashinfer_version_check": flashinfer_version_check(),
    }
