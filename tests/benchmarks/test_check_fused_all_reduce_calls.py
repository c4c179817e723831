# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU path of benchmarks/check_fused_all_reduce.py, checked on CPU.

No GPU here can run fused_all_reduce_gpu.py. So the tensors it hands a
released CUDA op are built by a plain function, `gather_tensors`, and
checked here against that op's contract as the installed release states it:
for vLLM's compiled `hisparse_gather_compact`, the error strings its library
throws. Every FlashInfer name and keyword the GPU path reaches (our modules
and the vLLM code the op runs) is checked against the released sources of
flashinfer-python 0.7.2.post1 and 0.7.4, and every vLLM name our modules
call against the installed vllm.
"""

import ast
import importlib
import importlib.util
import inspect
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import tree_imports

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
RANK = BENCHMARKS / "fused_all_reduce_rank.py"
GPU = BENCHMARKS / "fused_all_reduce_gpu.py"
STEP = BENCHMARKS / "fused_all_reduce_step.py"
OPTIONS = BENCHMARKS / "fused_all_reduce_options.py"
OUR_GPU_PATH = (GPU, RANK, STEP)
FLASHINFER_RELEASES = ("0.7.2.post1", "0.7.4")

# HiSparse's gather as vLLM 0.34.0 registers it in its stable-ABI library.
GATHER_LIBRARY = "_C_stable_libtorch.abi3.so"
GATHER_SCHEMA = (
    b"hisparse_gather_compact(Tensor host_cache, Tensor! hot_cache, "
    b"Tensor miss_global_indices, Tensor miss_hot_indices, Tensor miss_counts) -> ()"
)
# Where the row-matrix checks name the host pool (`check_2d_rows`, called
# with "host_cache").
HOST_ROW_CHECKS = (b" must be 2D", b" must be contiguous", b" row width mismatch")


def _installed_vllm() -> Path:
    """Where the installed vllm is: its files, compiled libraries and all,
    are under vllm/ here."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def _calls_of(tree: ast.AST, attribute: str) -> list[ast.Call]:
    """The calls of `x.attribute(...)` or `attribute(...)` in `tree`."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and attribute
        in (getattr(node.func, "attr", None), getattr(node.func, "id", None))
    ]


def _load(path: Path):  # type: ignore[no-untyped-def]
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(path.stem)


def gather_contract(args: tuple[torch.Tensor, ...], gpu: torch.device) -> list:
    """`hisparse_gather_compact`'s checks as (error string, holds), in the
    order vllm 0.34.0 makes them: the strings its function throws (read
    from the library's code for that function), then `check_2d_rows` on the
    host pool. `gpu` is the device the GPU code passes."""
    host, hot, host_rows, hot_rows, counts = args
    plan = (host_rows, hot_rows, counts)
    hot_row_bytes = hot.shape[-1] * hot.element_size()
    return [
        ("hot_cache must be on CUDA", hot.device == gpu),
        ("host_cache must be pinned CPU memory", host.device.type == "cpu"),
        (
            "compact miss plan must be matching contiguous int32 CUDA tensors",
            all(t.dtype == torch.int32 and t.is_contiguous() for t in plan)
            and all(t.device == gpu for t in plan)
            and host_rows.dim() == 2
            and host_rows.shape == hot_rows.shape
            and counts.shape == host_rows.shape[:1],
        ),
        ("KV rows must be 16-byte aligned", hot_row_bytes % 16 == 0),
        ("hot_cache must be [num_blocks, block_size, row_width]", hot.dim() == 3),
        (
            "hot-cache rows must be contiguous",
            hot.stride(-1) == 1 and hot.stride(-2) == hot.shape[-1],
        ),
        ("host_cache must be 2D", host.dim() == 2),
        ("host_cache must be contiguous", host.is_contiguous()),
        (
            "host_cache row width mismatch",
            host.shape[-1] * host.element_size() == hot_row_bytes,
        ),
    ]


@pytest.fixture(scope="module")
def gather_library() -> bytes:
    return (_installed_vllm() / "vllm" / GATHER_LIBRARY).read_bytes()


def test_the_gather_contract_is_the_installed_releases(gather_library: bytes) -> None:
    """The schema our call follows and every check `gather_contract`
    encodes are in the installed library: a release that changes them
    fails here, to be read again."""
    start = gather_library.find(b"hisparse_gather_compact(Tensor")
    end = gather_library.find(b"-> ()", start) + len(b"-> ()")
    # The library keeps the schema with its source's line breaks and indents.
    assert start >= 0 and b" ".join(gather_library[start:end].split()) == GATHER_SCHEMA
    tensors = _load(GPU).gather_tensors(64, 1, torch.device("cpu"), pin=False)
    for message, _ in gather_contract(tensors, torch.device("cpu")):
        if message.startswith("host_cache ") and message.endswith(
            tuple(c.decode() for c in HOST_ROW_CHECKS)
        ):
            message = message.removeprefix("host_cache")
        assert message.encode() + b"\0" in gather_library, message


def test_the_gather_tensors_meet_the_contract() -> None:
    """As the GPU code builds them, on the rank's device (meta stands in
    for its GPU), for a pool of 256 MiB: vLLM's [num_tokens, top_k] miss
    plan at batch 8, and after `replan` too, still inside the pool."""
    gpu = _load(GPU)
    meta, pool_rows = torch.device("meta"), 256 * 1024 * 1024 // 656
    args = gpu.gather_tensors(pool_rows, gpu.GATHER_TOKENS, meta, pin=False)
    failed = [message for message, holds in gather_contract(args, meta) if not holds]
    assert not failed, failed
    host, hot, host_rows, hot_rows, counts = args
    assert hot.shape[1:] == (gpu.BLOCK_SIZE, 656) and host.dtype == hot.dtype
    assert host_rows.shape == (8, 2048) and counts.shape == (8,)
    assert hot.shape[0] * hot.shape[1] == host_rows.numel()
    cpu_args = gpu.gather_tensors(pool_rows, 8, torch.device("cpu"), pin=False)
    before = cpu_args[2].clone()
    assert int(before.unique().numel()) > 8 * 2000  # scattered over the pool
    gpu.replan(cpu_args[2], pool_rows)
    after = cpu_args[2]
    assert after.dtype == torch.int32 and after.is_contiguous()
    assert int(after.min()) >= 0 and int(after.max()) < pool_rows
    assert not bool((after == before).any())  # every miss moved
    # The host pool is pinned where the GPU code builds it.
    calls = [
        node
        for node in ast.walk(ast.parse(GPU.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "gather_tensors"
    ]
    assert calls and all(
        any(
            k.arg == "pin" and getattr(k.value, "value", None) is True
            for k in c.keywords
        )
        for c in calls
    )


def test_the_row_width_and_cache_ops_are_the_releases() -> None:
    """vLLM 0.34.0 reads the fp8_ds_mla row width from the attention
    implementation and calls the gather on its HiSparse backend's cache
    ops, which on CUDA are torch.ops._C_cache_ops, as ours."""
    root = _installed_vllm() / "vllm"
    backend = ast.parse((root / "v1/attention/backend.py").read_text())
    (width,) = [
        n
        for n in ast.walk(backend)
        if isinstance(n, ast.FunctionDef) and n.name == "get_fp8_ds_mla_row_bytes"
    ]
    returned = [n.value for n in ast.walk(width) if isinstance(n, ast.Return)]
    assert [getattr(v, "value", None) for v in returned] == [_load(GPU).ROW_BYTES]
    hisparse = ast.parse((root / "v1/hisparse/backend.py").read_text())
    (cuda,) = [
        n
        for n in ast.walk(hisparse)
        if isinstance(n, ast.ClassDef) and n.name == "CUDAHiSparseBackend"
    ]
    (ops,) = [
        n
        for n in cuda.body
        if isinstance(n, ast.FunctionDef) and n.name == "create_cache_ops"
    ]
    returned = [
        ast.unparse(n.value) for n in ast.walk(ops) if isinstance(n, ast.Return)
    ]
    assert returned == ["torch.ops._C_cache_ops"]
    runtime = ast.parse((root / "v1/hisparse/runtime.py").read_text())
    (upstream,) = _calls_of(runtime, "hisparse_gather_compact")
    assert ast.unparse(upstream.func) == "self.cache_ops.hisparse_gather_compact"


def test_vllms_runtime_calls_the_gather_as_we_do() -> None:
    """vLLM's own call of the op (`_swap_rows`) passes the five tensors
    positionally, the hot cache from `PagedCacheView.bind`, as ours does."""
    runtime = ast.parse((_installed_vllm() / "vllm/v1/hisparse/runtime.py").read_text())
    (upstream,) = _calls_of(runtime, "hisparse_gather_compact")
    assert len(upstream.args) == GATHER_SCHEMA.count(b"Tensor")
    assert [a.attr for a in upstream.args[:2]] == ["host_cache", "cache"]  # hot.cache
    (ours,) = _calls_of(ast.parse(GPU.read_text()), "hisparse_gather_compact")
    assert isinstance(ours.args[0], ast.Starred)  # the five of gather_tensors
    assert _calls_of(runtime, "as_strided"), "vLLM's hot cache is not a view now"


# FlashInfer and vLLM names, against the releases ---------------------------

# What vLLM's op reaches on its way to FlashInfer: (file, functions, where);
# None means the whole file. "installed" files are read from the installed
# vllm 0.34.0, "tree" from this build.
VLLM_OP_CHAIN = (
    ("vllm/models/common/ops/fused_allreduce_rms_norm.py", None, "installed"),
    ("vllm/model_executor/layers/fused_allreduce_gemma_rms_norm.py", None, "installed"),
    (
        "vllm/compilation/passes/fusion/allreduce_rms_fusion.py",
        ("call_trtllm_fused_allreduce_norm",),
        "installed",
    ),
    ("vllm/distributed/device_communicators/flashinfer_all_reduce.py", None, "tree"),
)
# Names that hold flashinfer.comm in the code above (besides import aliases).
FLASHINFER_COMM_NAMES = {"flashinfer_comm", "_flashinfer_comm"}
# Receivers that hold a FlashInfer all-reduce workspace.
WORKSPACE_NAMES = {"ws", "workspace"}
# The workspaces create_allreduce_fusion_workspace makes for the backends
# vLLM uses, and their base.
WORKSPACE_CLASSES = (
    ("flashinfer.comm.allreduce", "TRTLLMAllReduceFusionWorkspace"),
    ("flashinfer.comm.trtllm_mnnvl_ar", "MNNVLAllReduceFusionWorkspace"),
)
WORKSPACE_BASE = ("flashinfer.comm.workspace_base", "AllReduceFusionWorkspace")


def _chain_sources() -> list[tuple[str, ast.AST]]:
    """The GPU path's code: our two modules, and vLLM's op chain."""
    sources: list[tuple[str, ast.AST]] = [
        (p.name, ast.parse(p.read_text())) for p in OUR_GPU_PATH
    ]
    for rel, functions, where in VLLM_OP_CHAIN:
        root = _installed_vllm() if where == "installed" else REPO_ROOT
        tree = ast.parse((root / rel).read_text())
        if functions is None:
            sources.append((rel, tree))
            continue
        found = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name in functions
        ]
        assert {f.name for f in found} == set(functions), rel
        # With the module's own assignments, so names bound at import time
        # (ar_fusion_patterns = flashinfer_comm.AllReduceFusionPattern) count.
        module = ast.Module(body=[*_module_assignments(tree.body), *found])
        sources.append((rel, module))
    return sources


def _module_assignments(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Assignments run at import, also under module-level if/try."""
    for node in body:
        if isinstance(node, ast.Assign):
            yield node
        elif isinstance(node, ast.If | ast.Try):
            yield from _module_assignments(node.body)
            yield from _module_assignments(node.orelse)


