"""``consistency inspect DUMP``: what a dump holds, without reading its data."""

from __future__ import annotations

import click


@click.command("inspect")
@click.argument("dump", type=click.Path(readable=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the metadata and tensor list as JSON.")
@click.option("--layer-ids", help="Aux layer ids, as the producing tool spells them, for files that do not record them.")
@click.option("--convention", help="What --layer-ids mean (default: the file's tool).")
def inspect(dump: str, as_json: bool, layer_ids: str | None, convention: str | None) -> None:
    """List the tensors (name, dtype, shape) and the metadata of DUMP.

    DUMP may also be a file or directory another tool wrote (SGLang tensor dump or dumper,
    Megatron activation log, vLLM extract_hidden_states, speculators, SpecForge, a
    torch.save archive): the first line says what was found."""
    import json

    from rich.table import Table
    from rich.text import Text

    from consistency.dump import names
    from consistency.dump.sets import open_side
    from consistency.escape import term
    from consistency.report.text import console

    from consistency.contract.ids import parse_ids

    with open_side(dump, parse_ids(layer_ids), convention, row_bound=False) as d:
        tensors = [{"name": n, "dtype": d[n].dtype, "shape": list(d[n].shape)} for n in d.names]
        meta = json.loads(d.metadata.model_dump_json(exclude_none=True)) if d.metadata else None
        if as_json:
            from consistency.escape import json_log

            click.echo(json_log(json.dumps({"path": dump, "format": d.format, "metadata": meta, "tensors": tensors},
                                           indent=2)))
            return
        con = console()
        found = (d.metadata.extra.get("source_format") or {}) if d.metadata else {}
        summary = found.get("summary") if isinstance(found, dict) else None
        count = f"{len(tensors)} tensor{'' if len(tensors) == 1 else 's'}"
        said = summary or d.format
        head = f"{dump}: {said}" + ("" if f"{len(tensors)} tensor" in said else f", {count}") \
            + ("" if meta else ", no consistency metadata")  # the count once, in the reader's words if it gave one
        con.print(Text(term(head)))
        for note in (d.metadata.extra.get("notes") or []) if d.metadata else []:
            con.print(Text(term(f"note: {note}")))
        if d.metadata and d.metadata.aux and d.metadata.aux.stream_ids is not None:
            a = d.metadata.aux
            con.print(Text(term(f"aux streams {a.stream_ids} (native ids {a.native_ids}, convention {a.convention})")))
        t = Table(show_edge=False)
        for c in ("name", "dtype", "shape"):
            t.add_column(c)
        for x in sorted(tensors, key=lambda x: names.sort_key(x["name"])):
            t.add_row(Text(term(x["name"])), Text(term(x["dtype"])), Text(str(x["shape"])))  # names from the file
        con.print(t)
