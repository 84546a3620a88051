"""Index folders as earlier code wrote them: the photo table as `meta.jsonl`, one JSON object
a row, instead of `index.table`'s columns."""

import json
from pathlib import Path

from index.store import META_FILE
from index.table import TABLE_FILES, PhotoTable


def to_meta_jsonl(version: Path) -> None:
    """Replace the photo table of a version folder by the meta.jsonl earlier code wrote."""
    rows = [{"id": p.id, "class": p.cls, "path": p.path} for p in PhotoTable.open(version)]
    (version / META_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in TABLE_FILES:
        (version / name).unlink()
