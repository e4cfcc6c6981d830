"""The package's shape: no import circle between its parts, imports only flow downwards.

Every import is read with `ast`, function-level ones included (a circle that only lazy
imports keep from failing is still a circle).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cmoe_jax"
# lower layers first; a part may import only parts of a lower layer. `moe` is self-contained
# and `models` builds its MoE layers from it; `checkpoint` (the converted-model format)
# sits below both `loading`, which reads it, and `convert` / `train`, which write it.
LAYERS = [
    {"errors", "lora_variables", "faults"},
    {"distributed", "sharding", "moe", "cli_args", "atomic_files", "orbax_io", "host_arrays"},
    {"models", "data", "state_digests"},
    {"checkpoint", "calibration_pass", "carving"},
    {"loading"},
    {"methods", "generate"},  # generate: the KV-cache engine and its CLI, which eval's tasks use
    {"jobs"},  # job staging, lock, resume and publish: used by every output-writing job
    {"convert", "train", "eval", "export", "compress"},
    {"downcycle"},  # a job like those below it, on the training package's state, checkpoints and loop
    {"demo", "__init__", "commands"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
# What docs/architecture.png draws: the layers read as tiers, lowest first, each importing
# only from its own tier or lower ones; the grouped-matmul kernels (`moe/gmm`, which import
# nothing of the project) drawn apart from the MoE layers that run them.
KERNELS = "moe.gmm"
TIERS = [
    ("kernels", {KERNELS}),
    ("foundations", {"errors", "lora_variables", "faults", "distributed", "sharding", "cli_args",
                     "atomic_files", "orbax_io", "state_digests", "host_arrays"}),
    ("models and moe", {"moe", "models", "data", "checkpoint", "calibration_pass", "carving", "loading"}),
    ("methods", {"methods", "generate"}),
    ("jobs", {"jobs", "convert", "train", "eval", "export", "compress", "downcycle"}),
    ("entry points", {"demo", "__init__", "commands"}),
]
TIER = {part: i for i, (_, parts) in enumerate(TIERS) for part in parts}


def _part(module: str, split: tuple[str, ...] = ()) -> str:
    """`cmoe_jax.convert.api` -> "convert"; the package itself -> "__init__"; a subpackage
    named in `split` (e.g. "moe.gmm") is a part of its own."""
    parts = module.split(".")
    inner = next((sub for sub in split if ".".join(parts[1:]).startswith(sub)), None)
    return inner or (parts[1] if len(parts) > 1 else "__init__")


def import_graph(split: tuple[str, ...] = ()) -> dict[str, set[str]]:
    subs = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        src = _part(".".join(rel.parts), split) if len(rel.parts) > 1 else "__init__"
        edges = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
                if node.module == "cmoe_jax":  # `from cmoe_jax import loading` names a part
                    targets = [f"cmoe_jax.{a.name}" if a.name in subs else "cmoe_jax"
                               for a in node.names]
            else:
                continue
            edges.update(_part(t, split) for t in targets if t.split(".")[0] == "cmoe_jax")
        edges.discard(src)
    return graph


def test_every_part_has_a_layer():
    assert set(import_graph()) <= set(RANK), set(import_graph()) - set(RANK)


def test_imports_flow_downwards():
    wrong = [f"{src} imports {dst}" for src, dsts in import_graph().items() for dst in dsts
             if RANK[dst] >= RANK[src]]
    assert not wrong, wrong


def test_no_import_circle():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_modules_stay_small():
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 300}
    assert not big, big


METHODS = PACKAGE / "methods"


def _imports(path: Path):
    """Every `cmoe_jax...` module a file imports (function-level imports included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


# the modules a method may be entered through from outside its folder: its package, and where
# the package stays light (cmoe's: carving one FFN loads no job library) its `job` (settings,
# steps, `METHOD`) and its `report`
ENTRIES = {"job", "report"}


def test_a_method_is_entered_through_its_package():
    """Outside its folder, a method is used through the names its `__init__` (or its
    `job` and `report` modules) export, so its modules can be rearranged without touching the rest of
    the package, the benchmarks, examples and scripts included."""
    methods = {p.name for p in METHODS.iterdir() if (p / "__init__.py").exists()}
    assert {"cmoe", "hierarchical", "expertweaver", "conmoe"} <= methods
    wrong = []
    outside = [PACKAGE.parent / d for d in ("benchmarks", "examples", "scripts")]  # the package's users
    for path in [*PACKAGE.rglob("*.py"), *(p for d in outside for p in d.rglob("*.py"))]:
        for module in _imports(path):
            parts = module.split(".")
            if parts[:2] == ["cmoe_jax", "methods"] and len(parts) > 3 and parts[3] not in ENTRIES:
                if METHODS / parts[2] not in path.parents:
                    wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not wrong, wrong


def test_the_layer_pass_is_written_once():
    """Only `calibration_pass/layer_pass.py` runs a model's layers one by one on calibration data:
    its building blocks (embedding, attention half, FFN half) are used nowhere else."""
    blocks = re.compile(r"\b(embed_step|attention_step|ffn_residual_step|_ffn_input)\b")
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if blocks.search(p.read_text()))
    assert users == ["calibration_pass/layer_pass.py"], users
    runs = re.compile(r"\b(layer_pass|converted_ffns)\(")
    callers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if runs.search(p.read_text()) and p.name != "layer_pass.py")
    # the methods (a new method's folder included) and layer-wise recovery run it; nothing else
    assert all(c.startswith("methods/") or c == "train/layerwise.py" for c in callers), callers
    assert {"methods/cmoe/convert.py", "methods/conmoe/expert_stats.py", "train/layerwise.py"} <= set(callers)


