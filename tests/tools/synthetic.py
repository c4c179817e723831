# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Synthetic releases, trees, projects and venvs for the build tool's tests.

Everything here is tiny and local: vllm wheels made with the ``wheel`` CLI,
scratch projects that copy the repo's ``tools/`` (git checkouts where a
command needs one), and scratch venvs. No helper touches the network or
needs the real 336 MB base wheel.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import packaging
import pytest

from tools import check, pack, util
from tools.pins import BASE_METADATA, LOCATION_ENV, Pins, load_pins

# Seconds a child process (pip, a scratch venv's python) may run.
TIMEOUT = 180


REPO_ROOT = Path(__file__).resolve().parents[2]


PATCHED = Path("vllm/distributed/device_communicators/flashinfer_all_reduce.py")


STOCK_SOURCE = "STOCK = True\n"


PATCHED_SOURCE = "STOCK = False  # hisparse\n"


REQUIRES_DIST = [
    "numpy",
    'torch==2.13.0; platform_machine == "x86_64"',
]


ENTRY_POINTS = "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n"


# The shape of the vcs-versioning file in upstream's wheel.
VERSION_SOURCE = (
    "__version__ = version = '{0}'\n"
    "__version_tuple__ = version_tuple = (0, 33, 0)\n"
    "__commit_id__ = commit_id = 'g4ba787ec9'\n"
)


def make_wheel(
    where: Path,
    *,
    version: str = "0.33.0",
    wheel_tag: str = "py3-none-any",
    file_tags: str | None = None,
    init_source: str = "",
    files: Mapping[str, str] | None = None,
    requires_dist: Sequence[str] = REQUIRES_DIST,
) -> Path:
    """Pack a tiny vllm wheel; ``file_tags`` renames it like upstream's files.

    Upstream's WHEEL file says ``linux_x86_64`` while its file name says
    ``manylinux_2_28_x86_64``; ``file_tags`` reproduces that mismatch.
    ``files`` maps ``vllm/...`` paths to contents that replace or join the
    stock ones; ``requires_dist`` gives METADATA's Requires-Dist lines.
    """
    tree = where / f"vllm-{version}"
    dist_info = tree / f"vllm-{version}.dist-info"
    (tree / PATCHED).parent.mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text(init_source)
    (tree / "vllm" / "_version.py").write_text(VERSION_SOURCE.format(version))
    (tree / PATCHED).write_text(STOCK_SOURCE)
    for package in PATCHED.parents[:-2]:  # regular packages, as upstream's
        (tree / package / "__init__.py").write_text("")
    for rel, text in (files or {}).items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    dist_info.mkdir()
    requires = "".join(f"Requires-Dist: {req}\n" for req in requires_dist)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n{requires}\n"
        "A tiny stand-in for the upstream wheel.\n"
    )
    (dist_info / "WHEEL").write_text(
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
        f"Tag: {wheel_tag}\n"
    )
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    out = where / "dist"
    out.mkdir()
    _run_wheel_cli("pack", "--dest-dir", str(out), str(tree))
    shutil.rmtree(tree)
    built = out / f"vllm-{version}-{wheel_tag}.whl"
    assert built.is_file()
    if file_tags is not None:
        built = built.rename(out / f"vllm-{version}-{file_tags}.whl")
    return built


def make_dist(
    where: Path, name: str, version: str, requires: Sequence[str] = ()
) -> Path:
    """A tiny pure wheel of any project, e.g. a flashinfer-python stand-in.

    It holds one module named after the project, so an install shows.
    """
    stem = name.replace("-", "_")
    tree = where / f"{stem}-{version}"
    dist_info = tree / f"{stem}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (tree / f"{stem}.py").write_text(f"VERSION = {version!r}\n")
    listed = "".join(f"Requires-Dist: {req}\n" for req in requires)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{listed}"
    )
    (dist_info / "WHEEL").write_text(
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n"
    )
    where.mkdir(parents=True, exist_ok=True)
    _run_wheel_cli("pack", "--dest-dir", str(where), str(tree))
    shutil.rmtree(tree)
    built = where / f"{stem}-{version}-py3-none-any.whl"
    assert built.is_file()
    return built


def _run_wheel_cli(*args: str) -> None:
    """Run the wheel CLI the way the backend does."""
    subprocess.run([sys.executable, "-m", "wheel", *args], check=True, text=True)


STOCK_PIN = hashlib.sha256(STOCK_SOURCE.encode()).hexdigest()


def metadata_of(wheel: Path) -> bytes:
    """A wheel's METADATA, as tools/base_wheel_METADATA holds the base's."""
    with zipfile.ZipFile(wheel) as zf:
        return check.wheel_metadata(zf)


def pins_for(*wheels: Path, base_version: str = "0.33.0"):
    """Pins that trust exactly the given wheels, replacing the stock PATCHED."""
    return Pins(
        base_version=base_version,
        local_label="hisparse1",
        sha256={w.name: util.sha256_of(w) for w in wheels},
        replaces={PATCHED.as_posix(): STOCK_PIN},
        base_metadata=metadata_of(wheels[0]),
    )


