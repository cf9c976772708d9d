"""README.md and docs/*.md against the repository: the paths, commands, flags and config keys
they name exist (a key in backticks in some config), docs/data.md lists every dataset, and the
README's tour runs end to end on debug configs. Code comments and docstrings cite sections that
exist, and no file speaks of how the work was organised.

What is read from a page: backtick spans, link targets and code blocks (fenced or indented),
with a shell line's trailing backslash joining it to the next. A path counts when it starts
with one of the repository's top-level names (`TOP`); runs/, /tmp, gs:// and the like never
do. Placeholders (<...>, NAME, BUCKET, ...) are skipped; a glob must match something.
Commands that cannot run here (gcloud, a GPU) are checked for their flags only.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import glob
import io
import os
import re
import shlex
import subprocess
import tokenize
from pathlib import Path

import forked
import pytest

from tx_jax.cli import VERBS
from tx_jax.config import STUDY_KEYS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MEASURES = [ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "HISTORY.md"]  # paths and links only
OTHER_PAGES = [ROOT / "experiments" / "README.md"]  # paths, links and cited sections
TOP = (
    "tx_jax/",
    "configs/",
    "benchmarks/",
    "experiments/",
    "tests/",
    "docs/",
    "scripts/",
    ".ci/",
    "launch.sh",
    "BENCHMARKS.md",
    "README.md",
    "setup.cfg",
    "pyproject.toml",
)
PLACEHOLDER = re.compile(r"<[^>]*>|\b(NAME|FILE|DIR|ROOT|BUCKET|PATH|OUT|WORKDIR|REV|N)\b")
CONFIG_SECTIONS = ("model", "data", "train", "eval", "checkpoint", "parallel")
README_MAX_LINES = 250


# ---------------------------------------------------------------------- reading the pages


def _fences(text: str) -> tuple[list[str], str]:
    """-> (code lines, prose with the code blocks removed)."""
    code, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith("    ") and not line.lstrip().startswith(("-", "|"))):
            code.append(line.strip())
        else:
            prose.append(line)
    return code, "\n".join(prose)


@functools.cache
def page_parts(page: Path) -> tuple[list[str], list[str], list[str]]:
    """-> (code lines, backtick spans, link targets) of a page, continuation lines joined."""
    code, prose = _fences(page.read_text())
    joined, pending = [], ""
    for line in code:
        if line.endswith("\\"):
            pending += line[:-1] + " "
        else:
            joined.append(pending + line)
            pending = ""
    prose_one_line = re.sub(r"\s*\n\s*", " ", prose)
    spans = re.findall(r"`([^`]+)`", prose_one_line)
    links = re.findall(r"\]\(([^)\s]+)\)", prose)
    return joined, spans, links


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\s=,'\"()\[\]|]+", text) if t]


def _clean_path(token: str) -> str | None:
    token = token.removeprefix("./").rstrip(".,;:")
    if not token.startswith(TOP) or PLACEHOLDER.search(token):
        return None
    token = token.split("::")[0]  # tests/test_x.py::test_name
    token = re.sub(r"(\.py):.*$", r"\1", token)  # configs/x.py:variant=...
    return token


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def named_paths(pages: tuple[Path, ...] = tuple(PAGES)) -> list[tuple[str, str]]:
    """(page, repository-relative path) for every path a page names."""
    found = set()
    for page in pages:
        code, spans, links = page_parts(page)
        for text in code + spans:
            for token in _tokens(text):
                path = _clean_path(token)
                if path:
                    found.add((_rel(page), path))
        for link in links:
            target = link.split("#")[0]
            if not target or "://" in target:
                continue
            resolved = os.path.normpath(page.parent / target)
            found.add((_rel(page), os.path.relpath(resolved, ROOT)))
    return sorted(found)


# A command a page names: `tx_jax VERB ...`, `python -m tx_jax VERB ...`, `python -m
# tx_jax.main ...` (and any other `python -m tx_jax.X`, which no longer runs) or `./launch.sh X`.
COMMAND = re.compile(
    r"(python3? -m tx_jax\b(?:\.\w+)?|(?<![\w/.$-])tx_jax (?=[a-z])|\./launch\.sh [\w*-]+).*"
)


def _is_command(found: str, text: str) -> bool:
    """Whether `tx_jax WORD ...` found in a code line or span is a command, not prose that
    names the package: WORD is a verb, or flags follow it, or it starts the line."""
    m = re.match(r"tx_jax ([\w.-]+)(\s+-)?", found)
    if not m:
        return True
    return m.group(1) in VERBS or bool(m.group(2)) or text.lstrip("$ ").startswith(found)


def commands() -> list[tuple[str, str]]:
    """(page, command) for every `tx_jax VERB ...` and `./launch.sh X ...` a page names."""
    found = []
    for page in PAGES:
        code, spans, _ = page_parts(page)
        for text in code + spans:
            # One command: up to a pipe, redirection, ';', '&&' or a comment.
            for part in re.split(r"\s(?:\||>|<|;|&&|#)\s|\s#|\s>\s?\S+|\s<\s?\S+", " " + text):
                for m in COMMAND.finditer(part):
                    if _is_command(m.group(0).strip(), text):
                        found.append((page.name, m.group(0).strip()))
    return sorted(set(found))


def flags(command: str) -> list[str]:
    return re.findall(r"(?<![\w-])--([A-Za-z][\w.-]*)", command)


# ---------------------------------------------------------------------- the module help texts


def _help_flags(verb: str) -> tuple[str, ...]:
    """The flags that make `tx_jax VERB` list every flag it accepts, in the order to try
    them: --helpfull for an absl command (--help leaves out absl's own flags), --help for
    the others."""
    cli = ROOT / "tx_jax" / "cli" / f"{VERBS[verb][0]}.py"
    return ("--helpfull", "--help") if "DEFINE_" in cli.read_text() else ("--help",)


def _verb(command: str) -> str | None:
    """The verb a command runs (`./launch.sh sweep` and `python -m tx_jax.main` run sweep
    and train; `python -m tx_jax.X` names X as it is, to be found no verb), or None."""
    if command.startswith("./launch.sh sweep"):
        return "sweep"
    if command.startswith("./launch.sh"):
        return None
    m = re.match(r"python3? -m tx_jax\.(\w+)", command)
    if m:
        return "train" if m.group(1) == "main" else f"tx_jax.{m.group(1)}"
    m = re.match(r"(?:python3? -m )?tx_jax ([\w.-]+)", command)
    return m.group(1) if m and m.group(1) != "VERB" else None  # VERB: any verb


@functools.cache
def help_texts() -> dict[str, str]:
    """verb -> its help text, for each verb the pages name: its first help flag that answers
    (exit 0 or 1, naming `tx_jax VERB`, no traceback). The commands run in children of one
    interpreter that has imported the libraries they share (tests/forked.py): a fresh
    process's flags, without its start-up per command."""
    verbs = sorted({_verb(c) for _, c in commands()} & set(VERBS))
    texts: dict[str, str] = {}
    last: dict[str, str] = {}
    for attempt in range(2):
        asks = [(v, _help_flags(v)) for v in verbs if v not in texts]
        asks = [(v, tries[attempt]) for v, tries in asks if attempt < len(tries)]
        if not asks:
            break
        runs = forked.run_modules(
            [("tx_jax", [v, flag]) for v, flag in asks],
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            parallel=2,
            timeout=300,
        )
        for (v, flag), (code, stdout, stderr) in zip(asks, runs):
            out = stdout + stderr
            assert "Traceback" not in out, f"tx_jax {v} {flag}:\n{out[-3000:]}"
            last[v] = f"tx_jax {v} {flag} (exit {code}):\n{out[-3000:]}"
            if code in (0, 1) and f"tx_jax {v}" in out:
                texts[v] = out
    missing = [last[v] for v in verbs if v not in texts]
    assert not missing, "\n".join(missing)
    return texts


def _accepts(help_text: str, flag: str) -> bool:
    names = {n.replace("-", "_") for n in re.findall(r"--(?:\[no\])?([A-Za-z][\w-]*)", help_text)}
    return flag.replace("-", "_") in names or flag.removeprefix("no").replace("-", "_") in names


# ---------------------------------------------------------------------- configs


@functools.cache
def config_of(spec: str):
    """'configs/x.py[:arg]' -> its ConfigDict; an argument that needs something not here (a
    workdir to fine-tune from, a placeholder) falls back to the file's default, then to
    configs/default.py's (every config has the same sections and model keys)."""
    from tx_jax.config import load_config

    path, _, arg = spec.partition(":")
    # configs/finetune.py reads its model from a workdir; its data section is that of the
    # config its `data=` argument names
    data = re.search(r"(?:^|,)data=(\w+)", arg) if path.endswith("finetune.py") else None
    sibling = [f"configs/{data.group(1)}.py"] if data else []
    for candidate in (spec, path, *sibling, "configs/default.py"):
        try:
            return load_config(str(ROOT / candidate))
        except Exception:  # noqa: BLE001 -- a placeholder argument or a missing workdir
            continue
    raise AssertionError(f"no config loads for {spec}")


def has_key(config, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return False
    return True


def _placeholder_key(flag: str) -> bool:
    """--config.key, --config.section.key, --config.a.b: how a page writes "any key"."""
    return flag.removeprefix("--").removeprefix("config.") in {"key", "section.key", "a.b", "x.y"}


def config_uses() -> list[tuple[str, str, str]]:
    """(page, config spec, dotted key) for every --config.a.b on a command line."""
    found = set()
    for page, command in commands():
        spec_match = re.search(r"--config=(\S+)", command)
        spec = spec_match.group(1) if spec_match else "configs/default.py"
        for flag in flags(command):
            if flag.startswith("config.") and not _placeholder_key(flag):
                found.add((page, spec, flag.removeprefix("config.")))
    for page in PAGES:  # a key named alone, outside a command
        code, spans, _ = page_parts(page)
        for text in spans:
            if "python -m" in text or "launch.sh" in text:
                continue
            spec = re.search(r"--config=([^\s`]+)", text)
            spec = spec.group(1) if spec else "configs/default.py"
            for m in re.finditer(r"--config\.([\w.]+)", text):
                if not _placeholder_key(m.group(0)):
                    found.add((page.name, spec, m.group(1)))
    return sorted(found)


# ---------------------------------------------------------------------- the checks


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_pages_exist_and_start_with_their_commands():
    names = {p.name for p in PAGES}
    for page in ("training", "data", "evaluation", "planning", "tpu_and_cloud", "models"):
        assert f"{page}.md" in names
    for page in ("experiments", "reliability", "design"):
        assert f"{page}.md" in names
    for page in PAGES[1:]:
        head = page.read_text().split("\n## ", 1)[0]
        assert "```" in head or "\n    " in head, f"{page.name} does not start with commands"


def test_every_named_path_exists():
    missing = []
    for page, path in named_paths(tuple(PAGES + MEASURES + OTHER_PAGES)):
        if any(ch in path for ch in "*?["):
            ok = bool(glob.glob(str(ROOT / path)))
        else:
            ok = (ROOT / path).exists()
        if not ok:
            missing.append(f"{page}: {path}")
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)
    assert len(named_paths()) > 50  # the extractor sees the pages


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(doc: Path) -> list[str]:
    """A markdown file's headings as they read now (another change may have renamed them)."""
    return re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)


