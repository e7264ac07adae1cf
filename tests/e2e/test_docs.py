"""The documentation runs as written: every fenced ``bash``/``console``/``python`` block of
README.md and docs/*.md is run, page by page in order, in a fresh directory; exit codes and the
output lines a ``console`` block shows are checked. Generated pages (the CLI reference, the
README's formats table) must equal what ``make docs`` writes, and every number on the front
page must be one docs/report holds.

A comment on the line before a block changes how it runs:
``<!-- test: model=tiny-llama -->`` runs it with the built-in ``smollm2`` replaced by
``tiny-llama`` (artifacts it builds get a byte tokenizer, which tiny built-ins lack);
``<!-- test: server -->`` runs its one command as a server on 127.0.0.1 and a free port (which
replaces 8000 in the page's later blocks) until the page's next server or its end, then
SIGTERM, exit 0 expected; ``<!-- test: skip REASON -->`` does not run it, for the reason given
(each counted in SKIPPED)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from helpers import with_byte_tokenizer

from benchmarks.report import glance
from tqexport.serve.runner import listen

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
#: generated pages: their blocks are usage synopses, checked by freshness instead
GENERATED = {"docs/cli.md"}
RUN = {"bash", "console", "python"}
#: blocks that are never run, per page: each carries its reason in the page
SKIPPED = {
    "README.md": 1,
    "docs/architecture.md": 0,
    "docs/benchmarks.md": 2,
    "docs/deployment.md": 3,
    "docs/formats.md": 1,
    "docs/verification.md": 3,
}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.M | re.S)
MARK = re.compile(r"<!-- test: (.*?) -->\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    marks: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of a page with the test marker on the line before it, if any."""
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marks = {}
        if mark := MARK.search(before):
            key, _, value = mark[1].partition(" " if mark[1].startswith("skip") else "=")
            marks[key.strip()] = value.strip()
        out.append(Block(page, text[: m.start()].count("\n") + 1, m[1], m[2], marks))
    return out


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) of a block: a ``console`` block's ``$ ``
    lines, or a ``bash`` block's lines; a trailing backslash continues a command."""
    out: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if block.lang == "console" and not line.startswith("$ "):
            if out:
                out[-1][1].append(line)
            i += 1
            continue
        cmd = line[2:] if block.lang == "console" else line
        while cmd.endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
        if cmd.strip() and not cmd.lstrip().startswith("#"):
            out.append((cmd, []))
        i += 1
    return out


def shows(expected: list[str], output: str) -> str | None:
    """None when each shown line (blank ones and ``...`` aside) is a line of the output, in
    order; else the first one that is not."""
    got = [ln.rstrip() for ln in output.splitlines()]
    pos = 0
    for want in (e.rstrip() for e in expected):
        if not want or want == "...":
            continue
        try:
            pos = got.index(want, pos) + 1
        except ValueError:
            return want
    return None


#: repository folders the pages' commands name by relative path, linked into each session
LINKED = ("examples", "scripts", "benchmarks")


def _env(**extra) -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "200", **extra}  # fmt: skip


class Session:
    """One page's blocks run in order in one directory, with at most one server up."""

    def __init__(self, cwd: Path):
        self.cwd, self.port, self.server = cwd, None, None
        for name in LINKED:
            (cwd / name).symlink_to(ROOT / name)

    def text(self, block: Block) -> str:
        text = block.text
        if block.marks.get("model"):
            text = re.sub(r"(?<![\w/.-])smollm2(?![\w/.-])", block.marks["model"], text)
        if self.port:
            text = text.replace(":8000", f":{self.port}")
        return text

    def run(self, block: Block) -> None:
        if "server" in block.marks:
            self.stop()
            return self.start(block)
        text = self.text(block)
        if block.lang == "python":
            self.check(block, "python", subprocess.run([sys.executable, "-c", text],
                       **self._kw()), [])  # fmt: skip
        else:
            for cmd, shown in commands(Block(**{**block.__dict__, "text": text})):
                done = subprocess.run(["bash", "-eo", "pipefail", "-c", cmd], **self._kw())
                self.check(block, cmd, done, shown)
        if block.marks.get("model"):
            self.tokenize(text)

    def _kw(self) -> dict:
        return dict(cwd=self.cwd, env=_env(), capture_output=True, text=True, timeout=600)

    @staticmethod
    def check(block, cmd, done, shown) -> None:
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{block.where}: `{cmd}` exited {done.returncode}\n{output}"
        missing = shows(shown, output)
        assert missing is None, f"{block.where}: `{cmd}` did not print {missing!r}\n{output}"

    def tokenize(self, text: str) -> None:
        """A byte tokenizer for each artifact a substituted block built (``-o DIR``)."""
        for out in re.findall(r"(?:-o|--out) (\S+)", text):
            art = self.cwd / out
            if (art / "tqexport.json").is_file() and not (art / "tokenizer.json").is_file():
                tmp = art.with_name(art.name + ".tok")
                with_byte_tokenizer(art, tmp)
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    (tmp / name).rename(art / name)

    def start(self, block: Block) -> None:
        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        sock.close()
        # Ray's socket paths must stay under 108 bytes: a short directory of its own
        ray_tmp = self.ray_tmp = tempfile.mkdtemp(prefix="tqx-ray-", dir="/tmp")
        (cmd, _), *rest = commands(Block(**{**block.__dict__, "text": self.text(block)}))
        assert not rest, f"{block.where}: a server block holds one command"
        assert " --host" not in cmd, f"{block.where}: servers in tests bind 127.0.0.1 only"
        self.server = subprocess.Popen(
            ["bash", "-c", f"exec {cmd} --port {self.port}"], cwd=self.cwd,
            env=_env(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while True:
            assert self.server.poll() is None, f"{block.where}: {self.server.stderr.read()}"
            try:
                url = f"http://127.0.0.1:{self.port}/health"
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{block.where}: the server did not come up"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        server.send_signal(signal.SIGTERM)
        try:
            rc = server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
            raise
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        assert rc == 0, server.stderr.read()


def _runnable(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang in RUN]


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED])
def test_every_documented_command_runs(page, tmp_path):
    session = Session(tmp_path)
    try:
        for block in _runnable(page):
            if "skip" not in block.marks:
                session.run(block)
    finally:
        session.stop()


