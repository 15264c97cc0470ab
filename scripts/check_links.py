#!/usr/bin/env python3
"""Checks that every relative link of the documentation resolves (a ctest entry).

    python3 scripts/check_links.py              check README.md, CONTRIBUTING.md, CHANGELOG.md,
                                                benchmarks/README.md and docs/*.md
    python3 scripts/check_links.py FILE ...     check these Markdown files instead

A link is a Markdown link or image, inline (`[text](target)`, `![alt](target)`) or a reference
definition (`[name]: target`), outside code blocks and code spans. Links with a scheme (https:,
mailto:, …) are not checked. A relative target must name an existing file or folder, relative to the
file that links it; a `#anchor` part (alone: the same file) must be the GitHub id of a heading of the
target Markdown file, or an explicit `id`/`name` attribute in it.

Prints each broken link as FILE:LINE: message and exits 1; otherwise prints the number of links checked
and exits 0.
"""

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "benchmarks/README.md", "docs/*.md"]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                         r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>\n]*>|\S+)", re.M)
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ID = re.compile(r"<[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def blank_code(text):
    """The text with fenced code blocks and code spans replaced by spaces (newlines kept, so offsets
    and line numbers stay). Indented code blocks are rare in this documentation and not treated."""
    lines = text.split("\n")
    out, fence = [], None
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append(" " * len(line))
        elif fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                fence = None
            out.append(" " * len(line))
        else:
            out.append(line)
    text = "\n".join(out)
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def heading_text(raw):
    """The rendered text of a heading's Markdown, as far as GitHub's id depends on it."""
    text = re.sub(r"`+([^`]*?)`+", r"\1", raw)                    # code spans keep their content
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)         # links and images keep their text
    text = re.sub(r"<[^>]+>", "", text)                            # HTML tags
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)           # emphasis markers
    return text.strip()


def github_slug(text):
    """GitHub's heading id: lower case; letters, marks, numbers, '_', '-' and spaces kept, every other
    character removed; each space becomes '-'."""
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors_of(path, cache={}):
    """Every id a link may name in the Markdown file `path`: heading ids (repeated ones get -1, -2, …)
    and explicit HTML id/name attributes."""
    if path in cache:
        return cache[path]
    text = path.read_text(encoding="utf-8")
    lines = blank_code(text).split("\n")
    ids, seen = set(), {}

    def add(raw):
        slug = github_slug(heading_text(raw))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")

    for i, line in enumerate(lines):
        m = ATX_HEADING.match(line)
        if m:
            add(m.group(2) or "")
        elif (i > 0 and SETEXT_UNDERLINE.match(line) and lines[i - 1].strip()
              and not ATX_HEADING.match(lines[i - 1]) and not lines[i - 1].lstrip().startswith(("|", "-", "*", ">"))):
            add(lines[i - 1].strip())
    ids.update(HTML_ID.findall(text))
    cache[path] = ids
    return ids


def links_of(path):
    """(line, target) of every link in the Markdown file `path`."""
    text = blank_code(path.read_text(encoding="utf-8"))
    found = []
    for pattern, group in ((INLINE_LINK, 2), (REFERENCE_DEF, 2)):
        for m in pattern.finditer(text):
            target = m.group(group)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((text.count("\n", 0, m.start()) + 1, target.strip()))
    return sorted(found)


def check_link(source, target):
    """None when `target`, linked from the file `source`, resolves; otherwise what is wrong."""
    if not target:
        return "empty link target"
    if SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part, anchor = unquote(path_part), unquote(anchor)
    if path_part.startswith("/"):
        resolved = (REPO / path_part.lstrip("/")).resolve()
    elif path_part:
        resolved = (source.parent / path_part).resolve()
    else:
        resolved = source.resolve()
    if not resolved.exists():
        return f"no such file or folder: {path_part}"
    if anchor and resolved.is_file() and resolved.suffix.lower() in (".md", ".markdown"):
        if anchor not in anchors_of(resolved):
            where = path_part or source.name
            return f"no heading with the id #{anchor} in {where}"
    return None


def main(argv):
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv:
        files = [Path(a).resolve() for a in argv]
    else:
        files = sorted({p.resolve() for pattern in DEFAULT_FILES for p in REPO.glob(pattern)})
    broken = checked = 0
    for f in files:
        if not f.is_file():
            print(f"{f}: no such file")
            broken += 1
            continue
        try:
            shown = f.relative_to(REPO)
        except ValueError:
            shown = f
        for line, target in links_of(f):
            checked += 1
            problem = check_link(f, target)
            if problem:
                broken += 1
                print(f"{shown}:{line}: broken link ({target}): {problem}")
    in_files = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    if broken:
        print(f"check_links: {broken} broken of {checked} links in {in_files}")
        return 1
    print(f"check_links: all {checked} links in {in_files} resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