def flashinfer_uses(
    sources: list[tuple[str, ast.AST]],
) -> dict[str, set[tuple[str, ...]]]:
    """Every flashinfer name the sources use: `module.Name[.attr]` -> the
    keyword sets it is called with (empty for a bare reference).

    Workspace methods are keyed `workspace.method`.
    """
    uses: dict[str, set[tuple[str, ...]]] = {}
    for _, tree in sources:
        aliases = dict.fromkeys(FLASHINFER_COMM_NAMES, "flashinfer.comm")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("flashinfer") and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "flashinfer"
            ):
                for a in node.names:
                    uses.setdefault(f"{node.module}.{a.name}", set())
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and (parts := _chain(node.value))
                and parts[0] in aliases
            ):
                aliases[node.targets[0].id] = ".".join([aliases[parts[0]], *parts[1:]])
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute | ast.Name):
                continue
            parts = _chain(node)
            if not parts:
                continue
            call = calls.get(id(node))
            keywords = (
                tuple(sorted(k.arg for k in call.keywords if k.arg)) if call else ()
            )
            if call and len(parts) == 2 and parts[0] in WORKSPACE_NAMES:
                uses.setdefault(f"workspace.{parts[1]}", set()).add(keywords)
                continue
            for i, part in enumerate(parts):
                if part in aliases and (
                    i > 0 or isinstance(node, ast.Attribute) or call
                ):
                    rest = parts[i + 1 :]
                    if not rest and not call:
                        break
                    name = ".".join([aliases[part], *rest])
                    uses.setdefault(name, set())
                    if call:
                        uses[name].add(keywords)
                    break
    # Keep the longest names only: `a.B.c` implies `a.B`.
    return {
        name: kw
        for name, kw in uses.items()
        if kw or not any(other.startswith(name + ".") for other in uses)
    }


