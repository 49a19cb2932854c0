"""Command-line flags generated from configuration dataclasses: one flag per field, its default the
field's, its help and choices from the field's metadata."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from 'on', 'off')")
    return value == "on"


def field_flags(f: dataclasses.Field, spell: str | None = None) -> list[str]:
    """The option strings of a config field: ``spell`` if given (a command's own spelling), else
    ``--field-name`` unless its metadata names a "flag"; then its "aliases"."""
    return [spell or f.metadata.get("flag", "--" + f.name.replace("_", "-")), *f.metadata.get("aliases", ())]


def field_dest(f: dataclasses.Field) -> str:
    """The namespace attribute that holds a config field's value (its name unless that would
    clash with another option, see ``EngineConfig.seed``)."""
    return f.metadata.get("dest", f.name)


def field_default(cls: type, f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{cls.__name__}.{f.name} needs a default to have a CLI flag")


def field_choices(f: dataclasses.Field) -> list | None:
    """A field's "choices" metadata as a list: a tuple, a registry (its names, read now) or a
    function returning names."""
    choices = f.metadata.get("choices")
    if choices is None:
        return None
    return list(choices() if callable(choices) else choices)


def config_fields(cls: type, only: Iterable[str] | None = None) -> list[dataclasses.Field]:
    """``cls``'s fields, or those named in ``only`` (in ``only``'s order; an unknown name is a
    TypeError)."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if only is None:
        return list(by_name.values())
    missing = [n for n in only if n not in by_name]
    if missing:
        raise TypeError(f"{cls.__name__} has no fields {missing}")
    return [by_name[n] for n in only]


def add_config_args(p: argparse.ArgumentParser, cls: type, only: Iterable[str] | None = None,
                    title: str = "engine", spell: dict[str, str] | None = None,
                    choices: dict[str, Iterable[str]] | None = None) -> None:
    """One flag per field of the dataclass ``cls`` (or of the fields in ``only``), generated from
    the fields: the default is the field's, the metadata gives "help", "choices", "metavar", a
    "type" (a parser for any other type), the help group ("group", else ``title``) and any special
    spelling ("flag", "aliases", "dest", "negate": a ``--no-...`` flag for a bool that defaults
    on). ``spell`` and ``choices`` map field names to a command's own spelling and choices (the
    simulator's eviction policies include the offline one)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in config_fields(cls, only):
        meta = f.metadata
        group = meta.get("group", title)
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        default = field_default(cls, f)
        kw: dict = {"dest": field_dest(f), "default": default, "help": meta.get("help")}
        tp = hints[f.name]
        args = typing.get_args(tp)
        optional = type(None) in args
        base = next((t for t in args if t is not type(None)), None) if optional and len(args) == 2 else tp
        if "type" in meta:
            kw["type"] = meta["type"]
        elif base is bool and not optional:
            if default is not bool(meta.get("negate")):
                raise TypeError(f"{cls.__name__}.{f.name}: a bool flag needs default False (or True with "
                                f"metadata negate, a --no-... flag)")
            kw["action"] = "store_false" if meta.get("negate") else "store_true"
        elif base is bool:  # bool | None: on, off, or not given (None)
            kw.update(type=on_off, metavar="{on,off}")
        elif base in (int, float, str):
            kw["type"] = base
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no CLI flag for type {tp!r} (give metadata 'type')")
        allowed = list((choices or {}).get(f.name, ())) or field_choices(f)
        if allowed is not None and "action" not in kw:
            kw["choices"] = allowed
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        groups[group].add_argument(*field_flags(f, (spell or {}).get(f.name)), **kw)


def config_kwargs(a: argparse.Namespace, cls: type, only: Iterable[str] | None = None) -> dict:
    """Keyword arguments of ``cls`` (the fields in ``only``, else every field) from flags added by
    ``add_config_args``."""
    return {f.name: getattr(a, field_dest(f)) for f in config_fields(cls, only)}


def add_engine_args(p: argparse.ArgumentParser, only: Iterable[str] | None = None, **kw) -> None:
    """``add_config_args`` for ``EngineConfig`` (every field unless ``only``)."""
    from kvos.config.engine import EngineConfig

    add_config_args(p, EngineConfig, only, **kw)


def engine_kwargs(a: argparse.Namespace, only: Iterable[str] | None = None) -> dict:
    """``EngineConfig`` keyword arguments, every field (or those in ``only``), from flags added by
    ``add_engine_args``."""
    from kvos.config.engine import EngineConfig

    return config_kwargs(a, EngineConfig, only)


def positive(tp: type, zero: bool = False) -> typing.Callable[[str], typing.Any]:
    """An argparse type: a positive ``tp`` (``zero``: or 0)."""
    def parse(value: str):
        try:
            v = tp(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a {tp.__name__}") from None
        if not (v > 0 or zero and v == 0):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else 'positive'}, got {value}")
        return v
    return parse


def non_negative(tp: type) -> typing.Callable[[str], typing.Any]:
    """An argparse type: a ``tp`` >= 0."""
    return positive(tp, zero=True)
