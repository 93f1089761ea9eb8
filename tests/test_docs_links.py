"""Every relative link in README.md, docs/*.md and the README.md files under scripts/ resolves: the file exists,
and a `#anchor` names a heading of the target (GitHub's slugs). Pure stdlib, no model: a moved section or a renamed
heading fails here, not for a reader. A negative control checks that the checker finds broken links at all."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading):
    """GitHub's anchor for a heading: lowercase, punctuation dropped except '-' and '_', spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def prose_lines(text):
    """The lines outside fenced code blocks, with their 1-based numbers."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def anchors(text):
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeats."""
    seen, out = {}, set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(text, here, read=lambda p: p.read_text()):
    """(line, target, why) for each relative link in `text` (a file in folder `here`) that does not resolve."""
    found = []
    for number, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)                            # links inside code spans are not links
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):         # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            if path:
                file = (here / path).resolve()
                if not file.exists():
                    found.append((number, target, "no such file"))
                    continue
                if not anchor or file.suffix.lower() != ".md":
                    continue
                names = anchors(read(file))
            else:
                names = anchors(text)
            if anchor and anchor not in names:
                found.append((number, target, "no such heading"))
    return found


def doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "scripts").rglob("README.md"))]


def test_every_relative_link_and_anchor_resolves():
    problems = []
    for doc in doc_files():
        for number, target, why in broken_links(doc.read_text(), doc.parent):
            problems.append(f"{doc.relative_to(ROOT)}:{number}: ({target}) {why}")
    assert problems == [], "\n".join(problems)


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section (with `code`, issue 7)\n\n## Twice\n\n## Twice\n")
    text = "\n".join([
        "# Here",
        "[fine](other.md) [fine](other.md#a-section-with-code-issue-7) [fine](other.md#twice-1) [fine](#here)",
        "[gone](missing.md) [no heading](other.md#a-section) [no local heading](#there) ![gone](pic.png)",
        "`[in code](missing.md)` [web](https://example.com/x#y)",
        "```",
        "[in a fence](missing.md)",
        "```",
    ])
    assert broken_links(text, tmp_path) == [
        (3, "missing.md", "no such file"),
        (3, "other.md#a-section", "no such heading"),
        (3, "#there", "no such heading"),
        (3, "pic.png", "no such file"),
    ]
    assert slug("Reading `results.json`") == "reading-resultsjson"
    before = 'Selecting before the vision tower (encode="before")'
    assert slug(before) == "selecting-before-the-vision-tower-encodebefore"
