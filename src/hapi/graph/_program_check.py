"""What hapi runs of a head program from the wire: checked before torch reads any of it.

torch's deserializer resolves operator names with getattr on `torch`, evaluates shape
expressions with sympy (which uses `eval`), and `ExportedProgram.module()` executes the
program's guard code; fx writes attribute names into the Python code it generates. So a
program is refused unless its operators are ATen's (or shape arithmetic), its shape
expressions are symbols, numbers and arithmetic, its tensor names are plain dotted names,
and it holds no guard code, custom objects or subgraphs. Node metadata is dropped.
"""

from __future__ import annotations

import re
from typing import Any

from hapi.errors import InvalidRequest

__all__ = ["TENSOR_NAME", "check_program"]

TENSOR_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_ATEN = re.compile(r"^torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")
# ATen operators with effects beyond their tensors (files, printing, storage swaps).
_REFUSED_ATEN = {"from_file", "_print", "save", "load", "set_", "record_stream"}
_SYM_OPS = {
    *(f"_operator.{op}" for op in ("getitem", "add", "sub", "mul", "floordiv", "truediv")),
    *(f"_operator.{op}" for op in ("mod", "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge")),
    *(f"torch.sym_{op}" for op in ("float", "int", "max", "min", "not", "sqrt", "ite")),
    "math.ceil",
    "math.floor",
    "math.trunc",
}
# What a shape expression may contain once its quoted symbol names are taken out: the
# names below, numbers and arithmetic. sympy evaluates these strings.
_QUOTED_SYMBOL = re.compile(r"'[a-z]{1,3}\d+'")
_EXPR_CHARS = re.compile(r"^[A-Za-z0-9_+\-*/%(),.=<>!&| ]*$")
_EXPR_NAMES = {
    "Symbol",
    "Add",
    "Mul",
    "Pow",
    "floor",
    "ceiling",
    "Integer",
    "Rational",
    "Float",
    "True",
    "False",
    "positive",
    "negative",
    "nonnegative",
    "integer",
    "real",
    "finite",
    "oo",
    "int_oo",
    "Max",
    "Min",
    "Eq",
    "Ne",
    "Ge",
    "Gt",
    "Le",
    "Lt",
    "And",
    "Or",
    "Not",
    "Abs",
    "FloorDiv",
    "ModularIndexing",
    "Where",
    "PythonMod",
    "Mod",
    "CleanDiv",
    "CeilToInt",
    "FloorToInt",
    "CeilDiv",
    "TruncToInt",
    "IntTrueDiv",
    "FloatTrueDiv",
    "ToFloat",
    "PowByNatural",
}


def check_program(data: Any) -> set[str]:
    """Refuse what hapi does not run, before torch's deserializer reads any of it.

    Returns:
        The names of the program's parameters.
    """
    if not isinstance(data, dict) or "graph_module" not in data:
        raise InvalidRequest("a head program must be torch.export's JSON of a program")
    if data.get("guards_code"):
        raise InvalidRequest("a head program must not carry guard code")
    gm = data["graph_module"]
    graph = gm.get("graph", {})
    if graph.get("custom_obj_values"):
        raise InvalidRequest("a head program must not hold custom objects")
    for node in graph.get("nodes", []):
        _check_target(str(node.get("target")))
        node["metadata"] = {}
    gm["metadata"] = {}
    parameters: set[str] = set()
    for spec in gm.get("signature", {}).get("input_specs", []):
        kind, body = next(iter(spec.items()))
        if kind == "parameter":
            parameters.add(str(body.get("parameter_name")))
        if kind not in ("user_input", "parameter", "buffer", "tensor_constant"):
            raise InvalidRequest(f"a head program must not take a {kind} input")
        for key in ("parameter_name", "buffer_name", "tensor_constant_name"):
            if key in body and not TENSOR_NAME.match(str(body[key])):
                raise InvalidRequest(f"a head program names a tensor {body[key]!r}")
    for name in data.get("range_constraints", {}):
        if not re.fullmatch(r"[a-z]{1,3}\d+", str(name)):
            raise InvalidRequest(f"a head program has a malformed shape symbol {name!r}")
    _check_values(data)
    return parameters


def _check_target(target: str) -> None:
    match = _ATEN.match(target)
    if match is not None and match.group(1) not in _REFUSED_ATEN:
        return
    if target in _SYM_OPS:
        return
    raise InvalidRequest(
        f"a head program calls {target!r}: hapi runs ATen operators and shape arithmetic only"
    )


def _check_values(value: Any) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("as_graph", "as_custom_obj", "as_custom_objs", "as_operator"):
                raise InvalidRequest(f"a head program must not hold {key[3:]} arguments")
            if key == "expr_str":
                _check_expr(str(item))
            _check_values(item)
    elif isinstance(value, list):
        for item in value:
            _check_values(item)


def _check_expr(expr: str) -> None:
    bare = _QUOTED_SYMBOL.sub("S", expr)
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", bare)) - {"S"}
    bad = names - _EXPR_NAMES
    if not _EXPR_CHARS.match(bare) or "__" in bare or bad:
        raise InvalidRequest(f"a head program has a shape expression hapi does not read: {expr!r}")
