"""Rich progress bars, and an adapter that lets tqdm-speaking libraries draw into them."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text
from tqdm.std import tqdm as base_tqdm


def make_progress(console: Console | None = None) -> Progress:
    """The progress display used by every CLI command (bars go to stderr)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        _AmountColumn(),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        transient=False,
    )


class _AmountColumn(ProgressColumn):
    """Bytes for byte-counted tasks (`unit="B"` field), "n/total" for the others."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = DownloadColumn()
        self._count = MofNCompleteColumn()

    def render(self, task: Task) -> Text:
        column = self._bytes if task.fields.get("unit") == "B" else self._count
        return column.render(task)


def rich_tqdm_class(progress: Progress) -> type[base_tqdm]:
    """A tqdm subclass whose bars are tasks of `progress` (for libraries that speak tqdm).

    tqdm itself is disabled (nothing is printed by it); `update`, iteration and total
    changes are forwarded to a rich task. Manual bars not counted in bytes (e.g. a file
    count next to a bytes bar) stay hidden to keep the display to one line per job.
    """

    class RichTqdm(base_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            unit = kwargs.get("unit", "it")
            iterable = args[0] if args else kwargs.get("iterable")
            iterable_total = len(iterable) if hasattr(iterable, "__len__") else None
            if iterable_total is not None and "total" not in kwargs:
                kwargs["total"] = iterable_total
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._task = progress.add_task(
                str(kwargs.get("desc") or "Downloading"),
                total=kwargs.get("total") or None,
                visible=unit == "B" or iterable_total is not None,
                unit=unit,
            )

        def __iter__(self) -> Any:
            for item in self.iterable:
                yield item
                progress.update(self._task, advance=1)

        def update(self, n: float | None = 1) -> bool | None:
            progress.update(self._task, advance=n or 0, total=self.total or None)
            return None

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            progress.update(self._task, total=self.total or None)

        def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
            progress.update(self._task, description=desc or "")

        def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
            self.set_description(desc)

        def close(self) -> None:
            progress.update(self._task, total=self.total or None)

    return RichTqdm