def make_overlay(where: Path, *extra: str) -> Path:
    """An overlay tree like the repo's vllm/, with build litter that is skipped."""
    root = where / "overlay" / "vllm"
    (root / PATCHED.relative_to("vllm")).parent.mkdir(parents=True)
    (root.parent / PATCHED).write_text(PATCHED_SOURCE)
    pycache = root / "__pycache__"
    pycache.mkdir()
    (pycache / "not_upstream.cpython-311.pyc").write_bytes(b"junk")
    (root / "stray.pyc").write_bytes(b"junk")
    for rel in extra:
        (root.parent / rel).parent.mkdir(parents=True, exist_ok=True)
        (root.parent / rel).write_text("# new\n")
    return root


def cached_copy(base: Path, cache: Path) -> Path:
    """Put ``base`` in the wheel cache ``cache``, as an earlier build did."""
    cache.mkdir(exist_ok=True)
    return Path(shutil.copyfile(base, cache / base.name))


def pip_sees_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Let pip fetch from ``folder`` and nowhere else."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))


def corrupt(path: Path) -> None:
    """Flip one byte in the middle, as a bad download or disk would."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def read_member(wheel: Path, member: str) -> str:
    """Text of one file inside a built wheel."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(member).decode()


def copy_tools(project: Path, base: Path) -> None:
    """Give a scratch project its own copy of the build tool, as a clone has,
    with ``base``'s METADATA as the pinned release's."""
    shutil.copytree(
        REPO_ROOT / "tools",
        project / "tools",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (project / BASE_METADATA).write_bytes(metadata_of(base))


def scratch_project(
    tmp_path: Path,
    base: Path,
    requires: Sequence[str] = (),
    adds: Mapping[str, str] | None = None,
) -> Path:
    """A repo copy whose pins trust ``base``, to drive the backend through pip.

    ``requires`` are its requirement overrides; ``adds`` maps the paths of
    added modules to their contents.
    """
    project = tmp_path / "project"
    copy_tools(project, base)
    shutil.copytree(make_overlay(tmp_path), project / "vllm")
    for rel, text in (adds or {}).items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    (project / "pyproject.toml").write_text(
        "[build-system]\n"
        "requires = ['packaging>=24.0']\n"
        "build-backend = 'tools.buildapi'\n"
        "backend-path = ['.']\n\n"
        "[tool.vllm-overlay]\n"
        "base-version = '0.33.0'\n"
        "local-label = 'hisparse1'\n"
        f"requires = {list(requires)!r}\n"
        f"adds = {sorted(adds or {})!r}\n\n"
        "[tool.vllm-overlay.sha256]\n"
        f"'{base.name}' = '{util.sha256_of(base)}'\n\n"
        "[tool.vllm-overlay.replaces]\n"
        f"'{PATCHED.as_posix()}' = '{STOCK_PIN}'\n"
    )
    return project


def pip_wheel(project: Path, out: Path, base: Path) -> subprocess.CompletedProcess:
    """``pip wheel .`` without build isolation, so no index is needed."""
    env = {**os.environ, LOCATION_ENV: str(base)}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    return subprocess.run(
        [*cmd, "-w", str(out), str(project)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


ADDED = "vllm/distributed/device_communicators/added_helper.py"


# Upstream's file, far enough apart that a change near the top and one near
# the bottom merge cleanly.
ORIGINAL = "".join(f"line_{i} = {i}\n" for i in range(12))


OURS = "# Base: vllm==0.33.0\n" + ORIGINAL.replace("line_2 = 2", "line_2 = 'ours'")


UPSTREAM_FIX = ORIGINAL.replace("line_9 = 9", "line_9 = 'upstream'")


UPSTREAM_CLASH = ORIGINAL.replace("line_2 = 2", "line_2 = 'upstream'")


NEW_VERSION = "0.34.0"


def sha(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def release(
    tmp_path: Path,
    index: Path,
    version: str,
    files: Mapping[str, str],
    requires_dist: Sequence[str] = REQUIRES_DIST,
) -> list[Path]:
    """One upstream release: an x86_64 and an aarch64 wheel, both in the index."""
    wheels = []
    for arch in ("x86_64", "aarch64"):
        built = make_wheel(
            tmp_path / f"release-{version}-{arch}",
            version=version,
            wheel_tag=f"cp38-abi3-linux_{arch}",
            file_tags=f"cp38-abi3-manylinux_2_28_{arch}",
            files=files,
            requires_dist=requires_dist,
        )
        wheels.append(Path(shutil.copy(built, index)))
    return wheels


def pyproject_text(
    wheels: list[Path],
    replaces: Mapping[str, str],
    adds: tuple[str, ...] = (),
) -> str:
    """The repo's pin tables, trusting ``wheels``."""
    version = wheels[0].name.split("-")[1]
    listed = ", ".join(f'"{path}"' for path in adds)
    return (
        "[build-system]\n"
        "requires = ['packaging>=24.0']\n"
        "build-backend = 'tools.buildapi'\n"
        "backend-path = ['.']\n\n"
        "[tool.vllm-overlay]\n"
        f'base-version = "{version}"\n'
        'local-label = "hisparse1"\n'
        "# New modules.\n"
        f"adds = [{listed}]\n\n"
        "[tool.vllm-overlay.sha256]\n"
        + "".join(f'"{w.name}" = "{util.sha256_of(w)}"\n' for w in wheels)
        + "\n[tool.vllm-overlay.replaces]\n"
        "# Replaced files, pinned to their upstream originals.\n"
        + "".join(f'"{path}" = "{pin}"\n' for path, pin in replaces.items())
    )


def make_project(
    tmp_path: Path,
    wheels: list[Path],
    files: Mapping[str, str],
    adds: tuple[str, ...] = (),
    replaces: Mapping[str, str] | None = None,
) -> Path:
    """A git checkout of the repo's layout: pins, the build tool, a tree."""
    project = tmp_path / "project"
    copy_tools(project, wheels[0])
    for rel, text in files.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    if replaces is None:
        replaces = {PATCHED.as_posix(): sha(ORIGINAL)}
    (project / "pyproject.toml").write_text(pyproject_text(wheels, replaces, adds))
    commit(project, "the overlay")
    return project


def commit(project: Path, message: str) -> None:
    """Commit everything in ``project``, making it a git checkout if needed."""
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", message]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=project,
            check=True,
            capture_output=True,
            timeout=60,
        )


def build(project: Path, wheel: Path, tmp_path: Path, out: Path | None = None) -> Path:
    """Build the project's overlay on ``wheel``, as pip install . would."""
    out = out or fresh_dir(tmp_path)
    name = pack.build(
        out,
        pins=load_pins(project / "pyproject.toml"),
        overlay_root=project / "vllm",
        location=str(wheel),
    )
    return out / name


def fresh_dir(tmp_path: Path) -> Path:
    """A fresh, empty wheel_directory for each build."""
    for i in range(100):
        folder = tmp_path / f"out{i}"
        if not folder.exists():
            folder.mkdir()
            return folder
    raise AssertionError("too many builds in one test")


def refused(project: Path, wheel: Path, tmp_path: Path) -> str:
    """The build's error message; the build must leave no wheel."""
    out = fresh_dir(tmp_path)
    with pytest.raises(util.OverlayError) as excinfo:
        build(project, wheel, tmp_path, out)
    assert list(out.iterdir()) == []
    return str(excinfo.value)


def bump_pins_by_hand(project: Path, wheels: list[Path]) -> None:
    """What the issue warns about: new base wheels, file pins left as they were."""
    pins = load_pins(project / "pyproject.toml")
    (project / "pyproject.toml").write_text(
        pyproject_text(wheels, pins.replaces, pins.adds)
    )


def no_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the build gets as far as unpacking the base wheel."""

    def unpack(base_wheel: Path, *args: object) -> Path:
        raise AssertionError(f"the base wheel {base_wheel} was unpacked")

    monkeypatch.setattr(pack, "repack", unpack)


def run_limited(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    """A child process with a hard limit; its output is returned for asserts."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=TIMEOUT, check=False, **kwargs
    )


def scratch_venv(where: Path, with_pip: bool = False) -> Path:
    """A venv that sees no vllm but its own; return its python.

    Without ``with_pip`` it has no pip (the outer pip installs into it with
    ``--python``); with it, Python's bundled pip (ensurepip, offline). It has
    no system site-packages: the backend's own need, packaging, is lent to it
    from the environment under test through a ``.pth`` file, as a build
    environment would install it, never from the base interpreter.
    """
    env_dir = where / "venv"
    venv.create(env_dir, with_pip=with_pip)
    python = env_dir / "bin" / "python"
    lent = where / "lent"
    lent.mkdir()
    (lent / "packaging").symlink_to(Path(packaging.__file__).parent)
    (site_packages(python) / "_lent.pth").write_text(f"{lent}\n")
    return python


def site_packages(python: Path) -> Path:
    """The site-packages folder of the venv whose interpreter is ``python``."""
    return next(python.parents[1].glob("lib/python*/site-packages"))


def call_hook(
    project: Path,
    hook: str,
    directory: Path,
    settings: Mapping | None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Call one PEP 517 hook of ``project``'s own backend, as a frontend does.

    ``settings`` is the hook's ``config_settings`` (what ``-C`` gives). The
    hook's return value is the last line of stdout.
    """
    code = (
        "import json, sys; sys.path.insert(0, '.'); "
        "from tools import buildapi; "
        "hook = getattr(buildapi, sys.argv[1]); "
        "settings = json.loads(sys.argv[3]); "
        "print(hook(sys.argv[2], settings))"
    )
    args = [hook, str(directory), json.dumps(settings)]
    return run_limited(
        [sys.executable, "-c", code, *args],
        cwd=project,
        env={**os.environ, **env} if env else None,
    )
