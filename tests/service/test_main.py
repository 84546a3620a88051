"""python -m service: one dashed flag per Settings field (training.cli); flags override the
SKETCHSVD_* environment, which overrides the defaults."""

from pathlib import Path

import pytest

from service.__main__ import parse_args
from service.settings import Settings


def test_flags_are_the_settings_fields(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in out
        assert f"SKETCHSVD_{name.upper()}" in " ".join(out.split())


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("SKETCHSVD_PORT", "9001")
    monkeypatch.setenv("SKETCHSVD_MAX_K", "7")
    monkeypatch.setenv("SKETCHSVD_LOG_LEVEL", "warning")
    s = parse_args(["--index", "idx", "--photos-dir", "ph", "--max-k", "9"])
    assert (s.index, s.photos_dir, s.port, s.max_k, s.log_level) == \
        (Path("idx"), Path("ph"), 9001, 9, "warning")
    s = parse_args(["--port", "8002", "--log-level", "debug", "--cors-origins", "http://a.test"])
    assert (s.port, s.log_level, s.cors_origins) == (8002, "debug", ["http://a.test"])
    assert parse_args([]) == Settings()


@pytest.mark.parametrize("argv,message", [
    (["--port", "70000"], "less than or equal to 65535"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--log-level", "loud"], "invalid choice: 'loud'"),
    (["--photos_dir", "x"], "unrecognized arguments: --photos_dir"),
    (["--max-k", "0"], "max_k"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
