"""``python -m consistency.record.autopatch`` prints the folder to put on PYTHONPATH."""

from pathlib import Path

print(Path(__file__).resolve().parent)
