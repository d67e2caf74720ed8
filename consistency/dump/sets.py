"""Open one side of a comparison: a dump, a set of tensor-parallel rank files, a file
another tool wrote, or a directory of a stock debug dump.

Formats other tools write (speculators ``hs_*.safetensors``, vLLM ``extract_hidden_states``,
SpecForge ``.ckpt``/``.ckpt.gz``, SGLang's tensor dump and dumper, Megatron's activation
log; see :mod:`consistency.dump.formats`) are recognised here, so every command that takes
a dump takes them too. ``layer_ids``/``convention`` describe inputs whose
files do not record which streams they hold; a dump records its own and ignores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from consistency.dump import names
from consistency.dump.reader import Dump
from consistency.errors import InputError


# compare keeps per-row statistics (~70 bytes a row: a 1-D float32 tensor of 2^24 elements took
# 1.16 GB RSS), so one tensor of hostile row count (a 2 MB npz whose 1-D member inflates to
# 2 GiB: 23 GB) is refused at open; 2^24 rows is 16M tokens, or a flattened [T, V] logits of 64
# tokens over a 262k vocabulary
MAX_ROWS = 1 << 24  # CONSISTENCY_MAX_ROWS


def open_side(spec: str | Path | Dump, layer_ids: Sequence[int] | None = None, convention: str | None = None,
              row_bound: bool = True) -> Dump:
    """The Dump for ``spec``; foreign training files are mapped onto the dump's names.
    An already opened Dump (e.g. an in-memory :class:`~consistency.dump.memory.MemoryDump`
    from the Python API) is used as it is. ``row_bound``: refuse a tensor of more rows than
    compare and replay keep per-row state for (inspect and convert stream, and read any)."""
    if isinstance(spec, Dump):
        return spec
    d = _open_side(spec, layer_ids, convention)
    if type(d) is not Dump:  # our own reader already refused them (reader.canonical_names)
        try:  # whatever other reader opened it: two spellings of one name are never resolved silently
            names.refuse_twins(d.path, d.tensors)
        except BaseException:
            d.close()
            raise
    if not row_bound:
        return d
    from consistency.contract.bounds import env_limit

    limit = env_limit("MAX_ROWS", MAX_ROWS)
    big = next((v for v in d.tensors.values() if v.rows > limit), None)
    if big is not None:
        d.close()
        raise InputError(d.path, f"tensor {big.name[:80]!r} has {big.rows} rows (shape {list(big.shape)}), over the "
                         f"{limit} compare keeps per-row statistics for (CONSISTENCY_MAX_ROWS)")
    return d


def _open_side(spec: str | Path, layer_ids: Sequence[int] | None, convention: str | None) -> Dump:
    p = Path(spec)
    try:
        p.stat()
    except FileNotFoundError:
        pass  # may name a rank set (NAME.rank*-of*.EXT) or a glob
    except OSError:
        return Dump(p)  # unreadable or untraversable: the loader says so in one line
    if p.is_file() and not any(ch in str(spec) for ch in "*?["):
        plain = _plain_dump(p)
        if plain is not None:
            return plain
    from consistency.dump.ranks import rank_files
    from consistency.dump.stages import open_rank_set

    ranks = rank_files(spec)
    if ranks is not None:
        return open_rank_set(ranks)
    if p.is_dir():
        from consistency.dump.formats import detect_dir, read_names

        fmt = detect_dir(p)
        if fmt is not None and fmt.open_dir is not None:
            return fmt.open_dir(p, layer_ids, convention)
        dumps = sorted(x.name for x in p.iterdir() if x.suffix.lower() in (".safetensors", ".npz") and x.is_file())
        if dumps:  # a directory given where its one dump was meant: name the file to give
            shown = ", ".join(dumps[:3]) + (f", ... ({len(dumps)} in all)" if len(dumps) > 3 else "")
            raise InputError(p, f"is a directory, not a dump: it holds {shown}, none named as a tensor-parallel rank "
                                f"(NAME.rankR-ofN.EXT); give the dump's file, e.g. {p / dumps[0]}")
        raise InputError(p, f"is a directory holding none of the formats consistency reads ({read_names()})")
    if any(ch in str(spec) for ch in "*?[") and not p.exists():
        import glob

        hits = sorted(glob.glob(str(spec)))
        if hits:  # the glob matched, but no rank files: "no such file" would send the user the wrong way
            shown = ", ".join(Path(h).name for h in hits[:3]) + (f", ... ({len(hits)} in all)" if len(hits) > 3 else "")
            raise InputError(p, f"matches {len(hits)} file(s) ({shown}), none named as a tensor-parallel rank "
                                f"(NAME.rankR-ofN.EXT); a pattern names a rank set: give one dump's file instead")
    if p.is_file():
        from consistency.dump.formats import detect

        fmt = detect(p)
        if fmt is not None:
            return fmt.open(p, layer_ids, convention)
    return Dump(p)


def _plain_dump(p: Path) -> Dump | None:
    """The dump at ``p`` when it can only be one of ours, else None (the caller then tries
    rank sets and foreign formats, whose modules cost ~10% of a small compare's start-up).

    An existing file without glob characters is never a rank set. A ``.npz`` whose content
    is a zip is no foreign format (SpecForge files are ``.ckpt``/gzip, speculators files are
    safetensors); a ``.safetensors`` file recording our metadata is a dump (speculators
    files never carry it). The content check that refuses a mislabelled file runs first.
    """
    from consistency.dump.formats import checked_head, content_kind

    head = checked_head(p)
    if head is None:
        return None
    name = p.name.lower()
    if name.endswith(".npz") and content_kind(head) == "zip":
        return Dump(p)
    if name.endswith(".safetensors") and content_kind(head) == "safetensors":
        d = Dump(p)
        if d.metadata is not None:
            return d
        d.close()
    return None


def member_metadata(d: Dump) -> list[tuple[str, object]]:
    """(file name, metadata) of every file a side was opened from: each rank of a rank set
    (tensor parallel, pipeline stages, data parallel), or the one file. What a recorder
    says about its own losses lives in each rank's file, so reading the merged metadata
    (rank 0's) alone let rank 1's dropped captures pass."""
    members = getattr(d, "rank_dumps", None) or getattr(d, "all_dumps", None)
    if members:
        return [(m.path.name, m.metadata) for m in members]
    base = getattr(d, "base", None)  # a view over a set (stitched, restricted)
    if isinstance(base, Dump) and base is not d:
        return member_metadata(base)
    return [("", d.metadata)]
