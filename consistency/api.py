"""The Python API: compare, lint, replay and record from a notebook or a test suite.

Each function returns the report model the matching command prints (``--json`` is its
``model_dump_json()``), and raises :class:`consistency.errors.InputError` /
:class:`~consistency.errors.UsageError` where the command would exit with code 2. They are
thin: the work happens in the same library entry points the CLI and the gate call
(:func:`consistency.pipeline.compare.run`, :func:`consistency.lint.engine.run_lint`,
:func:`consistency.replay.api.replay_check`, :func:`consistency.record.request.run`), so a notebook
and CI reach the same verdict on the same inputs. Everything heavy is imported inside the
functions: importing this module loads neither torch nor numpy. Guide: docs/api.md.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from consistency.contract.findings import CompareReport
    from consistency.lint.report import LintReport
    from consistency.replay.report import ReplayReport

PathLike = str | os.PathLike  # noqa: UP007 - runtime alias


def _codes(v: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, (list, tuple, set, frozenset)):
        from consistency.errors import UsageError

        raise UsageError(f"{name}: expected rule codes (a string or a list of strings), got {type(v).__name__}")
    return tuple(str(x) for x in v)


def _path(v: Any) -> str | None:
    return None if v is None else os.fspath(v)


def compare(reference: Any, candidate: Any, *, contract: PathLike | None = None, rtol: float | None = None,
            atol: float | None = None, threshold: float | None = None,
            tolerance: Mapping[str, float] | Sequence[str] | str | None = None,
            layer_ids: str | Sequence[int] | None = None, convention: str | None = None,
            **options: Any) -> CompareReport:
    """Compare REFERENCE (what the draft was trained on) with CANDIDATE (what it is fed).

    Each side is a path (a dump, a rank set, a speculators/SpecForge file), a mapping of
    tensor names to numpy arrays or torch tensors (``{"hidden.3": h3, "aux.0": a0}``; a
    bf16 tensor stays bf16), or a :class:`~consistency.dump.memory.MemoryDump` carrying
    metadata. Options are the ``consistency compare`` flags; ``tolerance`` also takes a
    ``{regex: floor}`` dict. Further keyword options go to the pipeline unchanged.
    Returns the :class:`~consistency.contract.findings.CompareReport`; ``report.verdict``
    is ``"pass"`` or ``"fail"``.
    """
    from consistency.compare.request import CompareRequest
    from consistency.pipeline.compare import run
    from consistency.dump.memory import as_side

    req = CompareRequest.build(reference, candidate, contract=contract, rtol=rtol, atol=atol,
                               threshold=threshold, tolerance=tolerance, layer_ids=layer_ids, convention=convention,
                               **options)  # an unknown option is a usage error, named
    ref, cand = as_side(reference, "reference"), as_side(candidate, "candidate")
    from dataclasses import replace

    return run(replace(req, reference=ref, candidate=cand))


def lint(draft: PathLike | None = None, target: PathLike | None = None, serve: str | None = None,
         runtime: str | None = None, trained_with: PathLike | None = None, *,
         select: str | Sequence[str] | None = None, ignore: str | Sequence[str] | None = None,
         fail_on: str = "error") -> LintReport:
    """Static checks of a draft, its target and the serving command (``consistency lint``).

    ``serve`` is the quoted command line (``"vllm serve ... --speculative-config ..."``),
    ``runtime`` e.g. ``"sglang@0.5.21"``, ``trained_with`` a dump, a contract file or
    ``"specforge:1,29,57"``. No weights are loaded, and torch is never imported.
    Returns the :class:`~consistency.lint.report.LintReport`.
    """
    from consistency.lint.engine import LintRequest, run_lint

    return run_lint(LintRequest(draft=_path(draft), target=_path(target), serve=serve, runtime=runtime,
                                trained_with=_path(trained_with), select=_codes(select, "select"),
                                ignore=_codes(ignore, "ignore"), fail_on=fail_on))


def replay(reference: Any, candidate: Any, draft: PathLike, target: Any = None, *, steps: int | None = None,
           max_drop_points: float = 5.0, min_acceptance: float | None = None, feed: str = "auto",
           labels: str = "auto", overrides: Mapping[str, bool] | None = None,
           max_drop: float | None = None, **options: Any) -> ReplayReport:
    """Run the EAGLE-3 draft on both sides' aux states and predict acceptance (``consistency replay``).

    ``draft`` is a draft directory or a built-in fixture name; ``target`` a built-in tiny
    name, a local HF directory or an already loaded HF model. Sides are paths or mappings
    of tensors (written to a temporary dump, since the replay reads its sides from files).
    Needs torch. Returns the :class:`~consistency.replay.report.ReplayReport`.

    ``max_drop_points`` is the CLI's ``--max-drop-points`` and the gate's ``max_drop_points``;
    ``max_drop``, its name before 0.1.0's rename, still works and warns (DeprecationWarning).
    Further options (``method``, ``layer_ids``, ``convention``: the command's and the gate's) go
    to :class:`~consistency.replay.request.ReplayRequest`, which names an unknown one.
    """
    from consistency.errors import UsageError
    from consistency.replay.api import replay_check

    if max_drop is not None:
        import warnings

        warnings.warn("consistency.replay(max_drop=...) is deprecated: use max_drop_points (the name the CLI and "
                      "the gate use)", DeprecationWarning, stacklevel=2)
        if max_drop_points != 5.0 and max_drop_points != max_drop:
            raise UsageError(f"max_drop={max_drop} and max_drop_points={max_drop_points}: give one (max_drop_points)")
        max_drop_points = max_drop
    # its value is the request's to check (ReplayRequest: a finite number >= 0), naming the field
    with _on_disk(reference, "reference") as ref, _on_disk(candidate, "candidate") as cand:
        return replay_check(_path(draft), ref, cand, target=_path(target) if isinstance(target, (str, os.PathLike))
                            else target, steps=steps, max_drop_points=max_drop_points, min_acceptance=min_acceptance,
                            feed=feed, labels=labels, overrides=dict(overrides) if overrides else None,
                            **options)


@contextmanager
def _on_disk(side: Any, role: str) -> Iterator[str]:
    """A path for ``side``: itself, or an in-memory side written to a temporary dump."""
    from consistency.dump.memory import MemoryDump, as_side

    opened = as_side(side, role)
    if isinstance(opened, str):
        yield opened
        return
    if not isinstance(opened, MemoryDump):
        yield str(opened.path)
        return
    from consistency.dump.writer import write_dump

    with tempfile.TemporaryDirectory(prefix="consistency-") as tmp:
        tensors = {n: (v.read_all(), v.dtype) for n, v in opened.tensors.items()}
        yield str(write_dump(Path(tmp) / f"{role}.safetensors", tensors, opened.metadata))


def record(model: Any, input_ids: Any = None, output: PathLike | None = None, *, prompt: str | None = None,
           style: str = "training", aux_layers: str | Sequence[int] | None = None, convention: str = "stream",
           capture: str = "guarded", components: bool | None = None, logits: bool = False, dtype: str = "float32",
           seed: int = 0, force: bool = False, gguf_file: PathLike | None = None) -> Path:
    """Record a dump from a model the training way or the serving way (``consistency record``).

    ``model`` is a loaded HF causal LM, a built-in tiny model name or a local HF
    directory; give ``input_ids`` (a sequence, array or tensor, or a token-id file) or
    ``prompt``. ``style="training"`` records every stream, the deltas, the final norm and, with
    ``aux_layers``, the aux slots; ``style="serving"`` records the aux slots as a
    fused-residual runtime builds them (``capture``: ``guarded``, ``add`` or the
    ``clone`` bug). ``aux_layers`` are spelled as ``convention`` spells them (``"sglang"``,
    ``"vllm"``, ...). ``output`` defaults to a new temporary file. Needs torch; returns
    the path written. The request is the command's (:class:`~consistency.record.request.RecordRequest`):
    the same input is refused with the same line, and the same inputs record the same dump.
    """
    from consistency.record.request import run

    return run(record_request(model, input_ids, output, prompt=prompt, style=style, aux_layers=aux_layers,
                              convention=convention, capture=capture, components=components, logits=logits,
                              dtype=dtype, seed=seed, force=force, gguf_file=gguf_file)).path


def record_request(model: Any, input_ids: Any = None, output: PathLike | None = None, **options: Any) -> Any:
    """The :class:`~consistency.record.request.RecordRequest` :func:`record` runs (validated)."""
    from consistency.record.request import RecordRequest

    return RecordRequest.build(model, output, input_ids=input_ids, **options)


def __getattr__(name: str) -> Any:
    """``consistency.api.MemoryDump``: build a side with metadata (lazy, numpy-bound)."""
    if name == "MemoryDump":
        from consistency.dump.memory import MemoryDump

        return MemoryDump
    raise AttributeError(f"module 'consistency.api' has no attribute {name!r}")
