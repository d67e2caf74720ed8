"""What a file's first bytes say it is: one table, shared by the dump reader and the foreign formats.

Without dependencies of its own, so the plain dump reader can name what a file it cannot
read looks like (a ``.npy``, text, a raw pickle) without importing the format registry.
"""

from __future__ import annotations

# first bytes -> what the content is; a name never overrides them
MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"), (b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"), (b"\x80", "pickle"),
    (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
)
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def content_kind(head: bytes) -> str:
    """What the first bytes say the file is: gzip, zip, pickle, ..., safetensors, or unknown.

    The safetensors shape is tested first: its first 8 bytes are a little-endian header
    length, and one valid file in 32 has a length whose low byte is 0x80 (pickle's magic).
    No gzip, zip or pickle stream has '{' at byte 8 after a plausible length."""
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER:
        return "safetensors"
    for magic, kind in MAGIC:
        if head.startswith(magic):
            return kind
    return "unknown"


def looks_like(head: bytes, name: str = "") -> str:
    """What a file's first bytes say it is, in words, for refusals of files we do not read."""
    kind = content_kind(head)
    if kind == "zip":
        return ("a zip archive: a torch.save .pt/.pth (read when it is an SGLang or Megatron dump, or via "
                "`consistency convert`) or an .npz" if head.startswith(b"PK\x03\x04") else "a zip archive")
    if kind == "pickle":
        return "a raw pickle stream (never unpickled)"
    if head.startswith(b"\x93NUMPY"):
        return "a single numpy .npy array (save it with np.savez as an .npz)"
    if kind not in ("unknown", "safetensors"):
        return f"{kind}-compressed data"
    if head.startswith(b"GGUF"):
        return "a GGUF model file"
    if not head:
        return "an empty file"
    try:
        text = head.decode("utf-8")
        if all(c.isprintable() or c in "\r\n\t" for c in text):
            return "text" + (" (JSON)" if text.lstrip().startswith(("{", "[")) else "")
    except UnicodeDecodeError:
        pass
    return "unrecognised bytes (binary data, never shown: it may be a secret)"


def read_names() -> str:
    """The formats we read, for a refusal's 'what will work'."""
    return ("a dump (.safetensors or .npz), a rank set, speculators hs_*.safetensors, vLLM extract_hidden_states, "
            "SpecForge .ckpt[.gz], or a directory of SGLang tensor-dump / dumper or Megatron activation files")

