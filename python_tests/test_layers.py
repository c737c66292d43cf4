"""The package's floors (docs/architecture.md), enforced on the source: every import of every
module, read with ``ast`` (module- and function-level, relative and absolute), goes to a module
of the same floor or a lower one; no two modules import each other, directly or round a longer
cycle; no module imports another's private names or reaches into another module's private
attributes (``obj._name`` with ``_name`` defined elsewhere); the torch-free modules import
nothing but the standard library and each other; each wire constant and topology list has one home.

A new module needs a floor in FLOORS (a prefix covers a whole package), and the table in
docs/architecture.md says the same. KNOWN lists the rule breaks not fixed yet: each entry names
the import that breaks a rule today; remove it when its fix lands (the test then fails if the
entry is stale, so the list can only shrink)."""

import ast
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "dlion_kernels"

# (module or package prefix, floor): the longest matching prefix gives a module its floor.
# A module imports only modules of its own floor or lower ones; the package __init__ re-exports
# and nothing imports it. Floor 0 is torch-free: the standard library and floor 0 only.
FLOORS = [
    ("dlion_kernels._version", 0),  # the version, once
    ("dlion_kernels.kernels.layout", 0),  # the wire format: blocks, bit planes, header words
    ("dlion_kernels.topologies", 0),  # gossip topologies: names, rules, schedules
    ("dlion_kernels.strategies", 0),  # the named strategies
    ("dlion_kernels.accounting", 0),  # bytes of the collectives torch runs (all-reduce, FSDP2)
    ("dlion_kernels.plan", 0),  # the runtime model: numbers, not tensors
    ("dlion_kernels.kernels", 1),  # the fused stages on every backend
    ("dlion_kernels.launch", 1),  # local gloo ranks for tests, benchmarks and the demo
    ("dlion_kernels.exchange", 2),  # the D-Lion protocol on a process group (and sharded.py)
    ("dlion_kernels.plan.measure", 2),  # the runtime model on a live group: calibration
    ("dlion_kernels.plan.auto", 2),
    ("dlion_kernels.plan.__main__", 2),  # its CLI (--measure)
    ("dlion_kernels.optim", 3),  # torch.optim front ends
    ("dlion_kernels.decentralized", 3),  # gossip training
    ("dlion_kernels.local_steps", 3),  # local steps (DiLoCo)
    ("dlion_kernels.simulate", 3),  # D-Lion and DiLoCo on k workers in one process
    ("dlion_kernels.elastic", 3),  # torchft's quorum around a step (the optional dependency)
    ("dlion_kernels.checkpoint", 4),  # per-rank optimizer checkpoints
    ("dlion_kernels.recipes", 4),  # a named strategy built on a rank
    ("dlion_kernels.demo", 5),  # the training demos
    ("dlion_kernels", 6),  # the package __init__: re-exports only
]
# Importable without torch: floor 0, and the modules `python -m dlion_kernels.plan` loads first
# (module level only: --measure imports torch inside a function).
TORCH_FREE_AT_IMPORT = {"dlion_kernels.plan.__main__"}
# One home for each fact: (module-level name or function) -> the module that defines it.
HOMES = {"BLOCK": "dlion_kernels.kernels.layout", "WORD_BYTES": "dlion_kernels.kernels.layout",
         "_WORD_BYTES": "dlion_kernels.kernels.layout",
         "HEADER_WORDS": "dlion_kernels.kernels.layout",
         "TOPOLOGIES": "dlion_kernels.topologies", "STRATEGIES": "dlion_kernels.strategies",
         "ring_all_reduce_bytes": "dlion_kernels.accounting",
         "fsdp_unit_bytes": "dlion_kernels.accounting",
         "fsdp_model_bytes": "dlion_kernels.accounting",
         "ddp_all_reduce_bytes": "dlion_kernels.accounting"}

