"""What every benchmark script does with its result: JSON on stdout, or into the ``--json`` file."""

from __future__ import annotations

import json
from typing import Any


def write_json(result: dict[str, Any], path: str | None) -> None:
    """Print ``result`` as indented JSON, or write it to ``path`` when one is given."""
    text = json.dumps(result, indent=2)
    if path:
        with open(path, "w") as file:
            file.write(text + "\n")
    else:
        print(text)
