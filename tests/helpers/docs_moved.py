"""Did every figure that left the README land in the docs? A check for moving text out of README.md (issue 43).

    python tests/helpers/docs_moved.py --base d27d901        # the README as it was at that commit

Every line of the old README that is a table row or holds a digit is looked up in the new README and docs/**/*.md:

- ``same``: the line, whitespace collapsed and a leading list marker dropped, is in the new text word for word
  (prose is compared against the pages' lines joined by spaces, so a paragraph may be re-wrapped);
- ``figures``: the line is not, but its numbers appear in the same order, one after another, in one page (a line
  whose cross-reference was rewritten as a link, its figures untouched);
- ``missing``: neither. Each is printed, for a person to judge: a figure lost, or a number that is no figure
  (``exit 2``, ``mpiexec -n 8``), or one re-measured on purpose.

Exit status 1 when a line is missing and ``--allow`` does not list it (a file of such lines, one per line, each
after a ``#`` line saying why: ``tests/helpers/docs_moved_allowed.txt`` for issue 43).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def normal(line: str) -> str:
    text = " ".join(line.split())
    return re.sub(r"^(?:[-*] |\d+\. )", "", text)


def candidates(readme: str) -> List[str]:
    """The old README's lines that carry figures: table rows (not separators) and lines with a digit."""
    out, fenced = [], False
    for line in readme.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        text = normal(line)
        if not text or re.fullmatch(r"\|[-| ]+\|", text):
            continue
        if text.startswith("|") or NUMBER.search(text):
            out.append(text)
    return out


def pages(root: Path) -> Dict[str, str]:
    found = {"README.md": (root / "README.md").read_text()}
    found.update({str(p.relative_to(root)): p.read_text() for p in sorted((root / "docs").rglob("*.md"))})
    return found


def classify(line: str, texts: Dict[str, str]) -> str:
    for text in texts.values():
        if line in text or line in " ".join(normal(x) for x in text.splitlines()):
            return "same"
    numbers = NUMBER.findall(line)
    if numbers:
        for text in texts.values():
            stream = NUMBER.findall(text)
            n = len(numbers)
            if any(stream[i:i + n] == numbers for i in range(len(stream) - n + 1)):
                return "figures"
    return "missing"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit whose README.md the text left")
    p.add_argument("--allow", type=Path, help="a file of lines judged fine although missing, one per line "
                   "(# starts a comment line)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the lines kept as figures only")
    args = p.parse_args(argv)
    old = subprocess.run(["git", "show", f"{args.base}:README.md"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    texts = pages(ROOT)
    allowed = set()
    if args.allow:
        allowed = {normal(x) for x in args.allow.read_text().splitlines() if x.strip() and not x.startswith("#")}
    verdicts: Dict[str, List[str]] = {"same": [], "figures": [], "missing": []}
    for line in candidates(old):
        verdicts[classify(line, texts)].append(line)
    missing = [x for x in verdicts["missing"] if x not in allowed]
    print(f"{len(verdicts['same']) + len(verdicts['figures']) + len(verdicts['missing'])} lines of the old README "
          f"carry a digit or are table rows: {len(verdicts['same'])} word for word in the new text, "
          f"{len(verdicts['figures'])} with their figures in order, {len(verdicts['missing'])} missing "
          f"({len(verdicts['missing']) - len(missing)} of them allowed)")
    for kind in (("figures", "missing") if args.verbose else ("missing",)):
        for line in verdicts[kind]:
            mark = " (allowed)" if line in allowed else ""
            print(f"{kind}{mark}: {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