@pytest.fixture(scope="module")
def flashinfer_wheels(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The released flashinfer-python wheels, fetched once through pip.

    Kept in pytest's cache between runs; where that is off
    (`-p no:cacheprovider`, as mutation runs use), fetched for this run.
    """
    cache = getattr(request.config, "cache", None)
    wheels = {}
    for release in FLASHINFER_RELEASES:
        name = f"flashinfer-python-{release}"
        dest = Path(cache.mkdir(name)) if cache else tmp_path_factory.mktemp(name)
        found = list(dest.glob("flashinfer_python-*.whl"))
        if not found:
            proc = tree_imports.run_in_session(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                    f"flashinfer-python=={release}",
                    "-d",
                    str(dest),
                ],
                timeout=900,
            )
            found = list(dest.glob("flashinfer_python-*.whl"))
            if not found:
                reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                if any(
                    word in proc.stderr
                    for word in (
                        "NewConnectionError",
                        "Network is unreachable",
                        "Temporary failure in name resolution",
                        "Max retries exceeded",
                        "ConnectionError",
                    )
                ):
                    pytest.skip(
                        f"cannot download flashinfer-python {release}: {reason}"
                    )
                pytest.fail(f"pip download flashinfer-python=={release}: {reason}")
        wheels[release] = found[0]
    return wheels


class ReleasedSource:
    """A flashinfer-python wheel's Python sources, resolved like imports."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())

    def module(self, dotted: str) -> tuple[str, ast.Module] | None:
        base = dotted.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.names:
                return path, ast.parse(self.zip.read(path))
        return None

    def find(self, dotted: str, name: str, depth: int = 0) -> ast.AST | None:
        """The definition of `name` as `import dotted.name` would get it."""
        found = self.module(dotted)
        if found is None or depth > 8:
            return None
        path, tree = found
        package = dotted if path.endswith("__init__.py") else dotted.rpartition(".")[0]
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return node
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        source = node.module or ""
                        if node.level:
                            parent = package.split(".")
                            parent = parent[: len(parent) - node.level + 1]
                            source = ".".join(parent + ([source] if source else []))
                        return self.find(source, a.name, depth + 1)
        if self.module(f"{dotted}.{name}") is not None:
            return ast.Module(body=[], type_ignores=[])
        return None


def _parameters(node: ast.AST) -> tuple[set[str], bool] | None:
    """A function's (or a class's __init__'s) keyword names, and **kwargs."""
    if isinstance(node, ast.ClassDef):
        inits = [
            n
            for n in node.body
            if isinstance(n, ast.FunctionDef) and n.name == "__init__"
        ]
        if not inits:
            return None
        node = inits[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    args = node.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return names, args.kwarg is not None


def _class_member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    return None


def check_against_release(
    uses: dict[str, set[tuple[str, ...]]], source: ReleasedSource
) -> list[str]:
    """What in `uses` the release lacks: names, members, keywords."""
    problems = []
    for name, keyword_sets in sorted(uses.items()):
        if name.startswith("workspace."):
            method = name.split(".", 1)[1]
            for module, cls_name in WORKSPACE_CLASSES:
                member = None
                for where, which in ((module, cls_name), WORKSPACE_BASE):
                    cls = source.find(where, which)
                    if isinstance(cls, ast.ClassDef):
                        member = member or _class_member(cls, method)
                if member is None:
                    problems.append(f"{cls_name}.{method}: not in the release")
                for keywords in keyword_sets:
                    problems += _keyword_problems(
                        f"{cls_name}.{method}", member, keywords
                    )
            continue
        parts = name.split(".")
        # flashinfer.comm[.mnnvl].Name[.member]
        target = None
        for split in range(len(parts) - 1, 0, -1):
            module, rest = ".".join(parts[:split]), parts[split:]
            if source.module(module) is None:
                continue
            target = source.find(module, rest[0])
            for member_name in rest[1:]:
                target = (
                    _class_member(target, member_name)
                    if isinstance(target, ast.ClassDef)
                    else None
                )
            break
        if target is None:
            problems.append(f"{name}: not in the release")
            continue
        for keywords in keyword_sets:
            problems += _keyword_problems(name, target, keywords)
    return problems


def _keyword_problems(
    name: str, target: ast.AST | None, keywords: tuple[str, ...]
) -> list[str]:
    params = None if target is None else _parameters(target)
    if params is None:
        return []
    names, takes_any = params
    unknown = set(keywords) - names
    if unknown and not takes_any:
        return [f"{name}: no parameter {sorted(unknown)}"]
    return []


def test_the_gpu_path_reaches_the_flashinfer_calls_it_should() -> None:
    """The derivation itself: it finds the calls vLLM's op makes."""
    uses = flashinfer_uses(_chain_sources())
    assert "flashinfer.comm.allreduce_fusion" in uses
    # The fused call of call_trtllm_fused_allreduce_norm, with PDL.
    assert any(
        {"launch_with_pdl", "norm_out", "residual_in", "use_oneshot"} <= set(kw)
        for kw in uses["flashinfer.comm.allreduce_fusion"]
    )
    assert "flashinfer.comm.create_allreduce_fusion_workspace" in uses
    assert "flashinfer.comm.AllReduceFusionPattern.kARResidualRMSNorm" in uses
    assert "flashinfer.comm.mnnvl.TorchDistBackend" in uses
    ws_calls = uses["workspace.is_buffer_size_sufficient"]
    assert ("dtype", "hidden_dim", "num_tokens", "tp_size") in ws_calls


@pytest.mark.parametrize("release", FLASHINFER_RELEASES)
def test_every_flashinfer_call_of_the_gpu_path_exists_in_the_release(
    flashinfer_wheels: dict[str, Path], release: str
) -> None:
    uses = flashinfer_uses(_chain_sources())
    problems = check_against_release(uses, ReleasedSource(flashinfer_wheels[release]))
    assert not problems, f"flashinfer-python {release}: {problems}"


def test_a_drifted_flashinfer_call_is_caught(
    flashinfer_wheels: dict[str, Path],
) -> None:
    """The check can fail: a keyword and a name no release has."""
    source = ReleasedSource(flashinfer_wheels[FLASHINFER_RELEASES[0]])
    drifted = {
        "flashinfer.comm.allreduce_fusion": {("launch_with_pdl", "no_such_keyword")},
        "flashinfer.comm.no_such_function": set(),
        "workspace.is_buffer_size_sufficient": {("tp_size", "max_tokens")},
    }
    problems = check_against_release(drifted, source)
    # The workspace method's keyword is missing from both backends' classes.
    assert len(problems) == 4, problems


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` as ["a", "b", "c"]; [] for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _vllm_uses() -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(module, name, keywords) for each vLLM name our GPU-path modules
    import and call."""
    for path in OUR_GPU_PATH:
        tree = ast.parse(path.read_text())
        imported: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm"
            ):
                for a in node.names:
                    imported[a.asname or a.name] = (node.module or "", a.name)
        seen = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                target = imported.get(node.func.id)
                if target:
                    keywords = tuple(k.arg for k in node.keywords if k.arg)
                    seen.add(node.func.id)
                    yield (*target, keywords)
        for alias, target in imported.items():
            if alias not in seen:
                yield (*target, ())


# vLLM modules that import CUDA ops at import time: read, not imported.
CUDA_ONLY_MODULES = {"vllm.compilation.passes.fusion.allreduce_rms_fusion"}


def _defined_in_source(module: str, name: str) -> bool:
    path = _installed_vllm() / (module.replace(".", "/") + ".py")
    return any(
        isinstance(n, ast.FunctionDef) and n.name == name
        for n in ast.parse(path.read_text()).body
    )


def test_every_vllm_name_the_gpu_path_calls_exists_in_the_installed_vllm() -> None:
    problems = []
    uses = list(_vllm_uses())
    assert ("vllm.distributed", "init_distributed_environment") in {
        (m, n) for m, n, _ in uses
    }
    for module, name, keywords in uses:
        try:
            target = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            if module in CUDA_ONLY_MODULES and _defined_in_source(module, name):
                continue
            problems.append(f"{module}.{name}: {e}")
            continue
        if keywords and callable(target):
            parameters = inspect.signature(target).parameters
            unknown = set(keywords) - set(parameters)
            if unknown and not any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
            ):
                problems.append(f"{module}.{name}: no parameter {sorted(unknown)}")
    assert not problems, problems


def test_the_platform_methods_the_gpu_module_calls_exist_on_cuda() -> None:
    """CudaPlatform does not import without a GPU driver; read its source.
    The options ask it for the GPUs' capability too."""
    called = {
        node.func.attr
        for path in (GPU, OPTIONS)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "current_platform"
    }
    assert called >= {"get_device_name", "get_device_capability"}
    defined = set()
    for rel in ("vllm/platforms/cuda.py", "vllm/platforms/interface.py"):
        source = ast.parse((_installed_vllm() / rel).read_text())
        defined |= {n.name for n in ast.walk(source) if isinstance(n, ast.FunctionDef)}
    assert called <= defined, called - defined


def test_the_capture_mode_exists_in_torch() -> None:
    """Thread-local capture: the keyword and its value, as torch takes them."""
    import torch

    calls = _calls_of(ast.parse(GPU.read_text()), "graph")
    keywords = {k.arg: k.value for c in calls for k in c.keywords}
    assert isinstance(keywords.get("capture_error_mode"), ast.Constant)
    assert keywords["capture_error_mode"].value == "thread_local"
    parameters = inspect.signature(torch.cuda.graph.__init__).parameters
    assert "capture_error_mode" in parameters
