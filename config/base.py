"""StageConfig, the base of every stage's config: its JSON round trip (saved beside what the stage made), and the
command line that makes it again (what `dflash run` passes the stage it starts)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["StageConfig"]


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """Base of the stage configs: JSON round trip and a stable identity."""

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain JSON-able values (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_json(self) -> str:
        """Return the config as indented, key-sorted JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build the config from `to_dict` output; unknown keys are refused by name."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; allowed: {sorted(names)}")
        kwargs = {}
        for key, value in data.items():
            if isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)

    def to_argv(self) -> list[str]:
        """Return the command-line flags that make this config (what `dflash run` passes the stage it starts)."""
        from .options import flag_name

        out: list[str] = []
        for f in dataclasses.fields(self):
            value, flag = getattr(self, f.name), "--" + flag_name(f).replace("_", "-")
            if f.type == "bool":
                out += [flag] if value else []
            elif value is None:
                continue
            elif isinstance(value, dict):
                out += [flag, json.dumps(value, sort_keys=True)]
            elif isinstance(value, tuple) and str(f.type).startswith("tuple[str"):
                for v in value:
                    out += [flag, str(v)]
            elif isinstance(value, tuple):
                out += [flag, ",".join(str(v) for v in value)]
            else:
                out += [flag, str(value)]
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as JSON, atomically (temp file, fsync, rename)."""
        from ..runtime.atomic import write_atomic

        write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a config written by `save`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {cls.__name__} from {os.fspath(path)}: {e}") from None
        return cls.from_dict(data)
