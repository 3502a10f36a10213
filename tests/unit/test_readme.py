"""Every code block in README.md and in the pages of docs/ runs as written, the way the README says to run them.

- A ```` ```python ```` block runs as ``python -`` with the block on stdin, in a folder that holds the repository's
  ``examples/`` and a copy of ``benchmarks/results/`` (what the blocks read), so it sees what a ``python`` started
  in the repository root sees, and what it writes (checkpoints, pictures) lands in a scratch folder.
- A ```` ```bash ```` block runs command by command (a line, with its ``\\`` continuations) in bash, in such a
  folder; every command must exit with status 0. Not run, for the reasons in :data:`SKIPPED`: the set-up
  commands (``pip install``, and ``pytest``, which runs this suite), ``python -m benchmarks`` (7 to 45
  minutes), two-node torchrun lines (they need two machines) and the 4-process Pipe-BD torchrun line (tested
  elsewhere). Commands in :data:`SMALLER` run with the smaller settings named there appended (argparse keeps
  the last value), so that, with two blocks running at a time, the whole file takes about a minute on 2 cores.
- The README's recipe, saved to a file in a folder outside the repository, runs there as ``python train.py``
  (where only the package is importable, not ``examples``), and a second run resumes from its checkpoint.
- Every relative link of the README and the pages leads to a file that exists (and to a heading, with ``#``).
- Output blocks (```` ```text ````, or a bare fence) are not run. One that directly follows a python block is
  that block's output and must equal what the block prints, on a machine without CUDA devices (the output names
  the devices; the README shows it as printed there).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The README and the pages of docs/ whose blocks run here."""


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in PAGES:
        text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.S | re.M)  # links outside code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", README.read_text()))
    assert linked == {p.relative_to(ROOT).as_posix() for p in PAGES[1:]}, "every docs page is linked from the README"