def tier_edges() -> list[list]:
    """[source tier, imported tier, number of part-to-part imports] between different tiers."""
    counts: dict[tuple[str, str], int] = {}
    for src, dsts in import_graph((KERNELS,)).items():
        for dst in dsts:
            if TIER[src] != TIER[dst]:
                key = (TIERS[TIER[src]][0], TIERS[TIER[dst]][0])
                counts[key] = counts.get(key, 0) + 1
    return sorted([*key, n] for key, n in counts.items())


def test_tiers_hold_every_part_once_and_import_only_downwards():
    parts = [part for _, tier in TIERS for part in tier]
    assert sorted(parts) == sorted(set(import_graph((KERNELS,)))), "a part missing from TIERS, or twice"
    wrong = [f"{src} ({TIERS[TIER[src]][0]}) imports {dst} ({TIERS[TIER[dst]][0]})"
             for src, dsts in import_graph((KERNELS,)).items() for dst in dsts if TIER[dst] > TIER[src]]
    assert not wrong, wrong
    assert not import_graph((KERNELS,))[KERNELS], "the kernels import nothing of the project"


def test_the_architecture_picture_shows_these_layers():
    """docs/architecture.png is drawn from TIERS and the import graph
    (`python scripts/architecture_figure.py`); its data file must match the code as it is."""
    import json

    drawn = json.loads((PACKAGE.parent / "docs" / "architecture.json").read_text())
    redraw = "run python scripts/architecture_figure.py"
    assert drawn["tiers"] == [[name, sorted(parts)] for name, parts in TIERS], f"the tiers moved: {redraw}"
    assert drawn["tier_edges"] == tier_edges(), f"the imports between tiers changed: {redraw}"
    assert drawn["layers"] == [sorted(layer) for layer in LAYERS], f"the layers moved: {redraw}"


# Functions a reader can hold: no function over MAX_LINES lines (its `def` to its last line)
# and no parameter list over MAX_PARAMS (positional, keyword-only, *args and **kwargs; self and
# cls not counted). Wider settings travel as one object (e.g. `Decoding`, `GLUExperts`).
MAX_LINES, MAX_PARAMS = 60, 8
# the exceptions, each with its reason (file:qualified name)
ALLOWED_WIDE = {
    "moe/moe_layer.py:MoELayer.__init__": "a layer library users build with keywords "
                                    "(docs/guides/moe-layer.md lists every argument)",
    "methods/cmoe/carve_ffn.py:carve_ffn": "the one-call carve of the MoE layer guide: library "
                                           "users call it with keywords",
    "moe/gmm/pallas_gpu.py:_gmm_kernel": "a Pallas kernel: one ref per operand",
    "moe/gmm/pallas_gpu.py:_tgmm_kernel": "a Pallas kernel: one ref per operand",
}
# Functions still over the limits while they are being split on other branches.
# MUST BE EMPTY once those branches are merged: empty it then, never add to it.
BEING_SPLIT: set[str] = set()


