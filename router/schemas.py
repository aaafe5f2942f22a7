"""Checks on the JSON schemas a request carries (`response_format`, `structured_outputs`, `tools`)
before any engine compiles them: what vLLM cannot compile is a 400 naming the field, not a 500
that takes the engine out of the router's rotation (a 5xx any tenant could cause at will).

A schema's `$ref`s must be local ('#' or '#/...'), each must name a part of the schema, and no
chain of references may lead back where it began without a schema in between (`{"$ref": "#/$defs/a"}`
with `a` a reference to `b` and `b` to `a`): no value satisfies it. A recursive schema whose
references pass through structure (a tree whose children are trees) is fine.
"""

from __future__ import annotations

from typing import Any

# Keys that carry no constraint of their own: a schema of only these and a `$ref` is the reference.
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "description", "title", "$comment", "$schema", "$id"})


class SchemaRefused(ValueError):
    """A schema vLLM could not compile; the message names the field."""


def request_schemas(extra: dict[str, Any]) -> list[tuple[str, Any]]:
    """The JSON schemas in a request's passed-through fields, each with the field that holds it."""
    schemas = []
    response_format = extra.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict):
        schemas.append(("response_format.json_schema.schema", response_format["json_schema"].get("schema")))
    structured = extra.get("structured_outputs")
    if isinstance(structured, dict) and isinstance(structured.get("json"), dict):
        schemas.append(("structured_outputs.json", structured["json"]))
    for k, tool in enumerate(extra.get("tools") or []):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            schemas.append((f"tools.{k}.function.parameters", tool["function"].get("parameters")))
    return [(field, schema) for field, schema in schemas if isinstance(schema, dict)]


def check_refs(field: str, schema: dict[str, Any]) -> None:
    """Raise SchemaRefused unless every `$ref` of `schema` is local, resolves, and no chain of bare
    references loops."""
    for node in _nodes(schema):
        reference = node.get("$ref")
        if reference is None:
            continue
        seen: list[int] = []
        while isinstance(node, dict) and "$ref" in node and node.keys() <= _ANNOTATIONS:
            if id(node) in seen:
                raise SchemaRefused(f"{field}: $ref {reference!r} leads back to itself through references alone")
            seen.append(id(node))
            node = _resolve(field, schema, node["$ref"])
        if isinstance(node, dict) and "$ref" in node:
            _resolve(field, schema, node["$ref"])


def _resolve(field: str, schema: dict[str, Any], reference: Any) -> Any:
    """The part of `schema` a local JSON pointer names."""
    if not isinstance(reference, str) or not (reference == "#" or reference.startswith("#/")):
        raise SchemaRefused(f"{field}: $ref must point inside the schema ('#' or '#/...')")
    node: Any = schema
    for raw in reference[2:].split("/") if reference != "#" else ():
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaRefused(f"{field}: $ref {reference!r} names nothing in the schema")
    return node


def _nodes(value: Any) -> list[dict[str, Any]]:
    """Every object in `value`, iteratively (a deep schema must not exhaust the stack)."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found
