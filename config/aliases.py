"""Former option names: each config field may list the names its option had (`option(aliases=...)`); the command
line takes them as hidden options that print one deprecation line, and `with_alias` hands their value to the field."""
from __future__ import annotations

from typing import Any, Callable

import click

from ..errors import ConfigError
from .options import flag_name

__all__ = ["alias_key", "deprecated", "warn_alias", "with_alias"]


def alias_key(key: str, alias: str) -> str:
    """Return the parameter name of an option's deprecated spelling (tree_budgets__was_tree_budgets)."""
    return f"{key}__was_{alias}"


def deprecated(what: str, now: str) -> None:
    """Print the one deprecation line of a former option name."""
    click.echo(f"dflash: warning: {what} is deprecated, use --{now} (same values); the old name goes away in a "
               "later release", err=True)


def warn_alias(now: str) -> Callable:
    """Return the callback of a deprecated spelling of option `now`: one line when it is given."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT:
            deprecated(param.opts[0], now.lstrip("-"))
        return value

    return callback


def with_alias(field: Any, key: str, opts: dict[str, Any]) -> Any:
    """Return the option's value, or its deprecated spelling's where only that was given (both given: refused)."""
    value = opts[key]
    for alias in field.metadata.get("aliases", ()):
        old = opts.get(alias_key(key, alias))
        if old is None:
            continue
        ctx = click.get_current_context(silent=True)
        source = ctx.get_parameter_source(key) if ctx else None
        if source not in (None, click.core.ParameterSource.DEFAULT):
            raise ConfigError(f"--{alias.replace('_', '-')} {old} and --{flag_name(field).replace('_', '-')} "
                              f"{value if not isinstance(value, tuple) else ','.join(map(str, value))}: the first "
                              "is the deprecated name of the second; pass only the second")
        value = old
    return value
