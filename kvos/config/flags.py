"""Command-line flags generated from configuration dataclasses: one flag per field, its default the
field's, its help and choices from the field's metadata."""
from __future__ import annotations

import argparse
import dataclasses
import typing


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from 'on', 'off')")
    return value == "on"


def engine_flags(f: dataclasses.Field) -> list[str]:
    """The option strings of an ``EngineConfig`` field: ``--field-name`` unless its metadata names a
    "flag", then its "aliases"."""
    return [f.metadata.get("flag", "--" + f.name.replace("_", "-")), *f.metadata.get("aliases", ())]


def engine_dest(f: dataclasses.Field) -> str:
    """The namespace attribute that holds an ``EngineConfig`` field's value (its name unless that
    would clash with another option, see ``seed``)."""
    return f.metadata.get("dest", f.name)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, generated from the fields (their metadata gives help,
    choices, the help group and any special spelling); defaults are the dataclass's."""
    from kvos.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        title = meta.get("group", "engine")
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"EngineConfig.{f.name} needs a default to have a CLI flag")
        kw: dict = {"dest": engine_dest(f), "default": default, "help": meta.get("help")}
        tp = hints[f.name]
        args = typing.get_args(tp)
        optional = type(None) in args
        base = next((t for t in args if t is not type(None)), None) if optional and len(args) == 2 else tp
        if base is bool and not optional:
            if default is not bool(meta.get("negate")):
                raise TypeError(f"EngineConfig.{f.name}: a bool flag needs default False (or True with "
                                f"metadata negate, a --no-... flag)")
            kw["action"] = "store_false" if meta.get("negate") else "store_true"
        elif base is bool:  # bool | None: on, off, or not given (None)
            kw.update(type=on_off, metavar="{on,off}")
        elif base in (int, float, str):
            kw["type"] = base
            if "choices" in meta:
                kw["choices"] = list(meta["choices"])
        else:
            raise TypeError(f"EngineConfig.{f.name}: no CLI flag for type {tp!r}")
        groups[title].add_argument(*engine_flags(f), **kw)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """``EngineConfig`` keyword arguments, every field, from flags added by ``add_engine_args``."""
    from kvos.config import EngineConfig

    return {f.name: getattr(a, engine_dest(f)) for f in dataclasses.fields(EngineConfig)}



def positive(tp: type) -> typing.Callable[[str], typing.Any]:
    """An argparse type: a positive ``tp``."""
    def parse(value: str):
        try:
            v = tp(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a {tp.__name__}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return v
    return parse
