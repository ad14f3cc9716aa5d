import sys

from kvbench.cli import main

sys.exit(main())
