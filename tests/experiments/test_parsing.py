"""The parsing toolkit every settings type reads through (experiments.plumbing.parsing): bounded YAML, one-line
errors naming the file, and the class allow-list on every form a command line can carry a config in."""

from __future__ import annotations

import time

import pytest

from experiments.plumbing import parsing
from experiments.training.config import load_config
from sweeps.spec import SpecError, load_spec

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_an_alias_bomb_is_refused_in_one_line_before_anything_is_built(tmp_path):
    """A 'billion laughs' document (~500 bytes, 9^9 values expanded) under model.backbone_kwargs used to
    expand into a 228 MB run.json; now the config is refused at once, naming the file."""
    path = tmp_path / "bomb.yaml"
    path.write_text(
        "model:\n  backbone_kwargs:\n" + "".join("    " + line + "\n" for line in LAUGHS.splitlines())
    )
    assert path.stat().st_size < 1000
    t = time.monotonic()
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert time.monotonic() - t < 5.0
    assert str(path) in str(e.value) and "aliases are expanded" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="aliases are expanded"):
        parsing.parse_sets([f"model.backbone_kwargs={{{LAUGHS.replace(chr(10), ', ')}}}"])
    # shared values that stay small are fine
    assert parsing.load_yaml("a: &x [1, 2]\nb: *x\n", "s") == {"a": [1, 2], "b": [1, 2]}


def test_a_recursive_alias_and_an_oversized_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="recursive YAML alias"):
        parsing.load_yaml("a: &a [*a]\n", "s")
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "y" * (parsing.MAX_YAML_BYTES + 10))
    with pytest.raises(ValueError, match=rf"{big}: \d+ bytes; a config file of at most"):
        parsing.read_yaml(big)


def test_a_non_utf8_config_or_spec_names_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("model:\n  circuit: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{bad}: not valid UTF-8 \(invalid .* at byte 21\)"):
        load_config(bad)
    with pytest.raises(SpecError, match=rf"^{bad}: not valid UTF-8"):
        load_spec(bad)


def test_an_inline_config_string_is_checked_like_a_file():
    """jsonargparse reads a --config value that is not a file as inline YAML and builds the classes it
    names: the allow-list covers it (the planted-module run is in test_config)."""
    inline = '{"trainer": {"profiler": {"class_path": "evil_marker.P"}}}'
    for argv in (["fit", "--config", inline], ["fit", f"--config={inline}"]):
        with pytest.raises(
            ValueError, match=r"--config \(inline\): trainer\.profiler\.class_path: 'evil_marker\.P'"
        ):
            parsing.check_cli_class_paths(argv)
    parsing.check_cli_class_paths(
        ["fit", "--config", '{"trainer": {"max_steps": 3}}']
    )  # a harmless one passes
    with pytest.raises(ValueError, match="aliases are expanded"):
        parsing.check_cli_class_paths(["fit", "--config", LAUGHS])


def test_an_empty_config_file_is_refused_naming_it(tmp_path):
    """An empty training config (a typo'd path to a new file, a truncated copy) used to train the
    defaults silently, also when a sweep spec's train.config named it."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    with pytest.raises(ValueError, match=rf"^{empty}: the config is empty; expected a mapping"):
        load_config(empty)
