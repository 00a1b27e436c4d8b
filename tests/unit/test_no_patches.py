"""Outside ``compat/`` the package changes no vLLM class or module: no assignment (or
``setattr``) to an attribute of anything imported from vLLM.  Extension happens by
subclassing and registering (integration/extension_points.py)."""
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "vllm_dhisparse"


def vllm_names(tree: ast.Module) -> set[str]:
    """Local names bound to vLLM modules or objects by the module's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "vllm"}
    return names


def patches(path: pathlib.Path, base: pathlib.Path = PKG) -> list[str]:
    tree = ast.parse(path.read_text())
    names = vllm_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            root = t
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in names:
                found.append(f"{path.relative_to(base)}:{node.lineno}")
    return found


def test_nothing_outside_compat_assigns_to_vllm():
    found = [p for f in PKG.rglob("*.py") if "compat" not in f.parts for p in patches(f)]
    assert found == [], found


def test_the_check_sees_a_patch(tmp_path):
    """The scan finds the kind of patch it forbids (the test can fail)."""
    bad = tmp_path / "probe.py"
    bad.write_text("from vllm.v1.worker.cpu_worker import CPUWorker\n"
                   "import vllm.platforms as P\n"
                   "CPUWorker.determine_available_memory = None\n"
                   "setattr(P.current_platform, 'x', 1)\n"
                   "worker = CPUWorker\n"  # binding a name is not a patch
                   "def f(module):\n    module.__class__ = CPUWorker\n")  # an instance's
    assert patches(bad, tmp_path) == ["probe.py:3", "probe.py:4"]
