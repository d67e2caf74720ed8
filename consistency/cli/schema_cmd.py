"""``consistency schema``: write the JSON Schemas into schemas/ (or check them)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("schema")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("schemas"),
              show_default=True, help="Directory to write the schemas into.")
@click.option("--check", is_flag=True, help="Exit 1 if the files in --out differ from the models.")
def schema(out_dir: Path, check: bool) -> None:
    """Write (or --check) the JSON Schemas of the contract, dump metadata and reports."""
    from consistency.contract.schema import all_schemas
    from consistency.dump.atomic import write_text_atomic

    if check:
        stale = [n for n, text in all_schemas().items()
                 if not (out_dir / n).is_file() or (out_dir / n).read_text() != text]
        for n in stale:
            click.echo(f"{out_dir / n}: out of date; run `consistency schema`", err=True)
        sys.exit(1 if stale else 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in all_schemas().items():  # atomic; regenerating may always replace them
        write_text_atomic(out_dir / name, text, force=True)
        click.echo(str(out_dir / name))