def test_every_link_to_a_section_has_its_heading():
    bad = []
    for page in PAGES + MEASURES + OTHER_PAGES:
        for link in page_parts(page)[2]:
            target, _, anchor = link.partition("#")
            if not anchor or "://" in target:
                continue
            doc = (page.parent / target).resolve() if target else page
            if anchor not in {_anchor(h) for h in headings(doc)}:
                bad.append(f"{_rel(page)}: {link}")
    assert not bad, "links to missing sections:\n" + "\n".join(bad)


def config_arguments(path: Path) -> tuple[list[str], list[str]]:
    """(the argument names a config's get_config parses, its variants), read from its source:
    parse_arg's keywords, and the variant names it compares against or lists in VARIANTS."""
    text = path.read_text()
    names = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "parse_arg":
            names += [k.arg for k in node.keywords]
    variants = set(re.findall(r'args\.variant [!=]= "(\w+)"', text))
    variants |= set(re.findall(r'\bvariant="(\w+)"', text))
    for listed in re.findall(r"^VARIANTS = \(([^)]*)\)", text, flags=re.M):
        variants |= set(re.findall(r'"(\w+)"', listed))
    return names, sorted(variants)


def test_the_configs_table_lists_every_config_its_arguments_and_variants():
    """docs/training.md's table of configs: a row per file in configs/, naming each argument
    its get_config parses and each of its variants (in backticks)."""
    section = (ROOT / "docs" / "training.md").read_text().split("\n## Configs\n", 1)[1]
    rows = {
        m.group(1): line
        for line in section.split("\n## ", 1)[0].splitlines()
        if (m := re.match(r"\| `(configs/\w+\.py)` \|", line))
    }
    bad = []
    for path in sorted((ROOT / "configs").glob("*.py")):
        row = rows.get(_rel(path))
        if row is None:
            bad.append(f"{_rel(path)}: no row")
            continue
        names, variants = config_arguments(path)
        assert names and variants, f"{_rel(path)}: no parse_arg or variant found"
        bad += [f"{_rel(path)}: argument {n}" for n in names if not re.search(rf"\b{n}\b", row)]
        bad += [f"{_rel(path)}: variant {v}" for v in variants if f"`{v}`" not in row]
    assert not bad, "missing from docs/training.md's table of configs:\n" + "\n".join(bad)


