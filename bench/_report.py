"""What every bench script does last: write its Markdown result (making the folder) and print it."""

from __future__ import annotations

from pathlib import Path


def write_report(out: str | Path, text: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {path}")


def emit(text: str, out: str | Path | None) -> None:
    """A script whose --out is optional: the file (printed too) when named, else standard output only."""
    if out:
        write_report(out, text)
    else:
        print(text, end="")
