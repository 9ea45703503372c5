"""The package's import structure: no import cycle among hyper_parallel modules, and private torch
names only in the compat package, hyper_parallel/compat/ (one module per torch subsystem: a torch
upgrade that moves one is fixed there).

Both are read from the source with ``ast``: every import statement counts, also the ones inside
functions (a cycle hidden by a function-local import is still a cycle) and those under
``if TYPE_CHECKING:`` (never executed, but a type that must be imported that way to dodge a circle
is a layering problem all the same). An import names the module it names: ``from ..plan.values
import x`` is an edge to ``plan.values``, not to ``plan``, whose ``__init__`` Python also runs."""

import ast
import importlib
import pathlib

import networkx as nx
import pytest

import hyper_parallel

ROOT = pathlib.Path(hyper_parallel.__file__).parent
PRIVATE_TORCH = ("torch._", "torch.distributed._", "torch.distributed.tensor._", "torch.utils._")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("hyper_parallel",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """(imported module, line, the dotted names it imports) for every import statement of a module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def walk(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, node.lineno, [alias.name]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                yield target, node.lineno, [f"{target}.{a.name}" for a in node.names]
            else:
                yield from walk(ast.iter_child_nodes(node))

    return list(walk(ast.parse(path.read_text()).body))


def test_every_module_imports():
    for name in sorted(MODULES):
        if not name.endswith("__main__"):  # the CLI entry: importing it runs it
            importlib.import_module(name)


def _edges():
    """(importer, line, imported module) for every import of one hyper_parallel module by another."""
    for name, path in MODULES.items():
        for target, line, names in _imports(name, path):
            for dotted in [*names, target]:  # "from .pkg import module" imports the module itself
                if dotted in MODULES and dotted != name:
                    yield name, line, dotted
                    break


def test_no_import_cycle():
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    graph.add_edges_from((a, b) for a, _, b in _edges())
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, f"import cycles among hyper_parallel modules: {cycles[:5]}"


LAYERS = [
    # (layer, module patterns below hyper_parallel, fnmatch): a module is in the first layer one of
    # whose patterns it matches, and imports only modules of its own layer or of layers above it
    # in this list (lower layers). docs/architecture.md §2 describes the order.
    ("foundation", ["compat", "compat.*", "errors", "progress", "ir", "ir.*", "layout", "distributed",
                    "distributed.*", "custom_rules"]),
    ("checkpoints", ["checkpoints", "checkpoints.*"]),
    ("plan values", ["plan.match", "plan.values", "plan.recorded", "plan.resolved", "plan.lanes", "tp", "tp.styles",
                     "fsdp.plan", "fsdp.flags", "cp.style", "cp.load_balance", "cp.resolve", "moe.style", "moe.resolve",
                     "pipeline.plan",
                     "pipeline.schedules", "pipeline.schedules.*"]),
    ("feature resolvers", ["plan", "plan.*", "fsdp", "fsdp.*", "cp", "moe", "recompute"]),
    ("propagation and lowering", ["propagation", "propagation.*", "compile.annotations", "compile.lower", "compile.moves",
                                  "compile.decompositions", "moe.*", "cp.*", "runtime.host_copies", "analysis.why",
                                  "cost", "cost.*"]),
    ("passes", ["passes", "passes.*"]),
    ("programs", ["runtime.program", "runtime.partition", "runtime.agreement_gate", "runtime.profiled",
                  "runtime.random_state", "runtime.zero_tangents", "runtime.input_check", "runtime.attribute_guards",
                  "runtime.autocast_state", "runtime.collective_inputs"]),
    ("compile driver", ["compile", "compile.*", "codegen", "codegen.*", "analysis.debug", "analysis.memory",
                        "analysis.allocator_model"]),
    ("runtime", ["runtime", "runtime.*", "pipeline", "pipeline.*", "options"]),
    ("front end and tools", ["*"]),  # api, backend, tools/, analysis.metrics, init/, optim/, models/, testing/
]


def _layer_of(module: str) -> int:
    import fnmatch

    short = module.removeprefix("hyper_parallel.") if module != "hyper_parallel" else "__init__"
    return next(i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(short, p) for p in patterns))


def test_layer_order():
    """Every import, function-local and TYPE_CHECKING ones included, runs down the declared layers
    (or within one): the graph contract and the plan values never reach up into the compiler, the
    compiler never into the run-time module, and so on."""
    upward = [f"{MODULES[a].relative_to(ROOT.parent)}:{line} ({LAYERS[_layer_of(a)][0]}) imports {b} "
              f"({LAYERS[_layer_of(b)][0]})" for a, line, b in _edges() if _layer_of(b) > _layer_of(a)]
    assert not upward, "imports running up the layers of LAYERS:\n" + "\n".join(sorted(upward))


def test_every_layer_pattern_names_a_module():
    """A pattern that matches no module (a file moved or renamed) would let its successor fall into
    the catch-all top layer unnoticed."""
    import fnmatch

    shorts = [m.removeprefix("hyper_parallel.") for m in MODULES]
    stale = [p for _, patterns in LAYERS[:-1] for p in patterns if not any(fnmatch.fnmatchcase(s, p) for s in shorts)]
    assert not stale, f"layer patterns that match no module: {stale}"


def _in_compat(name: str) -> bool:
    """Whether a module is the compat package or one of its submodules (where private torch names go)."""
    return name == "hyper_parallel.compat" or name.startswith("hyper_parallel.compat.")


def _private_torch_uses(name: str, path: pathlib.Path) -> list[str]:
    """``"<line> imports/uses <name>"`` for every private torch name a module outside compat reads."""
    if _in_compat(name):
        return []
    found = []
    for target, line, names in _imports(name, path):
        private = [n for n in [target, *names] if n and n.startswith(PRIVATE_TORCH)]
        if private:
            found.append(f"{line} imports {private[0]}")
    for node in ast.walk(ast.parse(path.read_text())):
        # torch._x attribute chains in code (torch.ops.<namespace> is the public op registry).
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            text = ast.unparse(node)
            if text.startswith(PRIVATE_TORCH) and not text.startswith("torch.ops."):
                found.append(f"{node.lineno} uses {text}")
    return found


def test_the_compat_rule_covers_the_package_and_only_it(tmp_path):
    compat_modules = [name for name in MODULES if _in_compat(name)]
    assert "hyper_parallel.compat" in compat_modules and len(compat_modules) > 1  # the package and its modules
    assert all(MODULES[name].parent.name == "compat" for name in compat_modules)
    source = tmp_path / "module.py"
    source.write_text("from torch._ops import OpOverload\nimport torch\nx = torch._C\n")
    for name in ("hyper_parallel.compat", "hyper_parallel.compat.dispatch"):
        assert _private_torch_uses(name, source) == []
    for name in ("hyper_parallel.compatibility", "hyper_parallel.propagation.compat", "hyper_parallel.api"):
        assert _private_torch_uses(name, source) == ["1 imports torch._ops", "3 uses torch._C"], name


def test_private_torch_names_only_in_compat():
    offenders = [f"{path.relative_to(ROOT.parent)}:{use}"
                 for name, path in MODULES.items() for use in _private_torch_uses(name, path)]
    assert not offenders, "private torch names outside hyper_parallel/compat/:\n" + "\n".join(offenders)


def test_graph_meta_keys_only_through_ir():
    """The graph contract has one home: every ``hp_*`` node-meta key and autograd's phase tag are
    spelled only in hyper_parallel/ir/ (docstrings and comments aside); code elsewhere uses its
    constants (``ir.meta.LAYOUT``, ``ir.phase.tag``), so a key cannot drift between writer and reader."""
    import io
    import re
    import tokenize

    spelled = re.compile(r"[\"'](hp_[a-z_]+|partitioner_tag|is_forward|is_backward)[\"']")
    found = []
    for name, path in MODULES.items():
        if name.startswith("hyper_parallel.ir"):
            continue
        source = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING and spelled.fullmatch(tok.string):
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
    assert not found, "spell these through hyper_parallel.ir:\n" + "\n".join(found)


def test_readme_layout_names_every_module():
    """README's "Layout of the repository" block names every package and module of hyper_parallel
    (models/ and testing/ as folders), so it cannot fall behind the tree."""
    import re

    readme = (ROOT.parent / "README.md").read_text()
    start = readme.index("## Layout of the repository")
    block = readme[start:readme.index("```\n", readme.index("```\n", start) + 4)]
    missing = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("models", "testing") or path.name.startswith("__"):
            names = [rel.parts[0]] if len(rel.parts) > 1 else []
        else:
            names = [path.stem] + list(rel.parts[:-1])
        missing += [f"{rel} ({n})" for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}\b", block)]
    assert not missing, "README's layout block does not name: " + ", ".join(sorted(set(missing)))


def test_version_is_the_installed_one(capsys):
    """``hp.__version__`` and ``hyper-parallel --version`` report the installed distribution's
    version; the package ships ``py.typed`` so type checkers read its annotations."""
    import importlib.metadata
    import pathlib

    import hyper_parallel as hp
    from hyper_parallel.tools.cli import main

    assert hp.__version__ == importlib.metadata.version("hyper_parallel")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert (pathlib.Path(hp.__file__).parent / "py.typed").is_file()