# ---------------------------------------------------------------------- sections cited in prose

# How a page or a comment cites a section of a document: the document's name (`BENCHMARKS.md`,
# `docs/training.md`, `training.md` beside the page, `README`), then optionally 's, a comma or
# a parenthesis, then the section's title in double or single quotes, or its first word bare:
#     BENCHMARKS.md, "Test suite"    docs/data.md "Your own corpus"    (BENCHMARKS.md ('Method'))
#     docs/design.md's Architecture tree
_DOC = r"(?<![\w/.-])(?P<doc>(?:[\w.-]+/)*[\w.-]+\.md|README)"
QUOTED_CITATION = re.compile(_DOC + r"(?:'s)?,?\s\(?(?:\"(?P<dq>[^\"]+)\"|'(?P<sq>[^']+)')")
BARE_CITATION = re.compile(_DOC + r"(?:'s|,)\s(?P<word>[A-Z][\w-]*)")
# A document a comment names must exist; these are written by the studies into their roots.
WRITTEN_BY_RUNS = {"REPORT.md", "RESULTS.md", "results.md"}
PLACEHOLDER_TITLES = {"Name", "Section", "Title"}


def code_files() -> list[Path]:
    """Every Python and shell file of the repository."""
    return [p for p in repository_files() if p.suffix in (".py", ".sh")]