def test_skipped_blocks_are_counted_and_give_a_reason():
    """No block is skipped silently: each skip names its reason, and the count per page is
    pinned here (a new skip is a decision, visible in the diff)."""
    found = {}
    for page in PAGES:
        if page in GENERATED:
            continue
        skips = [b for b in _runnable(page) if "skip" in b.marks]
        assert all(len(b.marks["skip"]) > 10 for b in skips), [b.where for b in skips]
        found[page] = len(skips)
    assert found == SKIPPED


def test_every_block_says_its_language():
    """An untagged fence (or a shell block tagged ``sh``) could hide a command from the runner:
    outside generated pages a block is run (bash, console, python) or is a ``text`` picture."""
    odd = [f"{b.where} {b.lang!r}" for p in PAGES for b in blocks(p)
           if b.lang not in RUN | {"text"} and not (p in GENERATED and b.lang)]  # fmt: skip
    assert not odd


def test_cli_reference_is_generated_from_the_typer_app(tmp_path):
    """docs/cli.md is what ``make docs`` writes (typer's own docs generator)."""
    out = tmp_path / "cli.md"
    subprocess.run([str(Path(sys.executable).parent / "typer"), "tqexport.cli", "utils", "docs",
                    "--name", "tqexport", "--output", str(out)], check=True, env=_env(),
                   capture_output=True)  # fmt: skip
    assert (ROOT / "docs" / "cli.md").read_text() == out.read_text(), "run `make docs`"


def _results() -> dict:
    return json.loads((ROOT / "docs" / "report" / "results.json").read_text())


def test_readme_formats_table_is_generated_from_the_report():
    readme = (ROOT / "README.md").read_text()
    assert glance.update(readme, _results()) == readme, "run `make docs`"


def _prose(text: str) -> str:
    """A page without its fenced blocks, code spans, comments and link targets."""
    text = FENCE.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:%|x)?(?![\w.])")


def test_every_number_on_the_front_page_is_in_the_report():
    report = "".join((ROOT / "docs" / "report" / f).read_text() for f in ("report.md", "models.md"))
    known = set(NUMBER.findall(report)) | set(NUMBER.findall(glance.table(_results())))
    unknown = [n for n in NUMBER.findall(_prose((ROOT / "README.md").read_text()))
               if n not in known and n.lstrip("+-") not in known]  # fmt: skip
    assert not unknown


def test_the_front_page_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


# the runner itself


def test_console_output_lines_are_checked_in_order():
    block = Block("x.md", 1, "console", "$ printf 'a\\nb\\n'\nb\n$ echo \\\n  c\n...\nc\n")
    (cmd1, shown1), (cmd2, shown2) = commands(block)
    assert (cmd1, shown1, cmd2, shown2) == ("printf 'a\\nb\\n'", ["b"], "echo c", ["...", "c"])
    assert shows(["a", "b"], "a\nb\n") is None
    assert shows(["b", "a"], "a\nb\n") == "a"
    assert shows(["c"], "a\nb\n") == "c"


def test_a_failing_block_fails(tmp_path):
    session = Session(tmp_path)
    with pytest.raises(AssertionError, match="exited 3"):
        session.run(Block("x.md", 1, "bash", "true\nexit 3\n"))
    with pytest.raises(AssertionError, match="did not print 'no'"):
        session.run(Block("x.md", 1, "console", "$ echo yes\nno\n"))


def test_markers_are_read_from_the_line_before_a_block(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- test: model=tiny-llama -->\n```bash\ntqexport plan smollm2\n```\n"
        "<!-- test: skip needs a GPU with TensorRT -->\n```console\n$ x\n```\n"
    )
    a, b = blocks(str(page))
    assert (a.lang, a.marks, a.line) == ("bash", {"model": "tiny-llama"}, 2)
    assert b.marks == {"skip": "needs a GPU with TensorRT"}
    text = Session(tmp_path).text(Block("p.md", 1, "bash", "build smollm2 -o out/smollm2-x",
                                        {"model": "tiny-llama"}))  # fmt: skip
    assert text == "build tiny-llama -o out/smollm2-x"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_pages_resolves():
    """Relative links name a file that exists and, with ``#anchor``, one of its headings."""
    broken = []
    for page in PAGES:
        text = FENCE.sub("", (ROOT / page).read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (ROOT / page).parent / path if path else ROOT / page
            if not dest.exists():
                broken.append(f"{page}: {target}")
            elif anchor and dest.suffix == ".md":
                heads = re.findall(r"^#+ (.*)$", FENCE.sub("", dest.read_text()), re.M)
                if anchor not in {_slug(h) for h in heads}:
                    broken.append(f"{page}: {target}")
    assert not broken
