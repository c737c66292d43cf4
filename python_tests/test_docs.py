"""The docs check: README.md and every docs/*.md page against the repository.

On every page:

1. every ```python block parses with ``ast``. A block that is deliberately partial is marked
   with the HTML comment ``<!-- fragment -->`` on the line right before its opening fence; it is
   neither parsed nor import-checked. Every other block must be valid Python as written.
2. every ``import X`` / ``from X import ...`` of those blocks names a package that exists
   (``importlib.util.find_spec`` of its top level, which imports nothing; every such block also
   runs, below, which imports the whole name).
3. every repository path the text cites (starting with ``bench/``, ``dlion_kernels/``,
   ``python_tests/``, ``csrc/`` or ``docs/``; in particular every ``bench/results/...``) exists.
   ``<placeholder>`` and ``*`` in a path stand for any name; at least one path must match.
4. every dotted name of the package (``dlion_kernels.x.y``, and ``dk.x`` for
   ``import dlion_kernels as dk``) is a module or an attribute that exists.
5. every relative markdown link resolves to a file, and its ``#anchor`` to a heading of that
   page (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens).

And the README's test command must be the one ``.ci/run`` runs; the pages (and the package's
two top docstrings) speak of the user's task, not of how the project was run (``PROCESS``), and so
does the whole text of the sources (``SOURCE_GLOBS``: package, tests, csrc/, bench/*.py, CMake);
``docs/results.md`` links every folder of ``bench/results/``; the FSDP2 page's script runs.
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_PATH = re.compile(r"(?<![\w./-])(?:bench|dlion_kernels|python_tests|csrc|docs)/[\w.<>*/-]*")
_DOTTED = re.compile(r"(?<![\w.])(?:dlion_kernels|dk)(?:\.[A-Za-z_]\w*)+")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def code_blocks(text: str):
    """(language, code, is_fragment) of every fenced block."""
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        yield m.group(1), m.group(2), before == FRAGMENT


def prose(text: str) -> str:
    """The text without fenced blocks and inline code (where links and headings live)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def python_problems(text: str) -> list[str]:
    """Checks 1 and 2."""
    problems = []
    for i, (lang, code, fragment) in enumerate(code_blocks(text)):
        if lang != "python" or fragment:
            continue
        try:
            tree = ast.parse(code)
        except SyntaxError as e:
            problems.append(f"python block {i} does not parse: {e.msg} (block line {e.lineno})")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["." * node.level]
            else:
                continue
            for name in names:  # the top package: test_example_runs imports the rest for real
                if not _module_exists(name.split(".")[0] if name else name):
                    problems.append(f"python block {i} imports {name!r}, which does not exist")
    return problems


def _module_exists(name: str) -> bool:
    if not name or name.startswith("."):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


# A file being renamed on another branch: the docs cite the new name; either name passes until
# both branches are in (then drop the entry). None now.
RENAMING: dict[str, str] = {}


def path_problems(text: str, root: Path = ROOT) -> list[str]:
    """Check 3."""
    problems = []
    for cited in sorted({m.group(0).rstrip(".,;:") for m in _PATH.finditer(text)}):
        if cited in RENAMING and not (root / cited).exists() and root == ROOT:
            cited = RENAMING[cited]
        pattern = re.sub(r"<[^<>/]*>", "*", cited)
        if "<" in pattern or ">" in pattern:
            problems.append(f"path {cited!r}: unbalanced <placeholder>")
        elif not glob.glob(str(root / pattern)):
            problems.append(f"path {cited!r} does not exist")
    return problems


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if _module_exists(module):
            break
    else:
        return False
    obj = importlib.import_module(module) if i < len(parts) else None
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def name_problems(text: str) -> list[str]:
    """Check 4."""
    problems = []
    for cited in sorted({m.group(0) for m in _DOTTED.finditer(text)}):
        full = "dlion_kernels" + cited[2:] if cited.startswith("dk.") else cited
        if not _resolves(full):
            problems.append(f"name {cited!r} is neither a module nor an attribute")
    return problems


