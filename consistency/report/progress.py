"""A rich progress bar for long passes, shown only on a terminal and only past a second."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

Tick = Callable[[int], None]


def factory() -> Callable[[str, int], Tick]:
    """Return ``make(label, total) -> tick(n)``; the bar appears after 1 s of work."""

    def make(label: str, total: int) -> Tick:
        start = time.monotonic()
        state: dict[str, object] = {"bar": None, "done": 0}

        def tick(n: int) -> None:
            state["done"] = int(state["done"]) + n  # type: ignore[arg-type]
            bar = state["bar"]
            if bar is None and time.monotonic() - start > 1.0:
                bar = Progress(TextColumn(label), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                               TimeRemainingColumn(), transient=True)
                bar.start()
                bar.add_task(label, total=total, completed=int(state["done"]))  # type: ignore[arg-type]
                state["bar"] = bar
            elif isinstance(bar, Progress):
                bar.update(bar.task_ids[0], completed=int(state["done"]))  # type: ignore[arg-type]
            if isinstance(bar, Progress) and int(state["done"]) >= total:  # type: ignore[arg-type]
                bar.stop()

        return tick

    return make
