"""``consistency gate``: one CI step that runs a project's declared lints, compares and
replays (``consistency.toml``) and reports them as an exit code, JSON, JUnit XML, GitHub
Actions annotations and a Markdown step summary.

The gate depends on nothing but the contract: the commands it runs are handed to it as
functions by the CLI (:mod:`consistency.cli.gate_cmd`), and the sub-reports are read in
their JSON form, so lint, compare and replay stay independent of it.
"""
