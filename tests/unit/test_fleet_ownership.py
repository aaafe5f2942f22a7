"""One owner of the live fleet's state: no module but fleet/instances.py assigns an instance's
state, load, health or circuit, or edits the streams it relays (read from the code itself, so a
new module that does is caught)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNED = {"state", "inflight", "engine_load", "pending_prefill_tokens", "failed_checks", "failed_prefills", "prefill_open_until"}
OWNER = ROOT / "fleet" / "instances.py"
PACKAGES = ("router", "prefill", "decode", "deploy", "fleet", "loadtest")


def changes(tree: ast.AST) -> list[str]:
    """Assignments to another object's owned fields, and edits of another object's streams."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr in OWNED
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                found.append(f"line {node.lineno}: {ast.unparse(target)} =")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("add", "discard")
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "streams"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_registry_changes_an_instances_state():
    offenders = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path != OWNER and (found := changes(ast.parse(path.read_text()))):
                offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders


def test_the_check_sees_a_change():
    assert changes(ast.parse("instance.state = READY\nother.inflight += 1\ni.streams.add(x)\nself.state = 1"))  == [
        "line 1: instance.state =", "line 2: other.inflight =", "line 3: i.streams.add(x)"]
