"""What names a worker in an elastic pool, checked the same way by the worker (`--name`,
`--register`), the router (a join's body) and `pdserve ctl` (`--url`, `flip NAME`): a worker's
name and the base URLs of the cluster's HTTP servers. A name appears in URL paths
(`/internal/workers/NAME`), so it needs no escaping."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def check_worker_name(name: object) -> str:
    """`name` if it is a valid worker name, else ValueError saying what one is."""
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
        raise ValueError(f"a worker name is 1-64 letters, digits and . _ : - starting with a "
                         f"letter or digit, got {name!r}")
    return name


def check_base_url(url: object, what: str = "a URL") -> str:
    """`url` without its trailing slash if it is http(s)://HOST[:PORT] with no path, query or
    fragment, else ValueError naming `what`."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        valid = parts is not None and parts.scheme in ("http", "https") and \
            bool(parts.hostname) and parts.path in ("", "/") and not parts.query and \
            not parts.fragment and (parts.port or 0) >= 0
    except ValueError:  # a bad port
        valid = False
    if not valid:
        raise ValueError(f"{what} must be http://HOST:PORT (or https://), got {url!r}")
    return url.rstrip("/")
