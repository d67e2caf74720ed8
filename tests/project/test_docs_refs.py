"""Every ref of this repository that the docs name exists and has what the examples use.

docs/ci.md and docs/integrations/ show `uses: consistency-dev/consistency@REF` (the GitHub
Action) and `repo: .../consistency` + `rev: REF` (pre-commit). A user copies them as they
are, so REF must resolve (issue 28: the docs named a `v0.1.0` tag that did not exist), must
be on this repository's history (not a commit a rebase dropped), and the `action.yml` and
`.pre-commit-hooks.yaml` *at REF* must declare each input, output and hook id the examples
use, with a hook `files` pattern that fires on the documented configs. Placeholders
(`OWNER/`, `<ref>`) do not run as written and are refused.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import pytest
import yaml

from tests.conftest import ROOT

REPO = "consistency-dev/consistency"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
USES = re.compile(rf"uses:\s*{re.escape(REPO)}@(\S+)")
PRECOMMIT = re.compile(rf"repo:\s*https://github\.com/{re.escape(REPO)}\s*\n\s*rev:\s*(\S+)")
PIP = re.compile(rf"git\+https://github\.com/{re.escape(REPO)}(?:\.git)?@([^\s\"'#]+)")  # pip install "... @ git+URL@REF"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def history() -> None:
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout (an sdist or a copied tree): no history to check the docs' refs against")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the history the docs' refs point into (git fetch --unshallow)")


def _refs() -> dict[tuple[str, str], set[str]]:
    """(kind, ref) -> the docs naming it; kind is 'action', 'pre-commit' or 'pip' (a git URL)."""
    out: dict[tuple[str, str], set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for kind, pat in (("action", USES), ("pre-commit", PRECOMMIT), ("pip", PIP)):
            for ref in pat.findall(text):
                out.setdefault((kind, ref), set()).add(str(doc.relative_to(ROOT)))
    return out


def _at(ref: str, path: str) -> str:
    r = _git("show", f"{ref}:{path}")
    assert r.returncode == 0, f"{path} does not exist at {ref}: {r.stderr.strip()}"
    return r.stdout


def _example_blocks(kind: str) -> list[str]:
    blocks = [b for doc in DOCS for b in re.findall(r"```ya?ml\n(.*?)```", doc.read_text(), re.S)]
    return [b for b in blocks if (USES if kind == "action" else PRECOMMIT).search(b)]


def test_the_docs_name_refs_and_no_placeholders() -> None:
    refs = _refs()
    assert {k for k, _ in refs} == {"action", "pre-commit", "pip"}, refs  # each way in is documented with a ref
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"\bOWNER/|github\.com/OWNER\b", text), f"{doc}: a placeholder owner does not run as written"
        for m in re.finditer(r"(?:uses:\s*\S*consistency@|rev:\s*)(\S+)", text):
            assert not m.group(1).startswith("<"), f"{doc}: placeholder ref {m.group(1)}"


def test_every_ref_the_docs_name_is_a_commit_of_this_history(history: None) -> None:
    for (kind, ref), docs in _refs().items():
        full = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        assert full.returncode == 0, (f"{sorted(docs)} name {kind} ref {ref}, which is not a commit or tag of this "
                                      "repository: pin an existing commit (git log -1 --format=%H) or tag the release")
        if re.fullmatch(r"[0-9a-f]{7,40}", ref):
            assert len(ref) == 40, f"{sorted(docs)}: {ref}: GitHub Actions takes a full 40-character SHA"
        anc = _git("merge-base", "--is-ancestor", full.stdout.strip(), "HEAD")
        assert anc.returncode == 0, (f"{sorted(docs)}: {kind} ref {ref} is not on this branch's history (a rebase or "
                                     "squash dropped it?): pin a commit of the history")
        if kind == "pip":  # `pip install "specdec-consistency @ git+...@REF"`: the commit's distribution has that name
            from consistency import DIST

            assert f'name = "{DIST}"' in _at(ref, "pyproject.toml"), f"{ref}: its pyproject.toml does not name {DIST}"


def test_the_action_at_the_ref_has_what_the_examples_use(history: None) -> None:
    for (kind, ref), _docs in _refs().items():
        if kind != "action":
            continue
        spec = yaml.safe_load(_at(ref, "action.yml"))
        inputs, outputs = set(spec["inputs"]), set(spec["outputs"])
        assert (ROOT / "scripts" / "action.py").is_file() and _at(ref, "scripts/action.py")
        for block in _example_blocks("action"):
            steps = yaml.safe_load(block)["jobs"]
            for job in steps.values():
                for step in job["steps"]:
                    if str(step.get("uses", "")).startswith(REPO):
                        used = set(step.get("with", {}))
                        assert used <= inputs, f"action at {ref} lacks inputs {sorted(used - inputs)}"
                        sid = step.get("id")
                        for out in re.findall(rf"steps\.{sid}\.outputs\.([\w-]+)", block) if sid else []:
                            assert out in outputs, f"action at {ref} has no output {out}"


def test_the_hooks_at_the_ref_have_what_the_examples_use(history: None) -> None:
    from tests.gate.test_action import _documented_inputs

    documented = _documented_inputs()
    for (kind, ref), _docs in _refs().items():
        if kind != "pre-commit":
            continue
        hooks = {h["id"]: h for h in yaml.safe_load(_at(ref, ".pre-commit-hooks.yaml"))}
        for block in _example_blocks("pre-commit"):
            for repo in yaml.safe_load(block)["repos"]:
                if REPO not in repo["repo"]:
                    continue
                for h in repo["hooks"]:
                    assert h["id"] in hooks, f"no hook {h['id']} at {ref}"
                    pat = re.compile(h.get("files") or hooks[h["id"]]["files"])
                    if "files" not in h:  # the hook's own trigger must see every documented input
                        missed = sorted(f for f in documented if not pat.search(f))
                        assert not missed, f"hook {h['id']} at {ref} does not fire on {missed}"


def test_refs_in_the_workflow_of_this_repository_are_local() -> None:
    """.github/workflows/action.yml runs the action of the checkout (`uses: ./`), never a ref."""
    wf = (ROOT / ".github" / "workflows" / "action.yml").read_text()
    assert not USES.search(wf) and "uses: ./" in wf


def test_refs_are_found_where_docs_put_them() -> None:
    """The extraction itself: a doc-shaped text yields its refs (so a reworded doc cannot hide one)."""
    text = (f"      - uses: {REPO}@abc\n"
            f"  - repo: https://github.com/{REPO}\n    rev: v9.9.9   # comment\n"
            f'      - run: pip install "x @ git+https://github.com/{REPO}@def"\n')
    assert USES.findall(text) == ["abc"] and PRECOMMIT.findall(text) == ["v9.9.9"] and PIP.findall(text) == ["def"]
