"""One validated Config object from TOML plus `-o key=value` overrides.

Every key is declared once in `SCHEMA` with its type, default, allowed values and a one-line doc; the loader,
the `-o` parser, the README table (`tierfs config-doc`) and the redacted `/.tierfs/config` view all derive from it,
so a key cannot exist in one place and be missing in another.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping


class ConfigError(ValueError):
    """A configuration problem, worded for the operator: names the key, the value and what is allowed."""


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
               "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '512MiB', '10GB', '4k'."""
    if isinstance(value, bool):
        raise ValueError("not a size")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("not a size")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number")
    return float(value)


def _parse_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("not an integer")
    return int(value)


@dataclass(frozen=True)
class Key:
    """One configuration key: how to parse it, what it defaults to, and what is allowed."""

    name: str
    kind: str  # bool | int | float | size | str | path | choice
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    secret: bool = False

    def allowed(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        rng = ""
        if self.minimum is not None and self.maximum is not None:
            rng = f" from {self.minimum:g} to {self.maximum:g}"
        elif self.minimum is not None:
            rng = f" >= {self.minimum:g}"
        return {
            "bool": "true or false",
            "int": "an integer" + rng,
            "float": "a number" + rng,
            "size": "a byte size such as 1048576, '512MiB' or '10GB'" + rng,
            "str": "a string",
            "path": "an absolute path (or empty for the default)",
        }[self.kind]

    def parse(self, value: Any) -> Any:
        parsers: dict[str, Callable[[Any], Any]] = {
            "bool": _parse_bool, "int": _parse_int, "float": _parse_float, "size": parse_size,
            "str": str, "path": str, "choice": lambda v: str(v).strip().lower(),
        }
        try:
            out = parsers[self.kind](value)
        except (TypeError, ValueError):
            raise self.error(value) from None
        if self.kind == "choice" and out not in self.choices:
            raise self.error(value)
        if self.kind == "path" and out and not out.startswith("/"):
            raise self.error(value)
        if self.minimum is not None and out < self.minimum:
            raise self.error(value)
        if self.maximum is not None and out > self.maximum:
            raise self.error(value)
        return out

    def error(self, value: Any) -> ConfigError:
        shown = "<redacted>" if self.secret else repr(value)
        return ConfigError(f"config key '{self.name}': invalid value {shown}; allowed: {self.allowed()} "
                           f"(default {self.default!r})")


SCHEMA: tuple[Key, ...] = (
    # --- mount: the FUSE front ---------------------------------------------------------------------
    Key("mount.allow_other", "bool", False,
        "Let users other than the mounting one access the store (FUSE allow_other). Off: only the owner sees it."),
    Key("mount.writeback_cache", "bool", True,
        "Kernel writeback cache: coalesces small and mmap writes into large WRITEs. Keep on for broker speed."),
    Key("mount.max_tasks", "int", 32, "Most FUSE requests handled concurrently by the daemon.",
        minimum=1, maximum=1024),
    Key("mount.attr_timeout", "float", 1.0, "Seconds the kernel may cache file attributes and names.",
        minimum=0, maximum=3600),
    Key("mount.read_ahead_kb", "int", 1024,
        "Kernel read-ahead of the mount (set through /sys/class/bdi after mounting; 0 keeps the kernel's).",
        minimum=0, maximum=65536),
    Key("mount.max_background", "int", 64,
        "FUSE max_background requests (fusectl; 0 keeps the kernel's). Higher lets more read-ahead overlap.",
        minimum=0, maximum=65535),
    Key("mount.log_file", "path", "", "Daemon log file. Empty: HOT_DIR/.tierfs/tierfs.log."),
    Key("mount.log_level", "choice", "info", "Daemon log level.",
        choices=("debug", "info", "warning", "error")),
    # --- statfs: what the broker is told about capacity ------------------------------------------
    Key("statfs.capacity_bytes", "size", 0,
        "Capacity reported by statfs (the broker's disk-ratio retention reads it). 0: the hot dir's own size.",
        minimum=0),
)

_BY_NAME = {k.name: k for k in SCHEMA}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, value in tree.items():
        full = f"{prefix}{name}"
        if isinstance(value, Mapping):
            yield from _flatten(value, full + ".")
        else:
            yield full, value


def _suggest(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
    return f" Did you mean '{close[0]}'?" if close else " Known keys are listed in README.md (Configuration)."


class Config:
    """Effective configuration: defaults, then the TOML file, then `-o` overrides, all validated."""

    def __init__(self, values: Mapping[str, Any] | None = None, source: str = "defaults"):
        self._values: dict[str, Any] = {k.name: k.default for k in SCHEMA}
        self.source = source
        for name, raw in (values or {}).items():
            self.set(name, raw)

    def set(self, name: str, raw: Any) -> None:
        key = _BY_NAME.get(name)
        if key is None:
            raise ConfigError(f"unknown config key '{name}'.{_suggest(name)}")
        self._values[name] = key.parse(raw)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def as_dict(self, redact: bool = True) -> dict[str, Any]:
        return {k.name: ("<redacted>" if (redact and k.secret and self._values[k.name]) else self._values[k.name])
                for k in SCHEMA}

    def render_toml(self, redact: bool = True) -> str:
        """The effective configuration as TOML, grouped by section (what /.tierfs/config shows)."""
        lines: list[str] = [f"# effective configuration (source: {self.source})"]
        section = None
        for name, value in self.as_dict(redact).items():
            sec, _, leaf = name.rpartition(".")
            if sec != section:
                lines.append(f"\n[{sec}]")
                section = sec
            lines.append(f"{leaf} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: str | None = None, overrides: Iterable[str] = ()) -> "Config":
        cfg = cls(source=path or "defaults")
        if path:
            try:
                tree = tomllib.loads(Path(path).read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file {path!r} does not exist; pass an existing TOML file to --config") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
            for name, value in _flatten(tree):
                cfg.set(name, value)
        for item in overrides:
            for name, value in parse_overrides(item).items():
                cfg.set(name, value)
        return cfg


def parse_overrides(text: str) -> dict[str, str]:
    """`a.b=1,c.d=x` -> {'a.b': '1', 'c.d': 'x'}. A bare word is refused: every override names its key."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"option '{part}' has no value; write it as -o {part}=VALUE")
        out[name.strip()] = value.strip()
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def schema_markdown() -> str:
    """The README configuration table, generated so docs and code cannot drift."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for k in SCHEMA:
        rows.append(f"| `{k.name}` | `{_toml_value(k.default)}` | {k.allowed()} | {k.doc} |")
    return "\n".join(rows)