def _functions(node, prefix=""):
    """(qualified name, lines, parameters) of every function under `node`, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = child.args
            named = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            yield (prefix + child.name, child.end_lineno - child.lineno + 1,
                   len(named) + (a.vararg is not None) + (a.kwarg is not None))
            yield from _functions(child, prefix + child.name + ".")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        else:
            yield from _functions(child, prefix)


def too_big() -> dict[str, str]:
    """Every function of the package over the limits: "file:name" -> "N lines, M parameters"."""
    return {f"{path.relative_to(PACKAGE).as_posix()}:{name}": f"{lines} lines, {params} parameters"
            for path in sorted(PACKAGE.rglob("*.py"))
            for name, lines, params in _functions(ast.parse(path.read_text()))
            if lines > MAX_LINES or params > MAX_PARAMS}


def test_functions_stay_small():
    wrong = {name: size for name, size in too_big().items()
             if name not in ALLOWED_WIDE and name not in BEING_SPLIT}
    assert not wrong, (f"over {MAX_LINES} lines or {MAX_PARAMS} parameters: split the function, or "
                       f"pass its settings as one object: {wrong}")


def test_no_constructor_takes_over_twelve_parameters():
    """Not even an allowed-wide one: a layer is built from one spec passed whole."""
    wide = {f"{path.relative_to(PACKAGE).as_posix()}:{name}": params
            for path in sorted(PACKAGE.rglob("*.py"))
            for name, _, params in _functions(ast.parse(path.read_text()))
            if name.endswith("__init__") and params > 12}
    assert not wide, f"constructors over 12 parameters: {wide}"


def test_every_exception_is_still_needed():
    """An entry of ALLOWED_WIDE or BEING_SPLIT whose function is now within the limits (or
    gone) is stale: remove it, so the lists only ever shrink."""
    assert not set(ALLOWED_WIDE) & BEING_SPLIT
    stale = sorted((set(ALLOWED_WIDE) | BEING_SPLIT) - set(too_big()))
    assert not stale, f"within the limits now, remove from ALLOWED_WIDE / BEING_SPLIT: {stale}"


def test_the_size_rule_counts_what_it_says():
    """The counter on a known shape: nested functions and methods are named and measured."""
    source = ("class A:\n    def f(self, a, b=1, *c, d, **e):\n        def g(x):\n            return x\n"
              "        return g\n\n\ndef h():\n    pass\n")
    assert list(_functions(ast.parse(source))) == [("A.f", 4, 5), ("A.f.g", 2, 1), ("h", 2, 0)]


def module_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` (e.g. "moe") it imports, function-level imports
    included; the package's own `__init__`, which imports everything, is left out."""
    root, prefix = PACKAGE / package, f"cmoe_jax.{package.replace('/', '.')}"
    names = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    graph = {}
    for name, path in names.items():
        if name == prefix:
            continue
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                edges.update(s for s in subs if s in names)
                edges.add(node.module)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        graph[name] = {e for e in edges if e in names and e not in (name, prefix)}
    return graph


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain of `graph` (a module, one it imports, one that imports, ...)."""
    memo: dict[str, list[str]] = {}

    def chain(node, seen=()):
        if node not in memo:
            assert node not in seen, f"import circle through {node}"
            memo[node] = [node] + max((chain(n, seen + (node,)) for n in graph[node]), key=len, default=[])
        return memo[node]

    return max((chain(n) for n in graph), key=len)


# modules along the longest import chain, at most (a reader follows one chain down)
DEPTH = {"moe": 6, "methods/cmoe": 6}


def test_the_busiest_packages_are_shallow():
    deep = {pkg: " -> ".join(c) for pkg, limit in DEPTH.items()
            if len(c := longest_chain(module_graph(pkg))) > limit}
    assert not deep, deep


def test_the_chain_measure_counts_modules():
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": set()}
    assert longest_chain(graph) == ["a", "b", "c"]


def test_no_import_circle_between_benchmarks():
    """The benchmark scripts import each other only one way (shared helpers in their own
    modules), as the package's parts do."""
    root = PACKAGE.parent / "benchmarks"
    graph = {}
    for path in root.glob("*.py"):
        graph[path.stem] = {m.split(".")[1] for m in _imports(path)
                            if m.startswith("benchmarks.") and m.split(".")[1] != path.stem}
    longest_chain(graph)  # asserts on a circle


def repository_graph(dirs=("cmoe_jax", "benchmarks", "examples", "scripts", "tests")) -> dict[str, set[str]]:
    """module -> the repository's modules it imports (function-level and relative imports
    included; `from pkg import name` is an import of `pkg.name` when that is a module, else of
    `pkg`), over every Python file of `dirs`."""
    root = PACKAGE.parent
    paths = {}
    for d in dirs:
        for path in (root / d).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                edges.update(f"{module}.{a.name}" if f"{module}.{a.name}" in paths else known(module)
                             for a in node.names)
        graph[name] = edges - {None, name}
    return graph


def test_no_module_import_circle_in_the_repository():
    """No two modules of the repository import each other, however indirectly: the package,
    the benchmarks, examples, scripts and tests (module by module, beyond the parts above)."""
    longest_chain(repository_graph())  # asserts on a circle


# A class a reader can hold: at most MAX_CLASS_LINES lines, a dataclass at most MAX_FIELDS
# fields (wider settings hold their parts as sub-configs).
MAX_CLASS_LINES, MAX_FIELDS = 150, 26
# still over the limits while they are split on other branches; never add to it
CLASSES_BEING_SPLIT: set[str] = set()


def big_classes() -> dict[str, str]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                fields = sum(isinstance(s, ast.AnnAssign) for s in node.body)
                dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
                if lines > MAX_CLASS_LINES or (dataclass and fields > MAX_FIELDS):
                    out[f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"] = f"{lines} lines, {fields} fields"
    return out


def test_classes_stay_small():
    wrong = {name: size for name, size in big_classes().items() if name not in CLASSES_BEING_SPLIT}
    assert not wrong, f"over {MAX_CLASS_LINES} lines or {MAX_FIELDS} dataclass fields: {wrong}"
