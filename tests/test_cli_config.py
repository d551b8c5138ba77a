"""``kvcs`` options from a TOML file (``--config``, ``KVCS_CONFIG``) and ``KVCS_*`` variables.

What :mod:`kvcs.transports.cli.config` promises, checked through the real parser:
the precedence (command line > environment > file table > file top level > default),
every kind of option (flag, store_false flag, count, repeatable, typed value, choices,
paths relative to the file), every option of every subcommand settable from both
places, the errors and their statuses (unknown keys 2, refused values 2 with
argparse's message, a file that is not TOML 5), mutually exclusive options, the rule
for unknown variables, the help text, and the README's example file.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcs.transports.cli import build_parser, main
from kvcs.transports.cli import config as cfg
from kvcs.transports.cli.common import CliError, Exit

ROOT = Path(__file__).resolve().parents[1]
URL = "moqt://127.0.0.1:9"


def parse(
    argv: list[str],
    env: dict[str, str] | None = None,
    toml: str | None = None,
    tmp: Path | None = None,
) -> tuple[argparse.Namespace, dict[str, str]]:
    """``config.parse_args`` with ``env`` only (never this process's environment) and, if
    given, ``toml`` written to ``tmp/kvcs.toml`` and named by ``--config``."""
    environ = dict(env or {})
    if toml is not None:
        assert tmp is not None
        path = tmp / "kvcs.toml"
        path.write_text(toml, encoding="utf-8")
        argv = ["--config", str(path), *argv]
    return cfg.parse_args(build_parser, argv, environ)


def refused(argv: list[str], env: dict[str, str] | None = None, toml: str | None = None,
            tmp: Path | None = None) -> CliError:  # fmt: skip
    with pytest.raises(CliError) as info:
        parse(argv, env, toml, tmp)
    assert "\n" not in str(info.value)
    return info.value


# --- precedence -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "env", "table", "top", "expected"),
    [
        (None, None, None, None, 30.0),  # the built-in default
        (None, None, None, "40", 40.0),
        (None, None, "50", "40", 50.0),  # the command's table over the top level
        (None, "60", "50", "40", 60.0),  # the environment over the file
        ("70", "60", "50", "40", 70.0),  # the command line over everything
        ("70", None, None, None, 70.0),
        (None, "60", None, None, 60.0),
    ],
)
def test_precedence_command_line_environment_file_default(
    tmp_path: Path,
    cmdline: str | None,
    env: str | None,
    table: str | None,
    top: str | None,
    expected: float,
) -> None:
    toml = (f"idle-timeout = {top}\n" if top else "") + (
        f"[relay]\nidle-timeout = {table}\n" if table else ""
    )
    argv = ["relay", *(["--idle-timeout", cmdline] if cmdline else [])]
    args, sources = parse(argv, {"KVCS_IDLE_TIMEOUT": env} if env else {}, toml, tmp_path)
    assert args.idle_timeout == expected
    if cmdline or not (env or table or top):
        assert "idle-timeout" not in sources
    elif env:
        assert sources["idle-timeout"] == "KVCS_IDLE_TIMEOUT"
    else:
        assert sources["idle-timeout"].endswith(
            "[relay] idle-timeout" if table else ": idle-timeout"
        )


def test_kvcs_config_names_the_file_and_config_wins_over_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('stack = "aioquic"\n')
    b.write_text('stack = "qh3"\n[relay]\nloop = "trio"\n')
    args, _ = cfg.parse_args(build_parser, ["relay"], {"KVCS_CONFIG": str(a)})
    assert (args.stack, args.loop) == ("aioquic", "asyncio")
    for argv in (["--config", str(b), "relay"], ["relay", "--config", str(b)]):
        args, _ = cfg.parse_args(build_parser, argv, {"KVCS_CONFIG": str(a)})
        assert (args.stack, args.loop) == ("qh3", "trio"), argv


def test_the_environment_applies_to_every_command_that_has_the_option(tmp_path: Path) -> None:
    env = {"KVCS_STACK": "aioquic", "KVCS_CACHE_BUDGET": "512MiB"}
    relay, _ = parse(["relay"], env)
    assert relay.stack == "aioquic" and relay.cache_budget == 512 << 20
    fetch, sources = parse(["fetch", URL], env)  # fetch has no --cache-budget: ignored
    assert fetch.stack == "aioquic" and not hasattr(fetch, "cache_budget")
    assert set(sources) == {"stack"}


# --- each kind of option ----------------------------------------------------------------------


def test_flags_from_the_file_and_the_environment(tmp_path: Path) -> None:
    toml = "json = true\n[fetch]\nno-verify = true\ninsecure = true\n"
    args, _ = parse(["fetch", URL], {}, toml, tmp_path)
    assert args.json is True and args.verify is False and args.insecure is True
    # a flag that is off at a higher place restores the default over a lower place's true
    env = {"KVCS_JSON": "0", "KVCS_NO_VERIFY": "false", "KVCS_INSECURE": "No"}
    args, sources = parse(["fetch", URL], env, toml, tmp_path)
    assert args.json is False and args.verify is True and args.insecure is False
    assert not {"json", "no-verify", "insecure"} & set(sources)  # off: not reported as set
    for word in ("1", "true", "TRUE", "yes", "on"):
        args, _ = parse(["fetch", URL], {"KVCS_NO_VERIFY": word})
        assert args.verify is False, word
    for word in ("0", "false", "no", "off"):
        args, _ = parse(["fetch", URL], {"KVCS_JSON": word})
        assert args.json is False, word


def test_count_list_and_typed_values(tmp_path: Path) -> None:
    toml = 'verbose = 2\n[fetch]\nalso = ["moqt://127.0.0.1:1", "moqt://127.0.0.1:2"]\nlayers = 3\n'
    args, _ = parse(["fetch", URL], {}, toml, tmp_path)
    assert args.verbose == 2
    assert args.also == ["moqt://127.0.0.1:1", "moqt://127.0.0.1:2"]
    assert args.layers == 3 and isinstance(args.layers, int)
    env = {"KVCS_VERBOSE": "1", "KVCS_ALSO": "moqt://127.0.0.1:3  moqt://127.0.0.1:4"}
    args, _ = parse(["fetch", URL], env, toml, tmp_path)
    assert args.verbose == 1
    assert args.also == ["moqt://127.0.0.1:3", "moqt://127.0.0.1:4"]
    # the command line replaces a list from elsewhere (it does not add to it)
    args, _ = parse(["fetch", URL, "--also", "moqt://127.0.0.1:5"], env, toml, tmp_path)
    assert args.also == ["moqt://127.0.0.1:5"]
    args, _ = parse(["fetch", URL, "-vvv"], env)
    assert args.verbose == 3
    args, _ = parse(["fetch", URL], {}, '[fetch]\nalso = "moqt://127.0.0.1:6"\n', tmp_path)
    assert args.also == ["moqt://127.0.0.1:6"]  # one string: a list of one


def test_values_are_converted_by_the_options_own_types(tmp_path: Path) -> None:
    toml = (
        '[relay]\ncache-budget = "2GiB"\nidle-timeout = 12\nrun-for = 1.5\n'
        '[publish]\nlayer-interval = "0.25"\nstack = "aioquic"\n'
    )
    relay, _ = parse(["relay"], {}, toml, tmp_path)
    assert relay.cache_budget == 2 << 30 and relay.idle_timeout == 12.0 and relay.run_for == 1.5
    publish, _ = parse(["publish", URL], {}, toml, tmp_path)
    assert publish.layer_interval == 0.25 and publish.stack == "aioquic"


def test_paths_in_the_file_are_relative_to_its_folder(tmp_path: Path, monkeypatch: Any) -> None:
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "kvcs.toml").write_text('[relay]\ncert = "cert.pem"\nkey = "/abs/key.pem"\n')
    monkeypatch.chdir(tmp_path)
    args, _ = cfg.parse_args(build_parser, ["--config", "etc/kvcs.toml", "relay"], {})
    assert args.cert == Path("etc/cert.pem") and args.key == Path("/abs/key.pem")
    args, _ = cfg.parse_args(build_parser, ["relay"], {"KVCS_CERT": "c.pem"})
    assert args.cert == Path("c.pem")  # from the environment: as on the command line


def test_every_option_of_every_command_can_be_set_both_ways(tmp_path: Path) -> None:
    """Derived from the parser: a new option is covered without being listed here."""
    parser = build_parser()
    commands = cfg.subcommands(parser)
    assert {"relay", "publish", "fetch", "ls", "demo", "selfcheck", "descriptor"} <= set(commands)
    count = 0
    for command in commands:
        for key, option in cfg.command_options(parser, command).items():
            text, expected = _sample(option)
            with_url = ("publish", "fetch", "ls", "prefill", "generate")
            positional = [URL] if command in with_url else []
            if command == "descriptor":
                positional = ["cache.npz"]
            if command == "token":
                positional = ["inspect"]
            toml = f"[{command}]\n{key} = {_toml(option, text)}\n"
            for env, file in (({option.env: text}, None), ({}, toml)):
                args, sources = parse([command, *positional], env, file, tmp_path)
                got = getattr(args, option.action.dest)
                if file and isinstance(expected, Path):
                    expected_here = tmp_path / expected
                else:
                    expected_here = expected
                assert got == expected_here, (command, key, env, file, got)
                assert key in sources, (command, key)
            count += 1
    assert count > 60  # every command's options were met


def _sample(option: cfg.Option) -> tuple[str, Any]:
    """A valid non-default value of ``option``: its text and what it parses to."""
    action = option.action
    if option.kind is cfg.Kind.FLAG:
        return "true", action.const
    if option.kind is cfg.Kind.COUNT:
        return "3", 3
    if option.kind is cfg.Kind.LIST:
        return "moqt://127.0.0.1:7", ["moqt://127.0.0.1:7"]
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    func = action.type
    if func is None:
        return "some-text", "some-text"
    if func is Path:
        return "some/file.pem", Path("some/file.pem")
    if func is int:
        return "7", 7
    name = getattr(func, "__name__", "")
    if func is float or name == "_seconds":
        return "2.5", 2.5
    if name == "parse_size":
        return "3MiB", 3 << 20
    if name == "parse_duration":
        return "15m", 900.0
    raise AssertionError(f"no sample value for {option.flag} of type {func!r}: add one")


def _toml(option: cfg.Option, text: str) -> str:
    if option.kind is cfg.Kind.FLAG:
        return text
    if option.kind is cfg.Kind.COUNT:
        return text
    if option.kind is cfg.Kind.LIST:
        return f'["{text}"]'
    return f'"{text}"'


# --- mutually exclusive options -------------------------------------------------------------------


def test_exclusive_options_are_claimed_by_the_highest_place(tmp_path: Path) -> None:
    toml = '[fetch]\nfile = "cache.npz"\n'
    args, _ = parse(["fetch", URL, "--synthetic"], {}, toml, tmp_path)
    assert args.synthetic is True and args.file is None  # the command line's choice
    args, _ = parse(["fetch", URL], {"KVCS_SYNTHETIC": "1"}, toml, tmp_path)
    assert args.synthetic is True and args.file is None
    args, _ = parse(["fetch", URL], {"KVCS_SYNTHETIC": "0"}, toml, tmp_path)
    assert args.file == tmp_path / "cache.npz"  # a flag that is off claims nothing
    toml = 'scope-key-file = "key"\n[fetch]\nscope-key = "' + "00" * 32 + '"\n'
    args, _ = parse(["fetch", URL], {}, toml, tmp_path)
    assert args.scope_key == "00" * 32 and args.scope_key_file is None


def test_two_exclusive_options_in_one_place_are_an_error(tmp_path: Path) -> None:
    e = refused(["fetch", URL], {}, '[fetch]\nfile = "a.npz"\nsynthetic = true\n', tmp_path)
    assert e.status == Exit.USAGE and "not allowed together" in str(e)
    e = refused(["fetch", URL], {"KVCS_FILE": "a.npz", "KVCS_TOKENS_FILE": "t.txt"})
    assert e.status == Exit.USAGE and "KVCS_FILE" in str(e) and "KVCS_TOKENS_FILE" in str(e)


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("stak = 1\n", "'stak' names no kvcs option"),
        ("[relay]\nprefix = 'x'\n", "[relay] 'prefix' is no option of kvcs relay"),
        ("[relais]\nstack = 'qh3'\n", "'relais' names no kvcs option (a table [name] must name"),
        ("relay = 3\n", "'relay' must be a table"),
        ("config = 'other.toml'\n", "'config' names no kvcs option"),
        ("cache_budget = '1G'\n", "names no kvcs option (keys are long option names without "),
        ("[relay]\n'--stack' = 'qh3'\n", "is no option of kvcs relay (keys are long option"),
        ("[relay]\nstack = 'quiche'\n", "[relay] stack: argument --stack: invalid choice: 'qu"),
        ("[relay]\ncache-budget = 'lots'\n", "argument --cache-budget: not a size: 'lots'"),
        ("[relay]\nidle-timeout = -1\n", "argument --idle-timeout: must be a positive number"),
        ("[fetch]\nlayers = 2.5\n", "argument --layers: invalid int value: '2.5'"),
        ("[fetch]\nlayers = true\n", "--layers: must be a string or a number, not a boolean"),
        ("json = 'yes'\n", "argument --json: must be true or false, not the string 'yes'"),
        ("verbose = -1\n", "argument --verbose: must be a non-negative integer"),
        ("[fetch]\nalso = 3\n", "argument --also: must be an array of strings"),
        ("[fetch]\nalso = [[1]]\n", "argument --also: must be a string or a number, not an array"),
        ("[relay]\nlisten = {host = 'x'}\n", "--listen: must be a string or a number, not a table"),
    ],
)  # fmt: skip
def test_bad_contents_of_the_file_exit_2(tmp_path: Path, toml: str, expected: str) -> None:
    # found whichever command runs: the whole file is checked
    e = refused(["selfcheck"], {}, toml, tmp_path)
    assert e.status == Exit.USAGE
    assert expected in str(e), str(e)
    assert str(tmp_path / "kvcs.toml") in str(e)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KVCS_STACK", "quiche", "KVCS_STACK: argument --stack: invalid choice: 'quiche'"),
        ("KVCS_CACHE_BUDGET", "-5", "KVCS_CACHE_BUDGET: argument --cache-budget: the size must be"),
        ("KVCS_IDLE_TIMEOUT", "soon", "argument --idle-timeout: not a number of seconds: 'soon'"),
        ("KVCS_JSON", "maybe", "KVCS_JSON: argument --json: not a boolean: 'maybe'"),
        ("KVCS_VERBOSE", "-1", "KVCS_VERBOSE: argument --verbose: not a count: '-1'"),
    ],
)
def test_bad_variables_exit_2(variable: str, value: str, expected: str) -> None:
    e = refused(["relay"], {variable: value})
    assert e.status == Exit.USAGE
    assert expected in str(e), str(e)


def test_a_variable_for_another_command_is_not_checked_or_used() -> None:
    args, sources = parse(["ls", URL], {"KVCS_CACHE_BUDGET": "nonsense"})
    assert not sources and not hasattr(args, "cache_budget")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"stack = \n", "not valid TOML: Invalid value (at line 1, column 9)"),
        (b"[relay\n", "not valid TOML"),
        (b"stack = 'qh3'\nstack = 'aioquic'\n", "not valid TOML"),  # a key twice
        (b"stack = '\xff'\n", "not UTF-8 text"),
    ],
)
def test_a_file_that_is_not_toml_exits_5(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    with pytest.raises(CliError) as info:
        cfg.parse_args(build_parser, ["--config", str(path), "selfcheck"], {})
    assert info.value.status == Exit.FILE
    assert expected in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_a_config_that_is_no_file_exits_5(tmp_path: Path, what: str) -> None:
    path = tmp_path / "none.toml" if what == "missing" else tmp_path
    for argv, env, named in (
        (["--config", str(path), "selfcheck"], {}, "--config"),
        (["selfcheck"], {"KVCS_CONFIG": str(path)}, "KVCS_CONFIG"),
    ):
        with pytest.raises(CliError) as info:
            cfg.parse_args(build_parser, argv, env)
        assert info.value.status == Exit.FILE
        message = str(info.value)
        assert message.startswith(named + ":")
        assert ("no such file" if what == "missing" else "a directory") in message


def test_unknown_variables_warn_reserved_ones_are_silent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {
        "KVCS_CACHE_BUGDET": "1G",  # misspelt: named on stderr, not an error
        "KVCS_UDP_GSO": "0",  # the project's own switches: silent
        "KVCS_UDP_NATIVE": "0",
        "KVCS_SHARED": "/tmp",
        "KVCS_TEST_PYTHONS": "python3",
        "KVCS_FETCH_TIMEOUT": "5",  # fetch's option, running relay: silent, unused
        "KVCS_LAYERS": "",  # empty: unset
        "OTHER": "x",
    }
    args, sources = parse(["relay"], env)
    err = capsys.readouterr().err
    assert err.splitlines() == ["kvcs: warning: KVCS_CACHE_BUGDET names no kvcs option; ignored"]
    assert not sources
    args, sources = parse(["fetch", URL], {"KVCS_LAYERS": ""})
    assert args.layers == 32 and not sources


def test_no_option_is_named_like_a_reserved_variable() -> None:
    parser = build_parser()
    for command in cfg.subcommands(parser):
        for option in cfg.command_options(parser, command).values():
            assert not cfg.is_reserved(option.env), option.env


# --- through the kvcs command --------------------------------------------------------------------


def kvcs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVCS_")}
    return subprocess.run(
        [sys.executable, "-m", "kvcs", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, **(env or {})},
    )


def _one_error(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("kvcs: error: ")
    return errors[0]


def test_the_command_exits_2_and_5_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[relay]\nlisten = \n")
    r = kvcs("--config", str(bad), "relay")
    assert r.returncode == 5 and "not valid TOML" in _one_error(r)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[relay]\nlisen = '127.0.0.1:0'\n")
    r = kvcs("relay", "--config", str(unknown))
    assert r.returncode == 2 and "'lisen' is no option of kvcs relay" in _one_error(r)
    r = kvcs("selfcheck", "--builtin-only", env={"KVCS_VECTORS": str(tmp_path)})
    assert r.returncode == 5 and "a directory" in _one_error(r)  # the value was used
    r = kvcs("relay", env={"KVCS_LOOP": "gevent"})
    assert r.returncode == 2 and "KVCS_LOOP: argument --loop: invalid choice" in _one_error(r)


def test_a_value_from_the_file_reaches_the_command(tmp_path: Path) -> None:
    conf = tmp_path / "kvcs.toml"
    conf.write_text("[selfcheck]\nbuiltin-only = true\n")
    r = kvcs("--config", str(conf), "-v", "selfcheck")
    assert r.returncode == 0, r.stderr
    assert "built-in checks: 5 of 5 OK" in r.stdout and "vector checks" not in r.stdout
    assert f"--builtin-only from {conf}: [selfcheck] builtin-only" in r.stderr  # -v says so


@pytest.mark.parametrize("command", [[], ["relay"], ["fetch"], ["descriptor"]])
def test_help_says_where_options_may_come_from(command: list[str]) -> None:
    r = kvcs(*command, "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--config FILE" in text and "KVCS_CONFIG" in text
    assert "KVCS_<OPTION>" in text
    assert "command line > environment > config file > default" in text


def test_main_turns_a_refused_file_into_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    for name in [k for k in __import__("os").environ if k.startswith("KVCS_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "k.toml"
    path.write_text("[fetch]\nfetch-timeout = 'never'\n")
    assert main(["--config", str(path), "selfcheck"]) == Exit.USAGE
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvcs: error: {path}: [fetch] fetch-timeout: argument --fetch-timeout: "
        "invalid float value: 'never'"
    )


# --- the README's example file --------------------------------------------------------------------


def test_the_readmes_example_file_is_valid(tmp_path: Path) -> None:
    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README shows an example --config file"
    for block in blocks:
        path = tmp_path / "example.toml"
        path.write_text(block)
        settings = cfg.load_file(path, build_parser())
        assert any(table or top for table, top in settings.values())


def test_the_demos_relay_runs_what_the_demo_gives_it(tmp_path: Path) -> None:
    """A user's ``[relay]`` table and ``KVCS_*`` relay options do not reach the relay that
    ``kvcs demo`` starts (here they would make it refuse to start: --self-signed with
    --cert, and a cache budget of 1 octet)."""
    conf = tmp_path / "kvcs.toml"
    conf.write_text('[relay]\ncert = "missing.pem"\nkey = "missing.pem"\n')
    r = kvcs(
        "demo", "--tokens", "32", "--layers", "2", "--timeout", "60",
        env={"KVCS_CONFIG": str(conf), "KVCS_CACHE_BUDGET": "1", "KVCS_RUN_FOR": "0.1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    env = {"KVCS_CONFIG": "c", "KVCS_STACK": "qh3", "KVCS_UDP_GSO": "0", "PATH": "/bin"}
    assert cfg.child_environment(env) == {"KVCS_UDP_GSO": "0", "PATH": "/bin"}
