"""What a package index shows of shardstream: README.md is the project page
too (pyproject's ``readme``), so its links must work outside the repository,
and the project's URLs, license and classifiers must be declared."""

from __future__ import annotations

import re

import tomllib
from _shardtest import REPO_ROOT

README = REPO_ROOT / "README.md"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
LINK = re.compile(r"\]\(([^)\s]+)\)")


def repository_url() -> str:
    return PYPROJECT["project"]["urls"]["Source"]


def anchors(markdown: str) -> set[str]:
    """The heading anchors a Markdown renderer (GitHub's, PyPI's) makes:
    lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_readme_links_lead_somewhere_from_a_package_index():
    text = README.read_text()
    blob = repository_url() + "/blob/main/"
    tree = repository_url() + "/tree/main/"
    links = LINK.findall(text)
    assert len(links) > 20, links
    into_repository = 0
    for link in links:
        path, _, fragment = link.partition("#")
        if not path:
            # An anchor in README itself: a heading must make it.
            assert fragment in anchors(text), f"README links to #{fragment}: no such heading"
            continue
        assert link.startswith("https://"), f"README link {link!r}: not absolute"
        for prefix in (blob, tree):
            if path.startswith(prefix):
                target = REPO_ROOT / path[len(prefix) :]
                assert target.exists(), f"README link {link!r}: {target} does not exist"
                if fragment:
                    assert fragment in anchors(target.read_text()), (
                        f"README link {link!r}: no heading makes #{fragment}"
                    )
                into_repository += 1
    assert into_repository > 20


def test_pyproject_declares_what_an_index_page_needs():
    project = PYPROJECT["project"]
    assert set(project["urls"]) >= {"Homepage", "Documentation", "Source", "Issues"}
    for url in project["urls"].values():
        assert url.startswith(repository_url()), url
    assert project["license"] == "Apache-2.0"
    # The project's license, then the notices of what the extension links.
    assert project["license-files"] == ["LICENSE", "THIRD_PARTY_NOTICES.md"]
    assert "Apache License" in (REPO_ROOT / "LICENSE").read_text()
    notices = (REPO_ROOT / "THIRD_PARTY_NOTICES.md").read_text()
    assert "based in part on the work of the Independent JPEG Group" in notices
    assert "Redistribution and use in source and binary forms" in notices
    classifiers = project["classifiers"]
    assert "Operating System :: POSIX :: Linux" in classifiers
    # One classifier per CPython the abi3 wheel is tested on or declares.
    minimum = project["requires-python"].removeprefix(">=")
    assert f"Programming Language :: Python :: {minimum}" in classifiers
