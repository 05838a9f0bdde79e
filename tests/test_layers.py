"""docs/architecture.md's table of who may import whom, checked on the code: every `import` of the package in each
layer (inside functions too) names a layer that layer may use."""

import ast
from pathlib import Path

import pytest

import llm_anatomy

ROOT = Path(llm_anatomy.__file__).parent
# layer -> the package's modules it may import (its own are always allowed)
ALLOWED = {
    "kernels": set(),
    "models": {"kernels", "engine.plan", "errors", "hub", "data"},
    "engine": {"models", "kernels", "tokenizer", "prompt", "hub", "errors", "disk_cache"},
    "probe": {"engine", "models", "kernels", "anatomy", "errors", "disk_cache", "hub", "tokenizer", "prompt", "gpus"},
    "gpus": {"errors"},
    "anatomy": set(),
    "report": {"anatomy"},
    "bench": {"report", "anatomy", "errors", "tokenizer", "cli_types"},
}


def is_module(parts: list[str]) -> bool:
    return (ROOT.joinpath(*parts).with_suffix(".py")).is_file() or ROOT.joinpath(*parts).is_dir()


def package_imports(path: Path) -> set[str]:
    """The package's modules a file imports, as dotted names under llm_anatomy (relative imports resolved)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[:len(parts) - node.level])
                name = ".".join(base + ([node.module] if node.module else []))
                names = [name] if node.module else [".".join(base + [a.name]) for a in node.names
                                                     if is_module(base + [a.name])]  # else a name of the package
            else:
                names = [node.module.removeprefix("llm_anatomy.")] if node.module.startswith("llm_anatomy") else []
            found.update(n for n in names if n)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("llm_anatomy.") for a in node.names if a.name.startswith("llm_anatomy."))
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(layer):
    files = [ROOT / f"{layer}.py"] if (ROOT / f"{layer}.py").is_file() else sorted((ROOT / layer).rglob("*.py"))
    assert files
    for path in files:
        for name in package_imports(path):
            if name == layer or name.startswith(layer + "."):
                continue
            assert any(name == a or name.startswith(a + ".") for a in ALLOWED[layer]), \
                f"{path.relative_to(ROOT)} imports {name}, which docs/architecture.md does not let {layer} import"