def slugs(text: str) -> set[str]:
    """GitHub's heading anchors of a markdown page."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def link_problems(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """Check 5."""
    problems = []
    for target in sorted({m.group(1) for m in _LINK.finditer(prose(text))}):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
        if not dest.exists():
            problems.append(f"link {target!r}: {rel} does not exist")
            continue
        if anchor and (dest.suffix != ".md" or anchor not in slugs(dest.read_text())):
            problems.append(f"link {target!r}: no heading #{anchor} in {rel}")
    return problems


# Words that speak of the project's own process, which a reader of the docs cannot look up: issue
# numbers, rounds, the decentralized-training paper by its place in a list ("seed 2's"), sections
# of a contract that is not in the repository, a GPU "visit", machine paths. Random seeds
# ("--seed 1", "seed 0") and benchmark rounds ("3 rounds") are fine.
PROCESS = {
    "an issue number": r"(?i)\bissue \d+",
    "a round": r"(?i)\b(?:round[ -]\d+|(?:next|this|last|previous) round)\b",
    "a paper by its seed": r"(?i)\bseed \d+'s|\(seed \d+\)|\bseed-\d",
    "a SPEC section": r"\bSPEC\b|§",
    "a GPU visit": r"(?i)\b(?:the|a|GPU) visit\b",
    "a machine path": r"(?<![\w.])/(?:work|tmp|root|home)/",
}
PROCESS_FILES = PAGES + [ROOT / "dlion_kernels" / "__init__.py",
                         ROOT / "dlion_kernels" / "plan" / "__init__.py"]


def process_words(text: str) -> list[str]:
    """Each process word in ``text``: what it is, and the line it is on."""
    found = []
    for what, pattern in PROCESS.items():
        for m in re.finditer(pattern, text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {what} ({m.group(0)!r})")
    return found


# The sources whose whole text (code, comments, docstrings, messages, test names) is held to
# PROCESS as well: the package, the tests, the native code, the benchmark scripts, the build.
SOURCE_GLOBS = ("dlion_kernels/**/*.py", "python_tests/**/*.py", "csrc/**/*.cpp", "csrc/**/*.h",
                "csrc/**/*.cu", "csrc/**/*.cuh", "bench/*.py", "CMakeLists.txt")
# This file plants process words on purpose, to show that the check catches them.
PLANTED = ("python_tests/test_docs.py",)


def source_files(root: Path = ROOT, excluded: tuple[str, ...] = ()) -> list[Path]:
    """The files of SOURCE_GLOBS under ``root``, less PLANTED and ``excluded``."""
    files = {p for pattern in SOURCE_GLOBS for p in root.glob(pattern) if p.is_file()}
    return sorted(p for p in files
                  if not any(fnmatch.fnmatch(p.relative_to(root).as_posix(), skip)
                             for skip in PLANTED + excluded))


def source_process_words(path: Path) -> list[str]:
    """Each process word anywhere in the source file ``path`` (not only its docstrings)."""
    return process_words(path.read_text())


# ----------------------------------------------------------------------------- the real docs


@pytest.fixture(params=PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def page(request):
    return request.param


def test_docs_folder_has_pages():
    names = {p.name for p in PAGES}
    assert {"README.md", "index.md", "results.md", "wire-format.md"} <= names


def test_python_blocks_parse_and_import(page):
    assert python_problems(page.read_text()) == []


def test_cited_paths_exist(page):
    assert path_problems(page.read_text()) == []


def test_package_names_resolve(page):
    assert name_problems(page.read_text()) == []


def test_links_resolve(page):
    assert link_problems(page, page.read_text()) == []


def test_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {m.group(1).partition("#")[0] for m in _LINK.finditer(index)}
    missing = [p.name for p in PAGES[1:] if p.name != "index.md" and p.name not in linked]
    assert missing == []


def test_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    commands = [line for lang, code, _ in code_blocks(readme) if lang == "bash"
                for line in code.splitlines() if 'pip install -e ".[test]"' in line]
    assert len(commands) == 1, commands
    steps = commands[0].split(" && ")
    # .ci/run makes and activates the venv on lines of their own, then runs the rest verbatim
    assert steps[0] in ci and steps[1] in ci
    assert " && ".join(steps[2:]) in ci


@pytest.mark.parametrize("path", PROCESS_FILES,
                         ids=[p.relative_to(ROOT).as_posix() for p in PROCESS_FILES])
def test_no_process_words(path):
    text = path.read_text()
    if path.suffix == ".py":  # the module docstring
        text = ast.get_docstring(ast.parse(text)) or ""
    assert process_words(text) == []


SOURCES = source_files()


@pytest.mark.parametrize("path", SOURCES, ids=[p.relative_to(ROOT).as_posix() for p in SOURCES])
def test_no_process_words_in_sources(path):
    assert source_process_words(path) == []


def test_sources_cover_the_code():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"dlion_kernels/__init__.py", "dlion_kernels/local_steps/diloco.py",
            "dlion_kernels/exchange/pipeline.py", "python_tests/test_layers.py",
            "csrc/bindings.cpp", "bench/bench_overlap.py", "CMakeLists.txt"} <= names


def test_results_index_links_every_folder():
    index = (ROOT / "docs" / "results.md").read_text()
    cited = {m.group(0).rstrip(".,;:/").split("/")[2] for m in _PATH.finditer(index)
             if m.group(0).startswith("bench/results/") and m.group(0).count("/") >= 2}
    folders = {p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_dir()}
    assert sorted(folders - cited) == []


# ----------------------------------------------------------------------------- the checks fail


BROKEN = """# Title

