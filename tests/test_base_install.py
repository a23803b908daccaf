"""A base install (no extra) trains everything but adapters (issue 32, item 1).

- No module of the packages imports, at module level, a package only an extra of
  pyproject.toml installs, or a module that does so, outside the files of that
  extra's feature (read by AST, no process).
- A node without peft asked for adapters refuses in one line naming the extra, and
  the server gives it other work from the next round on (a federation in process).

The subprocess half (``fleetfit simulate`` and a loopback ``server`` + ``client`` with
the extras unimportable, ``tests/base_install.py``) rides on tests that start those
processes anyway: ``tests/simulations/test_stop_and_logs.py`` and
``tests/deployment/test_commands.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import Message

from memory.lora import adapters_available
from server.config import AdapterConfig, ExportConfig, FleetConfig, ServerConfig
from server.loop import Federation
from tests.base_install import ROOT, extra_only_modules, pyproject
from tests.fakes import DirectTransport
from wire import keys
from wire.shape import RunShape

# The files of a feature that only an extra installs, and what each may import at
# module level. The measured child's adapter job preloads peft before the child's
# baseline (partition.measured), so that peft counts as library code, as torch does.
FEATURE_FILES = {"client/adapter_job.py": {"peft"}}


def package_files() -> dict[str, Path]:
    """Module name -> file, for every module of the packages pyproject.toml ships."""
    out = {}
    for package in pyproject()["tool"]["setuptools"]["packages"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def import_time_names(tree: ast.Module) -> Iterator[str]:
    """The absolute module names a module imports when it is imported: its body and
    the bodies of its ``if``/``try``/``with``/loops/classes, not its functions, not
    ``if TYPE_CHECKING:`` (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.module
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue  # runs when called, not when imported
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, []):
                    if isinstance(child, ast.stmt | ast.excepthandler):
                        todo.append(child)  # type: ignore[arg-type]
                    elif isinstance(child, ast.match_case):
                        todo.extend(child.body)


def extra_imports_at_import_time() -> dict[str, list[str]]:
    """Module -> the chain by which importing it imports a package only an extra
    installs (``["client.adapter_job", "peft"]``), for every module that does."""
    files = package_files()
    imports = {
        name: set(import_time_names(ast.parse(path.read_text(), str(path))))
        for name, path in files.items()
    }
    extras = extra_only_modules()
    chain: dict[str, list[str]] = {}
    changed = True
    while changed:  # a fixpoint over the package's own modules
        changed = False
        for name, names in imports.items():
            if name in chain:
                continue
            for imported in sorted(names):
                if imported.partition(".")[0] in extras:
                    chain[name] = [imported]
                elif imported in chain:
                    chain[name] = [imported, *chain[imported]]
                else:
                    continue
                changed = True
                break
    return chain


def test_the_blocked_modules_are_the_extras_packages():
    modules = extra_only_modules()
    assert {"peft", "transformers", "flwr_datasets", "pytest"} <= modules
    assert not {"torch", "flwr", "numpy", "ray", "safetensors"} & modules


def test_no_module_imports_an_extra_outside_its_feature():
    files = package_files()
    feature = {
        name: FEATURE_FILES[str(path.relative_to(ROOT))]
        for name, path in files.items()
        if str(path.relative_to(ROOT)) in FEATURE_FILES
    }
    assert len(feature) == len(FEATURE_FILES), "a feature file has moved"
    chains = extra_imports_at_import_time()
    wrong = {
        name: chain
        for name, chain in chains.items()
        if name not in feature or chain[0].partition(".")[0] not in feature[name]
    }
    causes = [  # where the import is written (what imports those follows)
        f"{files[name].relative_to(ROOT)} imports {' -> '.join(chain)} when imported"
        for name, chain in wrong.items()
        if chain[0] not in wrong
    ]
    assert not wrong, (
        "import an extra's package only where its feature runs:\n" + "\n".join(causes)
    )


class OlderNodes(DirectTransport):
    """Nodes that do not say whether they can train adapters (before the fact)."""

    def query(self, node_ids: list[int], timeout_s: float) -> dict[int, Message]:
        replies = super().query(node_ids, timeout_s)
        for reply in replies.values():
            reply.content.config_records[keys.NODE].pop(keys.ADAPTERS, None)
        return replies


def _federation(tmp_path: Path, transport: DirectTransport) -> Federation:
    cfg = ServerConfig(
        shape=RunShape(workload="digits-mlp", local_steps=1),
        adapters=AdapterConfig(mode="all", rank=4, alpha=8.0),
        num_server_rounds=2,
        min_nodes=1,
        out=str(tmp_path / "run"),
        client_measure="inline",
        fleet=FleetConfig(memory_budgets=(2**30,)),
        export=ExportConfig(onnx="off"),
    )
    return Federation(cfg, transport)


@pytest.fixture
def no_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    """peft cannot be imported, as on a base install."""
    monkeypatch.setitem(sys.modules, "peft", None)
    assert not adapters_available()


def test_a_node_without_peft_refuses_adapters_and_then_trains_the_model(
    tmp_path, no_peft
):
    fed = _federation(tmp_path, OlderNodes(1))
    fed.discover()
    assert fed.nodes[1000].adapters is None  # it did not say
    first = fed.run_round(1)["assignments"][0]
    assert first["kind"] == "adapter"
    status = first["status"]
    assert status == (
        "error: adapters need peft: install the hf extra "
        "(bash scripts/install hf, or pip install 'fleetfit[hf]')"
    )
    assert fed.nodes[1000].adapters is False
    second = fed.run_round(2)
    assert second["assignments"][0]["kind"] == "full"
    assert second["assignments"][0]["status"] == "ok"
    assert second["num_clients"] == 1


def test_a_node_without_peft_says_so_and_is_never_asked_for_adapters(
    tmp_path, no_peft, caplog
):
    fed = _federation(tmp_path, DirectTransport(1))
    fed.discover()
    assert fed.nodes[1000].adapters is False
    assert "node 1000 cannot train adapters (no peft: the hf extra)" in caplog.text
    rec = fed.run_round(1)
    assert rec["assignments"][0]["kind"] == "full"
    assert rec["num_clients"] == 1
