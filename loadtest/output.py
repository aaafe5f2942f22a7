"""Where a benchmark's results go: JSON, and a PNG beside it where matplotlib is installed (the
GPU machines may lack it). No imports beyond the standard library: it runs wherever they do."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_results(path: Path, data: dict, draw: Callable[[Path], None]) -> None:
    """`data` as JSON at `path`; `draw(png_path)` beside it, skipped without matplotlib."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    try:
        draw(path.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG")
    print(f"wrote {path}")
