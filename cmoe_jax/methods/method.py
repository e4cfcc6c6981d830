"""What a method plugs in: one `Method` per folder under `cmoe_jax/methods/`, listed in
`cmoe_jax.methods.registry`. The commands build their `--method` choices, their flag groups
and their "flag X does not apply to method Y" errors from it, and run its `steps` with the
job skeleton (`cmoe_jax.jobs.run_job`)."""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Method:
    """A conversion or compression method, as the commands and the job skeleton see it.

    - `command`: the command that runs it ("convert" or "compress"); `choices`: its `--method`
      values (several methods may share one, told apart by `takes_source`).
    - `settings`: its settings dataclass; `steps`: `steps(settings)` gives the object whose
      `kind`, `validate`, `prepare`, `work`, `interrupted` and `write_report` the job runs.
    - `add_flags(group)`: its own flags, added to the "`choice` (with --method `choice`)" group
      of every choice in `flag_choices` (default: all its choices).
    - `from_args(args)`: its settings from the parsed flags; `check_args(args, error)`: checks
      across flags, calling `error(message)` on a bad combination.
    - `refuses`: shared flags (argparse destinations) it does not take, and `refuse_note`
      why, for its "does not apply" error.
    """

    name: str
    command: str
    choices: tuple[str, ...]
    title: str
    summary: str
    settings: type
    steps: Callable
    add_flags: Callable | None = None
    from_args: Callable | None = None
    check_args: Callable | None = None
    takes_source: Callable | None = None  # config -> bool; None: any source
    flag_choices: tuple[str, ...] | None = None
    refuses: tuple[str, ...] = ()
    refuse_note: str = ""
    single_process: bool = False  # refused in a multi-process run

    def flags_for(self, choice: str) -> bool:
        return self.add_flags is not None and choice in (self.flag_choices or self.choices)