## A `section`: with punctuation

```python
x = (
```

<!-- fragment -->
```python
opt.step(   # partial on purpose
```

```python
import os
import no_such_module_here
from dlion_kernels.kernels import layout
import dlion_kernels as dk
dk.DistributedLion
```

See `bench/results/no-such-folder/`, `bench/results/all-<date>/` and bench/README.md.
`dlion_kernels/kernels/layout.py` yes, `dlion_kernels/layout.py` no,
`dlion_kernels.native` and `dk.NoSuchThing` no,
`dk.plan.predict` and `dlion_kernels.kernels.native` yes.
[good](other.md#a-section-with-punctuation), [bad anchor](other.md#nope),
[missing](missing.md), [web](https://example.org/x), [self](#title).
"""


def test_checks_catch_broken_docs(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(BROKEN)
    (tmp_path / "docs" / "other.md").write_text(BROKEN)
    for path in ("bench/results/all-20260101/summary.md", "bench/README.md",
                 "dlion_kernels/kernels/layout.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")

    python = python_problems(BROKEN)
    assert len(python) == 2
    assert "does not parse" in python[0] and "block 0" in python[0]
    assert "block 2" in python[1] and "no_such_module_here" in python[1]

    assert path_problems(BROKEN, tmp_path) == [
        "path 'bench/results/no-such-folder/' does not exist",
        "path 'dlion_kernels/layout.py' does not exist",
    ]
    assert name_problems(BROKEN) == [
        "name 'dk.NoSuchThing' is neither a module nor an attribute",
        "name 'dlion_kernels.native' is neither a module nor an attribute",
    ]
    assert link_problems(page, BROKEN, tmp_path) == [
        "link 'missing.md': docs/missing.md does not exist",
        "link 'other.md#nope': no heading #nope in docs/other.md",
    ]


def test_process_words_are_caught():
    text = ("Issue 19's targets; round 1; the round-2 keys; the next round; seed 2's factor;\n"
            "the model (seed 2); SPEC §11 fixes it; part of the GPU visit; flock /work/notes/x")
    found = process_words(text)
    assert len(found) == 10, found
    assert found[-1].startswith("line 2: a machine path")
    fine = ("--seed 1 and --seeds 0 1 2; the demo's lrs, seed 0); 3 rounds, rounded, around;\n"
            "bench/results/plan-network-round1/; bash bench/gpu_run.sh; dk.save_state(opt, d)")
    assert process_words(fine) == []


def test_source_scan_catches_process_words(tmp_path):
    for path, text in [("dlion_kernels/x.py", "# SPEC §7: the rule\nx = 1\n"),
                       ("dlion_kernels/exchange/y.py", '"""Issue 21\'s target."""\n'),
                       ("csrc/cpu/k.h", "// ok\n// the round-2 layout\n"),
                       ("bench/b.py", 'assert ok, "see the next round"\n'),
                       ("bench/sub/deep.py", "# round 1, not scanned: not bench/*.py\n"),
                       ("python_tests/test_t.py", "def test_z():\n    pass  # seed 0 is fine\n"),
                       ("CMakeLists.txt", "# seed 2's factor\n"), ("notes.txt", "issue 3\n")]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    files = source_files(tmp_path, excluded=("dlion_kernels/exchange/*.py",))
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        "CMakeLists.txt", "bench/b.py", "csrc/cpu/k.h", "dlion_kernels/x.py",
        "python_tests/test_t.py"]
    found = {p.relative_to(tmp_path).as_posix(): source_process_words(p) for p in files}
    assert found == {
        "CMakeLists.txt": ["line 1: a paper by its seed (\"seed 2's\")"],
        "bench/b.py": ["line 1: a round ('next round')"],
        "csrc/cpu/k.h": ["line 2: a round ('round-2')"],
        "dlion_kernels/x.py": ["line 1: a SPEC section ('SPEC')", "line 1: a SPEC section ('§')"],
        "python_tests/test_t.py": [],
    }
    assert source_process_words(tmp_path / "dlion_kernels/exchange/y.py") == [
        "line 1: an issue number ('Issue 21')"]


