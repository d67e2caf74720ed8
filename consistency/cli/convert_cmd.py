"""``consistency convert INPUT -o OUT``: a file or directory another tool wrote, as a dump.

``compare`` reads these directly; converting is for keeping a self-describing copy (names
mapped, stream ids recorded in the metadata) or for tools that only read dumps. SpecForge
``.ckpt`` files and ``.pt``/``.pth`` zip archives (SGLang, Megatron, a user's ``torch.save``)
are read through the restricted reader, without torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from consistency.errors import UsageError


def convert_file(src: str | Path, out: str | Path, layer_ids: list[int] | None = None, convention: str | None = None,
                 force: bool = False) -> tuple[Path, list[str]]:
    """Write ``src`` (a speculators/SpecForge file, or a dump) to ``out``; returns (path, notes)."""
    import numpy as np

    from consistency.dump.atomic import check_writable
    from consistency.dump.formats.base import ScaledView
    from consistency.dump.sets import open_side
    from consistency.dump.writer import check_dump_name, write_dump

    src_p, out_p = Path(src), check_dump_name(out)
    check_writable(out_p, force)
    if src_p.exists() and out_p.exists() and src_p.resolve() == out_p.resolve():
        raise UsageError(f"{out_p}: the output would overwrite the input")
    with open_side(src_p, layer_ids, convention, row_bound=False) as d:
        if d.metadata is None:
            from consistency.dump.sniff import read_names

            raise UsageError(f"{src_p}: a dump without metadata has nothing to convert (convert reads {read_names()})")
        meta = d.metadata.model_copy(deep=True)
        notes = list(meta.extra.get("notes", []))
        tensors = {}
        for name in d.names:
            v = d[name]
            if isinstance(v, ScaledView):  # dequantize: a dump has no per-row scales
                tensors[name] = np.ascontiguousarray(v.rows_float(0, v.rows).reshape(v.shape))
                notes.append(f"{name}: FP8 values dequantized to float32 with their per-token scale; they keep "
                             f"FP8 rounding, so compare them with --threshold 0.07 or a --tolerance rule")
                meta.tensors.pop(name, None)
            else:
                tensors[name] = (np.ascontiguousarray(v.read_all()), v.dtype)
        meta.extra["source"] = {"path": str(src_p), "format": getattr(d, "format", None)}
        if notes:
            meta.extra["notes"] = notes
        written = write_dump(out_p, tensors, meta, force=force)
    return written, notes


@click.command("convert")
@click.argument("source", type=click.Path(dir_okay=True, readable=False, path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Dump to write (.safetensors or .npz).")
@click.option("--layer-ids", help="Aux layer ids of the data-generation run, as the producing tool spells them "
                                  "(speculators: include the appended N, e.g. 2,30,58,61).")
@click.option("--convention", help="What --layer-ids mean (default: the file's tool): stream, speculators, vllm, "
                                   "specforge, sglang[@VER], sglang-deepseek, ...")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
def convert(source: str, output: str, layer_ids: str | None, convention: str | None, force: bool) -> None:
    """Convert a file or directory another tool wrote to a dump.

    Reads speculators hs_*.safetensors, vLLM extract_hidden_states files, SpecForge
    .ckpt/.ckpt.gz, torch.save .pt/.pth archives of named tensors, and the directories of
    SGLang's tensor dump and dumper and Megatron's activation log. Names are mapped onto
    the dump format (hidden.s, aux.i, input_ids, final_norm; passes as name#k) and the
    stream ids of the aux slots are recorded when --layer-ids says what they are.
    """
    from consistency.contract.ids import parse_ids

    out, notes = convert_file(source, output, parse_ids(layer_ids), convention, force)
    from consistency.escape import term

    for n in notes:
        click.echo(f"note: {term(n, multiline=True)}", err=True)
    click.echo(f"wrote {term(out)}")
    sys.exit(0)
