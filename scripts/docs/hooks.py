"""The docs site's build hook (``mkdocs.yml``: ``hooks``): under each Python
example it puts the output that example printed when ``scripts/docs/examples.py``
last ran it. An example that changed since, or never ran, fails the build: the
output shown is always the output produced."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

BLOCK = re.compile(r"^```python\n(.*?)^```\n?", re.S | re.M)


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def on_page_markdown(markdown: str, page, config, files) -> str:
    sources = BLOCK.findall(markdown)
    if not sources:
        return markdown
    name = page.file.src_uri
    found = Path(config["docs_dir"]) / "_outputs" / (name[:-3] + ".json")
    if not found.is_file():
        raise PluginError(f"{name}: its examples have not run (python scripts/docs/examples.py {name})")
    ran = json.loads(found.read_text())["blocks"]
    if [block["sha"] for block in ran] != [_digest(source) for source in sources]:
        raise PluginError(
            f"{name}: its examples changed since they ran (python scripts/docs/examples.py {name})"
        )
    outputs = iter(block["stdout"] for block in ran)

    def with_output(match: re.Match) -> str:
        printed = next(outputs)
        if not printed.strip():
            return match.group(0)
        fence = "````" if "```" in printed else "```"
        return f'{match.group(0)}\n{fence}text title="output"\n{printed.rstrip()}\n{fence}\n'

    return BLOCK.sub(with_output, markdown)