def citing_files() -> list[Path]:
    """The pages, experiments/README.md and the code, whose comments and docstrings cite."""
    return PAGES + OTHER_PAGES + code_files()


@functools.cache
def prose(path: Path) -> str:
    """What a file says to its reader: a page whole; of a Python file its comments and
    docstrings, of a shell file its comments (not the code's strings, which may build paths)."""
    text = path.read_text()
    if path.suffix == ".md":
        return text
    if path.suffix != ".py":
        return "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    parts = [
        tok.string.lstrip("#")
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            parts.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(parts)


def _cited_document(doc: str, citing: Path) -> Path | None:
    """The file a citation names: from the repository's root, else beside the citing file."""
    name = "README.md" if doc == "README" else doc
    for base in (ROOT, citing.parent):
        if (base / name).is_file():
            return base / name
    return None


def _one_line(path: Path) -> str:
    """The file's prose with its lines joined: a citation may wrap."""
    return re.sub(r"\s*\n\s*", " ", prose(path))


def citations(path: Path) -> list[tuple[str, str, bool]]:
    """(document, title, quoted) for each section `path` cites."""
    text = _one_line(path)
    found = [
        (m.group("doc"), m.group("dq") or m.group("sq"), True)
        for m in QUOTED_CITATION.finditer(text)
    ]
    found += [(m.group("doc"), m.group("word"), False) for m in BARE_CITATION.finditer(text)]
    return found


def test_every_cited_section_exists():
    """A quoted title names the start of one of the cited document's headings (an ellipsis
    ends a shortened one); a bare capitalised word after a document's name is a word of one
    of its headings. Titles are read from the documents as they are now."""
    bad, seen = [], 0
    for path in citing_files():
        for doc, title, quoted in citations(path):
            cited = _cited_document(doc, path)
            if cited is None:
                if quoted and doc not in WRITTEN_BY_RUNS:
                    bad.append(f'{_rel(path)}: {doc} "{title}" (no such file)')
                continue
            if title in PLACEHOLDER_TITLES:
                continue
            seen += 1
            names = headings(cited)
            if quoted:
                ok = any(h.startswith(title.rstrip(".…").strip()) for h in names)
            else:
                ok = any(re.search(rf"\b{re.escape(title)}\b", h) for h in names)
            if not ok:
                bad.append(f'{_rel(path)}: {doc} "{title}" (no such heading in {_rel(cited)})')
    assert not bad, "sections cited but missing:\n" + "\n".join(bad)
    assert seen > 20  # the extractor sees the citations


def test_every_document_a_comment_names_exists():
    """A markdown file named in the comments or docstrings of Python or shell code (one under
    docs/, or an upper-case name such as BENCHMARKS.md) is a file of the repository, from its
    root or beside the code, unless the runs write it."""
    name = re.compile(r"(?<![\w/.$-])((?:docs/[\w.-]+|[A-Z][A-Z_]+)\.md)\b")
    bad = []
    for path in code_files():
        for doc in set(name.findall(prose(path))) - WRITTEN_BY_RUNS:
            if _cited_document(doc, path) is None:
                bad.append(f"{_rel(path)}: {doc}")
    assert not bad, "documents named but not in the repository:\n" + "\n".join(bad)


def test_every_launch_sh_subcommand_exists():
    case = (ROOT / "launch.sh").read_text().split('case "$cmd" in', 1)[1]
    labels = {
        name
        for line in re.findall(r"^\s+([\w|*-]+)\)", case, flags=re.M)
        for name in line.split("|")
    }
    tpu_script = (ROOT / "scripts" / "tpu.sh").read_text()
    bad = []
    for page, command in commands():
        if not command.startswith("./launch.sh"):
            continue
        sub = command.split()[1]
        if not any(fnmatch.fnmatch(label, sub) for label in labels):
            bad.append(f"{page}: {command}")
        if sub.startswith("tpu-"):  # gcloud is not run here: its flags are checked only
            own = command.split(" -- ")[0]
            bad += [f"{page}: {command} (--{f})" for f in flags(own) if f"--{f}" not in tpu_script]
    assert not bad, "\n".join(bad)