# Private attributes of code outside the package that the package reads on purpose, as
# (module, attribute): the reason. Reaching into a dlion_kernels module never belongs here: give
# that module a public name instead. An entry no longer used fails the test.
THIRD_PARTY_PRIVATE = {
    ("dlion_kernels.exchange.collectives", "_get_backend"):
        "torch.distributed: a ProcessGroup tells its timeout only through its backend's options",
    ("dlion_kernels.exchange.collectives", "_device_types"):
        "torch.distributed: a ProcessGroup lists the device types of its backends only there",
    ("dlion_kernels.exchange.collectives", "_timeout"):
        "torch.distributed: the backend options' timeout (public only as a constructor argument)",
    ("dlion_kernels.elastic", "_pg"):
        "torchft's Manager hands out its reconfigurable process group only as manager._pg (its "
        "own DDP and DiLoCo read it there too)",
    ("dlion_kernels.elastic", "_use_async_quorum"):
        "torchft's Manager keeps whether its quorum is asynchronous only there; a 1-bit vote "
        "needs it synchronous, so the manager is checked at construction",
    ("dlion_kernels.elastic", "_group_rank"):
        "torchft's Manager keeps its rank in the replica only there (no getter): checked against "
        "this rank's place in its replica",
    ("dlion_kernels.elastic", "_group_world_size"):
        "torchft's Manager keeps its replica's size only there (no getter)",
    ("dlion_kernels.elastic", "_user_state_dicts"):
        "torchft's Manager can register a state key but not remove one: a closed or collected "
        "owner's key is taken off there (and checked free before registering)",
    ("dlion_kernels.elastic", "_load_state_dict_fns"):
        "the other half of a registered state key (see _user_state_dicts)",
    ("dlion_kernels.elastic", "_state_dict_lock"):
        "the lock torchft holds while it serves registered state to a healing peer",
    ("dlion_kernels.optim.amp", "_per_optimizer_states"):
        "torch.amp.GradScaler keeps each optimizer's found_inf tensors only there, and update() "
        "sums them: the overflow vote every rank agrees on must be written back there",
}

# Rule breaks not fixed yet, as (rule, module[, what it imports or defines]).
KNOWN: set = set()


# ----------------------------------------------------------------------------- reading


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                out[name] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    """A module of the package: a .py file, a package, or a compiled extension (_C)."""
    if name in MODULES:
        return True
    parent, _, leaf = name.rpartition(".")
    folder = os.path.join(ROOT, *parent.split("."))
    return parent in MODULES and os.path.isdir(folder) and any(
        f.startswith(leaf + ".") and f.endswith(".so") for f in os.listdir(folder))


