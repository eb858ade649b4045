"""The suite's config-parsing toolkit: what every settings type (training, evaluation, sweep specs,
pre-training) reads its input through, so each rule is written once.

- `read_yaml(path)` / `load_yaml(text, source)`: bounded YAML — at most `MAX_YAML_BYTES` of UTF-8
  text and `MAX_YAML_NODES` values once aliases are expanded (a "billion laughs" document of a few
  hundred bytes is refused before anything is built from it or written), no recursive aliases; every
  failure one line naming the file (and line where YAML gives one).
- `Fail`: `fail(key, msg)` raises ValueError("<source>: <key>: <msg>"); its methods check one value.
- `parse_section(cls, raw, key, fail)`: one mapping into a dataclass through jsonargparse (unknown and
  missing keys, types: errors name the key).
- `apply_overrides`: the one dotted-override rule; `parse_sets`: `--set KEY=VALUE` flags; `CONFIG_DIR`:
  the folder of the shipped YAML configs (training and pre-training).
- `key_sources(argv, known, hint)` / `blame(message, source, sources)`: where each key of a command
  line was set (a `--config` file or a flag), so a check's error names that file or flag.
- The class allow-list: `check_class_paths` refuses a `class_path` (or a dotted name where Lightning
  takes an object) outside `ALLOWED_CLASSES`, on the raw mapping, before anything is parsed, so the
  module it names is never imported; `check_cli_class_paths` does it for a command line: every
  `--config` value, a file or an inline YAML string alike, and every `--key value` flag.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The shipped YAML configs (training and pre-training), named by their stem."""
MAX_YAML_BYTES = 1 << 20
"""A config or sweep spec larger than this (1 MiB) is refused unread: the suite's largest is ~10 KB."""
MAX_YAML_NODES = 100_000
"""Values in a YAML document with its aliases expanded; more is refused (alias bombs)."""

#: Lightning's own profilers, strategies and accelerators, by full path or class name. Any other name
#: is refused before anything is parsed, so no module it names is imported (`check_class_paths`).
ALLOWED_CLASSES = frozenset({
    "lightning.pytorch.profilers.SimpleProfiler", "lightning.pytorch.profilers.AdvancedProfiler",
    "lightning.pytorch.profilers.PyTorchProfiler", "lightning.pytorch.strategies.SingleDeviceStrategy",
    "lightning.pytorch.strategies.DDPStrategy", "lightning.pytorch.strategies.FSDPStrategy",
    "lightning.pytorch.strategies.DeepSpeedStrategy", "lightning.pytorch.accelerators.CPUAccelerator",
    "lightning.pytorch.accelerators.CUDAAccelerator", "lightning.pytorch.accelerators.MPSAccelerator",
})  # fmt: skip