def test_every_command_names_a_verb_that_answers_help_and_accepts_its_flags():
    texts = help_texts()
    assert len(texts) >= 8, f"the extractor sees too few verbs: {sorted(texts)}"
    bad = []
    for page, command in commands():
        verb = _verb(command)
        if verb is None:
            continue
        if verb not in texts:
            bad.append(f"{page}: {command} (no verb {verb}; the verbs: {', '.join(VERBS)})")
            continue
        for flag in flags(command):
            if not flag.startswith("config.") and not _accepts(texts[verb], flag):
                bad.append(f"{page}: {command} (--{flag})")
    assert not bad, "\n".join(bad)


def test_a_command_of_no_verb_is_found():
    """The extractor reads each form a page may write, and an old or mistyped command is no
    verb: the test above would name it."""
    written = {
        "tx_jax evaluate --workdir=W": "evaluate",
        "python -m tx_jax translate --workdir=W": "translate",
        "python -m tx_jax.main --config=C": "train",
        "python -m tx_jax.evaluate --workdir=W": "tx_jax.evaluate",
        "tx_jax evalute --workdir=W": "evalute",
        "./launch.sh sweep experiments/x.py": "sweep",
        "./launch.sh train": None,
    }
    for command, verb in written.items():
        (found,) = [m.group(0) for m in COMMAND.finditer(f"$ {command}")]
        assert _is_command(found, f"$ {command}") and _verb(found) == verb, command
    assert _verb("python -m tx_jax VERB --help") is None  # a placeholder
    assert not COMMAND.search("import tx_jax; tx_jax.variant('base'); tx_jax/cli/")
    prose = "python x.py  # tx_jax vs Transformers"
    assert not _is_command(COMMAND.search(prose).group(0), prose)
    assert {"evalute", "tx_jax.evaluate"}.isdisjoint(VERBS)


def test_every_config_key_exists_in_its_config():
    uses = config_uses()
    assert uses, "no --config.a.b found: the extractor is broken"
    bad = []
    for page, spec, key in uses:
        path = spec.partition(":")[0]
        if not (ROOT / path).is_file():
            bad.append(f"{page}: --config={spec} (no such file)")
        elif not has_key(config_of(spec), key):
            bad.append(f"{page}: --config.{key} not in {spec}")
    assert not bad, "\n".join(bad)


# A backtick span of a page's prose that starts with a section's key (`data.max_train_len`,
# `config.data.dataset`, `model.loss_impl=onepass`, `data.tokenizer.*`,
# `parallel.coordinator_address/num_processes/process_id`) names a config key. Spans that read
# like one and name something else, each with what it is:
NOT_CONFIG_KEYS = {
    "model.encode": "a method of the model (docs/design.md)",
    "model.decode": "a method of the model (docs/design.md)",
    "parallel.make_abstract_strategy": "a function of tx_jax/training/parallel.py",
}
NAMED_KEY = re.compile(
    rf"(?:--)?(?:config\.)?((?:{'|'.join(CONFIG_SECTIONS)})(?:\.[A-Za-z_][\w/]*)+)(\.\*)?"
)
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "txt", "model", "safetensors", "png", "gz"}


def named_keys() -> list[tuple[str, str]]:
    """(page, dotted key) for each config key a page's prose names in backticks; `a.b/c` names
    a.b and a.c, `a.b.*` names a.b."""
    found = set()
    for page in PAGES:
        for span in page_parts(page)[1]:
            m = NAMED_KEY.match(span)
            if not m or m.group(1).rpartition(".")[2] in FILE_SUFFIXES:
                continue
            head, _, last = m.group(1).rpartition(".")
            found |= {(_rel(page), f"{head}.{name}") for name in last.split("/") if name}
    return sorted(found)


@functools.cache
def every_config() -> tuple:
    """Each file of configs/ as loaded plain and under each variant it names."""
    specs = []
    for path in sorted((ROOT / "configs").glob("*.py")):
        specs += [_rel(path), *(f"{_rel(path)}:{v}" for v in config_arguments(path)[1])]
    return tuple(config_of(spec) for spec in specs)


def names_a_key(config, dotted: str) -> bool:
    """Whether `dotted` is a key of `config`, or lies under one of its free-form dicts, whose
    keys no config fixes: a plain dict, or one left empty (parallel.mesh_by_platform)."""
    node = config
    for part in dotted.split("."):
        if type(node) is dict or (hasattr(node, "keys") and not list(node.keys())):
            return True
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return False
    return True


