#!/usr/bin/env python
"""Extract the command-line flags of SGLang's ``ServerArgs`` from SGLang's source, statically.

    python scripts/sglang_server_args.py /path/to/sglang [--check]

``/path/to/sglang`` is the unpacked ``sglang`` package of a wheel (the folder holding ``srt/``).
The script writes ``tinylm/sglang_server_args.py``: every option string ``sglang serve`` /
``python -m sglang.launch_server`` accepts, with the field it sets and how many values it takes.
With ``--check`` it writes nothing and exits 1 when the checked-in module differs.

SGLang cannot be imported here (it needs CUDA-era dependencies), so the flags are read from the
syntax tree, following the rules SGLang itself applies when it builds its parser:

- ``srt/server_args.py``, ``_INPUT_NAMESPACES``: the namespace classes whose fields make up
  ``ServerArgs`` (each imported from ``srt/arg_groups/fields/*.py``);
- ``srt/arg_groups/arg_utils.py``, ``add_cli_args_from_dataclass``: a field annotated
  ``A[T, "help"]`` or ``A[T, Arg(...)]`` becomes ``--field-name`` (or ``Arg.cli_name``) plus
  ``Arg.aliases``, unless ``Arg.no_cli``; a custom ``action`` decides its own arity
  (``argparse.BooleanOptionalAction`` adds ``--no-...``); else ``Literal[...]`` takes one value,
  ``list[...]`` (no ``type_parser``) takes ``Arg.nargs`` or ``+``, ``bool`` is a switch, and
  anything else takes one value (or ``Arg.nargs``); ``Optional[X]`` is read as ``X``;
- ``ServerArgs.add_cli_args``: the flags registered by hand (dynamic choices, ``--config``,
  deprecated spellings).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent.parent / "tinylm" / "sglang_server_args.py"
FIELDS_PACKAGE = "sglang.srt.arg_groups.fields."
SWITCH_ACTIONS = {
    "store_true",
    "store_false",
    "store_const",
    "BooleanOptionalAction",
    "DeprecatedAction",
    "DeprecatedStoreTrueAction",
    "DeprecatedStoreConstAction",
}

Nargs = int | str | None  # 0: a switch; None: one value; "?", "*", "+": argparse's


@dataclass(frozen=True)
class Flag:
    options: tuple[str, ...]
    dest: str
    nargs: Nargs


class SourceError(RuntimeError):
    """The source does not have the shape this extractor reads; the message says where."""


def _name(node: ast.expr) -> str:
    """``X`` for ``X`` and ``m.X`` (the last part of a dotted name), else ``""``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _literal(node: ast.expr, where: str) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError as exc:
        raise SourceError(f"{where}: expected a literal, got {ast.unparse(node)}") from exc


def _members(node: ast.expr) -> list[ast.expr]:
    """The members of ``Union[...]`` / ``a | b`` (a single node is its own member)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _members(node.left) + _members(node.right)
    if isinstance(node, ast.Subscript) and _name(node.value) == "Union":
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [m for item in items for m in _members(item)]
    return [node]


def _unwrap_optional(node: ast.expr) -> ast.expr:
    """``X`` for ``Optional[X]`` / ``Union[X, None]`` / ``X | None`` (one non-None member)."""
    if isinstance(node, ast.Subscript) and _name(node.value) == "Optional":
        return _unwrap_optional(node.slice)
    members = _members(node)
    real = [m for m in members if not (isinstance(m, ast.Constant) and m.value is None)]
    if len(members) > 1 and len(real) == 1:
        return real[0]
    return node


def _type_kind(annotation: ast.expr) -> str:
    """``literal``, ``list``, ``bool`` or ``scalar``: what ``add_cli_args_from_dataclass``
    branches on, after unwrapping ``Optional``."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    inner = _unwrap_optional(annotation)
    if isinstance(inner, ast.Subscript):
        origin = _name(inner.value)
        if origin == "Literal":
            return "literal"
        if origin in ("List", "list"):
            return "list"
    if _name(inner) == "bool":
        return "bool"
    return "scalar"


def _keywords(call: ast.Call, where: str) -> dict[str, ast.expr]:
    if any(k.arg is None for k in call.keywords):
        raise SourceError(f"{where}: **kwargs in {ast.unparse(call)}")
    return {str(k.arg): k.value for k in call.keywords}


