"""Drift early warning: is there a release on the package index newer than the newest
the matrix ran?

For each upstream package the stack pins (:data:`PACKAGES`), the newest version
installed in any row of the report is compared with the index's latest release
(PyPI's JSON API, ``<index>/<distribution>/json``, field ``info.version``: the newest
non-pre-release). A newer one is "not yet tested: flax 0.12.9". An index that cannot
be reached, or answers with something else, is said so in the result; it never fails
the report.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from packaging.version import InvalidVersion, Version

PACKAGES: dict[str, str] = {
    "tunix": "google-tunix",
    "qwix": "qwix",
    "flax": "flax",
    "jax": "jax",
    "optax": "optax",
    "orbax": "orbax-checkpoint",
}
"""Short name -> distribution, in report order."""
DEFAULT_INDEX = os.environ.get("POSTTRAIN_INDEX_URL", "https://pypi.org/pypi")
TIMEOUT_S = 10.0


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def newest_tested(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Distribution -> the newest version installed in any row (rows that ran only)."""
    found: dict[str, str] = {}
    for row in rows:
        for dist, text in row.get("versions", {}).items():
            if dist not in PACKAGES.values() or _version(text) is None:
                continue
            if dist not in found or _version(text) > _version(found[dist]):
                found[dist] = text
    return found


def latest(dist: str, index: str, timeout: float = TIMEOUT_S) -> str:
    """The index's latest release of ``dist``.

    Raises:
      OSError: the index cannot be reached (``urllib.error.URLError``, a timeout);
      ValueError: the answer is not the JSON API's ``{"info": {"version": ...}}``.
    """
    url = f"{index.rstrip('/')}/{dist}/json"
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body = json.load(answer)
    try:
        return str(body["info"]["version"])
    except (KeyError, TypeError):
        raise ValueError(f"{url}: no info.version in the answer") from None


def check(
    rows: Sequence[dict[str, Any]], index: str = DEFAULT_INDEX, timeout: float = TIMEOUT_S
) -> dict[str, Any]:
    """The drift section of the report.

    Returns ``{"index", "checked", "error", "packages"}``: ``error`` is None or why the
    index could not be asked (the packages after that one are not asked); each package
    is ``{"name", "distribution", "tested", "latest", "newer", "error"}`` (``newer``: the
    index has a release newer than ``tested``, None when no row installed it; ``error``:
    the index does not know the package). ``index="off"``: nothing asked, ``error`` says
    so. Never raises: whatever the index answers is reported, credentials in its URL
    left out.
    """
    tested = newest_tested(rows)
    given, index = index, _without_credentials(index)
    result: dict[str, Any] = {
        "index": index,
        "checked": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "error": None,
        "packages": [],
    }
    for name, dist in PACKAGES.items():
        entry: dict[str, Any] = {
            "name": name,
            "distribution": dist,
            "tested": tested.get(dist),
            "latest": None,
            "newer": False,
            "error": None,
        }
        result["packages"].append(entry)
        if index == "off":
            result["error"] = "not asked (--index-url off)"
            continue
        if result["error"]:
            continue
        try:
            entry["latest"] = latest(dist, given, timeout)
        except urllib.error.HTTPError as error:  # this package only (404: not on the index)
            entry["error"] = f"{error.code} {error.reason}"
            continue
        except Exception as error:  # unreachable, or not the JSON API: say so, never fail
            reason = getattr(error, "reason", None) or error
            result["error"] = f"index {index} could not be asked: {type(error).__name__}: {reason}"
            continue
        have, new = _version(entry["tested"] or ""), _version(entry["latest"])
        entry["newer"] = bool(new and (have is None or new > have))
    return result


def _without_credentials(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if not parts.username and not parts.password:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def lines(drift: dict[str, Any] | None) -> list[str]:
    """The report's sentences: one "not yet tested" per newer release, else that every
    package is at its latest; or why the index could not be asked."""
    if not drift:
        return ["Upstream releases: not checked."]
    out = []
    if drift["error"]:
        out.append(f"Upstream releases: {drift['error']}.")
    for p in drift["packages"]:
        if p.get("error"):
            out.append(
                f"{p['name']}: the index did not answer for {p['distribution']} ({p['error']})"
            )
        if p["newer"]:
            tested = f"newest tested {p['tested']}" if p["tested"] else "never installed"
            out.append(f"not yet tested: {p['name']} {p['latest']} ({tested})")
    if not out:
        out.append(
            f"Upstream releases: every pinned package's newest release on {drift['index']} "
            f"has been tested (checked {drift['checked']})."
        )
    return out