def test_every_config_key_a_page_names_exists_in_some_config():
    keys = named_keys()
    assert len(keys) > 50, "the extractor sees too few keys"
    configs = every_config()
    # a study key defined outside configs/ (the back-translation study's make_config, whose
    # test checks it defines them)
    elsewhere = {k for k, v in STUDY_KEYS.items() if not v.home.startswith("configs/")}
    bad = [
        f"{page}: `{key}`"
        for page, key in keys
        if key not in {*NOT_CONFIG_KEYS, *elsewhere}
        and not any(names_a_key(c, key) for c in configs)
    ]
    assert not bad, "named but in no config of configs/ (any variant):\n" + "\n".join(bad)
    unused = set(NOT_CONFIG_KEYS) - {key for _, key in keys}
    assert not unused, f"NOT_CONFIG_KEYS names what no page says any more: {sorted(unused)}"


def dataset_names() -> list[str]:
    """The names of tx_jax/data/datasets.py's DATASETS table, read from its source (importing
    it imports TFDS): string keys, and `module.NAME` keys looked up in tx_jax/data/module.py."""
    tree = ast.parse((ROOT / "tx_jax" / "data" / "datasets.py").read_text())
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "DATASETS"
    )
    names = []
    for key in table.keys:
        if isinstance(key, ast.Constant):
            names.append(key.value)
        else:
            module = (ROOT / "tx_jax" / "data" / f"{key.value.id}.py").read_text()
            names.append(re.search(rf'^{key.attr} = "(\w+)"', module, flags=re.M).group(1))
    return names


def test_the_datasets_section_lists_every_dataset():
    """docs/data.md's "Datasets" names each value of config.data.dataset that the table of
    tx_jax/data/datasets.py has, in backticks, and the TFDS catalog for every other name."""
    page = (ROOT / "docs" / "data.md").read_text()
    section = page.split("\n## Datasets\n", 1)[1].split("\n## ", 1)[0]
    names = dataset_names()
    assert {"synthetic", "multi30k", "text"} <= set(names), names
    missing = [name for name in names if f"`{name}`" not in section]
    assert not missing, f'docs/data.md "Datasets" does not list: {missing}'
    assert "TFDS catalog name" in section


# ---------------------------------------------------------------------- the project's words

# Files speak of the code and its results, never of how the work on it was organised: no
# ticket numbers, no machines on loan, no working periods, no brief, no numbered seed files
# (the "H100, 2026-11-27", "the seed articles in ../shared/seeds", "the paper" instead). Each
# word is built from parts, so that this file does not contain it.
_TICKET, _LOAN, _PERIOD = "iss" + "ue", "le" + "nt", "sess" + "ion"
_WHICH = (
    "this|that|these|those|a|an|one|the|each|every|next|last|previous|earlier|later|current|"
    "first|second|third|fourth|fifth|sixth|other|another|several|many|two|three|same|whole|"
    "our|between"
)
PROJECT_WORDS = {
    "a ticket's number": re.compile(rf"\b{_TICKET}s?\s+#?\d+", re.I),
    "the ticket": re.compile(rf"\b(?:the|this|that|our) {_TICKET}\b", re.I),
    "a machine on loan": re.compile(rf"\b{_LOAN}\b", re.I),
    "a working period": re.compile(rf"\b(?:{_WHICH})\s+{_PERIOD}s?\b|\b{_PERIOD}s'", re.I),
    "the brief": re.compile(r"\btask\s+" + "state" + "ment", re.I),
    "a numbered seed file": re.compile(
        r"\bsource\s+" + "docu" + r"ments?\b|\bseed\s+" + r"0\d\d\b", re.I
    ),
}
# Another project's tickets are references like any other (jax-ml/jax#1605): a number after
# a repository's path or a project's name is not one of ours.
THIRD_PARTY = re.compile(
    r"(?:github|[\w.-]+/[\w.-]+|\b(?:jax|jaxlib|xla|flax|orbax|optax|grain|tensorflow|tfds|"
    r"pytorch|torch|sentencepiece|sacrebleu|ctranslate2|transformers|cuda|cudnn|pip))\W*$",
    re.I,
)


