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

import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The README and the pages of docs/ whose blocks run here."""
TIMEOUT = 300

SKIPPED = {
    "pip install": "sets up the environment these tests run in",
    "pytest": "runs the test suite this file belongs to",
    "python -m benchmarks": "the benchmarks run for 7 to 45 minutes and write the results the README quotes",
    "--nnodes=2": "needs two machines",
    "--max-restarts": "a torchrun job that kills one of its processes takes a minute (the plain reproduction fails on "
    "purpose); tests/integration/test_restart.py runs the restarting job for a killed first, middle and last rank",
    "examples/pipebd_mobilenet.py --runtime distributed": "4 processes take about 20 s on 2 cores; "
    "tests/integration/test_distributed.py holds the distributed Pipe-BD runtime equal to sequential distillation",
}
"""A bash command containing the key is not run, for the reason given."""
SMALLER = {
    "examples/train_cifar_style.py": ["--epochs", "1", "--steps-per-epoch", "4"],
}
"""A bash command containing the key runs with these flags appended: the same code, a shorter run
(tests/integration/test_examples.py holds what the full runs learn)."""


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: its language, first line number and text, the output shown after it, and the
    page (relative to the repository root)."""

    lang: str
    line: int
    text: str
    output: str | None = None
    page: str = "README.md"

    @property
    def id(self) -> str:
        return f"{self.lang}@{self.page}:{self.line}"


