"""The package's layers, enforced: errors/config <- kernels <- models <- runtime <- serve, train,
bench. Every `import` of a flashtree module anywhere in a file (function-level imports too) is
checked against what its package may depend on, so a shortcut across layers fails here first."""

import ast
from pathlib import Path

import flashtree

ROOT = Path(flashtree.__file__).parent
BOTTOM = {"errors", "config", "sampling_params"}
# what each top-level part of the package may import (besides itself)
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "sampling_params": {"errors"},
    "kernels": set(),  # self-contained: Triton kernels and their PyTorch definitions
    "checkpoint": BOTTOM,
    "models": BOTTOM | {"kernels", "checkpoint"},
    "runtime": BOTTOM | {"kernels", "checkpoint", "models"},
    "serve": BOTTOM | {"checkpoint", "runtime"},  # runtime: only the worker process (see below)
    "train": BOTTOM | {"kernels", "checkpoint", "models", "runtime"},
    "bench": BOTTOM | {"kernels", "checkpoint", "models", "runtime"},
    "cli": BOTTOM | {"serve", "train", "bench", "runtime", "checkpoint"},
    "__init__": BOTTOM | {"runtime"},
    "__main__": {"cli"},
}
# what `from flashtree import X` really imports (the package root only re-exports, lazily)
ROOT_EXPORTS = {"Engine": "runtime", "GenerationResult": "runtime", "GenerationStats": "runtime",
                "GenerationStream": "runtime", "SamplingParams": "sampling_params"}


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: Path) -> set[tuple[str, int]]:
    """(top-level flashtree part, line) for every import of a flashtree module in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]  # ("flashtree", "serve")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                names = base + (node.module.split(".") if node.module else [])
                if len(names) == 1:  # `from .. import x`: x is the part
                    found.update((alias.name, node.lineno) for alias in node.names)
                    continue
            else:
                names = (node.module or "").split(".")
            if names[0] == "flashtree" and len(names) > 1:
                found.add((names[1], node.lineno))
            elif names == ["flashtree"]:
                found.update((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == "flashtree" and len(names) > 1:
                    found.add((names[1], node.lineno))
    return found


def test_every_import_respects_the_layers():
    broken = []
    files = [p for p in ROOT.rglob("*.py") if "assets" not in p.parts]
    assert len(files) > 40
    for path in files:
        part = part_of(path)
        assert part in ALLOWED, f"{path.relative_to(ROOT)}: part {part!r} has no place in the layer contract"
        for dep, line in imported_parts(path):
            dep = ROOT_EXPORTS.get(dep, dep)
            if dep == part:
                continue
            if dep == "runtime" and part == "serve" and path.name == "worker.py":
                continue  # the engine process; the HTTP process never imports it (test below)
            if dep not in ALLOWED[part]:
                broken.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {dep}")
    assert not broken, "layer contract broken:\n" + "\n".join(sorted(broken))


def test_the_checker_sees_relative_and_function_level_imports(tmp_path):
    """The contract test itself must be able to fail."""
    fake = ROOT / "kernels" / "_contract_probe.py"
    fake.write_text("def f():\n    from ..models import common\n    from flashtree.runtime import engine\n")
    try:
        assert imported_parts(fake) == {("models", 2), ("runtime", 3)}
    finally:
        fake.unlink()