class _Imports(ast.NodeVisitor):
    """Every import of one module: (target module, imported name or None, line, at import
    time), targets resolved to absolute names (``from . import x`` is the module ``x`` when x
    is one, else the name x of the package)."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, str | None, int, bool]] = []
        self.depth = 0  # inside a function body: runs later, not at import time

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, None, node.lineno, self.depth == 0))

    def visit_ImportFrom(self, node):
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module
        if base == "__future__":
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if base.startswith(PACKAGE) and _is_module(sub):
                self.found.append((sub, None, node.lineno, self.depth == 0))
            else:
                self.found.append((base, alias.name, node.lineno, self.depth == 0))


def _imports() -> dict[str, list[tuple[str, str | None, int, bool]]]:
    out = {}
    for name, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        visitor = _Imports(name, path.endswith("__init__.py"))
        visitor.visit(tree)
        out[name] = visitor.found
    return out


IMPORTS = _imports()


def floor(module: str) -> int | None:
    best = None
    for prefix, level in FLOORS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, level)
    return None if best is None else best[1]


def _where(module: str, line: int) -> str:
    return f"{os.path.relpath(MODULES[module], ROOT)}:{line}"


def _internal(target: str) -> str | None:
    """The package module an import target is (compiled extensions count as their package)."""
    if target != PACKAGE and not target.startswith(PACKAGE + "."):
        return None
    while target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def private_attributes(source: str) -> list[tuple[int, str, str]]:
    """Reach-ins of one module's source: (line, expression, attribute) for each ``x._name``
    (read, written or deleted; single underscore, not a dunder), and each ``getattr``,
    ``setattr``, ``hasattr`` or ``delattr`` of ``x`` with a literal ``"_name"``, where ``x`` is
    not ``self`` or ``cls``, ``_name`` is not defined in this module (a def, class, assigned name,
    or attribute of ``self``/``cls``), and ``x`` does not start from a name imported from
    outside the package (``torch._foreach_add_``, ``os._exit``: the third party's own
    business)."""
    tree = ast.parse(source)
    defined, outside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            defined.add(node.attr)
        elif isinstance(node, ast.Import):
            outside |= {a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.split(".")[0] != PACKAGE}
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and node.module.split(".")[0] != PACKAGE:
            outside |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value, attr = node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            value, attr = node.args[0], node.args[1].value
        else:
            continue
        if not (attr.startswith("_") and not attr.startswith("__")) or attr in defined:
            continue
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        root = value
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in outside:
            continue
        found.append((node.lineno, ast.unparse(node), attr))
    return sorted(found)


def _check(found: list, known_kind: str, key: tuple, message: str, errors: list, used: set):
    if (known_kind, *key) in KNOWN:
        used.add((known_kind, *key))
    else:
        errors.append(message)
    found.append((known_kind, *key))


# ----------------------------------------------------------------------------- rules


def _violations():
    errors, used, seen = [], set(), []
    edges: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, imports in IMPORTS.items():
        mine = floor(module)
        for target, name, line, _ in imports:
            inner = _internal(target)
            if inner is None or inner == module:
                continue
            edges[module].setdefault(inner, line)
            theirs = floor(inner)
            if inner == PACKAGE or (mine is not None and theirs is not None and theirs > mine):
                _check(seen, "upward", (module, inner),
                       f"{_where(module, line)}: {module} (floor {mine}) imports {inner} "
                       f"(floor {theirs}{', the package __init__' if inner == PACKAGE else ''})",
                       errors, used)
            # (_C is the compiled extension module, its name fixed by the build)
            if name and name.startswith("_") and not name.startswith("__") and name != "_C" \
                    and inner == target:
                _check(seen, "private", (module, inner),
                       f"{_where(module, line)}: {module} imports the private name {name} of "
                       f"{inner}", errors, used)
    # cycles: strongly connected components of the import graph (Tarjan)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(MODULES)))
    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    for comp in comps:
        inner_edges = sorted((a, b) for a in comp for b in edges[a] if b in comp)
        if all((("cycle", a, b) in KNOWN or ("cycle", b, a) in KNOWN) for a, b in inner_edges):
            used.update(k for a, b in inner_edges for k in [("cycle", a, b), ("cycle", b, a)]
                        if k in KNOWN)
            continue
        errors.append("import cycle: " + "; ".join(
            f"{a} imports {b} ({_where(a, edges[a][b])})" for a, b in inner_edges))
    # torch-free modules: the standard library and each other, also their parent packages
    torch_free = {m for m in MODULES if floor(m) == 0} | TORCH_FREE_AT_IMPORT
    parents = {p for m in torch_free for p in _ancestors(m)}
    for module in sorted(torch_free | parents):
        for target, _, line, at_import in IMPORTS[module]:
            if module in parents - torch_free and not at_import:
                continue  # a parent package must only load light
            if module in TORCH_FREE_AT_IMPORT and not at_import:
                continue
            inner = _internal(target)
            top = target.split(".")[0]
            if inner is None and top in sys.stdlib_module_names:
                continue
            if inner is not None and (inner in torch_free or inner in parents):
                continue
            _check(seen, "torch", (module,),
                   f"{_where(module, line)}: {module} must load without torch but imports "
                   f"{target}", errors, used)
    # one home for each fact
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else \
                [ast.Name(node.name)] if isinstance(node, ast.FunctionDef) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id in HOMES and HOMES[t.id] != module:
                    _check(seen, "home", (module, t.id),
                           f"{_where(module, node.lineno)}: {module} defines {t.id}; its one "
                           f"home is {HOMES[t.id]}", errors, used)
        # private attributes of other modules
        with open(path, encoding="utf-8") as f:
            source = f.read()
        for line, expr, attr in private_attributes(source):
            if (module, attr) in THIRD_PARTY_PRIVATE:
                used.add(("third-party", module, attr))
                continue
            _check(seen, "private-attribute", (module, attr),
                   f"{_where(module, line)}: {module} reaches into the private attribute "
                   f"{expr} ({attr} is not defined in {module}: give its home a public name)",
                   errors, used)
    return errors, used


def _ancestors(module: str):
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def test_every_module_has_a_floor():
    missing = [m for m in MODULES if floor(m) is None]
    assert not missing, f"add these modules (or their package) to FLOORS: {missing}"


def test_floors_cycles_private_names_torch_and_homes():
    errors, used = _violations()
    assert not errors, "\n".join(errors)
    stale = KNOWN - used
    assert not stale, f"fixed: remove these entries from KNOWN: {sorted(stale)}"
    unused = {("third-party", *k) for k in THIRD_PARTY_PRIVATE} - used
    assert not unused, f"no longer used: remove from THIRD_PARTY_PRIVATE: {sorted(unused)}"


def test_the_architecture_page_states_the_same_floors():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    stated = set()
    for row in re.findall(r"^\| *(\d+) *\|[^|]*\|([^|]*)\|", text, re.M):
        stated |= {(m, int(row[0])) for m in re.findall(r"`([\w.]+)`", row[1])}
    assert stated == set(FLOORS), (f"only in the test: {set(FLOORS) - stated}; only in "
                                   f"docs/architecture.md: {stated - set(FLOORS)}")


# ----------------------------------------------------------------------------- the checker


@pytest.mark.parametrize("source, kind", [
    ("from ..demo import common\n", "upward"),
    ("from dlion_kernels import checkpoint\n", "upward"),
    ("def f():\n    from .. import recipes\n", "upward"),
    ("from .pipeline import _private\n", "private"),
    ("import dlion_kernels\n", "upward"),
    ("from . import pipeline\n\ndef f(opt):\n    return pipeline._engine(opt)\n",
     "private attribute"),
    ("def f(opt):\n    opt._ddp_hooked = True\n", "private attribute"),
    ("def f(opt):\n    return getattr(opt, '_path', None)\n", "private attribute"),
])
def test_the_checker_finds_violations(tmp_path, monkeypatch, source, kind):
    """A module of floor 2 written with a bad import is caught, function-level imports too."""
    name = "dlion_kernels.exchange.probe"
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, name, str(path))
    visitor = _Imports(name, False)
    visitor.visit(ast.parse(source))
    monkeypatch.setitem(IMPORTS, name, visitor.found)
    errors, _ = _violations()
    assert any(name in e and kind.replace("upward", "imports") in e for e in errors), errors


def _planted(tmp_path, monkeypatch, source: str) -> list[str]:
    """The checker's errors with ``source`` planted as dlion_kernels/exchange/probe.py."""
    name = "dlion_kernels.exchange.probe"
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, name, str(path))
    visitor = _Imports(name, False)
    visitor.visit(ast.parse(source))
    monkeypatch.setitem(IMPORTS, name, visitor.found)
    where = os.path.relpath(str(path), ROOT)
    return [e.replace(where, "probe.py") for e in _violations()[0] if name in e]


