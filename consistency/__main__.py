from consistency.cli import run

run()
