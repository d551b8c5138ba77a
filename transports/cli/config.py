"""Options of the ``kvcs`` command from a TOML file and ``KVCS_*`` environment variables.

Theory of operation
-------------------
Every option of every subcommand may be given in four places; for each option the
first of these that gives it wins:

1. the command line;
2. the environment: ``KVCS_<OPTION>``, the long option name in capitals with ``-``
   as ``_`` (``--cache-budget`` is ``KVCS_CACHE_BUDGET``, ``--no-verify`` is
   ``KVCS_NO_VERIFY``); it applies to every subcommand that has the option;
3. a TOML file named by ``--config FILE`` (before or after the subcommand) or by
   ``KVCS_CONFIG``: a table per subcommand (``[relay]``, ``[fetch]``, ...) and
   top-level keys for every subcommand that has the option; a subcommand's table
   wins over the top level;
4. the built-in default.

Nothing is listed twice: the options, their types and choices are read from the
argparse parser that :func:`kvcs.transports.cli.build_parser` makes
(:func:`options_of`). Positional arguments (a relay's URL, a file to describe)
come from the command line only; ``--help`` and ``--version`` are not options
here; ``--config`` is the file itself (``KVCS_CONFIG`` in the environment).

The values of one option kind are written alike everywhere:

* a flag (``--json``, ``-k/--insecure``, ``--no-verify``): a TOML boolean; in the
  environment ``1``, ``true``, ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off``
  (any case). A flag that is off takes the built-in default: a lower place's
  ``true`` is overridden by a higher place's ``false``;
* a count (``-v/--verbose``): a non-negative integer;
* a repeatable option (``--also``): a TOML array of strings (or one string); in
  the environment the values separated by whitespace; a higher place replaces
  the whole list of a lower one;
* any other option: a TOML string or number, or the variable's text, converted
  and checked exactly as the same text on the command line (the option's
  ``type`` and ``choices``; the same message). A path relative to a TOML file is
  taken from the file's folder; one from the environment, from the current one.

The command line is parsed first on its own, every default suppressed: its errors
are argparse's (status 2), and the namespace names exactly the options it gave.
The other places' values become the defaults of a second parse of the same
command line, so that a value the command line gives replaces them. Options that
argparse makes mutually exclusive (``--file``, ``--synthetic``, ``--tokens-file``)
are claimed together: the highest place that sets one of them (a flag: to true)
keeps it and the others of that group from lower places are dropped; two of them
in one place are an error, as on the command line.

Errors (:class:`~.common.CliError`): a file that is missing, not a regular file,
larger than 1 MiB, not UTF-8 or not valid TOML is status 5 (files); a key that
names no option (or a table that names no subcommand), a value of the wrong kind
or one the option refuses is status 2 (bad arguments), in the file as in the
environment. A ``KVCS_*`` variable that names no option of any subcommand is not
an error: the prefix is shared with the project's own switches
(:data:`RESERVED_ENV`, ``KVCS_TEST_*``, ignored silently) and maybe with other
tools, and an environment is inherited by every process started from it, so a
foreign variable must not stop every command. It is named once on stderr as a
warning instead (a misspelt option is seen); a variable that names an option of
another subcommand only is ignored silently (one environment serves them all).
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .common import CliError, Exit, read_file

ENV_PREFIX = "KVCS_"
CONFIG_ENV = "KVCS_CONFIG"
"""The environment variable that names the TOML file when ``--config`` is not given."""
RESERVED_ENV = frozenset(
    {
        CONFIG_ENV,
        "KVCS_UDP_GSO",  # kvcs.transports.quic.udp
        "KVCS_UDP_NATIVE",  # kvcs.transports.quic.udp
        "KVCS_SHARED",  # kvcs selfcheck's default vector folder
        "KVCS_FUZZ_SECONDS",  # scripts/test.sh
        "KVCS_INTEROP_REPORT",  # tests/interop
        "KVCS_PEERS_NETNS",  # tests/interop
    }
)
"""``KVCS_*`` variables of the project that are no option: never read as one."""
RESERVED_ENV_PREFIXES = ("KVCS_TEST_",)
"""Prefixes of further such variables (the test scripts' own)."""
NOT_OPTIONS = frozenset({"help", "version", "config"})

HELP_EPILOG = (
    "Every option may also come from the environment, KVCS_<OPTION> (--cache-budget: "
    "KVCS_CACHE_BUDGET; flags 1/0/true/false), or from a TOML file, --config FILE or "
    "KVCS_CONFIG (a table per command such as [fetch], top-level keys for every "
    "command). Precedence: command line > environment > config file > default."
)
"""What ``--help`` says about where options come from (the README has the details)."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_COUNT = re.compile(r"[0-9]+")


class Kind(enum.IntEnum):
    """How an option's value is written in a file or a variable."""

    FLAG = 1
    """``store_true`` / ``store_false`` / ``store_const``: a boolean."""
    COUNT = 2
    """``count``: a non-negative integer."""
    LIST = 3
    """``append``: a list of values, each like a :attr:`VALUE`."""
    VALUE = 4
    """``store``: one value, converted by the option's ``type``."""


@attrs.frozen
class Option:
    """One option of a parser, named by its long form without ``--``."""

    key: str
    action: argparse.Action = attrs.field(eq=False)
    kind: Kind

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper().replace("-", "_")

    @property
    def flag(self) -> str:
        return "--" + self.key


@attrs.frozen
class Setting:
    """A value for an option from the environment or the file."""

    value: Any
    where: str
    """Where it was read: ``KVCS_STACK`` or ``kvcs.toml: [relay] cache-budget``."""
    claims: bool
    """It sets the option (a flag that is off does not: it only restores the default)."""


def _kind(action: argparse.Action) -> Kind | None:
    if isinstance(action, argparse._CountAction):
        return Kind.COUNT
    if isinstance(action, argparse._AppendAction):
        return Kind.LIST
    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false too
        return Kind.FLAG
    if isinstance(action, argparse._StoreAction):
        return Kind.VALUE
    return None  # help, version, subcommands


def options_of(parser: argparse.ArgumentParser) -> dict[str, Option]:
    """The options of ``parser`` (its own, not its subcommands'), by key."""
    out: dict[str, Option] = {}
    for action in parser._actions:
        kind = _kind(action)
        longs = [s for s in action.option_strings if s.startswith("--")]
        if kind is None or not longs:
            continue
        key = longs[0][2:]
        if key not in NOT_OPTIONS:
            out[key] = Option(key, action, kind)
    return out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_options(parser: argparse.ArgumentParser, command: str) -> dict[str, Option]:
    """The options ``command`` accepts: its own and the main parser's (``--verbose``: the
    main parser's action, whose default is the one that counts)."""
    return {**options_of(subcommands(parser)[command]), **options_of(parser)}


# --- converting values ----------------------------------------------------------------------


def convert(option: Option, text: str, where: str) -> Any:
    """``text`` as the command line would make it: the option's ``type``, then ``choices``;
    a refusal is a :class:`CliError` (status 2) with argparse's message."""
    action = option.action
    func: Callable[[str], Any] = action.type if callable(action.type) else str
    try:
        value = func(text)
    except argparse.ArgumentTypeError as exc:
        raise _usage(where, option, str(exc)) from None
    except (TypeError, ValueError):
        name = getattr(func, "__name__", repr(func))
        raise _usage(where, option, f"invalid {name} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise _usage(where, option, f"invalid choice: {value!r} (choose from {choices})")
    return value


def _usage(where: str, option: Option, message: str) -> CliError:
    return CliError(f"{where}: argument {option.flag}: {message}", Exit.USAGE)


def _flag(option: Option, on: bool, where: str) -> Setting:
    action = option.action
    return Setting(action.const if on else action.default, where, on)


def from_text(option: Option, text: str, where: str) -> Setting:
    """A variable's text as a value of ``option``."""
    if option.kind is Kind.FLAG:
        word = text.strip().lower()
        if word not in _TRUE | _FALSE:
            expected = "1/0, true/false, yes/no, on/off"
            raise _usage(where, option, f"not a boolean: {text!r} ({expected})")
        return _flag(option, word in _TRUE, where)
    if option.kind is Kind.COUNT:
        if not _COUNT.fullmatch(text.strip()):
            raise _usage(where, option, f"not a count: {text!r} (0, 1, 2, ...)")
        return Setting(int(text.strip()), where, True)
    if option.kind is Kind.LIST:
        return Setting([convert(option, t, where) for t in text.split()], where, True)
    return Setting(convert(option, text, where), where, True)


def from_toml(option: Option, value: Any, where: str, base: Path) -> Setting:
    """A TOML value as a value of ``option`` (relative paths from ``base``)."""
    if option.kind is Kind.FLAG:
        if not isinstance(value, bool):
            raise _usage(where, option, f"must be true or false, not {_toml_type(value)}")
        return _flag(option, value, where)
    if option.kind is Kind.COUNT:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _usage(where, option, f"must be a non-negative integer, not {value!r}")
        return Setting(value, where, True)
    if option.kind is Kind.LIST:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise _usage(where, option, f"must be an array of strings, not {_toml_type(value)}")
        return Setting([_scalar(option, v, where, base) for v in items], where, True)
    return Setting(_scalar(option, value, where, base), where, True)


def _scalar(option: Option, value: Any, where: str, base: Path) -> Any:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _usage(where, option, f"must be a string or a number, not {_toml_type(value)}")
    converted = convert(option, str(value), where)
    if isinstance(converted, Path) and not converted.is_absolute():
        converted = base / converted
    return converted


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


# --- the file ----------------------------------------------------------------------------------


FileSettings = dict[str, tuple[dict[str, Setting], dict[str, Setting]]]
"""For each subcommand: its table's settings, then the top level's that it has."""


def load_file(path: Path, parser: argparse.ArgumentParser, what: str = "--config") -> FileSettings:
    """Read and check the whole TOML file against every subcommand (a mistake is found
    whichever command runs); ``what`` names where the path came from, for messages.

    Raises:
        CliError: status 5 for a file that cannot be read as TOML, 2 for its contents.
    """
    try:
        raw = read_file(path)  # status 5: missing, not a regular file, over 1 MiB
    except CliError as exc:
        raise CliError(f"{what}: {exc}", exc.status) from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CliError(f"{what}: {path}: not UTF-8 text", Exit.FILE) from None
    except tomllib.TOMLDecodeError as exc:
        raise CliError(f"{what}: {path}: not valid TOML: {exc}", Exit.FILE) from None
    commands = subcommands(parser)
    every = {key for name in commands for key in command_options(parser, name)}
    top = {k: v for k, v in doc.items() if k not in commands}
    for key, value in top.items():
        if key not in every:
            hint = " (a table [name] must name a command)" if isinstance(value, dict) else ""
            raise CliError(f"{path}: {key!r} names no kvcs option{hint or _hint(key)}", Exit.USAGE)
    base = path.parent
    out: FileSettings = {}
    for name in commands:
        options = command_options(parser, name)
        table = doc.get(name, {})
        if not isinstance(table, dict):
            raise CliError(f"{path}: {name!r} must be a table ([{name}])", Exit.USAGE)
        mine: dict[str, Setting] = {}
        for key, value in table.items():
            if key not in options:
                message = f"{path}: [{name}] {key!r} is no option of kvcs {name}{_hint(key)}"
                raise CliError(message, Exit.USAGE)
            mine[key] = from_toml(options[key], value, f"{path}: [{name}] {key}", base)
        shared = {
            key: from_toml(options[key], value, f"{path}: {key}", base)
            for key, value in top.items()
            if key in options
        }
        out[name] = (mine, shared)
    return out


def _hint(key: str) -> str:
    """For a key written with ``_`` or ``--``: the name it should have."""
    fixed = key.lstrip("-").replace("_", "-")
    return f" (keys are long option names without '--': {fixed!r})" if fixed != key else ""


# --- the environment --------------------------------------------------------------------------


def is_reserved(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def env_settings(
    environ: Mapping[str, str], parser: argparse.ArgumentParser, command: str
) -> tuple[dict[str, Setting], list[str]]:
    """The ``KVCS_*`` settings for ``command``, and the variables that name no option of
    any subcommand (for a warning). An empty variable counts as unset."""
    options = {o.env: o for o in command_options(parser, command).values()}
    every = {o.env for name in subcommands(parser) for o in command_options(parser, name).values()}
    settings: dict[str, Setting] = {}
    unknown: list[str] = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or is_reserved(name):
            continue
        if name in options:
            if environ[name] != "":
                settings[options[name].key] = from_text(options[name], environ[name], name)
        elif name not in every:
            unknown.append(name)
    return settings, unknown


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for a ``kvcs`` process that this one starts with every option it
    needs on its command line (``kvcs demo``'s relay): ``environ`` without
    ``KVCS_CONFIG`` and the ``KVCS_<OPTION>`` variables, so that the child runs exactly
    what it was given (a user's ``[relay]`` table must not turn the demo's relay into
    theirs); the project's other switches (``KVCS_UDP_GSO``, ...) are kept."""
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith(ENV_PREFIX) or (is_reserved(name) and name != CONFIG_ENV)
    }


# --- putting it together ----------------------------------------------------------------------


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [parser, *subcommands(parser).values()]


def parse_args(
    build: Callable[[], argparse.ArgumentParser],
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse ``argv`` (``None``: ``sys.argv[1:]``) with ``environ`` and the TOML file:
    the namespace, and where each option that did not come from the command line or
    its default was read (``{"stack": "KVCS_STACK"}``).

    Raises:
        CliError: the file or a variable is refused (status 5 or 2).
        SystemExit: the command line is refused (argparse's status 2), or --help.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    probe = build()
    for p in _all_parsers(probe):
        for action in p._actions:
            if _kind(action) is not None:
                action.default = argparse.SUPPRESS
    given = probe.parse_args(args)  # exactly what the command line gives
    command: str = given.command
    final = build()
    options = command_options(final, command)
    given_keys = {k for k, o in options.items() if hasattr(given, o.action.dest)}

    config = getattr(given, "config", None)
    path, what = (Path(config), "--config") if config is not None else (None, CONFIG_ENV)
    if path is None and environ.get(CONFIG_ENV):
        path = Path(environ[CONFIG_ENV])
    levels: list[dict[str, Setting]] = []
    env, unknown = env_settings(environ, final, command)
    for name in unknown:
        print(f"kvcs: warning: {name} names no kvcs option; ignored", file=sys.stderr)
    levels.append(env)
    if path is not None:
        levels.extend(load_file(path, final, what)[command])

    chosen: dict[str, tuple[int, Setting]] = {}
    for key in options:
        if key in given_keys:
            continue
        for rank, level in enumerate(levels):
            if key in level:
                chosen[key] = (rank, level[key])
                break
    _claim_exclusive(subcommands(final)[command], options, given_keys, levels, chosen)

    sources: dict[str, str] = {}
    for key, (_, setting) in chosen.items():
        options[key].action.default = setting.value
        if setting.claims:
            sources[key] = setting.where
    namespace = final.parse_args(args)
    return namespace, sources


def _claim_exclusive(
    parser: argparse.ArgumentParser,
    options: dict[str, Option],
    given_keys: set[str],
    levels: list[dict[str, Setting]],
    chosen: dict[str, tuple[int, Setting]],
) -> None:
    """Within each group of mutually exclusive options, keep only what the highest place
    that sets one of them gives; two of them set in one place are an error."""
    by_action = {id(o.action): o.key for o in options.values()}
    for group in parser._mutually_exclusive_groups:
        keys = [by_action[id(a)] for a in group._group_actions if id(a) in by_action]
        top = -1 if any(k in given_keys for k in keys) else None
        for rank, level in enumerate(levels):
            if top is not None:
                break
            claimed = [level[k] for k in keys if k in level and level[k].claims]
            if len(claimed) > 1:
                names = " and ".join(s.where for s in claimed)
                raise CliError(f"{names}: not allowed together", Exit.USAGE)
            if claimed:
                top = rank
        if top is None:
            continue
        for key in keys:
            if key in chosen and chosen[key][0] > top:
                del chosen[key]
