"""The registered methods: adding one is one folder and one line in `METHODS`."""
from __future__ import annotations

from cmoe_jax.errors import CmoeError
from cmoe_jax.methods import conmoe, expertweaver, hierarchical
from cmoe_jax.methods.cmoe import job as cmoe  # its METHOD apart from the light carving package
from cmoe_jax.methods.method import Method

METHODS: list[Method] = [
    cmoe.METHOD,
    hierarchical.METHOD,
    expertweaver.METHOD,
    conmoe.METHOD,
]


def for_command(command: str) -> list[Method]:
    return [m for m in METHODS if m.command == command]


def choices(command: str) -> list[str]:
    """The `--method` values of `command`, in registration order."""
    seen = []
    for m in for_command(command):
        seen += [c for c in m.choices if c not in seen]
    return seen


def for_choice(command: str, choice: str) -> list[Method]:
    return [m for m in for_command(command) if choice in m.choices]


def primary(command: str, choice: str) -> Method:
    """The method that reads the flags of `--method choice` (the first registered)."""
    return next(m for m in for_choice(command, choice) if m.from_args is not None)


def select(settings, config) -> Method:
    """The method that runs `settings` on a source of `config`."""
    for m in METHODS:
        if isinstance(settings, m.settings) and (m.takes_source is None or m.takes_source(config)):
            return m
    raise CmoeError(f"no registered method takes {type(settings).__name__} for this source")


def group_title(choice: str) -> str:
    return f"{choice} (with --method {choice})"


def add_method_flags(parser, command: str) -> None:
    """Each `--method` value's flag group, from the methods registered for `command`; records
    on the parser which destinations belong to which value (`parser.method_flags`)."""
    parser.method_flags = {}
    for choice in choices(command):
        methods = [m for m in for_choice(command, choice) if m.flags_for(choice)]
        if not methods:
            continue
        before = {a.dest for a in parser._actions}
        group = parser.add_argument_group(group_title(choice))
        for m in methods:
            m.add_flags(group)
        parser.method_flags[choice] = [a.dest for a in parser._actions if a.dest not in before]


def parse_method_args(parser, command: str, argv):
    """`parser.parse_args(argv)`, then `check_method_flags`: a command's flags, checked."""
    args = parser.parse_args(argv)
    check_method_flags(parser, args, command)
    return args


def check_method_flags(parser, args, command: str) -> None:
    """One `error:` line when a flag given does not apply to the chosen `--method`: another
    value's flag group, or a shared flag the method refuses; then the method's own checks."""
    chosen = args.method
    method = primary(command, chosen)
    foreign = {d: c for c, dests in parser.method_flags.items() if c != chosen for d in dests}
    bad = [a.dest for a in parser._actions
           if (a.dest in foreign or a.dest in method.refuses) and a.dest in args.given]
    if method.refuse_note:
        reason = method.refuse_note
    else:
        owners = [primary(command, foreign[d]).title for d in bad if d in foreign]
        reason = f"{', '.join(dict.fromkeys(owners))} flags"
    parser.reject(args, list(dict.fromkeys(bad)), f"to --method {chosen} ({reason})")
    if method.check_args is not None:
        method.check_args(args, parser.error)


def method_help(command: str) -> str:
    return " or ".join(m.summary for m in for_command(command) if m.summary)