class Fail:
    """`fail(key, msg)` raises ValueError("<source>: <key>: <msg>"); the methods check one value.
    A config with another message layout (the sweep spec's) overrides `__call__`."""

    def __init__(self, source: str):
        self.source = source

    def __call__(self, key: str, msg: str) -> None:
        raise ValueError(f"{self.source}: {key}: {msg}")

    def integer(self, key: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
        if not is_integer(v):
            self(key, f"expected an integer, got {v!r}")
        if lo is not None and v < lo or hi is not None and v > hi:
            self(
                key,
                f"{v} out of range; expected {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}",
            )
        return v

    def number(self, key: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
        if not is_number(v):
            self(key, f"expected a number, got {v!r}")
        if lo is not None and not v >= lo or hi is not None and not v <= hi:  # a NaN lies in no range
            self(
                key,
                f"{float(v)} out of range; expected {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}",
            )
        return float(v)

    def choice(self, key: str, v: Any, choices: tuple) -> Any:
        if v not in choices:
            self(key, f"{v!r} is not one of {list(choices)}")
        return v

    def text(self, key: str, v: Any) -> str:
        if not isinstance(v, str) or not v:
            self(key, f"expected a non-empty string, got {v!r}")
        return v


def is_integer(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def docstring_settings() -> None:
    """jsonargparse reads attribute docstrings (they become --help text)."""
    from jsonargparse import set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)


_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def _allowed_class(name: Any) -> bool:
    return isinstance(name, str) and (
        name in ALLOWED_CLASSES or any(c.rsplit(".", 1)[1] == name for c in ALLOWED_CLASSES)
    )


def check_class_paths(raw: Any, fail: Fail, key: str = "") -> None:
    """Refuse, through `fail(<key>, msg)`, a class a raw config names outside ALLOWED_CLASSES: a
    `class_path` anywhere, or a dotted name as a value in a trainer section (jsonargparse imports
    either to build the object). Run on the raw mapping before it is parsed, so nothing is imported."""
    if isinstance(raw, dict):
        for k, v in raw.items():
            where = f"{key}.{k}" if key else str(k)
            named = (
                v
                if k == "class_path"
                else (
                    v
                    if "trainer" in where.split(".")[:-1] and isinstance(v, str) and _DOTTED.match(v)
                    else None
                )
            )
            if named is not None and not _allowed_class(named):
                fail(
                    where,
                    f"{named!r} is not a class the suite loads (allowed: Lightning's {sorted(ALLOWED_CLASSES)}, "
                    "or their class names); nothing was imported",
                )
            check_class_paths(v, fail, where)
    elif isinstance(raw, list):
        for i, v in enumerate(raw):
            check_class_paths(v, fail, f"{key}[{i}]")


def check_cli_class_paths(argv: list[str]) -> None:
    """`check_class_paths` on a command line (its --config files and --key value flags), before it is parsed."""
    raw: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token in ("-h", "--help"):
            continue
        name, eq, value = token.lstrip("-").partition("=")
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                continue
            value, i = argv[i], i + 1
        if name in ("c", "config"):
            # jsonargparse reads a --config value that is not a file as inline YAML: both are checked
            p, file = Path(value), is_file(value)
            raw_config = read_yaml(p) if file else load_yaml(value, "--config (inline)")
            check_class_paths(raw_config, Fail(str(p) if file else "--config (inline)"))
            continue
        try:
            parsed = load_yaml(value, f"--{name}")
        except ValueError:
            parsed = value
        raw = apply_overrides(raw, {name: parsed})
    check_class_paths(raw, Fail("<command line>"))


def one_line(err: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(err).split())


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any], *, merge: bool = True) -> dict[str, Any]:
    """A copy of `base` with `overrides` applied: the one override rule of the suite's configs.

    A dotted key ("model.rank", "space.slices") sets the value at its path, replacing what was there;
    a mapping given under a plain key ({"model": {"rank": 8}}) is merged into the mapping there, key
    by key, by the same rule — unless `merge` is False (a sweep spec's `--set`: KEY names the whole
    value it replaces, e.g. `--set space={...}` is the new space, not a slice added to the old)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        last = parts[-1]
        if merge and len(parts) == 1 and isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = apply_overrides(node[last], value)
        else:
            node[last] = copy.deepcopy(value)
    return out


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` flags -> {dotted key: YAML value} (for `apply_overrides`); ValueError on a bad flag."""
    out: dict[str, Any] = {}
    for kv in pairs:
        if "=" not in kv:
            raise ValueError(f"--set {kv!r}: expected KEY=VALUE")
        k, v = kv.split("=", 1)
        try:
            out[k] = load_yaml(v, f"--set {k}")
        except ValueError as err:
            raise ValueError(f"--set {kv!r}: the value is not valid YAML ({err})") from None
    return out


@functools.cache
def _section_parser(cls: type) -> Any:
    from jsonargparse import ArgumentParser

    docstring_settings()
    p = ArgumentParser(exit_on_error=False)
    p.add_class_arguments(cls)
    return p