def _action_nargs(action: ast.expr, kwargs: dict[str, object]) -> Nargs:
    if "nargs" in kwargs:
        return kwargs["nargs"]  # type: ignore[return-value]
    return 0 if _name(action) in SWITCH_ACTIONS or _literal_str(action) in SWITCH_ACTIONS else None


def _dict_literals(node: ast.expr | None, where: str) -> dict[str, object]:
    """The literal-valued entries of a ``{...}`` (``type=str`` and the like are left out)."""
    if node is None:
        return {}
    if not isinstance(node, ast.Dict):
        raise SourceError(f"{where}: expected a dict literal, got {ast.unparse(node)}")
    out: dict[str, object] = {}
    for key, value in zip(node.keys, node.values, strict=True):
        if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
            out[str(key.value)] = value.value
    return out


def _literal_str(node: ast.expr) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def _boolean_optional(options: list[str]) -> list[str]:
    """``argparse.BooleanOptionalAction``'s option strings: each ``--x`` and ``--no-x``."""
    out = []
    for option in options:
        out.append(option)
        if option.startswith("--"):
            out.append("--no-" + option[2:])
    return out


def _field_flag(name: str, annotation: ast.expr, where: str) -> Flag | None:
    """The flag ``add_cli_args_from_dataclass`` registers for one field (None: no flag)."""
    if not isinstance(annotation, ast.Subscript) or _name(annotation.value) not in (
        "A",
        "Annotated",
    ):
        return None
    parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    inner, metadata = parts[0], parts[1:]
    arg: dict[str, ast.expr] | None = None
    for meta in metadata:
        if isinstance(meta, ast.Call) and _name(meta.func) == "Arg":
            arg = _keywords(meta, where)
            break
        if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
            arg = {}
            break
    if arg is None:
        return None  # no Arg: registered by hand or not a flag
    literal = {k: v for k, v in arg.items() if k in ("cli_name", "aliases", "no_cli", "nargs")}
    meta_values = {k: _literal(v, f"{where}.{k}") for k, v in literal.items()}
    if meta_values.get("no_cli"):
        return None
    cli_name = meta_values.get("cli_name") or "--" + name.replace("_", "-")
    aliases = meta_values.get("aliases") or []
    assert isinstance(aliases, list), f"{where}: aliases is not a list"
    options = [str(cli_name), *(str(a) for a in aliases)]
    nargs: Nargs
    if "action" in arg:
        action = arg["action"]
        extra = _dict_literals(arg.get("action_kwargs"), f"{where}.action_kwargs")
        if _name(action) == "BooleanOptionalAction":
            options = _boolean_optional(options)
        nargs = _action_nargs(action, extra)
    else:
        kind = _type_kind(inner)
        declared = meta_values.get("nargs")
        if kind == "literal":
            nargs = None  # the Literal branch ignores Arg.nargs
        elif kind == "list" and "type_parser" not in arg:
            nargs = declared if declared is not None else "+"  # type: ignore[assignment]
        elif kind == "bool":
            nargs = 0
        else:
            nargs = declared  # type: ignore[assignment]
    return Flag(tuple(options), name, nargs)


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _class_flags(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], where: str) -> list[Flag]:
    flags: list[Flag] = []
    for base in cls.bases:  # a namespace may extend another of its module
        if _name(base) in classes:
            flags += _class_flags(classes[_name(base)], classes, where)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            flag = _field_flag(node.target.id, node.annotation, f"{where}:{node.lineno}")
            if flag is not None:
                flags.append(flag)
    return flags


def _namespaces(server_args: ast.Module) -> list[tuple[str, str]]:
    """``(class name, module)`` of every class in ``_INPUT_NAMESPACES``, in order."""
    imported: dict[str, str] = {}
    names: list[str] | None = None
    for node in server_args.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(FIELDS_PACKAGE):
            for alias in node.names:
                imported[alias.asname or alias.name] = str(node.module)[len(FIELDS_PACKAGE) :]
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets
        ):
            if not isinstance(node.value, ast.List):
                raise SourceError("server_args.py: _INPUT_NAMESPACES is not a list literal")
            names = [_name(e) for e in node.value.elts]
    if names is None:
        raise SourceError("server_args.py: no _INPUT_NAMESPACES")
    missing = [n for n in names if n not in imported]
    if missing:
        raise SourceError(f"server_args.py: namespaces not imported from fields: {missing}")
    return [(n, imported[n]) for n in names]


