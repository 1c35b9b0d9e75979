"""MkDocs hook: the site's home page is the README (one text, two homes), its links rewritten
from the repository's root to the docs folder."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    text = README.read_text()
    text = re.sub(r"\]\(docs/", "](", text)
    text = text.replace("[CONTRIBUTING.md](CONTRIBUTING.md)", "`CONTRIBUTING.md` in the repository")
    return re.sub(r"Full documentation:.*?\n\n", "", text, count=1, flags=re.S)
