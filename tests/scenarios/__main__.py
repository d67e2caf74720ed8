import sys

from tests.scenarios.run import main

sys.exit(main(sys.argv[1:]))
