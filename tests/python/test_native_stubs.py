"""torch_hook/cfc/_native.pyi stays in step with the native module."""

import ast
import pathlib

import cfc._native as native

STUB = pathlib.Path(__file__).resolve().parents[2] / "torch_hook" / "cfc" / "_native.pyi"


def stub_names():
    tree = ast.parse(STUB.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    return names


def test_every_stub_exists_and_every_public_name_has_a_stub():
    public = {n for n in dir(native) if not n.startswith("_")} | {"__version__"}
    assert stub_names() == public
