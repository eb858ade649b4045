"""The Optuna journal after a torn write (a full disk or kill -9 mid-append): the sweep opens it
again, with every acknowledged operation kept, instead of failing with JSONDecodeError forever;
a line that is not a torn write is reported with its number and the command that drops it."""

from __future__ import annotations

import json

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend, JournalStorage

from sweeps.journal import repair
from sweeps.study import StorageError, open_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(path, n=3):
    study = optuna.create_study(study_name="s", storage=JournalStorage(JournalFileBackend(str(path))))
    for i in range(n):
        t = study.ask()
        t.suggest_int("x", 0, 10)
        study.tell(t, float(i))
    return study


def _load(storage):
    return optuna.load_study(study_name="s", storage=storage).get_trials()


def test_a_torn_line_followed_by_a_later_write_is_repaired(tmp_path, capsys):
    path = tmp_path / "optuna.journal"
    _study(path)
    whole = path.read_bytes()
    # the operations the next worker writes (after space was freed): a new trial
    other = tmp_path / "copy.journal"
    other.write_bytes(whole)
    optuna.load_study(
        study_name="s", storage=JournalStorage(JournalFileBackend(str(other)))
    ).ask().suggest_int("x", 0, 10)
    later = other.read_bytes()[len(whole) :]
    # a write cut short (ENOSPC) and that next append landing on the same line
    path.write_bytes(whole + b'{"op_code":5,"worker_id":"x","trial_id":0,"par' + later)
    with pytest.raises(json.JSONDecodeError):  # plain Optuna: fails from now on, for good
        _load(JournalStorage(JournalFileBackend(str(path))))
    trials = _load(open_storage(f"journal:{path}"))
    assert [tr.state.name for tr in trials] == ["COMPLETE"] * 3 + ["RUNNING"]
    err = capsys.readouterr().err
    assert f"{path}:" in err and "dropped a torn write" in err
    assert repair(path) == []  # repaired for good


def test_a_torn_last_line_is_truncated(tmp_path):
    path = tmp_path / "optuna.journal"
    _study(path)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"op_code":5,"wor')
    notes = repair(path)
    assert len(notes) == 1 and "torn last line of 17 bytes" in notes[0]
    assert path.read_bytes() == whole
    assert len(_load(open_storage(f"journal:{path}"))) == 3


def test_a_line_that_is_no_torn_write_is_reported_with_the_repair(tmp_path):
    path = tmp_path / "optuna.journal"
    _study(path)
    lines = path.read_bytes().split(b"\n")
    lines.insert(2, b"garbage")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(StorageError, match=rf"{path}:3: not an Optuna journal operation.*sed -i '3d' {path}"):
        open_storage(f"journal:{path}")
