#!/usr/bin/env python3
"""The logic of the GitHub Action (action.yml): install consistency, run the gate, set outputs.

Kept out of the YAML so it can be tested directly (tests/gate/test_action.py,
tests/gate/test_hostile_ci.py; ``act`` is not available) and so no action input is ever pasted
into a shell script: action.yml passes inputs as environment variables / arguments only.
Standard library only: it runs before consistency is installed. Nothing here reads the
repository under test except through the installed ``consistency`` (the config is
someone else's file: docs/security.md).

``install``: a virtual environment (``$RUNNER_TEMP/consistency-venv``; a Debian/Ubuntu
system Python refuses ``pip install`` as externally managed), then the package from the
action's own checkout (``version`` empty: the action ref is the package version),
``specdec-consistency==VERSION`` (the distribution's name on PyPI) for a version number, or any other pip requirement as given.
Then the installed gate is asked what the config needs (``consistency gate --plan``: the
gate's own TOML loader and config model, never a guess over the text), and torch comes in
only when a check needs it, as the CPU wheel, not a multi-GB CUDA one. Outputs ``python``
(the environment's interpreter, for the gate step), ``replay`` and ``needs``.

``gate``: ``consistency gate`` with the report paths asked for and ``--result`` in a fresh
temporary directory: the verdict is read back from that file only, which nothing but this
run can have written (a file a pull request commits at the ``json:`` path is never read).
``fail-on``: ``error`` (default: the gate's own code), ``warning`` (passed to the gate, so
lint warnings make the verdict ``fail``), ``never`` (report only: the step passes on a
``fail`` verdict; an ``error`` verdict, exit 2, still fails). Writes ``verdict``,
``exit-code``, ``json``, ``sarif`` and ``junit`` (the last two only when this run wrote them:
the upload steps publish nothing else) to ``$GITHUB_OUTPUT``; ``exit-code`` is the step's
exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DIST = "specdec-consistency"  # the distribution's name on PyPI (consistency/__init__.py DIST; `consistency` is another project)
FAIL_ON = ("", "error", "warning", "never")
VERDICT_CODE = {"pass": 0, "fail": 1, "error": 2}
# ``python -m X`` puts the working directory (the pull request's checkout) first on sys.path:
# a committed ``click.py``, ``json.py``, ``pip/`` or ``consistency/__main__.py`` would be
# imported instead of the real one and run in the job. -I (isolated mode) never adds it
# (nor the user site, nor PYTHON* variables); every interpreter this script starts gets it.
SAFE = ("-I",)
_VERSION = re.compile(r"^v?\d+(\.\d+)*([abc]|rc|\.post|\.dev)?\d*$")


def requirement(version: str, source: Path, extras: list[str] | None = None) -> str:
    """What pip installs: the action's checkout, ``specdec-consistency==X``, or a requirement as given."""
    v = version.strip()
    ext = f"[{','.join(extras)}]" if extras else ""
    if not v:
        return f"{source}{ext}"
    if _VERSION.match(v):
        return f"{DIST}{ext}=={v.removeprefix('v')}"
    return v  # a URL or requirement the user spelled out, extras included if wanted


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def default_venv() -> Path:
    return Path(os.environ.get("RUNNER_TEMP") or tempfile.gettempdir()) / "consistency-venv"


def set_output(**values: str) -> None:
    out = os.environ.get("GITHUB_OUTPUT")
    if not out:
        return
    with open(out, "a", encoding="utf-8") as fh:
        for k, v in values.items():
            fh.write(f"{k}={str(v).replace(chr(10), ' ').replace(chr(13), ' ')}\n")


