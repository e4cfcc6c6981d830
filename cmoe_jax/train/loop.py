"""The step loop of a training run, written once for fine-tuning and downcycling.

Each step appends its record to the log and passes the fault point "step"; the state is
checkpointed every `save_every` steps and after the last one (the caller's `save` passes
"checkpoint"), so a killed run resumes from its latest checkpoint with the log it had then.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from tqdm.auto import tqdm

from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs import fault_point

DONE, OUT_OF_TIME, STOPPED = "done", "out of time", "stopped"


def finite_loss(loss: float, step: int, advice: str) -> float:
    """`loss`, or one line when the step made it NaN or infinite: training diverged, so
    nothing is published (`advice`: the flags to lower)."""
    if not math.isfinite(loss):
        raise CmoeError(f"the loss became {loss} at step {step}: {advice}")
    return loss


@dataclasses.dataclass
class TrainLoop:
    """`step(i)` runs step i (from 0) and returns its log record (with its "seconds");
    `save(n)` checkpoints the state after n steps; `postfix(record)` is the progress bar's.
    `out_of_time(seconds of the last step)` says whether to stop before the next step;
    `stop_after` exists for testing interruption (stop as if killed after that step)."""

    step: Callable[[int], dict]
    save: Callable[[int], None]
    save_every: int | None
    postfix: Callable[[dict], dict]
    desc: str
    progress: bool = True
    out_of_time: Callable[[float], bool] | None = None
    stop_after: int | None = None

    def run(self, log: list, start: int, total: int, saved_at: int | None) -> str:
        """Steps `start` .. `total - 1` appended to `log`; `saved_at`: the step of the latest
        checkpoint. Returns DONE, OUT_OF_TIME or STOPPED (then without a final checkpoint)."""
        last_seconds, how = 0.0, DONE
        bar = tqdm(total=total, initial=start, desc=self.desc, disable=not self.progress)
        for i in range(start, total):
            if self.out_of_time is not None and self.out_of_time(last_seconds):
                how = OUT_OF_TIME
                break
            try:
                log.append(self.step(i))
            except BaseException:  # the bar cleared, so that the error is the job's one line
                bar.leave = False
                bar.close()
                raise
            last_seconds = log[-1]["seconds"]
            bar.update(1)
            bar.set_postfix(**self.postfix(log[-1]))
            fault_point("step")
            if self.save_every and (i + 1) % self.save_every == 0:
                self.save(i + 1)
                saved_at = i + 1
            if self.stop_after is not None and i + 1 >= self.stop_after:
                bar.close()
                return STOPPED
        bar.close()
        if saved_at != len(log):
            self.save(len(log))
        return how
