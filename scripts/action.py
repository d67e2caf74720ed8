#!/usr/bin/env python3
"""The logic of the GitHub Action (action.yml): install consistency, run the gate, set outputs.

Kept out of the YAML so it can be tested directly (tests/test_action.py; ``act`` is not
available) and so no action input is ever pasted into a shell script: action.yml passes
inputs as environment variables / arguments only. Standard library only: it runs before
consistency is installed.

``install``: the package from the action's own checkout (``version`` empty: the action
ref is the package version), ``specdec-consistency==VERSION`` (the distribution's name on PyPI) for a version number, or any other
pip requirement as given. torch comes in only when the config declares a ``[[replay]]``
(lint and compare never import it), and then as the CPU wheel, not a multi-GB CUDA one.

``gate``: ``consistency gate`` with the report paths asked for, then the exit code under
``fail-on``: ``error`` (default: the gate's own code), ``warning`` (lint warnings fail
too, as ``[gate] fail_on = "warning"``), ``never`` (report only; an unreadable input,
exit 2, still fails). Writes ``verdict``, ``exit-code`` and ``json`` to ``$GITHUB_OUTPUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DIST = "specdec-consistency"  # the distribution's name on PyPI (consistency/__init__.py DIST; `consistency` is another project)
FAIL_ON = ("", "error", "warning", "never")
_REPLAY = re.compile(r"^\s*\[\[\s*replay\s*\]\]", re.M)
_VERSION = re.compile(r"^v?\d+(\.\d+)*([abc]|rc|\.post|\.dev)?\d*$")


def declares_replay(config: Path) -> bool:
    """Does the gate config declare a ``[[replay]]`` check? (a missing config: no; the gate says why)."""
    try:
        text = config.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return bool(_REPLAY.search(text))


def requirement(version: str, source: Path, extra: str = "") -> str:
    """What pip installs: the action's checkout, ``specdec-consistency==X``, or a requirement as given."""
    v = version.strip()
    ext = f"[{extra}]" if extra else ""
    if not v:
        return f"{source}{ext}"
    if _VERSION.match(v):
        return f"{DIST}{ext}=={v.removeprefix('v')}"
    return v  # a URL or requirement the user spelled out, extras included if wanted


def install_commands(config: Path, version: str, source: Path, python: str = sys.executable) -> list[list[str]]:
    pip = [python, "-m", "pip", "install", "-q"]
    if not declares_replay(config):
        return [pip + [requirement(version, source)]]
    return [pip + ["torch", "--index-url", TORCH_CPU_INDEX], pip + [requirement(version, source, "hf")]]


def set_output(**values: str) -> None:
    out = os.environ.get("GITHUB_OUTPUT")
    if not out:
        return
    with open(out, "a", encoding="utf-8") as fh:
        for k, v in values.items():
            fh.write(f"{k}={str(v).replace(chr(10), ' ').replace(chr(13), ' ')}\n")


def gate_command(config: str, json_path: str, junit: str, sarif: str, annotations: str,
                 python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", "consistency", "gate", "--config", config, "--json", json_path]
    if junit:
        cmd += ["--junit", junit]
    if sarif:
        cmd += ["--sarif", sarif]
    a = annotations.strip().lower()
    if a in ("true", "1", "yes", "on"):
        cmd.append("--annotations")
    elif a in ("false", "0", "no", "off"):
        cmd.append("--no-annotations")
    elif a:
        raise SystemExit(f"action: annotations must be true or false, got {annotations!r}")
    return cmd


def exit_code(report: dict, gate_rc: int, fail_on: str) -> int:
    """The step's exit code from the gate's report and ``fail-on``."""
    if gate_rc not in (0, 1) or report.get("verdict") == "error":
        return 2 if gate_rc in (0, 1) else gate_rc  # an unreadable input or a crash is never "report only"
    if fail_on == "never":
        return 0
    if gate_rc == 1:
        return 1
    if fail_on == "warning":
        for chk in report.get("checks", []):
            if chk.get("kind") == "lint" and any(c.get("severity") == "warning" for c in chk.get("cases", [])):
                return 1
    return 0


def run_gate(args: argparse.Namespace) -> int:
    fail_on = (args.fail_on or "").strip().lower()
    if fail_on not in FAIL_ON:
        print(f"action: fail-on must be error, warning or never, got {args.fail_on!r}", file=sys.stderr)
        return 2
    for p in (args.junit, args.sarif, args.json):
        if p:
            Path(p).parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    json_path = args.json
    if not json_path:
        tmp = tempfile.mkdtemp(prefix="consistency-action-", dir=os.environ.get("RUNNER_TEMP") or None)
        json_path = str(Path(tmp) / "consistency-gate.json")
    cmd = gate_command(args.config, json_path, args.junit, args.sarif, args.annotations)
    print("+ " + " ".join(cmd[1:]), flush=True)
    rc = subprocess.run(cmd, check=False).returncode
    try:
        report = json.loads(Path(json_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        report = {"verdict": "error"}  # the gate stopped before writing its report (bad config: exit 2)
    code = exit_code(report, rc, fail_on)
    set_output(verdict=report.get("verdict", "error"), **{"exit-code": str(code), "json": json_path})
    if code == 0 and rc != 0:
        print(f"action: gate verdict {report.get('verdict')}; not failing the step (fail-on: {fail_on})")
    elif code == 1 and rc == 0:
        print("action: lint warnings fail this step (fail-on: warning)")
    return code


def run_install(args: argparse.Namespace) -> int:
    cmds = install_commands(Path(args.config), args.version, Path(args.source))
    set_output(replay="true" if len(cmds) > 1 else "false")
    for cmd in cmds:
        print("+ " + " ".join(cmd[1:]), flush=True)
        if not args.dry_run:
            rc = subprocess.run(cmd, check=False).returncode
            if rc:
                return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="action.py", description="consistency GitHub Action steps")
    sub = ap.add_subparsers(dest="step", required=True)
    i = sub.add_parser("install")
    i.add_argument("--config", default="consistency.toml")
    i.add_argument("--version", default="")
    i.add_argument("--source", default=str(Path(__file__).resolve().parents[1]))
    i.add_argument("--dry-run", action="store_true")
    g = sub.add_parser("gate")
    g.add_argument("--config", default="consistency.toml")
    g.add_argument("--fail-on", default="")
    g.add_argument("--annotations", default="")
    g.add_argument("--sarif", default="")
    g.add_argument("--junit", default="")
    g.add_argument("--json", default="")
    args = ap.parse_args(argv)
    return run_install(args) if args.step == "install" else run_gate(args)


if __name__ == "__main__":
    sys.exit(main())