def test_slugs_follow_github():
    assert slugs("# A `b`: c (d)\n## A `b`: c (d)\n```bash\n# not a heading\n```\n") == {
        "a-b-c-d", "a-b-c-d-1"}


# ----------------------------------------------------------------------------- the FSDP2 example


def test_fsdp_page_example_runs_on_a_2x2_mesh():
    """The FSDP2 page's script, taken from the page itself, trains on 4 gloo processes in 2
    nodes of 2: the replicas of each shard end bit-identical, and the votes crossed nodes."""
    from doc_examples import run_example

    text = (ROOT / "docs" / "fsdp.md").read_text()
    code = next(c for lang, c, fragment in code_blocks(text) if lang == "python" and not fragment)
    assert "fully_shard" in code and "device_mesh=mesh" in code
    facts = run_example(code, "docs/fsdp.md:0", n=4, per_node=2)
    # ranks r and r + 2 hold the same shard (the mesh's replicate dimension)
    assert facts[0]["model"] == facts[2]["model"] and facts[1]["model"] == facts[3]["model"]
    assert facts[0]["model"] != facts[1]["model"]
    assert all(f["inter_node_bytes_sent"] > 0 and not f["skipped"] for f in facts)


# ----------------------------------------------------------------------------- every example runs


def examples(pages=PAGES):
    """(id, page, code) of every Python block that is not a fragment, in page order."""
    out = []
    for page in pages:
        blocks = [code for lang, code, fragment in code_blocks(page.read_text())
                  if lang == "python" and not fragment]
        for i, code in enumerate(blocks):
            out.append((f"{page.relative_to(ROOT).as_posix()}:{i}", page, code))
    return out


# run by a test of their own, on the mesh they describe
OWN_TEST = {"docs/fsdp.md:0": "test_fsdp_page_example_runs_on_a_2x2_mesh",
            "README.md:0": "test_readme_loop_trains_on_each_ranks_own_data"}
EXAMPLES = [e for e in examples() if e[0] not in OWN_TEST]


