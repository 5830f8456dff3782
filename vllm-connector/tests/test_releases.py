"""The connector against every vLLM release it supports (tested-vllm.txt), read from each
release's own source, without installing it (one CPU venv holds one vLLM; these hooks
move between releases): every hook the connector implements has the signature that
release calls it with, or the release does not have it and the connector does without;
every name the connector imports from vLLM exists where it is imported. The connector
keys on hooks, not versions, and SINCE is where each hook it relies on appears: a release
that moves one fails here before it fails in an engine."""

from __future__ import annotations

import ast
import os

import pytest

from releases import sources

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "kvhandoff_vllm")
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def releases() -> list[str]:
    with open(os.path.join(HERE, "..", "tested-vllm.txt")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


# Hooks and names the connector uses that not every supported release has: the first
# release with each, and what the connector does before it.
SINCE = {
    # get_finished and get_block_ids_with_load_errors report a failed receive.
    "get_transfer_results": "0.30.0",
    "KVConnectorTransferResults": "0.30.0",
    # GPU KV comes from cudaMalloc, named by IPC handles; on the CPU backend, refused.
    "get_mem_pool_context": "0.31.0",
    # vLLM zeroes no group of a request that loads KV.
    "get_loaded_kv_cache_group_ids": "0.32.0",
    # No sleep hooks: vLLM keeps the KV where it is.
    "supports_sleep_mode": "0.33.0",
    "unregister_kv_caches": "0.33.0",
    "restore_kv_caches": "0.33.0",
    # No extensible KV cache to make exportable.
    "kv_cache_access": "0.34.0",
    "KVCacheAccess": "0.34.0",
}
FIRST = releases()[0]


def _parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def _signature(fn: ast.FunctionDef) -> tuple:
    a = fn.args
    params = [("pos", x.arg) for x in a.posonlyargs + a.args] + [("kw", x.arg) for x in a.kwonlyargs]
    return tuple(params), a.vararg is not None, a.kwarg is not None, _is_classmethod(fn)


def _is_classmethod(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(name)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def _abstract(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("abstractmethod") for d in fn.decorator_list)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, ast.Assign) and node in tree.body:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and node in tree.body and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            # Re-exports, including those inside try blocks at module level.
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in tree.body:
        # Names a module makes on first use (vllm.platforms.current_platform).
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def connector_imports() -> list[tuple[str, str, str, bool]]:
    """(module, name, the release from which it must exist, whether it must be absent
    before) for every name the connector imports from vLLM: at once, inside a hook only
    releases from SINCE call, or in a try block whose fallback stands in for it before
    SINCE of the name (exactly then)."""
    out = []
    for file in sorted(os.listdir(PACKAGE)):
        if not file.endswith(".py"):
            continue
        tree = _parse(os.path.join(PACKAGE, file))

        def visit(node, since):
            if isinstance(node, ast.FunctionDef) and node.name in SINCE:
                since = SINCE[node.name]
            if isinstance(node, ast.Try) and any(ast.unparse(h.type or ast.Name("")) == "ImportError" for h in node.handlers):
                for child in node.body:
                    if isinstance(child, ast.ImportFrom) and child.module.startswith("vllm"):
                        for a in child.names:
                            out.append((child.module, a.name, SINCE[a.name], True))
                for child in node.handlers + node.orelse + node.finalbody:
                    visit(child, since)
                return
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
                for a in node.names:
                    out.append((node.module, a.name, since, False))
            for child in ast.iter_child_nodes(node):
                visit(child, since)

        visit(tree, FIRST)
    return out


def connector_class() -> ast.ClassDef:
    return _class(_parse(os.path.join(PACKAGE, "connector.py")), "KVHandoffConnector")


@pytest.fixture(scope="module", params=releases())
def release(request):
    modules = sorted({BASE, "vllm.v1.request", "vllm.v1.kv_cache_interface", "vllm.config.cache"}
                     | {m for m, _, _, _ in connector_imports()})
    return request.param, sources(request.param, modules)


def test_every_hook_the_connector_implements_is_called_as_it_expects(release):
    v, root = release
    base = _methods(_class(_parse(os.path.join(root, *BASE.split(".")) + ".py"), "KVConnectorBase_V1"))
    ours = _methods(connector_class())
    for name, fn in ours.items():
        if name == "__init__" or name.startswith("_"):
            continue
        since = SINCE.get(name, FIRST)
        assert (name in base) == (version(v) >= version(since)), (
            f"vLLM {v} {'has' if name in base else 'lacks'} the hook {name}, which the connector expects from {since}")
        if name in base:
            assert _signature(fn) == _signature(base[name]), (
                f"vLLM {v} calls {name}({ast.unparse(base[name].args)}); the connector takes {name}({ast.unparse(fn.args)})")


def test_the_connector_implements_every_abstract_hook(release):
    v, root = release
    base = _methods(_class(_parse(os.path.join(root, *BASE.split(".")) + ".py"), "KVConnectorBase_V1"))
    missing = {n for n, f in base.items() if _abstract(f)} - set(_methods(connector_class()))
    assert not missing, f"vLLM {v} requires {sorted(missing)}, which the connector does not implement"


def test_every_name_the_connector_imports_exists_where_it_is_imported(release):
    v, root = release
    for module, name, since, exact in connector_imports():
        base = os.path.join(root, *module.split("."))
        path = base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")
        present = os.path.exists(path) and name in _top_level_names(_parse(path))
        if version(v) >= version(since) or exact:
            assert present == (version(v) >= version(since)), (
                f"vLLM {v}: {module}.{name} is {'present' if present else 'absent'}; the connector expects it from {since}")


def test_what_the_connector_reads_from_vllms_objects_exists_where_it_reads_it(release):
    v, root = release
    status = {t.id for n in _class(_parse(os.path.join(root, "vllm", "v1", "request.py")), "RequestStatus").body
              if isinstance(n, ast.Assign) for t in n.targets}
    with open(os.path.join(PACKAGE, "scheduler.py")) as f:
        used = {a.attr for a in ast.walk(ast.parse(f.read()))
                if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "RequestStatus"}
    assert used and used <= status, f"vLLM {v}'s RequestStatus lacks {sorted(used - status)}"
    if version(v) >= version(SINCE["get_loaded_kv_cache_group_ids"]):
        kv = _methods(_class(_parse(os.path.join(root, "vllm", "v1", "kv_cache_interface.py")), "KVCacheConfig"))
        assert "transfer_group_ids" in kv, f"vLLM {v}'s KVCacheConfig has no transfer_group_ids"
    cache = _class(_parse(os.path.join(root, "vllm", "config", "cache.py")), "CacheConfig")
    fields = {n.target.id for n in cache.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    # The connector's own KV pool steps aside exactly where vLLM's extensible KV cache exists.
    assert ("enable_extensible_kv_cache" in fields) == (version(v) >= version(SINCE["kv_cache_access"])), v