def test_the_checker_names_a_planted_reach_in_and_upward_import(tmp_path, monkeypatch):
    errors = _planted(tmp_path, monkeypatch, (
        "from ..optim import dlion\n"
        "\n"
        "def hook(opt, params, grads):\n"
        "    opt._exchange_bucket(params, grads)\n"))
    assert errors == [
        "probe.py:1: dlion_kernels.exchange.probe (floor 2) imports "
        "dlion_kernels.optim.dlion (floor 3)",
        "probe.py:4: dlion_kernels.exchange.probe reaches into the "
        "private attribute opt._exchange_bucket (_exchange_bucket is not defined in "
        "dlion_kernels.exchange.probe: give its home a public name)"], errors


def test_the_private_attribute_rule_spares_own_and_third_party_names(tmp_path, monkeypatch):
    """``self._x``, a private name defined in the same module (another instance's too), and
    private API reached from a name imported from outside the package are not reach-ins."""
    source = (
        "import os\n"
        "import torch\n"
        "from torch.distributed import group as g\n"
        "\n"
        "class Box:\n"
        "    def __init__(self):\n"
        "        self._items = []\n"
        "\n"
        "    def merge(self, other):\n"
        "        self._items += other._items\n"
        "        torch._foreach_add_(self._items, 1)\n"
        "        g.WORLD._get_backend\n"
        "        os._exit(0)\n")
    assert private_attributes(source) == []
    assert _planted(tmp_path, monkeypatch, source) == []
    assert private_attributes("def f(box):\n    del box._items\n") == [
        (2, "box._items", "_items")]


def test_the_checker_finds_cycles(monkeypatch):
    IMPORTS_ = dict(IMPORTS)
    IMPORTS_["dlion_kernels.kernels.layout"] = IMPORTS["dlion_kernels.kernels.layout"] + [
        ("dlion_kernels.kernels.errors", None, 1, False)]
    IMPORTS_["dlion_kernels.kernels.errors"] = IMPORTS["dlion_kernels.kernels.errors"] + [
        ("dlion_kernels.kernels.layout", None, 1, False)]
    monkeypatch.setattr(sys.modules[__name__], "IMPORTS", IMPORTS_)
    errors, _ = _violations()
    assert any(e.startswith("import cycle: ") and "kernels.errors imports "
               "dlion_kernels.kernels.layout" in e for e in errors), errors