@functools.cache
def repository_files() -> tuple[Path, ...]:
    """Every file git tracks or would add (untracked and not ignored); where git is not at hand,
    a walk of the tree that skips .git, .venv, runs and caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}
        names = []
        for top, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in skip]
            names += [os.path.relpath(os.path.join(top, f), ROOT) for f in files]
    return tuple(ROOT / n for n in sorted(set(names)) if (ROOT / n).is_file())


def project_words(path: Path) -> list[str]:
    """'file:line: "words" (what they are)' for each of PROJECT_WORDS in a text file."""
    data = path.read_bytes()
    if b"\0" in data:
        return []
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return []
    found = []
    for kind, pattern in PROJECT_WORDS.items():  # on the whole text: a phrase may wrap
        for m in pattern.finditer(text):
            before = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
            if kind == "a ticket's number" and THIRD_PARTY.search(before):
                continue
            number = text.count("\n", 0, m.start()) + 1
            found.append(f'{_rel(path)}:{number}: "{" ".join(m.group(0).split())}" ({kind})')
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_no_file_speaks_of_how_the_work_was_organised():
    files = repository_files()
    assert ROOT / "BENCHMARKS.md" in files and ROOT / "tests" / "test_docs.py" in files
    found = [hit for path in files for hit in project_words(path)]
    assert not found, (
        "name things by what they are (a machine and a date, a seed article, the paper):\n"
        + "\n".join(found)
    )


def test_the_project_words_are_caught_and_the_rest_is_not(tmp_path):
    """The patterns against lines they must catch and lines they must leave alone."""
    caught = [
        f"the levers of {_TICKET} 38",
        f"{_TICKET.title()} #53 asks for it",
        f"within the {_TICKET}'s 45 minutes",
        f"the fourth {_LOAN} GPU",
        f"Before a GPU was {_LOAN}",
        f"measured in this {_PERIOD}",
        f"a later {_PERIOD} will",
        f"the earlier {_PERIOD}s' tables",
        f"its kind changed between\n  {_PERIOD}s: AMD EPYC",
        f"**Second {_PERIOD}** (2026-11-24)",
        "the task " + "statement's figure",
        "source " + "document 002",
        "long context (seed " + "003)",
    ]
    left = [
        f'@pytest.fixture(scope="{_PERIOD}")',
        f"s = requests.{_PERIOD.title()}()",
        f"async with aiohttp.Client{_PERIOD.title()}() as s:",
        f"subprocess.Popen(cmd, start_new_{_PERIOD}=True)",
        f"the ssh {_PERIOD} ends with 255",
        f"one data dir per test {_PERIOD}",
        "an excel" + f"{_LOAN} and si{_LOAN} fallback",
        f"see https://github.com/jax-ml/jax/{_TICKET}s/12345",
        f"a jax {_TICKET} 1605 of theirs",
        "the fix of PR #39512",
        "seed 1 (AMD Zen 4), seeds 0,1",
    ]
    for i, line in enumerate(caught + left):
        (tmp_path / f"{i}.txt").write_text(line + "\n")
    hits = {i for i in range(len(caught + left)) if project_words(tmp_path / f"{i}.txt")}
    missed = [caught[i] for i in range(len(caught)) if i not in hits]
    wrong = [left[i - len(caught)] for i in hits if i >= len(caught)]
    assert not missed and not wrong, f"missed: {missed}; caught wrongly: {wrong}"


# ---------------------------------------------------------------------- the tour, end to end


def _run(args: list[str], stdin: str | None = None, timeout: int = 300) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        args, input=stdin, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{shlex.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def _run_verbs(commands: list[tuple], timeout: int = 600) -> list[str]:
    """`tx_jax VERB *args [< stdin]` for each (verb, args[, stdin]), one after another, each
    a `python -m tx_jax` process forked from one interpreter (tests/forked.py) -> their
    stdouts; each must exit 0."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    named = [("tx_jax", [c[0], *c[1]], *c[2:]) for c in commands]
    runs = forked.run_modules(named, cwd=ROOT, env=env, timeout=timeout)
    for (_, args, *_), (code, _, stderr) in zip(named, runs):
        command = shlex.join(["tx_jax", *args])
        assert code == 0, f"{command} exited {code}:\n{stderr[-4000:]}"
    return [stdout for _, stdout, _ in runs]


