"""Each setting is declared once; its flag, variable, parsing and README row follow from it."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from trillm.api.cli import _serve_parser
from trillm.api.settings import ServerConfig, server_config_from_env, settings_table
from trillm.engine.config import EngineConfig
from trillm.engine.settings import from_env, overrides_from, settings_of

README = Path(__file__).parent.parent / "README.md"


def _serve() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    _serve_parser(sub)
    return sub.choices["serve"]


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_every_field_is_a_setting_with_a_flag_a_variable_and_a_readme_row(cls):
    settings = {s.name: s for s in settings_of(cls)}
    assert set(settings) == {f.name for f in attrs.fields(cls)}, "a field without a setting declaration"
    flags = {option for action in _serve()._actions for option in action.option_strings}
    readme = README.read_text()
    for s in settings.values():
        assert s.flag in flags and s.env.startswith("TRILLM_") and s.help
        assert f"| `{s.flag}` | `{s.env}` |" in readme, f"README has no row for {s.env}"


def test_readme_table_is_the_generated_one():
    text = README.read_text()
    begin, end = "<!-- settings:begin -->\n", "\n<!-- settings:end -->"
    assert text[text.index(begin) + len(begin) : text.index(end)] == settings_table()


def test_flags_and_variables_reach_the_same_fields():
    args = _serve().parse_args(
        [
            "--kv-cache-mb",
            "2",
            "--no-prefix-cache",
            "--disable-overlap-schedule",
            "--enforce-eager",
            "--request-timeout",
            "3",
            "--served-model-name",
            "x",
        ]
    )
    engine = from_env(
        EngineConfig, {"TRILLM_KV_CACHE_MB": "9", "TRILLM_PAGE_SIZE": "8"}, **overrides_from(args, EngineConfig)
    )
    assert (engine.kv_cache_bytes, engine.page_size) == (2 * 1024 * 1024, 8)  # the flag wins, the variable fills
    assert not engine.prefix_cache and not engine.overlap_schedule and engine.enforce_eager
    server = server_config_from_env({}, **overrides_from(args, ServerConfig))
    assert (server.request_timeout, server.served_model_name) == (3.0, "x")
    assert from_env(EngineConfig, {"TRILLM_PREFIX_CACHE": "off", "TRILLM_NUM_PAGES": "none"}).prefix_cache is False
    with pytest.raises(SystemExit, match="TRILLM_PREFIX_CACHE"):
        from_env(EngineConfig, {"TRILLM_PREFIX_CACHE": "maybe"})
    with pytest.raises(SystemExit, match="TRILLM_DEVICE"):
        from_env(EngineConfig, {"TRILLM_DEVICE": "tpu"})
    with pytest.raises(SystemExit):
        _serve().parse_args(["--page-size", "x"])


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_every_choice_of_every_setting_is_taken_on_the_command_line_and_others_refused(cls, capsys):
    """Each listed value of a setting with choices parses from its flag into the field (a number's
    choices too: argparse compared the converted 8 with the text '8' and refused
    `--activation-bits 8`), and a value not listed ends with argparse's usage error."""
    for s in settings_of(cls):
        if not s.choices or s.many:
            continue
        for choice in s.choices:
            args = _serve().parse_args([s.flag, choice])
            assert overrides_from(args, cls)[s.name] == s.parse(choice), (s.flag, choice)
        with pytest.raises(SystemExit):
            _serve().parse_args([s.flag, "not-a-choice"])
        assert f"argument {s.flag}: expected one of" in capsys.readouterr().err


def test_cache_dir_is_read_once_from_the_setting(tmp_path):
    config = from_env(EngineConfig, {"TRILLM_CACHE_DIR": str(tmp_path)})
    assert config.cache_path == tmp_path
    assert EngineConfig(cache_dir="~/x").cache_path == Path.home() / "x"
