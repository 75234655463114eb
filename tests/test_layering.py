"""Dependencies run one way (docs/design.md, "The package"): read from the source with ast, every
import counted, at module level or inside a function, so a lazy import cannot hide a dependency.

    model/        imports nothing of the package but errors and files; no deepspeed, no torch.distributed
    data/         no train/, no inference/
    inference/    no train/ (it reads checkpoints through checkpoint_format.py)
    train/        no inference/ (decoding and scoring for BLEU are handed in by launch/train.py)
    checkpoint_format.py   below both train/ and inference/
    and no import cycle among the package's modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "admin_ds"

# Import cycles that exist and are known, each an exact set of modules: none. An entry whose
# modules are gone is ignored (delete it then); an entry whose modules remain but no longer form
# that cycle fails, so that it is deleted and cannot return.
ALLOWED_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name ``module`` imports, anywhere in its source (relative imports resolved;
    ``from a import b`` gives both ``a`` and ``a.b``, b may be a module)."""
    names = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                source = ".".join(base)
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every name each module imports, the package modules each module imports)."""
    modules = _modules()
    imports, edges = {}, {}
    for module, path in modules.items():
        names = _imported_names(module, path)
        imports[module] = names
        targets = set()
        for name in names:
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        edges[module] = targets
    return imports, edges


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _offenders(imports: dict[str, set[str]], where: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {name}" for module, names in imports.items() if _within(module, where)
                  for name in names if any(_within(name, f) for f in forbidden))


def test_the_reader_sees_function_level_imports():
    """The graph is only as good as its reader: inference/model_file.py imports deepspeed inside a
    function only, and the loop reaches the runners at module level."""
    imports, edges = _graph()
    assert "deepspeed.utils.zero_to_fp32" in imports["admin_ds.inference.model_file"]
    assert "admin_ds.train.runners" in edges["admin_ds.train.loop"]
    assert "admin_ds.checkpoint_format" in edges["admin_ds.train.checkpoints"]


def test_train_and_inference_do_not_import_each_other():
    imports, _ = _graph()
    assert _offenders(imports, "admin_ds.inference", ("admin_ds.train",)) == []
    assert _offenders(imports, "admin_ds.train", ("admin_ds.inference",)) == []


def test_model_runs_on_one_device_and_imports_only_errors_and_files():
    imports, edges = _graph()
    assert _offenders(imports, "admin_ds.model", ("deepspeed", "torch.distributed")) == []
    allowed = ("admin_ds.model", "admin_ds.errors", "admin_ds.files")
    outside = sorted(f"{m} imports {t}" for m, ts in edges.items() if _within(m, "admin_ds.model")
                     for t in ts if t != "admin_ds" and not any(_within(t, a) for a in allowed))
    assert outside == []


def test_data_and_the_checkpoint_format_sit_below_train_and_inference():
    imports, _ = _graph()
    for where in ("admin_ds.data", "admin_ds.checkpoint_format"):
        assert _offenders(imports, where, ("admin_ds.train", "admin_ds.inference")) == []


def test_no_import_cycles_but_the_known_ones():
    _, edges = _graph()
    found = _cycles(edges)
    unknown = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert unknown == [], f"import cycles: {unknown}"
    stale = [sorted(c) for c in ALLOWED_CYCLES if c <= set(edges) and c not in found]
    assert stale == [], f"no longer a cycle, delete it from ALLOWED_CYCLES: {stale}"


def test_the_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}, "f": set()}
    assert sorted(map(sorted, _cycles(edges))) == [["a", "b", "c"], ["e", "e2"]]


def test_no_sys_path_edits():
    """The package is installed (pyproject.toml); its modules and the command lines import it as
    installed, never by editing sys.path."""
    edits = []
    for folder in ("admin_ds", "launch", "data_prep"):
        for path in sorted((PACKAGE.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                        and node.value.id == "sys"):
                    edits.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert edits == []
