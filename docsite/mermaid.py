"""Mermaid served with the site, not from a CDN: a page with a diagram gets the vendored copy of
mermaid's browser build (docs/assets/vendor/mermaid/, from the npm package, put there by
scripts/vendor-mermaid.sh), which mkdocs-material's own mermaid support then uses instead of
fetching one from unpkg. Readers beside a GPU cluster are often offline; they see the diagrams.

Why not draw the diagrams at build time: that needs a browser at every build (mermaid lays out
text with the browser's fonts; its command-line tool drives a Chromium that puppeteer
downloads), whereas a copied script keeps `mkdocs build` pure Python and the theme's styling
of the diagrams (light and dark) intact. The cost is 3.5 MB in the repository, loaded only by
pages that hold a diagram.

mkdocs loads this module as a hook (`hooks:` in mkdocs.yml).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MERMAID_VERSION = "11.17.2"  # material for mkdocs asks for mermaid@11
MERMAID_SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"
MERMAID_JS = "assets/vendor/mermaid/mermaid.min.js"  # under docs/, and so under the site

# material's bundle looks for a global `mermaid` when it first meets a diagram (after the page's
# scripts have run) and fetches its own only when there is none: ours goes in before it.
_BUNDLE = re.compile(r'<script src="[^"]*assets/javascripts/bundle\.[0-9a-f]+\.min\.js">')


def with_mermaid(html: str, page_url: str) -> str:
    """`html` with a script tag for the vendored mermaid, when the page has a diagram."""
    if 'class="mermaid"' not in html:
        return html
    from mkdocs.utils import get_relative_url

    src = get_relative_url(MERMAID_JS, page_url)
    tag = f'<script src="{src}"></script>\n'
    found = _BUNDLE.search(html)
    if found is None:
        raise RuntimeError(
            "docsite/mermaid.py: the theme's script bundle is not in the page; where does "
            "mkdocs-material load its scripts now?"
        )
    return html[: found.start()] + tag + html[found.start() :]


def on_post_page(output: str, page: Any, config: Any) -> str:
    return with_mermaid(output, page.url)
