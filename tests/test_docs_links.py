"""Every link in the project's markdown stays inside the repository and names a file or folder that exists.

A clone has nothing beside it (the README once sent its reader to `../shared/DESIGN.md`), so a link that leaves
the checkout, a path in inline code that does, or an absolute URL standing in for a file of ours, is a broken
link for the next reader.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
PATH_IN_CODE = re.compile(r"`(\.\./[^`\s]*)`")


def markdown_files() -> list[Path]:
    named = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md"]
    return [p for p in named if p.exists()] + sorted((ROOT / "docs").glob("*.md"))


def links_in(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link or image outside code blocks and inline code, and of every
    inline-code path that starts with `../` (a reader follows it like a link)."""
    found: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        found.extend((number, m.group(1)) for m in LINK.finditer(INLINE_CODE.sub("", line)))
        found.extend((number, m.group(1)) for m in PATH_IN_CODE.finditer(line))
    return found


def broken_links(path: Path) -> list[str]:
    wrong = []
    for number, target in links_in(path.read_text(encoding="utf-8")):
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("/"):
            wrong.append(f"{where} (not a relative link inside the repository)")
            continue
        file_part = target.split("#", 1)[0]
        if not file_part:
            continue  # an anchor in the same file
        resolved = (path.parent / file_part).resolve()
        if not resolved.is_relative_to(ROOT):
            wrong.append(f"{where} (leaves the repository)")
        elif not resolved.exists():
            wrong.append(f"{where} (no such file)")
    return wrong


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_inside_the_repository_and_resolves(path):
    assert broken_links(path) == []


def test_the_check_sees_a_link_out_of_the_repository_and_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("x")
    page = tmp_path / "README.md"
    page.write_text(
        "[design](../shared/DESIGN.md) [a](docs/a.md#part) [b](docs/b.md) [web](https://example.org)\n"
        "```\n[in code](../nowhere.md)\n```\n`[inline](../nowhere.md)` ![plot](docs/a.md) see `../shared/DESIGN.md`\n"
    )
    assert [line.split(": ", 1)[1] for line in broken_links(page)] == [
        "../shared/DESIGN.md (leaves the repository)",
        "docs/b.md (no such file)",
        "https://example.org (not a relative link inside the repository)",
        "../shared/DESIGN.md (leaves the repository)",
    ]