def parse_section(cls: type, raw: Any, key: str, fail: Fail) -> Any:
    """One config section (a mapping) -> a `cls` dataclass, its types checked by jsonargparse.

    Errors go through `fail(<key>.<field>, msg)`: a section that is not a mapping, an unknown key
    (with the allowed ones), a missing required key, a value of the wrong type. A scalar given for a
    tuple field is read as a one-element list. Bounds are the dataclass's own `check`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        fail(key, f"expected a mapping, got {type(raw).__name__}")
    prefix = f"{key}." if key else ""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in fields:
            fail(f"{prefix}{k}", f"unknown key; expected one of {sorted(fields)}")
    for name, f in fields.items():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in raw:
            fail(f"{prefix}{name}", "missing (required)")
    raw = {k: [v] if _is_tuple(fields[k]) and not isinstance(v, (list, tuple)) else v for k, v in raw.items()}
    try:
        ns = _section_parser(cls).parse_object(raw)
    except Exception as err:  # noqa: BLE001 (jsonargparse's ArgumentError: 'Parser key "x": ...')
        msg = one_line(err)
        m = re.match(r'Parser key "([^"]+)": (.*)', msg)
        fail(f"{prefix}{m.group(1)}" if m else key, m.group(2) if m else msg)
    return cls(**ns.as_dict())


def _is_tuple(f: dataclasses.Field) -> bool:
    return str(f.type).startswith(("tuple", "typing.Tuple"))


def load_yaml(text: str, source: str) -> Any:
    """`text` (YAML) -> Python values, bounded (module docstring); ValueError "<source>[:line]: ..."."""
    if len(text) > MAX_YAML_BYTES:
        raise ValueError(f"{source}: {len(text)} characters of YAML; expected at most {MAX_YAML_BYTES}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise ValueError(
            f"{where}: not valid YAML ({getattr(err, 'problem', None) or one_line(err)})"
        ) from None
    except RecursionError:
        raise ValueError(f"{source}: YAML nested too deeply") from None
    _check_expanded_size(value, source)
    return value


def is_file(path: str | Path) -> bool:
    """`Path.is_file`, False for a value no file can be named (too long, a NUL byte) instead of raising."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def read_yaml(path: str | Path, what: str = "config") -> Any:
    """A YAML file -> Python values: a regular file of at most MAX_YAML_BYTES, UTF-8, bounded by
    `load_yaml`; ValueError with one line naming the file."""
    p = Path(path)
    if not is_file(p):
        raise ValueError(f"{p}: no such {what} file")
    size = p.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{p}: {size} bytes; a {what} file of at most {MAX_YAML_BYTES} bytes expected")
    data = p.read_bytes()[: MAX_YAML_BYTES + 1]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{p}: not valid UTF-8 ({err.reason} at byte {err.start}); a {what} file is UTF-8 YAML"
        ) from None
    return load_yaml(text, str(p))


def _check_expanded_size(value: Any, source: str) -> None:
    """Count the values `value` holds with shared (aliased) parts counted at every use, without
    expanding them (memoised by identity); refuse more than MAX_YAML_NODES and recursive aliases."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(v: Any) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        key = id(v)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ValueError(f"{source}: a recursive YAML alias (a value that contains itself)")
        active.add(key)
        children = [*v.keys(), *v.values()] if isinstance(v, dict) else v
        n = 1
        for c in children:
            n += size(c)
            if n > MAX_YAML_NODES:
                raise ValueError(
                    f"{source}: more than {MAX_YAML_NODES} values once its aliases are expanded "
                    "(an alias bomb?); expected a plain config"
                )
        active.discard(key)
        sizes[key] = n
        return n

    size(value)


def key_sources(
    argv: list[str], known: dict[str, Any], hint: str, skip: tuple[str, ...] = ()
) -> dict[str, str]:
    """Where each key of a command line was set last: `<file>` or `--key (command line)`. `known` is
    the parser's defaults as a dict (sections are dicts); `hint` ends an unknown-key message (e.g.
    "python -m experiments.train fit --help lists the options"); `skip`: tokens that are no flags
    (a subcommand).

    Each --config file is read here first, so malformed YAML names its file and line and an unknown
    key names the file that holds it (jsonargparse names neither)."""
    sources: dict[str, str] = {}
    args = [a for a in argv if a not in skip]
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            path = Path(args[i + 1])
        elif arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
        else:
            if arg.startswith("--") and not arg.startswith("--config"):
                sources[arg[2:].split("=", 1)[0]] = f"{arg.split('=', 1)[0]} (command line)"
            continue
        if not is_file(path):
            continue  # the parser says so (or reads it as inline YAML)
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of {sorted(known)}")
        for section, body in raw.items():
            if section not in known:
                raise ValueError(f"{path}: unknown key {section!r}; expected one of {sorted(known)}")
            if isinstance(known[section], dict):
                if not isinstance(body, dict):
                    raise ValueError(f"{path}: {section}: expected a mapping")
                for key in body:
                    if key not in known[section]:
                        raise ValueError(f"{path}: unknown key {section}.{key} ({hint})")
                    sources[f"{section}.{key}"] = str(path)
            else:
                sources[section] = str(path)
    return sources


def blame(message: str, source: str, sources: dict[str, str]) -> str:
    """A check error `<source>: <key>: ...` re-addressed to where that key was set (a flag or one file)."""
    if not message.startswith(f"{source}: "):
        return message
    rest = message[len(source) + 2 :]
    where = source_of(rest.split(":", 1)[0], sources)
    return f"{where}: {rest}" if where else message


def source_of(key: str, sources: dict[str, str]) -> str | None:
    """Where `key` (or the mapping above it: model.backbone_kwargs for model.backbone_kwargs.x) was set."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in sources:
            return sources[".".join(parts[:n])]
    return None
