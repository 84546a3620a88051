"""The one command-line convention of every entry point.

An entry point has one frozen dataclass of defaults (the service: its pydantic settings
class). Every field is a dashed flag typed by its annotation: ``batch_size: int`` is
``--batch-size N``, ``dims: int | None`` an optional int, ``x: list[str]`` takes several
values, a ``Literal`` gives the choices. A bool field is ``--name [true|false|1|0|yes|no]``
(bare: true) or ``--no-name``. Where there are presets, ``--preset NAME`` picks one and the
config is built from the preset's values, then the flags given on the command line. A flag
that names no field, or a value of the wrong type or outside the choices, is a usage error
(exit 2) that names it.

    parser = build_parser(Config, prog="python -m x", presets=PRESETS, default_preset="cpu")
    cfg = parse(parser, make_config, argv)  # make_config(preset=..., **flags_given)

Every parser also takes ``--log-level debug|info|warning|error`` (default info), and every
entry point runs its body through ``main``: the project's own loggers log at that level and
other libraries' only from WARNING up; an error the user can fix (bad data, a bad value, a
missing file, a locked index) ends the run with one line ``error: ...`` on stderr and exit
status 2, with the traceback only under ``--log-level debug``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["LOG_LEVELS", "UserError", "parse_bool", "build_parser", "parse", "build",
           "setup_logging", "main"]

T = TypeVar("T")
LOG_LEVELS = ("debug", "info", "warning", "error")
# The loggers that follow --log-level; every other library logs from WARNING up.
OWN_LOGGERS = ("training", "index", "service", "benchmarks", "__main__")


class UserError(Exception):
    """An error the user can fix, whose message names the thing and the fix: ``main``
    reports it in one line. ValueError and OSError are treated the same way."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error: ``error: MESSAGE (PROG --help ...)``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} --help lists the flags)\n")


BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_bool(text: str) -> bool:
    """true/false, 1/0, yes/no (any case); anything else is an error naming it."""
    try:
        return BOOLS[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected one of {'/'.join(BOOLS)}, got {text!r}") from None


def _fields(cls) -> list[tuple[str, Any, Any, str]]:
    """(name, annotation, default, help) of a dataclass's or a pydantic model's fields."""
    if dataclasses.is_dataclass(cls):
        hints = get_type_hints(cls)
        return [(f.name, hints[f.name],
                 f.default_factory() if f.default is dataclasses.MISSING else f.default, "")
                for f in dataclasses.fields(cls)]
    prefix = cls.model_config.get("env_prefix", "")
    return [(name, f.annotation, f.get_default(call_default_factory=True),
             "; ".join(filter(None, [f.description, prefix and f"env {prefix}{name.upper()}"])))
            for name, f in cls.model_fields.items()]


def _optional(tp) -> Any:
    """X of ``X | None``, else tp."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _describe(preset) -> str:
    """One line for a preset: its docstring's first paragraph (a function of something) or
    its values (nested tables in parentheses)."""
    if callable(preset):
        return " ".join((preset.__doc__ or preset.__name__).strip().split("\n\n")[0].split())
    if not preset:
        return "the defaults"
    return ", ".join(f"{k}: ({_describe(v)})" if isinstance(v, Mapping) else f"{k}={v!r}"
                     for k, v in preset.items())


def build_parser(
    cls,
    *,
    prog: str,
    description: str | None = None,
    presets: Mapping[str, Any] | None = None,
    default_preset: str | None = None,
    choices: Mapping[str, Sequence] | None = None,
    required: Sequence[str] = (),
    positional: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """A parser with one flag per field of ``cls`` (a field named ``preset`` is the
    ``--preset`` flag), plus ``--preset`` when ``presets`` (name -> values, or a function
    of something the entry point knows) is given. ``choices``: allowed values per field;
    ``required``: fields that must be given; ``positional``: fields given without a flag.
    Only the flags on the command line end up in the parsed namespace."""
    choices = dict(choices or {})
    epilog = None
    if presets:
        epilog = "presets (applied before the flags):\n" + "\n".join(
            f"  {name}: {_describe(values)}" for name, values in presets.items())
    parser = _Parser(prog=prog, description=description, epilog=epilog, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    specs = _fields(cls)
    if "log_level" not in {spec[0] for spec in specs}:  # read by main() before parsing
        parser.add_argument("--log-level", dest="_log_level", choices=LOG_LEVELS,
                            default=argparse.SUPPRESS,
                            help="debug also shows tracebacks; default: info")
    for name in (*choices, *required, *positional):
        if name not in {spec[0] for spec in specs}:
            raise ValueError(f"{name!r} is not a field of {cls.__name__}")
    if presets:
        parser.add_argument("--preset", choices=list(presets), default=default_preset,
                            help=f"default: {default_preset}")
    for name, annotation, default, note in specs:
        if name == "preset":
            continue
        tp = _optional(annotation)
        kw: dict[str, Any] = {"default": argparse.SUPPRESS}
        if get_origin(tp) is Literal:
            kw["choices"], tp = list(get_args(tp)), type(get_args(tp)[0])
        if get_origin(tp) is list:
            kw["nargs"], tp = "*", get_args(tp)[0]
        if name in choices:
            kw["choices"] = list(choices[name])
        if tp is bool:
            kw.update(nargs="?", const=True, metavar="BOOL")
        elif tp not in (int, float, str, Path):
            raise TypeError(f"no command-line type for {cls.__name__}.{name}: {annotation!r}")
        kw["type"] = parse_bool if tp is bool else tp
        given = name in required or name in positional
        shown = "required" if given else f"default: {_show(default)}"
        kw["help"] = "; ".join(filter(None, [note, shown])).replace("%", "%%")
        if name in positional:
            parser.add_argument(name, **{k: v for k, v in kw.items() if k != "default"})
            continue
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, required=name in required, **kw)
        if tp is bool:
            parser.add_argument("--no-" + flag[2:], dest=name, action="store_false",
                                default=argparse.SUPPRESS, help=f"{flag} false")
    return parser


def parse(parser: argparse.ArgumentParser, make: Callable[..., T],
          argv: Sequence[str] | None = None) -> T:
    """``make(**given)`` for the flags given in ``argv`` (and ``preset`` where the parser
    has it); a ValueError from ``make`` (a bad value) becomes a usage error naming it."""
    given = vars(parser.parse_args(argv))
    given.pop("_log_level", None)  # read by main() from argv
    try:
        return make(**given)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def _matches(value, tp) -> bool:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in get_args(tp))
    if origin is Literal:
        return value in get_args(tp)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, get_args(tp)[0]) for v in value)
    if tp is type(None):
        return value is None
    if tp is float:  # an int is a fine float; a bool is neither
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def build(cls: type[T], *layers: Mapping[str, Any]) -> T:
    """``cls`` from its defaults and then each layer of field values in turn (a preset,
    then the flags); a name that is no field of ``cls`` or a value of the wrong type is a
    ValueError naming it."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for layer in layers:
        for name, value in layer.items():
            if name not in hints:
                raise ValueError(f"unknown config field {name!r}; known: {sorted(hints)}")
            if not _matches(value, hints[name]):
                kind = getattr(hints[name], "__name__", str(hints[name]))
                raise ValueError(f"{name} must be of type {kind}, got {value!r}")
            values[name] = value
    return cls(**values)


def setup_logging(level: str = "info") -> None:
    """The project's loggers at ``level``; every other library's from WARNING up (the ONNX
    exporter, Ray, matplotlib... stay out of the default output)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
    if level == "debug":
        logging.getLogger().setLevel(logging.DEBUG)


def log_level_of(argv: Sequence[str]) -> str:
    """The value of ``--log-level`` in ``argv`` (the last one given), else info."""
    level = "info"
    for i, arg in enumerate(argv):
        if arg == "--log-level" and i + 1 < len(argv):
            level = argv[i + 1]
        elif arg.startswith("--log-level="):
            level = arg.split("=", 1)[1]
    return level if level in LOG_LEVELS else "info"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{text}: {err.filename}"
    return text


def main(body: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run an entry point's ``body(argv)`` under the one convention: logging by
    ``--log-level``; a UserError, ValueError or OSError -> ``error: ...`` on stderr and exit
    status 2 (traceback under ``--log-level debug``); Ctrl-C -> exit 130. Returns the exit
    status (``body``'s, 0 when it returns None)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    level = log_level_of(argv)
    setup_logging(level)
    try:
        return int(body(argv) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError) as err:
        if level == "debug":
            traceback.print_exc()
        else:
            hint = " (--log-level debug shows the traceback)"
        print(f"error: {_one_line(err)}{'' if level == 'debug' else hint}", file=sys.stderr)
        return 2