@pytest.mark.slow
def test_the_readme_tour_runs_on_debug_configs(tmp_path):
    """The tour's commands 1, 3-8, 10, 11 and 12 on debug configs, one after another
    (the tx_jax commands in processes forked from one interpreter, tests/forked.py).

    Not run: 2 (needs the Multi30k files), 9 (a downloaded OPUS-MT directory; tests/
    test_import_model.py imports tiny ones), 11 for real (gcloud and a TPU VM): only its
    --dry-run."""
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A tour", 1)[1].split("\n## ", 1)[0]
    for verb in ("train", "evaluate", "translate", "score", "plan", "export", "import", "prepare"):
        assert f"tx_jax {verb}" in tour or verb == "train"
    for sub in ("train", "sweep", "tpu-run"):
        assert f"./launch.sh {sub}" in tour
    run, debug = tmp_path / "run", "--config=configs/default.py:debug"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.src").write_text("the dog sees two cats .\n\nthe cat runs .\n")
    (tmp_path / "src.txt").write_text("the dog sees two cats .\nthe cat runs .\n")
    (tmp_path / "tgt.txt").write_text("a b\nc\n")
    source, target = f"--source={tmp_path / 'src.txt'}", f"--target={tmp_path / 'tgt.txt'}"
    for shard in ("train-0", "train-1"):  # 12's corpus: two shards and a TSV file
        (corpus / f"{shard}.en").write_text("the cat runs .\nthe dog sees two cats .\n")
        (corpus / f"{shard}.de").write_text("die Katze rennt .\nder Hund sieht zwei Katzen .\n")
    (corpus / "dev.tsv").write_text("the cat runs .\tdie Katze rennt .\n")
    text = [
        "--config=configs/text.py:debug",
        f"--workdir={tmp_path / 'mine'}",
        f"--config.data.train={corpus}/train-*",
        f"--config.data.validation={corpus}/dev.tsv",
        f"--config.data.data_dir={tmp_path / 'tfds'}",
        "--config.data.vocab_size=24",
    ]
    out, line, _, scores, plan, _, _, prepared = _run_verbs(
        [
            ("train", [debug, f"--workdir={run}"]),  # 1
            ("evaluate", [f"--workdir={run}", "--limit=8", "--beam_size=2"]),  # 3
            ("translate", [f"--workdir={run}"], "the dog sees two cats .\n"),  # 4
            (
                "translate",
                [f"--workdir={run}", f"--input={corpus}/*.src", f"--output_dir={tmp_path / 'out'}"],
            ),  # 5
            ("score", [f"--workdir={run}", source, target]),  # 6
            ("plan", [debug, "--target=tpu:v5e-4", "--programs=train"]),  # 7
            ("export", [f"--workdir={run}", "--format=hf", f"--out={tmp_path / 'hf'}"]),  # 8
            ("sweep", ["experiments/table3_cpu.py", "--dry_run", "--only", "0"]),  # 10
            ("prepare", text),  # 12
        ]
    )[1:]
    assert "data: text train: 4 pairs" in prepared and "data: text validation: 1 pairs" in prepared
    assert "BLEU" in out
    assert len(line.splitlines()) == 1
    assert len((tmp_path / "out" / "a.src").read_text().splitlines()) == 3
    assert len(scores.splitlines()) == 2
    assert "FITS" in plan
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    dry = _run(
        [
            "bash",
            "scripts/tpu.sh",
            "tpu-create",
            "tx1",
            "--zone",
            "us-central2-b",
            "--accelerator-type",
            "v4-8",
            "--dry-run",
        ]
    )  # 11, as far as it goes without gcloud
    assert "gcloud" in dry


def test_the_tpu_walk_in_the_docs_runs_with_dry_run():
    """docs/tpu_and_cloud.md's walk from create to delete: each command, with --dry-run, prints
    the gcloud commands it would run (scripts/tpu.sh) and exits 0."""
    page = (ROOT / "docs" / "tpu_and_cloud.md").read_text()
    block = page.split("```bash\n", 1)[1].split("```", 1)[0]  # the walk, the page's first block
    commands = [
        shlex.split(c)
        for c in block.replace("\\\n", " ").splitlines()
        if c.strip() and not c.startswith("#")
    ]
    subcommands = [c[1] for c in commands]
    assert subcommands == [
        "tpu-create",
        "tpu-create",
        "tpu-setup",
        "tpu-prepare",
        "tpu-run",
        "tpu-logs",
        "tpu-delete",
    ]
    outs = []
    for args in commands:
        assert args[0] == "./launch.sh"
        cut = args.index("--") if "--" in args else len(args)
        outs.append(_run(["bash", *args[:cut], "--dry-run", *args[cut:]]))
        lines = outs[-1].splitlines()
        assert lines and all(line.startswith("+ ") for line in lines), outs[-1]
        assert any(line.startswith("+ gcloud ") for line in lines), outs[-1]
    assert "--spot" in outs[0] and "queued-resources create" in outs[1]
    assert "--version=tpu-ubuntu2204-base" in outs[0]  # v4's runtime
    assert "--worker=0" in outs[3] and "python -m tx_jax prepare --config=" in outs[3]
    assert "-m tx_jax plan --target=tpu:" in outs[4]  # planned first


def test_the_tpu_setup_dry_run_in_the_docs_is_what_it_prints():
    page = (ROOT / "docs" / "tpu_and_cloud.md").read_text()
    prompt = "$ ./launch.sh tpu-setup tx1 --zone us-central2-b --dry-run\n"
    shown = page.split(prompt, 1)[1].split("```", 1)[0]
    printed = _run(
        ["bash", "./launch.sh", "tpu-setup", "tx1", "--zone", "us-central2-b", "--dry-run"]
    )
    assert shown == printed
