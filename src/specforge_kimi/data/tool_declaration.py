"""K2.5's TypeScript-style tool declaration: the text of the ``tool_declare`` system turn.

K2.5 declares tools not as JSON (as K2 did) but as a TypeScript-like namespace that its
tokenizer class (``tokenization_kimi.TikTokenTokenizer.apply_chat_template``) builds from the
key-sorted tool list and passes to the chat template as ``tools_ts_str``:

    # Tools

    ## functions
    namespace functions {
    // description
    type NAME = (_: {
      required_arg: string,
      optional_arg?: number
    }) => any;
    }

This module is our own implementation of that encoding, written from the behaviour of K2.5's
``tool_declaration_ts.py`` (as reimplemented in thinking-machines-lab/tinker-cookbook and
fixture-tested in lightseekorg/smg). Rules it reproduces: required properties first, each group
sorted by name; ``integer`` shown as ``number``; string/number/array constraints and defaults as
``//`` comment lines; ``enum``, ``anyOf``, type lists, ``$ref``/``$defs`` (as ``interface``
blocks) and ``additionalProperties``.

Scope: when the reference encoder fails on a schema (``oneOf``, a schema with no ``type``, an
unknown ``$ref``...), the tokenizer catches the error and the template falls back to compact JSON
of the (key-sorted) tools. :func:`render_tool_declaration` does the same, so an unusual schema
renders exactly as K2.5 renders it rather than raising.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["deep_sort", "encode_tools_typescript", "render_tool_declaration"]

_INDENT = "  "
_FIELD_SEPARATOR = ",\n"
_UNION_TYPE_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}


class _UnsupportedSchema(ValueError):
    """A schema the reference encoder rejects; the declaration then falls back to JSON."""


def deep_sort(value: Any) -> Any:
    """Sort dict keys recursively (lists keep their order), as K2.5's tokenizer does to tools."""
    if isinstance(value, dict):
        return {key: deep_sort(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(item) for item in value]
    return value


def _comment_lines(text: str, indent: str) -> str:
    # Empty lines stay empty (no bare "//"), as in the reference.
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Definitions:
    """``$defs`` seen while walking one function's parameters, for ``$ref`` resolution."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.self_referenced = False

    def add(self, defs: Mapping[str, Any]) -> None:
        for name, schema in defs.items():
            self.schemas[name] = schema

    def resolve(self, ref: str) -> str:
        if ref == "#":
            self.self_referenced = True
            return "parameters"
        if ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.schemas:
                raise _UnsupportedSchema(f"reference not found: {ref}")
            return name
        raise _UnsupportedSchema(f"unsupported reference format: {ref}")


class _Type:
    """One parsed schema node: a doc comment (description + constraints) and a TS type."""

    constraint_keys: tuple[str, ...] = ()

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.description = schema.get("description", "")
        self.constraints = {k: v for k, v in schema.items() if k in self.constraint_keys}

    def doc(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(_comment_lines(self.description, indent))
        if self.constraints:
            joined = ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items()))
            lines.append(f"{indent}// {joined}")
        return "".join(line + "\n" for line in lines)

    def ts(self, indent: str = "") -> str:
        raise NotImplementedError


class _Scalar(_Type):
    def __init__(self, type_name: str, schema: Mapping[str, Any] | None = None) -> None:
        self.type_name = type_name
        if type_name == "string":
            self.constraint_keys = ("maxLength", "minLength", "pattern")
        elif type_name in ("number", "integer"):
            self.constraint_keys = ("maximum", "minimum")
        super().__init__(schema or {})

    def ts(self, indent: str = "") -> str:
        return "number" if self.type_name == "integer" else str(self.type_name)


class _Property:
    def __init__(self, name: str, type_: _Type, optional: bool, default: Any) -> None:
        self.name = name
        self.type = type_
        self.optional = optional
        self.default = default

    def ts(self, indent: str) -> str:
        comments = self.type.doc(indent)
        if self.default is not None:
            if isinstance(self.default, (int, float, bool)):
                shown = repr(self.default)
            else:
                shown = json.dumps(self.default, ensure_ascii=False)
            comments += f"{indent}// Default: {shown}\n"
        mark = "?" if self.optional else ""
        return f"{comments}{indent}{self.name}{mark}: {self.type.ts(indent)}"


class _Object(_Type):
    def __init__(self, schema: Mapping[str, Any], defs: _Definitions) -> None:
        super().__init__(schema)
        self.properties: list[_Property] = []
        self.additional: Any = None
        if not schema:
            return
        if "$defs" in schema:
            defs.add(schema["$defs"])
        additional = schema.get("additionalProperties")
        self.additional = _parse(additional, defs) if isinstance(additional, dict) else additional
        if "properties" not in schema:
            return
        required = set(schema.get("required", []))
        for name, prop in schema["properties"].items():
            self.properties.append(
                _Property(
                    name=name,
                    type_=_parse(prop, defs),
                    optional=name not in required,
                    default=prop.get("default") if isinstance(prop, dict) else None,
                )
            )

    def ts(self, indent: str = "") -> str:
        ordered = sorted((p for p in self.properties if not p.optional), key=lambda p: p.name)
        ordered += sorted((p for p in self.properties if p.optional), key=lambda p: p.name)
        fields = [p.ts(indent + _INDENT) for p in ordered]
        if self.additional is not None:
            if self.additional is True:
                shown = "any"
            elif self.additional is False:
                shown = "never"
            elif isinstance(self.additional, _Type):
                shown = self.additional.ts(indent + _INDENT)
            else:
                raise _UnsupportedSchema(f"unknown additionalProperties: {self.additional!r}")
            fields.append(f"{indent}{_INDENT}[k: string]: {shown}")
        if not fields:
            return "{}"
        return "{\n" + _FIELD_SEPARATOR.join(fields) + "\n" + indent + "}"


class _Array(_Type):
    constraint_keys = ("minItems", "maxItems")

    def __init__(self, schema: Mapping[str, Any], defs: _Definitions) -> None:
        super().__init__(schema)
        items = schema.get("items")
        self.item = _parse(items, defs) if items else _Scalar("any")

    def ts(self, indent: str = "") -> str:
        item_doc = self.item.doc(indent + _INDENT)
        if not item_doc:
            return f"Array<{self.item.ts(indent)}>"
        inner = self.item.ts(indent + _INDENT)
        return f"Array<\n{item_doc}{indent}{_INDENT}{inner}\n{indent}>"


class _Enum(_Type):
    def __init__(self, schema: Mapping[str, Any]) -> None:
        super().__init__(schema)
        self.values = schema["enum"]
        if "type" in schema:
            _check_enum_values(self.values, schema["type"])

    def ts(self, indent: str = "") -> str:
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)


def _check_enum_values(values: Sequence[Any], declared: Any) -> None:
    if isinstance(declared, list):
        if len(declared) == 1:
            declared = declared[0]
        elif len(declared) == 2 and "null" in declared:
            declared = declared[0] if declared[0] != "null" else declared[1]
        else:
            raise _UnsupportedSchema(f"enum type {declared} is not supported")
    expected = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,)}
    for value in values:
        if value is not None and declared in expected and not isinstance(value, expected[declared]):
            raise _UnsupportedSchema(f"enum value {value!r} is not a {declared}")


class _AnyOf(_Type):
    def __init__(self, schema: Mapping[str, Any], defs: _Definitions) -> None:
        super().__init__(schema)
        self.options = [_parse(option, defs) for option in schema["anyOf"]]

    def ts(self, indent: str = "") -> str:
        return " | ".join(option.ts(indent) for option in self.options)


class _TypeList(_Type):
    def __init__(self, schema: Mapping[str, Any]) -> None:
        super().__init__(schema)
        unknown = [t for t in schema["type"] if t not in _UNION_TYPE_NAMES]
        if unknown:
            raise _UnsupportedSchema(f"unsupported types in type list: {unknown}")
        self.names = [_UNION_TYPE_NAMES[t] for t in schema["type"]]

    def ts(self, indent: str = "") -> str:
        return " | ".join(self.names)


class _Ref(_Type):
    def __init__(self, schema: Mapping[str, Any], defs: _Definitions) -> None:
        super().__init__(schema)
        self.name = defs.resolve(schema["$ref"])

    def ts(self, indent: str = "") -> str:
        return self.name


def _parse(schema: Any, defs: _Definitions) -> _Type:
    if isinstance(schema, bool):
        return _Scalar("any" if schema else "null")
    if not isinstance(schema, Mapping):
        raise _UnsupportedSchema(f"invalid JSON schema object: {schema!r}")
    if "$ref" in schema:
        return _Ref(schema, defs)
    if "anyOf" in schema:
        return _AnyOf(schema, defs)
    if "enum" in schema:
        return _Enum(schema)
    if "type" in schema:
        type_name = schema["type"]
        if isinstance(type_name, list):
            return _TypeList(schema)
        if type_name == "object":
            return _Object(schema, defs)
        if type_name == "array":
            return _Array(schema, defs)
        return _Scalar(type_name, schema)
    if not schema:
        return _Scalar("any")
    raise _UnsupportedSchema(f"invalid JSON schema object: {schema!r}")


def _encode_function(function: Mapping[str, Any]) -> str:
    defs = _Definitions()
    parameters = _Object(function.get("parameters") or {}, defs)

    interfaces = []
    # Decided before the $defs are walked: a "#" reference inside a definition does not turn the
    # function's own argument type into the "parameters" interface (the reference's order).
    root_is_interface = defs.self_referenced
    if root_is_interface:
        fields = _FIELD_SEPARATOR.join(p.ts(_INDENT) for p in parameters.properties)
        interfaces.append("interface parameters {" + (f"\n{fields}\n" if fields else "") + "}")
    for name, schema in dict(defs.schemas).items():
        if not isinstance(schema, Mapping):
            raise _UnsupportedSchema(f"$defs entry {name!r} is not a schema object")
        body = _parse(schema, defs).ts()
        description = schema.get("description", "")
        prefix = _comment_lines(description, "") + "\n" if description else ""
        interfaces.append(f"{prefix}interface {name} {body}")

    name = function.get("name", "function")
    argument_type = "parameters" if root_is_interface else parameters.ts()
    description = function.get("description")
    parts = [
        "\n".join(interfaces),
        _comment_lines(description, "") if description else "",
        f"type {name} = (_: {argument_type}) => any;",
    ]
    return "\n".join(part for part in parts if part)


def encode_tools_typescript(tools: Sequence[Mapping[str, Any]]) -> str:
    """Encode OpenAI-style tools (``{"type": "function", "function": {...}}``) as K2.5's TS text.

    Raises :class:`ValueError` (a private subclass) for schemas K2.5's encoder rejects; use
    :func:`render_tool_declaration` for the template's behaviour (JSON fallback).
    """
    if not tools:
        return ""
    functions = []
    for tool in tools:
        if tool.get("type") != "function":
            continue  # the reference skips other tool types (e.g. "_plugin")
        function = tool.get("function", {})
        if function:
            functions.append(_encode_function(function))
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def render_tool_declaration(tools: Sequence[Mapping[str, Any]]) -> str:
    """The content of K2.5's ``tool_declare`` turn for these tools, as its template renders it.

    Tools are deep key-sorted first (K2.5's tokenizer does this). The TypeScript text is used
    when it can be built and is non-empty; otherwise compact JSON (``separators=(",", ":")``,
    non-ASCII kept), which is the template's fallback.
    """
    tools = deep_sort(list(tools))
    try:
        text = encode_tools_typescript(tools)
    except (_UnsupportedSchema, KeyError, TypeError, AttributeError):
        # The reference catches any exception here and falls back to JSON; these are the ones a
        # malformed schema raises in this implementation.
        text = ""
    if text:
        return text
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