def ask_plan(python: str, config: str) -> tuple[dict | None, str]:
    """The installed gate's reading of the config (``gate --plan``), or None and why not."""
    try:
        r = subprocess.run([python, *SAFE, "-m", "consistency", "gate", "--config", config, "--plan"],
                           capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"cannot run the installed consistency: {exc}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return None, last
    try:
        plan = json.loads(r.stdout)
    except ValueError:
        return None, "gate --plan printed no JSON"
    if not isinstance(plan, dict) or plan.get("kind") != "gate-plan" or not isinstance(plan.get("needs"), list):
        return None, "gate --plan printed something else than a plan"
    return plan, ""


def run_install(args: argparse.Namespace) -> int:
    venv = Path(args.venv) if args.venv else default_venv()
    py = venv_python(venv)
    source = Path(args.source)

    def run(cmd: list[str]) -> int:
        print("+ " + " ".join(cmd), flush=True)
        return 0 if args.dry_run else subprocess.run(cmd, check=False).returncode

    if not py.exists():
        rc = run([sys.executable, *SAFE, "-m", "venv", str(venv)])
        if rc:
            print("action: cannot create a virtual environment (on Debian/Ubuntu: apt-get install python3-venv, or "
                  "set the action's python input)", file=sys.stderr)
            return rc
    pip = [str(py), *SAFE, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    rc = run(pip + [requirement(args.version, source)])
    if rc:
        return rc
    # what the config needs, read by the gate that will run it; in a dry run without the
    # environment, by the consistency this script runs beside (the tests' own)
    asker = str(py) if py.exists() else sys.executable
    plan, why = ask_plan(asker, args.config)
    if plan is None and "No such option" in why:  # an older consistency: install torch so nothing is skipped
        print(f"action: the installed consistency cannot report what the config needs ({why}); installing torch "
              "so that every check can run", flush=True)
        plan = {"needs": ["torch", "transformers"], "extras": ["hf"], "torch": True}
    elif plan is None:
        print(f"action: the config does not load ({why}); installing nothing more: the gate step reports it",
              flush=True)
        plan = {"needs": [], "extras": [], "torch": False}
    needs = [str(m) for m in plan.get("needs", [])]
    set_output(python=str(py), replay="true" if plan.get("torch") else "false", needs=",".join(needs))
    if plan.get("torch"):
        rc = run(pip + ["torch", "--index-url", TORCH_CPU_INDEX])
        if rc:
            return rc
    extras = [str(e) for e in plan.get("extras", []) if re.fullmatch(r"[a-z0-9_-]+", str(e))]
    if extras:
        rc = run(pip + [requirement(args.version, source, extras)])
    return rc


def annotation_flags(annotations: str) -> list[str]:
    """The gate's flag for the ``annotations`` input; ValueError for anything but a boolean."""
    a = annotations.strip().lower()
    if a in ("true", "1", "yes", "on"):
        return ["--annotations"]
    if a in ("false", "0", "no", "off"):
        return ["--no-annotations"]
    if a:
        raise ValueError(f"annotations must be true or false, got {annotations!r}")
    return []


def gate_command(python: str, config: str, result: str, json_path: str, junit: str, sarif: str, annotations: str,
                 fail_on: str) -> list[str]:
    cmd = [python, *SAFE, "-m", "consistency", "gate", "--config", config, "--result", result]
    for flag, value in (("--json", json_path), ("--junit", junit), ("--sarif", sarif)):
        if value:
            cmd += [flag, value]
    cmd += annotation_flags(annotations)
    if fail_on == "warning":
        cmd += ["--fail-on", "warning"]
    return cmd


def read_result(path: Path) -> tuple[dict, str]:
    """This run's gate report, or an error verdict and why it cannot be trusted."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {"verdict": "error"}, f"the gate wrote no result ({type(exc).__name__}): it stopped before its checks"
    if not isinstance(data, dict) or data.get("tool") != "consistency" or data.get("kind") != "gate" \
            or data.get("verdict") not in VERDICT_CODE:
        return {"verdict": "error"}, "the gate's result is not a gate report"
    return data, ""


def step_code(verdict: str, gate_rc: int, fail_on: str) -> tuple[str, int, str]:
    """(verdict, the step's exit code, a note): the two always agree with the gate's code."""
    expected = VERDICT_CODE[verdict]
    if gate_rc != expected:  # a crash after the result, or a result from elsewhere: never trusted
        return "error", 2, f"the gate exited {gate_rc} but its result says {verdict}"
    if fail_on == "never" and verdict == "fail":
        return verdict, 0, "not failing the step (fail-on: never)"
    return verdict, expected, ""


def make_parents(path: str) -> str:
    """Create the missing directories of an output path; "" or why not (never a traceback).

    Inside the checkout nothing is created through a symlink (the pull request committed
    it; the gate decides whether the path may be written at all), and a committed file
    where a directory should be is an error, not a crash."""
    try:
        parent = Path(os.path.abspath(path)).parent
        ws = Path.cwd()
        if parent == ws or ws in parent.parents:
            p = ws
            for part in parent.relative_to(ws).parts:
                p = p / part
                if p.is_symlink():
                    return ""  # the gate resolves it and refuses a symlink that moves an output
                if p.exists() and not p.is_dir():
                    return f"{path}: {p.relative_to(ws)} is a file of the checkout, not a directory; refused"
        parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        return f"{path}: cannot create its directory: {getattr(exc, 'strerror', None) or exc}"
    return ""


def run_gate(args: argparse.Namespace) -> int:
    fail_on = (args.fail_on or "").strip().lower()
    try:
        if fail_on not in FAIL_ON:
            raise ValueError(f"fail-on must be error, warning or never, got {args.fail_on!r}")
        annotation_flags(args.annotations)
    except ValueError as exc:  # a bad input: an error verdict with its outputs, exit 2, nothing run
        print(f"action: {exc}", file=sys.stderr)
        set_output(verdict="error", **{"exit-code": "2", "json": ""})
        return 2
    for key, p in (("junit", args.junit), ("sarif", args.sarif), ("json", args.json)):
        why = make_parents(p) if p else ""
        if why:
            print(f"action: {key}: {why}", file=sys.stderr)
            set_output(verdict="error", **{"exit-code": "2", "json": ""})
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="consistency-action-", dir=os.environ.get("RUNNER_TEMP") or None))
    result = tmp / "consistency-gate.json"
    python = args.python or sys.executable
    cmd = gate_command(python, args.config, str(result), args.json, args.junit, args.sarif, args.annotations, fail_on)
    print("+ " + " ".join(cmd[1:]), flush=True)
    rc = subprocess.run(cmd, check=False).returncode
    data, why = read_result(result)
    verdict, code, note = step_code(data["verdict"], rc, fail_on) if not why else ("error", 2, why)
    outputs = data.get("outputs") if isinstance(data.get("outputs"), dict) else {}
    json_path = str(outputs.get("json") or "") or (str(result) if result.is_file() else "")
    if json_path == "-":
        json_path = str(result)
    if json_path != str(result):
        shutil.rmtree(tmp, ignore_errors=True)  # the report lives where it was asked for
    # the reports this run wrote, for the upload steps: a SARIF or JUnit file a pull request
    # committed at that path (which the gate refused to overwrite) is never uploaded
    written = {k: str(outputs.get(k) or "") for k in ("sarif", "junit")}
    set_output(verdict=verdict, **{"exit-code": str(code), "json": json_path}, **written)
    if note:
        print(f"action: verdict {verdict}, exit code {code}: {note}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="action.py", description="consistency GitHub Action steps")
    sub = ap.add_subparsers(dest="step", required=True)
    i = sub.add_parser("install")
    i.add_argument("--config", default="consistency.toml")
    i.add_argument("--version", default="")
    i.add_argument("--source", default=str(Path(__file__).resolve().parents[1]))
    i.add_argument("--venv", default="",
                   help="the environment to install into (default: $RUNNER_TEMP/consistency-venv)")
    i.add_argument("--dry-run", action="store_true", help="print what would be installed; install nothing")
    g = sub.add_parser("gate")
    g.add_argument("--config", default="consistency.toml")
    g.add_argument("--python", default="", help="the interpreter install set up (its python output)")
    g.add_argument("--fail-on", default="")
    g.add_argument("--annotations", default="")
    g.add_argument("--sarif", default="")
    g.add_argument("--junit", default="")
    g.add_argument("--json", default="")
    args = ap.parse_args(argv)
    return run_install(args) if args.step == "install" else run_gate(args)


if __name__ == "__main__":
    sys.exit(main())
