"""Progress of a run's sample loop: on a terminal, on a log, and in the run's ``run.log``.

On a terminal (stderr is a TTY) a tqdm bar shows samples done and the running mean score. Redirected
to a file, a bar's carriage-return redraws become one long line of noise, so there a plain line is
printed at most every ``interval`` seconds (and after the last sample). Every sample also gets a line
in ``run.log``, whatever ``progress=`` says: the log is the run's record, the bar only a view.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(
        self,
        run_dir: Any,
        *,
        total: int | None,
        enabled: bool = True,
        interval: float = 10.0,
        stream: TextIO | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.total = total
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = 0
        self.scored = 0  # samples with a score (tasks without gold answers score None)
        self.score_sum = 0.0
        self.started = self.last_line = time.perf_counter()
        self.bar = None
        self.plain = enabled and not _is_tty(self.stream)
        if enabled and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total,
                desc=run_dir.path.name,
                unit="sample",
                file=self.stream,
                dynamic_ncols=True,
                mininterval=1.0,
            )

    @property
    def mean(self) -> float:
        return self.score_sum / self.scored if self.scored else float("nan")

    def sample(self, sample_id: str, score: float | None, seconds: float) -> None:
        """One finished sample: its score (when it has one) joins the running mean."""
        self.done += 1
        if score is not None:
            self.scored += 1
            self.score_sum += float(score)
        of = f"/{self.total}" if self.total is not None else ""
        shown = f"{score:.2f}" if score is not None else "none"
        self.run_dir.log(
            f"sample {sample_id}: score {shown} in {seconds:.1f} s ({self.done}{of} this run, "
            f"mean score {self.mean:.2f})"
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(mean=f"{self.mean:.1f}")  # the running mean score, not the last sample's
        elif self.plain:
            clock = time.perf_counter()
            if clock - self.last_line >= self.interval or self.done == self.total:
                self.last_line = clock
                print(
                    f"{self.run_dir.path.name}: {self.done}{of} samples, mean score {self.mean:.1f}, "
                    f"{clock - self.started:.0f} s",
                    file=self.stream,
                    flush=True,
                )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