def _manual_flags(server_args: ast.Module) -> list[Flag]:
    """The ``parser.add_argument(...)`` calls of ``ServerArgs.add_cli_args``."""
    cls = _classes(server_args).get("ServerArgs")
    method = next(
        (
            n
            for n in (cls.body if cls else [])
            if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"
        ),
        None,
    )
    if method is None:
        raise SourceError("server_args.py: no ServerArgs.add_cli_args")
    flags: list[Flag] = []
    for node in ast.walk(method):
        if not (isinstance(node, ast.Call) and _name(node.func) == "add_argument"):
            continue
        where = f"server_args.py:{node.lineno}"
        options = [str(_literal(a, where)) for a in node.args]
        kwargs = _keywords(node, where)
        if "dest" in kwargs:
            dest = str(_literal(kwargs["dest"], where))
        else:
            long = next(o for o in options if o.startswith("--"))
            dest = long[2:].replace("-", "_")
        nargs: Nargs
        if "nargs" in kwargs:
            nargs = _literal(kwargs["nargs"], where)  # type: ignore[assignment]
        elif "action" in kwargs:
            nargs = _action_nargs(kwargs["action"], {})
        else:
            nargs = None
        flags.append(Flag(tuple(options), dest, nargs))
    return flags


def extract(root: Path) -> list[Flag]:
    """Every flag of SGLang's ``ServerArgs`` CLI under ``root`` (the ``sglang`` package)."""
    srt = root / "srt"
    server_args = ast.parse((srt / "server_args.py").read_text())
    flags: list[Flag] = []
    parsed: dict[str, ast.Module] = {}
    for cls_name, module in _namespaces(server_args):
        path = srt / "arg_groups" / "fields" / f"{module}.py"
        tree = parsed.setdefault(module, ast.parse(path.read_text()))
        classes = _classes(tree)
        if cls_name not in classes:
            raise SourceError(f"{path}: no class {cls_name}")
        flags += _class_flags(classes[cls_name], classes, f"fields/{module}.py")
    flags += _manual_flags(server_args)
    seen: dict[str, str] = {}
    for flag in flags:
        for option in flag.options:
            if option in seen:
                raise SourceError(f"{option} is registered twice ({seen[option]}, {flag.dest})")
            seen[option] = flag.dest
    return flags


def version_of(root: Path) -> str:
    """``__version__`` of the wheel (``_version.py``, written by its build)."""
    tree = ast.parse((root / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(_literal(node.value, "_version.py"))
    raise SourceError("_version.py: no __version__")


HEADER = '''"""The command-line flags of SGLang {version}'s ``ServerArgs``: what ``sglang serve``
and ``python -m sglang.launch_server`` accept. Generated by ``scripts/sglang_server_args.py``
from SGLang {version}'s source; do not edit (re-run the script on a new release).

``FLAGS`` maps every option string to ``(dest, nargs)``: the ``ServerArgs`` field it sets and
how many values follow it, as argparse counts them: ``0`` for a switch, ``None`` for exactly
one value, ``"?"``, ``"*"`` or ``"+"``. Aliases (``--model`` for ``--model-path``) and the
``--no-...`` spellings of boolean-optional flags are entries of their own. ``-h`` / ``--help``
are argparse's and not listed. SGLang's parser keeps argparse's ``allow_abbrev``: an
unambiguous prefix of a long option (``--weight-vers``) is accepted as that option.
"""

from __future__ import annotations

SGLANG_VERSION = {version_literal}

FLAGS: dict[str, tuple[str, int | str | None]] = '''


def render(flags: list[Flag], version: str) -> str:
    """The module's text: the header, then one ``FLAGS`` line per option, sorted."""
    table = sorted((option, f.dest, f.nargs) for f in flags for option in f.options)
    lines = ["{"]
    for option, dest, nargs in table:
        count = json.dumps(nargs) if isinstance(nargs, str) else repr(nargs)
        key, value = json.dumps(option), json.dumps(dest)
        line = f"    {key}: ({value}, {count}),"
        if len(line) > 100:  # as ruff formats it
            line = f"    {key}: (\n        {value},\n        {count},\n    ),"
        lines.append(line)
    lines.append("}")
    header = HEADER.format(version=version, version_literal=json.dumps(version))
    return header + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the unpacked sglang package (holds srt/)")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render(extract(args.root), version_of(args.root))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date; re-run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