_FENCE = re.compile(r"^( *)```(\w*)[ \t]*$")


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` (indented ones too), in order; an output block (```` ```text ```` or a bare
    fence) directly after a python block, with only blank lines between, becomes that block's ``output``."""
    lines = text.splitlines()
    found: list[tuple[str, int, int, str]] = []  # lang, first line (1-based), index of the closing fence, text
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}```")
        body = "\n".join(line[len(indent):] for line in lines[i + 1:end])
        found.append((lang, i + 1, end, body + "\n"))
        i = end + 1
    blocks: list[Block] = []
    for k, (lang, line, end, body) in enumerate(found):
        if lang not in ("python", "bash"):
            continue
        after = found[k + 1] if k + 1 < len(found) else None
        output = None
        if lang == "python" and after is not None and after[0] in ("", "text") and \
                all(not s.strip() for s in lines[end + 1:after[1] - 1]):
            output = after[3]
        blocks.append(Block(lang=lang, line=line, text=body, output=output, page=page))
    return blocks


def commands(block: str) -> list[str]:
    """The commands of a bash block: each line, joined with the lines its trailing ``\\`` continues onto."""
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _skip_reason(command: str) -> str | None:
    return next((why for key, why in SKIPPED.items() if key in command), None)


def _smaller(command: str) -> str:
    extra = next((flags for key, flags in SMALLER.items() if key in command), None)
    return command if extra is None else shlex.join(shlex.split(command, comments=True) + extra)


README_BLOCKS = readme_blocks(README.read_text())
BLOCKS = [b for page in PAGES for b in readme_blocks(page.read_text(), page.relative_to(ROOT).as_posix())]
"""Every block of the README, then of the docs pages in name order."""


def _root_like(folder: Path) -> Path:
    """``folder`` made to look like the repository root to the blocks: ``examples`` (linked) and a copy of
    ``benchmarks/results``."""
    (folder / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    shutil.copytree(ROOT / "benchmarks" / "results", folder / "benchmarks" / "results")
    return folder


def _env() -> dict[str, str]:
    """This environment, with the repository importable also where the package is not installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return os.environ | {"PYTHONPATH": path}


def _report(what: str, proc: subprocess.CompletedProcess) -> str:
    return f"{what} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


Ran = list[tuple[str, subprocess.CompletedProcess]]
"""What a block ran: each command (a python block: ``python -``) and its completed process."""


def _run_block(block: Block, folder: Path) -> Ran:
    """Run ``block`` in ``folder`` as the module docstring says: a python block as ``python -``, a bash block
    command by command, up to the first that fails."""
    if block.lang == "python":
        return [("python -", subprocess.run([sys.executable, "-"], input=block.text, cwd=folder, env=_env(),
                                            capture_output=True, text=True, timeout=TIMEOUT))]
    ran: Ran = []
    for command in commands(block.text):
        if _skip_reason(command) is None:
            ran.append((command, subprocess.run(["bash", "-c", _smaller(command)], cwd=folder, env=_env(),
                                                capture_output=True, text=True, timeout=TIMEOUT)))
            if ran[-1][1].returncode != 0:
                break
    return ran


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[int, Future]:
    """The blocks of the selected tests, started two at a time (most of their time is a process starting and
    tracing a model, on one core), each in its own folder that looks like the repository root; by block id."""
    if shutil.which("ppll-plan") is None:
        pytest.skip("ppll-plan is not on PATH: install the project (pip install -e .)")
    selected = [item.callspec.params["block"] for item in request.session.items
                if item.module is request.module and "block" in getattr(getattr(item, "callspec", None), "params", {})]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {b.id: pool.submit(_run_block, b, _root_like(tmp_path_factory.mktemp(re.sub(r"\W", "-", b.id))))
               for b in selected}
    yield futures
    pool.shutdown(cancel_futures=True)


RECIPE_START = "import os\nimport torch, torchvision, ppll_compile\n"
"""How the README's recipe (its first python block) begins."""


def test_the_readme_has_the_blocks_this_file_runs():
    langs = [b.lang for b in BLOCKS]
    assert langs.count("python") >= 10 and langs.count("bash") >= 5
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/models.md", "docs/training.md", "docs/pipebd.md"}
    first = commands(README_BLOCKS[0].text)  # the set-up lines at the top, never run here
    assert len(first) == 3 and all(_skip_reason(c) for c in first)
    assert "--index-url https://download.pytorch.org/whl/cpu" in first[0] and "torch torchvision" in first[0]
    others = [c for b in BLOCKS if b != README_BLOCKS[0] and b.lang == "bash" for c in commands(b.text)]
    assert not [c for c in others if "pip install" in c or "pytest" in c]
    recipe = next(b for b in README_BLOCKS if b.lang == "python")
    assert recipe.text.startswith(RECIPE_START) and "examples" not in recipe.text
    assert [b for b in README_BLOCKS if b.output is not None][0].text.startswith("import torch, torchvision, ")


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block: Block, runs):
    [(_, proc)] = runs[block.id].result()
    assert proc.returncode == 0, _report(f"the python block at {block.page}:{block.line}", proc)
    if block.output is not None and torch.cuda.device_count() == 0:
        assert proc.stdout == block.output, (f"the output shown after {block.page}:{block.line} is not what the "
                                             f"block prints; it prints:\n{proc.stdout}")


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.id)
def test_bash_block_runs(block: Block, runs):
    ran = runs[block.id].result()
    for command, proc in ran:
        assert proc.returncode == 0, _report(f"{command!r} ({block.page}:{block.line})", proc)
    if not ran:
        pytest.skip("; ".join(f"{c!r}: {_skip_reason(c)}" for c in commands(block.text)))


@pytest.mark.slow
def test_the_recipe_runs_outside_the_repository_and_resumes(tmp_path):
    """The recipe saved as ``train.py`` in a folder outside the clone, run there twice with only the package
    importable (a link to it, not the repository root: ``examples`` cannot be imported); the second run loads the
    first one's checkpoint, skips every batch it holds and evaluates the same parameters."""
    recipe = next(b for b in README_BLOCKS if b.lang == "python")
    assert ROOT not in tmp_path.resolve().parents
    (tmp_path / "train.py").write_text(recipe.text)
    site = tmp_path / "site"
    site.mkdir()
    (site / "ppll_compile").symlink_to(ROOT / "ppll_compile", target_is_directory=True)
    env = os.environ | {"PYTHONPATH": str(site)}
    assert subprocess.run([sys.executable, "-c", "import examples"], cwd=tmp_path, env=env,
                          capture_output=True).returncode != 0
    first, again = (subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=TIMEOUT) for _ in range(2))
    assert first.returncode == 0, _report("python train.py", first)
    assert again.returncode == 0, _report("python train.py, run again", again)
    assert re.fullmatch(r"loss \d+\.\d{3}, accuracy \d\.\d{3}, per stage \[.+\]\n", first.stdout), first.stdout
    assert again.stdout == first.stdout
    assert (tmp_path / "checkpoints" / "latest").is_file()
    # the saved model is a plain state_dict of the model as built
    import safetensors.torch
    import torchvision
    torchvision.models.resnet18(num_classes=10).load_state_dict(
        safetensors.torch.load_file(tmp_path / "model.safetensors"), strict=True)


def test_commands_split_skip_and_shrink_as_documented():
    block = "pip install -e .  # set up\ntorchrun --nnodes=2 --node-rank=0 \\\n    x.py --synthetic   # two\n"
    assert commands(block) == ["pip install -e .  # set up",
                               "torchrun --nnodes=2 --node-rank=0 x.py --synthetic   # two"]
    assert [_skip_reason(c) for c in commands(block)] == [SKIPPED["pip install"], SKIPPED["--nnodes=2"]]
    assert _smaller("python examples/train_cifar_style.py --synthetic   # one process") == \
        "python examples/train_cifar_style.py --synthetic --epochs 1 --steps-per-epoch 4"
