"""Container healthcheck: exit 0 when GET <url> answers 200, else 1.

    python healthcheck.py http://127.0.0.1:8000/readyz

Standard library only (the image has no curl). /readyz needs no token; it is 200 once
every model is loaded and each table's lookup path ran once (docs/http.md), so a
container is healthy when its first lookup is as fast as the next.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else "http://127.0.0.1:8000/readyz"
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return 0 if answer.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
