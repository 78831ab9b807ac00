"""The click layer of the configs: each dataclass field becomes an option (with its old names as hidden aliases),
`--config FILE` supplies defaults from YAML, TOML or JSON, and make_config turns parsed options into a frozen config."""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import click

from ..errors import ConfigError
from .aliases import alias_key, deprecated, warn_alias, with_alias
from .options import flag_name

__all__ = ["config_option", "config_options", "make_config"]


def _read_config_file(path: str) -> dict[str, Any]:
    """Return the mapping in a YAML, TOML or JSON file of command defaults."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read the file ({e.strerror})") from None
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
        elif ext == ".json":
            data = json.loads(raw)
        elif ext in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw)
        else:
            raise ConfigError(f"--config {path}: expected a .yaml, .yml, .toml or .json file, found {ext or 'no'} extension")
    except ConfigError:
        raise
    except Exception as e:  # the parsers' own error types differ; all mean the same to the user
        raise ConfigError(f"--config {path}: not valid {ext[1:].upper()}: {e}".replace("\n", " ")) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values, found {type(data).__name__}")
    return data


def _apply_config_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager callback: load the file into the command's default_map so command-line flags still win."""
    if not value:
        return value
    data = _read_config_file(value)
    # A file may hold one section per command ({extract: {...}, train: {...}}) or the command's options directly.
    cmd_name = ctx.command.name
    if cmd_name in data and isinstance(data[cmd_name], dict):
        data = data[cmd_name]
    params = [p for p in ctx.command.params if p.name and p.name != "config" and not getattr(p, "hidden", False)]
    # A key is an option's name (tree-tau-nodes) or, deprecated, the name it had before (tree-budgets: the
    # parameter's name, which is its config field's).
    flags = {o.lstrip("-").replace("-", "_"): p for p in params for o in p.opts if o.startswith("--")}
    known = {**{p.name: p for p in params}, **flags}
    defaults: dict[str, Any] = {}
    for key, val in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"--config {value}: `dflash {cmd_name}` has no option {key!r}; "
                f"allowed: {', '.join(sorted(n.replace('_', '-') for n in flags))}"
            )
        param = known[name]
        if name not in flags:
            deprecated(f"{key!r} in --config {value}", param.opts[0].lstrip("-"))
        if isinstance(val, list) and not param.multiple and not param.nargs != 1:
            val = ",".join(str(v) for v in val)
        defaults[param.name] = val
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def config_option(f):
    """Add `--config FILE` (YAML, TOML or JSON defaults for this command's options; flags win)."""
    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=_apply_config_file,
        help="YAML, TOML or JSON file of defaults for this command's options; command-line flags win.",
    )(f)


_CLICK_TYPES = {"int": int, "float": float, "str": str}


def _click_type(field: Any) -> Any:
    """Return the click type of a config field from its annotation (with `from __future__ import annotations`,
    a string such as "int | None" or "tuple[str, ...]")."""
    if field.metadata.get("choices"):
        return click.Choice(list(field.metadata["choices"]))
    if field.metadata.get("parse"):
        return str
    base = str(field.type).replace(" | None", "")
    return _CLICK_TYPES.get(base, str)


class _RequiredUnless(click.Option):
    """A required option that another one, when given, waives (--prompts unless --self-prompts)."""

    def __init__(self, *args: Any, unless: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.unless = unless

    def handle_parse_result(self, ctx: click.Context, opts: Any, args: list[str]) -> Any:
        waived = opts.get(self.unless) is not None or (ctx.default_map or {}).get(self.unless) is not None
        self.required = not waived
        try:
            return super().handle_parse_result(ctx, opts, args)
        finally:
            self.required = True


def config_options(cls: type, *, skip: tuple[str, ...] = (), names: dict[str, str] | None = None) -> Callable:
    """Add one click option per field of a stage config, with the default, choices and help its metadata holds.

    names: only these fields, each under its given option name ({field: name}), as `dflash run` takes them.
    """
    import dataclasses

    def decorate(f: Callable) -> Callable:
        for field in reversed([x for x in dataclasses.fields(cls) if x.name not in skip
                               and (names is None or x.name in names)]):
            meta = field.metadata
            key = (names or {}).get(field.name, field.name)  # the parameter's name: make_config's key
            prefix = key[: -len(field.name)] if key.endswith(field.name) else ""  # `dflash run`'s train_ / extract_
            name = "--" + (prefix + flag_name(field)).replace("_", "-")
            required = field.default is dataclasses.MISSING
            kw: dict[str, Any] = {"help": meta.get("help"), "metavar": meta.get("metavar")}
            if field.type == "bool":
                kw.update(is_flag=True, default=False)
            elif str(field.type).startswith("tuple[str"):
                kw.update(multiple=True, required=required, type=str)
                if not required:
                    kw.update(default=field.default)
            else:
                kw.update(type=_click_type(field), required=required)
                if not required:  # a required option given a default (even None) would no longer be required first
                    default = meta.get("cli_default") or field.default
                    kw.update(default=default, show_default=default is not None)
            if meta.get("unless"):
                kw.update(cls=_RequiredUnless, unless=meta["unless"])
            f = click.option(name, key, **kw)(f)
            for alias in meta.get("aliases", ()):
                f = click.option("--" + (prefix + alias).replace("_", "-"), alias_key(key, alias), hidden=True,
                                 default=None, type=kw.get("type", str), metavar=kw.get("metavar"),
                                 callback=warn_alias(name))(f)
        return f

    return decorate


def make_config(cls: type, opts: dict[str, Any], names: dict[str, str] | None = None, **fixed: Any) -> Any:
    """Return the stage config of a command's parsed options: text parsed where a field says so, lists as tuples.

    names: {field: option name} where they differ (`dflash run`); fixed: field values given as they are.
    """
    import dataclasses

    from .. import config as config_mod

    values = dict(fixed)
    for field in dataclasses.fields(cls):
        key = (names or {}).get(field.name, field.name)
        if field.name in fixed or key not in opts:
            continue
        value = with_alias(field, key, opts)
        if field.metadata.get("parse"):
            value = getattr(config_mod, field.metadata["parse"])(value)
        elif isinstance(value, list):
            value = tuple(value)
        values[field.name] = value
    return cls(**values)
