"""What every benchmark prints: machine info, a Markdown table of rows, and the JSON file."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np


def report(rows: list[dict[str, Any]], json_path: Path | None = None, **extra: Any) -> None:
    info = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "numpy": np.__version__, **extra}
    print(json.dumps(info))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    if json_path:
        json_path.write_text(json.dumps({"info": info, "rows": rows}, indent=1))


def emit(res: dict[str, Any], out: Path | None) -> None:
    """A GPU bench's result: printed (the device tool returns the output) and written to ``out``."""
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        out.write_text(text)