@pytest.mark.parametrize("name,page,code", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs(name, page, code):
    """Each example as a script on 2 ranks (gloo, torchrun's environment; the elastic ones as 2
    torchft replicas under a Lighthouse). Where it leaves a ``model`` trained with D-Lion, the
    ranks hold the same weights; where it leaves a batch ``x``, each rank read its own."""
    from doc_examples import run_example

    replicas = "torchft" in code
    facts = run_example(code, name, replicas=replicas)
    if "model" in facts[0] and "DistributedLion" in code and not replicas:
        assert all(f["model"] == facts[0]["model"] for f in facts), "ranks' weights differ"
    if "x" in facts[0]:
        assert len({f["x"] for f in facts}) == len(facts), "every rank read the same batch"


def test_fragments_are_completed_on_their_page():
    for page in PAGES:
        blocks = [(fragment) for lang, _, fragment in code_blocks(page.read_text())
                  if lang == "python"]
        if any(blocks):
            assert not all(blocks), f"{page.name}: fragments but no runnable example"


def test_readme_loop_trains_on_each_ranks_own_data():
    """The README's loop: bit-identical weights after training on different batches, with the
    bytes of the 1-bit exchange."""
    from doc_examples import run_example

    name, _, code = next(e for e in examples() if e[0] == "README.md:0")
    facts = run_example(code, name)
    assert facts[0]["model"] == facts[1]["model"]
    assert facts[0]["x"] != facts[1]["x"]
    # vote/binary on 2 ranks: about 2 (n-1)/n d/8 bytes, 1/32 of the fp32 all-reduce's 4d
    assert 0 < facts[0]["bytes_sent"] * 30 < 10_250 * 4


# ----------------------------------------------------------------------------- words of a log


# In the prose of the docs and of the results folders' notes they link (not in code, where
# round() and a test file's name may use these words): how a page was written, not what it
# documents. A results folder's name is held to them as well.
PROSE_WORDS = {
    "a visit": r"(?i)\bvisit(?:s|ed)?\b",
    "a round": r"(?i)\bround(?:[ _-]?\d+)?\b(?![ -]trip)",
    "time ran out": r"(?i)\btime ran out\b",
    "a verdict": r"(?i)\bverdicts?\b",
    "a commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
}
NOTES = ("README.md", "NOTES.md", "NOTE.md")


def prose_words(text: str) -> list[str]:
    """Each PROSE_WORDS match in the prose of ``text`` and in the results folders it cites."""
    found = []
    body = prose(text)
    for what, pattern in PROSE_WORDS.items():
        for m in re.finditer(pattern, body):
            line = body.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {what} ({m.group(0)!r})")
        for cited in sorted(m.group(0) for m in _PATH.finditer(text)):
            if cited.startswith("bench/results/") and re.search(pattern, cited):
                found.append(f"a results path: {what} ({cited!r})")
    return sorted(set(found))


def linked_notes(text: str, root: Path = ROOT) -> list[Path]:
    """The notes (README.md, NOTES.md, NOTE.md) of every results folder ``text`` cites."""
    folders = {m.group(0).split("/")[2] for m in _PATH.finditer(text)
               if m.group(0).startswith("bench/results/") and m.group(0).count("/") >= 2}
    folders |= {m.group(1).split("bench/results/")[1].split("/")[0]
                for m in _LINK.finditer(text) if "bench/results/" in m.group(1)}
    return sorted(root / "bench" / "results" / f / name for f in folders for name in NOTES
                  if (root / "bench" / "results" / f / name).is_file())


def test_no_log_words_in_prose(page):
    assert prose_words(page.read_text()) == []


NOTE_FILES = sorted({n for p in PAGES for n in linked_notes(p.read_text())})


@pytest.mark.parametrize("path", NOTE_FILES,
                         ids=[p.relative_to(ROOT).as_posix() for p in NOTE_FILES])
def test_no_log_words_in_linked_results_notes(path):
    assert prose_words(path.read_text()) == []


def test_log_words_are_caught():
    text = ("After the visit, round 2 and the round1 keys; time ran out; Verdicts on the targets;\n"
            "fixed at commit 70f7a32 (dd25f0a1b2). `round(x)` and `bench/results/plan-x/`.\n")
    found = prose_words(text)
    assert [f.split(": ", 1)[1].split(" (")[0] for f in found].count("a commit hash") == 2, found
    assert len(found) == 7, found
    fine = ("a round trip, rounded, 3 rounds, the rounding; decade, 1234567, 2e-10, a facade;\n"
            "`bench/gpu_visit.sh`, `python_tests/optim/test_dlion_deferred_verdict.py`\n")
    assert prose_words(fine) == []
    assert prose_words("see `bench/results/plan-network-round1/`") == [
        "a results path: a round ('bench/results/plan-network-round1/')"]


# ----------------------------------------------------------------------------- generated tables


def test_results_tables_match_their_json():
    """Every table between ``<!-- table: NAME -->`` and ``<!-- /table -->`` is what
    ``bench/docs_tables.py`` makes from its results folder now."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import docs_tables

    assert docs_tables.stale() == []
    named = {m.group(2) for p in PAGES for m in docs_tables.BLOCK.finditer(p.read_text())}
    assert named == set(docs_tables.TABLES), "a generator no page uses, or the reverse"
