"""Code-structure figures of the library: largest modules, longest functions, import layers.

    python -m bench.code_structure            # prints the figures; --json PATH also writes them

Goals (tests/test_code_structure.py holds the library to them): every module <= 500 lines, every
function <= 60 lines, no import against the layers of docs/DESIGN.md ("Direction of imports":
scheduling imports no jax and nothing above it; models import no drafters; drafters import no
training, decoding, serving or evaluation; decoding imports no training or serving; training imports
no serving; the library imports no program and names none to launch), and the README's lines before
its Python API section <= 40. Imports are read from the syntax tree, function-level ones included.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
PROGRAMS = ("train", "serve", "bench", "experiments")
# (importing package prefix, forbidden import prefixes)
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("specjax.scheduling", ("jax", "jaxlib", "flax", "optax", "specjax.models", "specjax.drafters",
                            "specjax.decoding", "specjax.training", "specjax.eval", "specjax.serving",
                            "specjax.api", "specjax.checkpoints")),
    ("specjax.sampling", ("specjax.decoding", "specjax.drafters", "specjax.models", "specjax.training")),
    ("specjax.models", ("specjax.drafters", "specjax.decoding", "specjax.training", "specjax.eval",
                        "specjax.serving", "specjax.api")),
    ("specjax.drafters", ("specjax.training", "specjax.decoding", "specjax.serving", "specjax.eval",
                          "specjax.api")),
    ("specjax.decoding", ("specjax.training", "specjax.serving", "specjax.eval")),
    ("specjax.training", ("specjax.serving",)),
    ("specjax", PROGRAMS),
)
_PROGRAM_NAME = re.compile(r"^(%s)\.[a-z_][a-z0-9_]*$" % "|".join(PROGRAMS))


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement; relative imports resolved against `module`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: -node.level]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
    return out


def program_names(source: str) -> list[tuple[int, str]]:
    """String constants that name a program module (e.g. launched with `python -m`)."""
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and _PROGRAM_NAME.match(n.value)]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, source: str) -> list[str]:
    """Every import of `module` that a rule forbids, and every program it names."""
    bad = []
    for line, name in imports_of(source, module):
        for owner, forbidden in RULES:
            if _under(module, owner) and any(_under(name, f) for f in forbidden):
                bad.append(f"{module}:{line} imports {name} ({owner} may not import it)")
                break
    bad += [f"{module}:{line} names the program {name}" for line, name in program_names(source)]
    return bad


def library_sources() -> list[tuple[str, str]]:
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "specjax")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    out.append((module_name(path), fh.read()))
    return out



def function_lengths(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines from `def` to its last line) for every function and method."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(ast.parse(source), "")
    return out


def readme_lines_before_api(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#") and "python api" in line.lower():
            return i
    return len(lines)


def measure() -> dict:
    mods = library_sources()
    sizes = sorted(((len(src.splitlines()), path) for path, src in mods), reverse=True)
    funcs = sorted(((n, f"{path}:{name}") for path, src in mods for name, n in function_lengths(src)),
                   reverse=True)
    upward = [v for mod, src in library_sources() for v in violations(mod, src)]
    return {"largest_modules": [{"path": p, "lines": n} for n, p in sizes[:5]],
            "longest_functions": [{"name": f, "lines": n} for n, f in funcs[:5]],
            "functions_over_60": sum(1 for n, _ in funcs if n > MAX_FUNCTION_LINES),
            "modules_over_500": sum(1 for n, _ in sizes if n > MAX_MODULE_LINES),
            "upward_imports": upward,
            "readme_lines_before_python_api": readme_lines_before_api(os.path.join(ROOT, "README.md"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    m = measure()
    for row in m["largest_modules"]:
        print(f"module   {row['lines']:5d}  {row['path']}")
    for row in m["longest_functions"]:
        print(f"function {row['lines']:5d}  {row['name']}")
    print(f"modules over 500 lines: {m['modules_over_500']}; functions over 60 lines: {m['functions_over_60']}")
    print(f"upward imports: {len(m['upward_imports'])}")
    for v in m["upward_imports"]:
        print(f"  {v}")
    print(f"README lines before the Python API: {m['readme_lines_before_python_api']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(m, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
